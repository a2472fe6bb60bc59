"""``vramsweep check [overrides]``: the training maths proven on the user's config, on a proxy, in seconds.

The config is composed and pre-flighted as ``vramsweep train`` does it (bad input: one line, exit 2, nothing
written; the machine's rules apply to the proxy, which runs here). The *proxy* is the same architecture
family with the same knobs (quant, adapter, dtype, checkpointing, tiling, packing), built by
:func:`vramsweep.knobs.build_model` from ``model.source=arch`` with at most :data:`PROXY_LAYERS` layers (a
model wider than :data:`PROXY_MAX_HIDDEN` is narrowed), random weights, dropout off, on the CPU; its LoRA
``B`` factors get random values so every LoRA factor has a gradient. The records are the first training
records of the configured data, as the trial builds them; the maths checks cut each to its last
:data:`PROXY_TOKENS` tokens and renumber the ids (:func:`proxy_examples`). Checks, one line each:

* ``accumulation``: one optimizer step's gradients with ``micro_batch=k, grad_accum=n/k`` equal those of
  ``micro_batch=n, grad_accum=1`` (the loop's token weighting, :func:`vramsweep.loop.token_weights`);
* ``eval_then_train``: LoRA gradients after an eval forward equal those without (4-bit bases: issue 49);
* ``packing``: loss and gradients of the examples packed into one row equal those of the rows unpacked;
* ``resume``: :data:`RESUME_STEPS` optimizer steps uninterrupted (an eval first, as a trial) against a run
  stopped after step :data:`RESUME_AT` and resumed in a fresh build, through the production path
  (:class:`vramsweep.production.checkpoint.Checkpointer` stops it as on SIGTERM, ``load_checkpoint`` and
  ``Resume.apply``/``restore_rng`` resume it; the optimizer, scheduler and fp32 masters of
  ``adapter.dtype=compute`` are the trial's); adapter tensors and per-step losses must be **bitwise** equal
  (the proxy runs on the CPU; on CUDA a run's resume is bitwise only with ``train.deterministic=true``);
* ``stop_token``: every trained span of the first records ends with a trained stop token (EOS or the
  template's end-of-turn token), unless the example was cut at ``context.max_tokens`` (counted apart).

Figures are relative differences (norm of the difference over the norm of the reference, over all trainable
gradients); the resume line's are the largest absolute differences (0 when bitwise). Exit 0 when every
check passes, 1 on any FAIL.
"""

from __future__ import annotations

import copy
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from omegaconf import DictConfig, open_dict

from vramsweep.config import ConfigError, compose
from vramsweep.config.errors import error_line
from vramsweep.config.rules import check_machine
from vramsweep.data.examples import IGNORE_INDEX, trained_spans
from vramsweep.data.packing import pack_examples
from vramsweep.data.prep import collate_batch, micro_batches, render_settings, trial_data
from vramsweep.data.render import end_of_turn_markers
from vramsweep.knobs import build_model
from vramsweep.knobs.build import model_source
from vramsweep.knobs.optim import build_optimizer, build_scheduler
from vramsweep.knobs.registry import loss_fn
from vramsweep.loop import Callback, Loop, fit
from vramsweep.measure.eval import evaluate
from vramsweep.measure.threads import apply as apply_threads
from vramsweep.preflight import check_named_options, preflight
from vramsweep.production.checkpoint import Checkpointer, Preempted, latest_checkpoint, load_checkpoint

PROXY_LAYERS = 2
PROXY_MAX_HIDDEN = 256
#: relative tolerance by ``train.dtype``: fp32 sums in another order differ by ~1e-7; 16-bit by its rounding
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-2}
#: first training records the checks use
N_RECORDS = 64
#: tokens of each record the maths checks keep (its last ones: where the trained tokens are)
PROXY_TOKENS = 512
CPU = torch.device("cpu")
#: optimizer steps of the resume check, and the step after which its interrupted run checkpoints and stops
RESUME_STEPS, RESUME_AT = 4, 2


@dataclass
class Line:
    """One check's verdict: ``PASS|FAIL <name>: <figure> (tolerance <t>)``."""

    name: str
    ok: bool
    figure: str
    tolerance: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}: {self.figure} (tolerance {self.tolerance})"


def proxy_examples(examples: list) -> tuple[list, int]:
    """The records for the maths checks: each cut to its last :data:`PROXY_TOKENS` tokens (those with a
    trained token left), the token ids renumbered 1..K in order of first use (0 stays the padding id), so
    the proxy's vocabulary has K + 1 rows whatever the tokenizer's size; returns (examples, K + 1)."""
    ids: dict[int, int] = {}

    def num(t: int) -> int:
        return ids.setdefault(t, len(ids) + 1)

    out = []
    for e in examples:
        labels = e.labels[-PROXY_TOKENS:]
        if all(t == IGNORE_INDEX for t in labels):
            continue
        new = [num(t) for t in e.input_ids[-PROXY_TOKENS:]]
        out.append(replace(e, input_ids=new, labels=[t if t == IGNORE_INDEX else num(t) for t in labels]))
    return out, len(ids) + 1


def proxy_config(
    cfg: DictConfig, packing: bool | None = None, vocab: int | None = None
) -> tuple[DictConfig, list[str]]:
    """The proxy's config (module docstring) and what differs from the user's besides size and weights."""
    p, notes = copy.deepcopy(cfg), []
    with open_dict(p):
        m = p.model
        m.source, m.path, m.num_layers = "arch", None, min(PROXY_LAYERS, int(m.num_layers))
        if int(m.hidden_size) > PROXY_MAX_HIDDEN:  # narrowed, same head layout ratio (GQA kept)
            notes.append(f"model.hidden_size={m.hidden_size} narrowed to 128 (intermediate 512, 4 heads)")
            gqa = int(m.num_kv_heads) < int(m.num_heads)
            m.hidden_size, m.intermediate_size, m.num_heads, m.head_dim = 128, 512, 4, 32
            m.num_kv_heads = 2 if gqa else 4
        if p.hardware.device != "cpu":
            notes.append(f"hardware.device={p.hardware.device} runs on the CPU")
            p.hardware.device = "cpu"
        if str(p.attention.implementation) == "flash_attention_2":
            notes.append("attention=flash_attention_2 runs as sdpa (no FA2 on the CPU)")
            p.attention.implementation = p.attention.name = "sdpa"
        if p.kernels.liger or p.kernels.unsloth:
            notes.append(f"kernels={p.kernels.name} runs as kernels=none (GPU kernels)")
            p.kernels.name, p.kernels.liger, p.kernels.unsloth = "none", False, False
        if str(p.vocab.mode) != "full":
            notes.append(f"vocab.mode={p.vocab.mode} runs with the full vocabulary")
            p.vocab.mode = "full"
        if packing is not None:
            p.data.packing = packing
        if vocab is not None:
            m.vocab_size = vocab
    return p, notes


def build_proxy(cfg: DictConfig, dropout: bool = False) -> torch.nn.Module:
    """The proxy model (seeded: the same config gives the same weights), LoRA ``B`` factors random, dropout
    off unless ``dropout`` (a random mask is another function on every pass: the gradient checks compare
    passes of one function; the resume check keeps the config's dropout, whose RNG a resume restores), in
    training mode (gradient checkpointing and every training-only path run as in a trial)."""
    torch.manual_seed(0)
    model = build_model(cfg, source=(None, None)).model
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout) and not dropout:
            mod.p = 0.0
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, q in model.named_parameters():
            if "lora_B" in name:
                q.copy_((torch.randn(q.shape, generator=g) * 0.05).to(q.dtype))
    return model


class _KeepGrads(Callback):
    def __init__(self, params):
        self.params, self.grads = params, None

    def on_grads(self, step: int) -> None:
        self.grads = [q.grad.detach().float().clone() for q in self.params]


def step_grads(cfg: DictConfig, model, batches: list[dict], grad_accum: int) -> tuple[float, list]:
    """(loss, gradients) of one optimizer step of ``batches`` through the project's loop (lr 0: the model
    does not change)."""
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    opt = torch.optim.SGD(params, lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    keep = _KeepGrads(params)
    loop = Loop(model=model, optimizer=opt, scheduler=sched, batches=batches, loss_fn=loss_fn(cfg, model),
                device=CPU, steps=1, grad_accum=grad_accum, params=params)  # fmt: skip
    return fit(loop, [keep])[0], keep.grads


def rel(a: list, b: list) -> float:
    """‖a − b‖ / ‖b‖ over all tensors (0 when both are zero)."""
    num = torch.sqrt(sum(((x - y) ** 2).sum() for x, y in zip(a, b, strict=True)))
    den = torch.sqrt(sum((y**2).sum() for y in b))
    return float(num / den) if float(den) > 0 else float(num)


def n_trained(e) -> int:
    return sum(1 for t in e.labels if t != IGNORE_INDEX)


def spread_by_trained(examples: list, n: int) -> list:
    """``n`` of ``examples`` spread evenly from the fewest to the most trained tokens (micro-batches of unlike
    token counts: what a per-micro-batch mean would get wrong)."""
    ranked = sorted(examples, key=n_trained)
    if n >= len(ranked) or n < 2:
        return ranked[:n] if n < 2 else ranked
    return [ranked[round(i * (len(ranked) - 1) / (n - 1))] for i in range(n)]


def _split(cfg: DictConfig, examples: list, k: int, n_micro: int) -> list[dict]:
    return [collate_batch(b, 0) for b in micro_batches(examples, k, n_micro, 1, int(cfg.train.seed))]


def check_accumulation(cfg: DictConfig, model, examples: list, tol: float) -> Line:
    """micro_batch=k x grad_accum=n/k against micro_batch=n x grad_accum=1 on the same n examples."""
    k = max(1, int(cfg.train.micro_batch))
    accum = max(2, int(cfg.train.grad_accum))
    while k > 1 and k * accum > len(examples):
        k //= 2
    n = min(k * accum, len(examples) - len(examples) % k)
    ex = spread_by_trained(examples, n)
    _, small = step_grads(cfg, model, _split(cfg, ex, k, n // k), n // k)
    _, big = step_grads(cfg, model, _split(cfg, ex, n, 1), 1)
    d = rel(small, big)
    figure = f"micro_batch={k} x grad_accum={n // k} vs {n} x 1, relative gradient difference {d:.1e}"
    return Line("accumulation", d <= tol, figure, f"{tol:.0e}")


def _grads_of(model, batch: dict, params: list) -> list:
    model.zero_grad(set_to_none=True)
    model.train()
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
    out.loss.backward()
    return [q.grad.detach().float().clone() for q in params]


def check_eval_then_train(model, examples: list, tol: float) -> Line:
    """LoRA gradients without, then after, an eval forward (what every trial runs before step 0)."""
    params = [q for q in model.parameters() if q.requires_grad]
    batch = collate_batch(examples[:2], 0)
    fresh = _grads_of(model, batch, params)
    evaluate(model, [batch], CPU)
    after = _grads_of(model, batch, params)
    model.zero_grad(set_to_none=True)
    d = rel(after, fresh)
    return Line("eval_then_train", d <= tol, f"relative gradient difference {d:.1e}", f"{tol:.0e}")


def check_packing(cfg: DictConfig, model, examples: list, tol: float) -> Line:
    """The examples packed into one row (the packing model's segment-wise attention) against unpacked."""
    ex = examples[: min(4, len(examples))]
    width = sum(len(e.input_ids) for e in ex)
    rows = pack_examples(ex, width, int(cfg.train.seed))
    p_loss, packed = step_grads(cfg, model, [collate_batch(rows, 0, width)], 1)
    u_loss, unpacked = step_grads(cfg, model, [collate_batch(ex, 0)], 1)
    d, dl = rel(packed, unpacked), abs(p_loss - u_loss) / max(abs(u_loss), 1e-12)
    figure = f"{len(ex)} examples in {len(rows)} row: loss {dl:.1e}, gradients {d:.1e} relative difference"
    return Line("packing", max(d, dl) <= tol, figure, f"{tol:.0e}")


class _Losses(Callback):
    def __init__(self):
        self.by_step: dict[int, float] = {}

    def on_loss(self, step: int, loss: float) -> None:
        self.by_step[step] = loss


class _StopAfter(Callback):
    """Raise the checkpointer's stop flag in step ``at - 1`` (as its SIGTERM handler does): it checkpoints
    after that step and stops the run with :class:`Preempted`."""

    def __init__(self, ckpt: Checkpointer, at: int):
        self.ckpt, self.at = ckpt, at

    def on_step_end(self, step: int) -> None:
        if step == self.at - 1:
            self.ckpt.signalled = "SIGTERM"


def resume_run(cfg: DictConfig, batches: list[dict], run_dir: str, stop_at: int | None, resume: bool):
    """One proxy run as a production trial runs it: build, an initial eval unless resuming, the trial's
    optimizer and scheduler, ``Resume.apply`` of the newest checkpoint in ``run_dir``, seeded RNG (or the
    checkpoint's), :func:`fit` with the production checkpointer. Returns (losses by step, trainable
    tensors); ``stop_at``: stop after that many steps, checkpointed."""
    model = build_proxy(cfg, dropout=True)
    if not resume:
        evaluate(model, batches[:1], CPU)
    model.train()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer, _ = build_optimizer(cfg, params)
    scheduler = build_scheduler(cfg, optimizer)
    point = load_checkpoint(latest_checkpoint(Path(run_dir))) if resume else None
    if point is not None:
        point.apply(model, optimizer, scheduler)
    losses = _Losses()
    ckpt = Checkpointer(Path(run_dir), 0, 1, model, optimizer, scheduler, lambda: {}, RESUME_STEPS)
    loop = Loop(model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
                loss_fn=loss_fn(cfg, model), device=CPU, steps=RESUME_STEPS, grad_accum=_accum(cfg),
                max_grad_norm=float(cfg.train.max_grad_norm), params=params,
                start_step=point.next_step if point is not None else 0)  # fmt: skip
    torch.manual_seed(int(cfg.train.seed))
    if point is not None:
        point.restore_rng()
    try:
        fit(loop, [*([_StopAfter(ckpt, stop_at)] if stop_at else []), losses, ckpt])
    except Preempted:
        pass
    finally:
        ckpt.close()
    return losses.by_step, {n: q.detach().clone() for n, q in model.named_parameters() if q.requires_grad}


def _accum(cfg: DictConfig) -> int:
    return min(2, max(1, int(cfg.train.grad_accum)))


def check_resume(cfg: DictConfig, examples: list) -> Line:
    """:data:`RESUME_STEPS` steps uninterrupted against stopped after :data:`RESUME_AT` and resumed."""
    k = min(2, max(1, int(cfg.train.micro_batch)))
    with open_dict(cfg):
        cfg.train.steps, cfg.train.warmup_steps = RESUME_STEPS, min(1, int(cfg.train.warmup_steps or 0))
    groups = micro_batches(examples, k, _accum(cfg), RESUME_STEPS, int(cfg.train.seed))
    batches = [collate_batch(b, 0) for b in groups]
    with tempfile.TemporaryDirectory(prefix="vramsweep-check-") as tmp:
        whole_losses, whole = resume_run(cfg, batches, f"{tmp}/whole", None, False)
        cut_losses, _ = resume_run(cfg, batches, f"{tmp}/cut", RESUME_AT, False)
        if latest_checkpoint(Path(tmp) / "cut") is None:
            return Line("resume", False, f"no complete checkpoint after step {RESUME_AT}", "bitwise")
        res_losses, res = resume_run(cfg, batches, f"{tmp}/cut", None, True)
    losses = [cut_losses.get(s) if s < RESUME_AT else res_losses.get(s) for s in range(RESUME_STEPS)]
    want = [whole_losses.get(s) for s in range(RESUME_STEPS)]
    d_loss = max((abs(a - b) if a is not None and b is not None else float("inf"))
                 for a, b in zip(losses, want, strict=True))  # fmt: skip
    off = [n for n in whole if not torch.equal(whole[n], res[n])]
    d = max((float((whole[n].float() - res[n].float()).abs().max()) for n in off), default=0.0)
    figure = (
        f"{RESUME_STEPS} steps vs stopped after {RESUME_AT} and resumed: {len(off)}/{len(whole)} adapter "
        f"tensors differ (max |diff| {d:.1e}), losses max |diff| {d_loss:.1e}"
    )
    return Line("resume", not off and d_loss == 0.0, figure, "bitwise")


def _stop_ids(tokenizer, cfg: DictConfig, fmt: str) -> set[int]:

    ids = {int(tokenizer.eos_token_id)} if tokenizer.eos_token_id is not None else set()
    if fmt in ("messages", "sharegpt", "chat"):
        vocab = tokenizer.get_vocab()
        s = render_settings(cfg, tokenizer, fmt)
        ids |= {vocab[t] for t in end_of_turn_markers(tokenizer, s) if t in vocab}
    return ids


def check_stop_token(cfg: DictConfig, tokenizer, examples: list, fmt: str) -> Line:
    """Every trained span of the first records ends with a trained stop token (a span cut at
    ``context.max_tokens`` is counted apart)."""
    stops, width = _stop_ids(tokenizer, cfg, fmt), int(cfg.context.max_tokens)
    checked, cut, bad = 0, 0, []
    for e in examples:
        for _, end in trained_spans(e.labels):
            if end == len(e.labels) and (e.truncated or len(e.labels) >= width):
                cut += 1
            elif e.input_ids[end - 1] in stops:
                checked += 1
            else:
                bad.append(e.where or e.doc_id)
    figure = f"{checked} trained spans of {len(examples)} records end with a trained stop token"
    figure += f", {cut} cut at context.max_tokens={width}" if cut else ""
    figure += f", {len(bad)} do not (first: {bad[0]})" if bad else ""
    if not checked and not bad:
        figure += (
            " (none ends inside the context: no stop token is trained; a longer context.max_tokens trains it)"
        )
    return Line("stop_token", not bad, figure, "0 missing")


def compute_dtype(cfg: DictConfig) -> str:
    """The coarsest dtype the model computes in: ``train.dtype``, or a 4-bit base's ``quant.compute_dtype``
    when that is coarser (an fp32 trial over NF4 weights multiplies in bf16)."""
    dtype = str(cfg.train.dtype)
    if int(cfg.quant.bits) == 4 and dtype == "fp32":
        return str(cfg.quant.compute_dtype)
    return dtype


def tolerance(cfg: DictConfig) -> float:
    return TOLERANCE[compute_dtype(cfg)]


def run_checks(cfg: DictConfig) -> tuple[list[Line], list[str]]:
    """Every check on ``cfg``'s proxy: (lines, notes on how the proxy differs from the config)."""
    tokenizer = model_source(cfg)[1]
    data = trial_data(cfg, tokenizer)
    examples = data.train[:N_RECORDS]
    tol = tolerance(cfg)
    small, vocab = proxy_examples(examples)
    pcfg, notes = proxy_config(cfg, vocab=vocab)
    cut = sum(1 for e in examples if len(e.input_ids) > PROXY_TOKENS)
    notes.append(
        f"token ids renumbered into {vocab} rows"
        + (f"; {cut} records cut to their last {PROXY_TOKENS} tokens" if cut else "")
    )
    model = build_proxy(pcfg)
    lines = [check_accumulation(pcfg, model, small, tol), check_eval_then_train(model, small, tol)]
    packed_cfg, _ = proxy_config(cfg, packing=True, vocab=vocab)
    packed_model = model if bool(pcfg.data.packing) else build_proxy(packed_cfg)
    lines.append(check_packing(packed_cfg, packed_model, small, tol))
    lines.append(check_resume(proxy_config(cfg, packing=False, vocab=vocab)[0], small))
    if tokenizer is None or data.stats.get("random_tokens"):
        notes.append("stop_token skipped: random tokens have no turns")
    else:
        lines.append(check_stop_token(cfg, tokenizer, examples, str(data.stats.get("format"))))
    return lines, notes


def checked_config(overrides: list[str], *, say_data: bool = True) -> DictConfig:
    """``overrides`` composed and pre-flighted as ``vramsweep train`` does it (the machine's rules on the
    proxy, which runs here); :class:`ConfigError` on bad input, before anything is built or written.
    ``say_data=False``: without the pre-flight's data summary line (a sweep's pre-flight says its own)."""
    check_named_options(overrides)
    cfg = compose(overrides, rules="config")
    check_machine(proxy_config(cfg)[0])
    preflight(cfg, overrides=overrides, say_data=say_data)
    return cfg


def headline(cfg: DictConfig) -> str:
    m = cfg.model
    return (
        f"proxy of {m.name} ({m.family}, {min(PROXY_LAYERS, int(m.num_layers))} layers, random "
        f"weights, cpu), quant={cfg.quant.name}, adapter={cfg.adapter.name}, dtype={cfg.train.dtype} "
        f"(computes in {compute_dtype(cfg)})"
    )


def checks_on(cfg: DictConfig) -> tuple[list[Line], list[str]]:
    """:func:`run_checks` on ``train.threads`` torch threads, as a trial (no oversubscribed cores); the
    caller's thread count restored after."""
    before = torch.get_num_threads()
    threads = apply_threads(cfg.train.get("threads", "auto"))
    try:
        lines, notes = run_checks(cfg)
    finally:
        torch.set_num_threads(before)
    notes.insert(0, f"{threads.threads} torch threads ({threads.why})")
    if cfg.hardware.device != "cpu" and not bool(cfg.train.get("deterministic", False)):
        notes.append(
            "resume on the card is bitwise only with train.deterministic=true (docs/RUNS.md); the proxy's "
            "is checked on the CPU"
        )
    return lines, notes


def run_check(overrides: list[str]) -> int:
    """``vramsweep check``: compose and pre-flight as ``train`` does, run the checks, print one line each."""
    try:
        cfg = checked_config(overrides)
    except ConfigError as exc:
        print(error_line("check", str(exc)), file=sys.stderr)
        return 2
    print(f"check: {headline(cfg)}", flush=True)
    lines, notes = checks_on(cfg)
    for note in notes:
        print(f"note: {note}")
    for line in lines:
        print(line, flush=True)
    return 0 if all(x.ok for x in lines) else 1
