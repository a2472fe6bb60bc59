"""Chunked linear cross-entropy: the loss of ``hidden @ weight.T`` without the full logits.

Forward computes, chunk by chunk of ``chunk_tokens`` rows, the logits in the weight's dtype, upcasts
them to fp32, takes the log-sum-exp and the target logit, and immediately turns them into the gradient
of the mean loss with respect to the chunk's logits (``softmax - onehot``, divided by the number of
target tokens); from that, the gradients for the chunk's hidden states and, when the weight is
trainable, the weight's gradient are accumulated. Peak extra memory: one chunk's fp32 logits
(``chunk_tokens x vocab x 4`` bytes, twice during the softmax) instead of ``tokens x vocab`` logits,
their fp32 copy and their gradient (12 bytes per token per vocab entry for HF's loss). The gradients are
kept from forward to backward (hidden-size per token), as in Liger's fused linear cross-entropy.

Matches ``torch.nn.functional.cross_entropy(hidden @ weight.T, labels, ignore_index=-100)`` (mean over
target tokens) to dtype tolerance; see tests/knobs/test_longctx.py.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int):
        n = hidden.shape[0]
        # The number of target tokens stays on the device (no host sync in forward): clamped to 1, as
        # an all-ignored batch has a zero loss and zero gradients.
        denom = (labels != IGNORE_INDEX).sum().clamp_min(1).to(torch.float32)
        need_h = hidden.requires_grad
        need_w = weight.requires_grad
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            y = labels[s : s + chunk]
            logits = (h @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            ok = y != IGNORE_INDEX
            safe_y = torch.where(ok, y, torch.zeros_like(y))
            target = logits.gather(1, safe_y.unsqueeze(1)).squeeze(1)
            total += ((lse - target) * ok).sum()
            if need_h or need_w:
                # d(mean loss)/d(logits) = (softmax - onehot) / n_valid on target rows, 0 elsewhere.
                g = logits.sub_(lse.unsqueeze(1)).exp_()  # softmax, in place
                g.scatter_add_(1, safe_y.unsqueeze(1), -torch.ones_like(target).unsqueeze(1))
                g.mul_((ok.to(g.dtype) / denom).unsqueeze(1))
                g = g.to(weight.dtype)
                if need_h:
                    grad_h[s : s + chunk] = g @ weight
                if need_w:
                    grad_w.addmm_(g.t().float(), h.float())
            del logits
        ctx.save_for_backward(grad_h, grad_w)
        ctx.need = (need_h, need_w)
        ctx.w_dtype = weight.dtype
        return total / denom

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        need_h, need_w = ctx.need
        gh = grad_h * grad_out.to(grad_h.dtype) if need_h else None
        gw = (grad_w * grad_out).to(ctx.w_dtype) if need_w else None
        return gh, gw, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, chunk_tokens: int = 1024
) -> torch.Tensor:
    """Mean cross-entropy of ``hidden @ weight.T`` against ``labels`` (``-100`` ignored).

    Args:
        hidden: ``[tokens, hidden]`` (flattened; already shifted so row i predicts ``labels[i]``).
        weight: ``[vocab, hidden]`` (``lm_head.weight``; may be tied to the embeddings).
        labels: ``[tokens]`` int64.
        chunk_tokens: rows per chunk (memory ~ ``chunk_tokens x vocab x 4`` bytes).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    return _ChunkedLinearCE.apply(hidden, weight, labels, int(chunk_tokens))


def causal_lm_loss(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The causal-LM training loss of a Hugging Face ``*ForCausalLM`` (or a PEFT wrapper of one) through
    :func:`chunked_linear_cross_entropy`: the decoder runs, ``lm_head`` never produces full logits.

    Same value as ``model(input_ids, attention_mask, labels=labels).loss`` (HF shifts labels by one and
    averages over target tokens); ``position_ids`` of packed rows reach the decoder (its block mask)."""
    lm = causal_lm_of(model)
    out = lm.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    hidden = out.last_hidden_state[:, :-1, :]
    target = labels[:, 1:]
    head = lm.get_output_embeddings()
    return chunked_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, target.reshape(-1), chunk_tokens=chunk_tokens
    )


def causal_lm_of(model: torch.nn.Module) -> torch.nn.Module:
    """The ``*ForCausalLM`` inside a PEFT model (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    lm = get() if callable(get) else model
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or not hasattr(lm, "model"):
        raise TypeError(f"{type(lm).__name__} is not a decoder-only *ForCausalLM with .model and an lm_head")
    if type(head) is not torch.nn.Linear:
        raise TypeError(
            f"tiled loss needs a plain nn.Linear lm_head, got {type(head).__name__} (a quantised or "
            "adapter-wrapped lm_head: leave lm_head out of quant.skip_modules/adapter.targets)"
        )
    if getattr(getattr(lm, "config", None), "final_logit_softcapping", None):
        raise TypeError("tiled loss does not implement final_logit_softcapping")
    return lm
