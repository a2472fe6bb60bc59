"""``vramsweep generate <run>`` and ``vramsweep export <run> [--merge] <dir>``: use a run's model.

Both read the run folder's ``run.json`` (:mod:`vramsweep.production.outputs`): the base weights folder, the
adapter kind, the vocabulary, the dtype and quantisation. ``generate`` loads base + adapter (4-bit bases
quantised again, as trained; a full fine-tune's ``model/``), renders the prompt or a messages file through
the tokenizer's chat template when it has one, and decodes greedily. ``export`` copies the adapter folder
(+ tokenizer), or with ``--merge`` folds the adapter into the **bf16** base from the run's base folder
(QLoRA runs included: the merge never happens into 4-bit weights) and writes a folder plain
``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

from vramsweep.config import compose
from vramsweep.config.errors import error_line
from vramsweep.data.prep import trial_data
from vramsweep.knobs.quant import keep_trainable_4bit_layout
from vramsweep.production.layout import ADAPTER_DIR, MODEL_DIR, TOKENIZER_DIR, read_manifest


class UseError(ValueError):
    """Bad input to generate/export (one error line, exit 2)."""


def _manifest(run: str) -> dict[str, Any]:
    try:
        return read_manifest(run)
    except FileNotFoundError as exc:
        raise UseError(
            f"{exc} (give the folder a vramsweep train run wrote, with run.json and adapter/)"
        ) from None


def _dtype(name: str) -> Any:
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def load_run_model(run: str | Path, *, quantised: bool = True) -> tuple[Any, Any, dict[str, Any]]:
    """(model, tokenizer, manifest) of a finished run: base + adapter as trained (``quantised=False``: the
    bf16/fp16 base even for a 4-bit run, what ``--merge`` folds into)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = Path(run)
    man = _manifest(str(run))
    dtype = _dtype(man["dtype"])
    tok = AutoTokenizer.from_pretrained(str(run / TOKENIZER_DIR))
    if man["weights"] == MODEL_DIR:
        return AutoModelForCausalLM.from_pretrained(str(run / MODEL_DIR), dtype=dtype).eval(), tok, man
    base_path = man["base"]["path"]
    if not base_path or not Path(base_path).is_dir():
        raise UseError(f"{run}/run.json: the base weights folder {base_path!r} is missing")
    kw: dict[str, Any] = {"dtype": dtype}
    if quantised and int(man["quant"]["bits"]) in (4, 8):
        from vramsweep.knobs.common import bnb_config

        cfg = compose([f"quant={man['quant']['name']}"], rules="none")
        kw["quantization_config"] = bnb_config(cfg)
    base = AutoModelForCausalLM.from_pretrained(base_path, **kw)
    if "quantization_config" in kw:  # the trained model's kernels: no lossy CPU repacking of 4-bit weights
        keep_trainable_4bit_layout(base)
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(run / ADAPTER_DIR)).eval(), tok, man


def model_device(model: Any) -> Any:
    """Where the model's weights are (transformers 5.x places a 4-bit model on the current CUDA device and
    attaches no hooks that would move the inputs: the caller must)."""
    import torch

    dev = getattr(model, "device", None)
    if isinstance(dev, torch.device):
        return dev
    return next(model.parameters()).device


def prompt_ids(tok: Any, prompt: str | None, messages: list[dict] | None) -> list[int]:
    """Token ids of the prompt: through the chat template when the tokenizer has one (a generation prompt
    appended), else the plain text."""
    if messages is None:
        messages = [{"role": "user", "content": prompt or ""}]
    if getattr(tok, "chat_template", None):
        # as training tokenised it (data/render.py): the rendered text, with the template's own specials
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    return list(tok("\n".join(str(m.get("content", "")) for m in messages))["input_ids"])


def generate(run: str | Path, prompt: str | None, messages: list[dict] | None, max_new_tokens: int) -> str:
    """Greedy completion of the prompt by the run's model."""
    import torch

    model, tok, man = load_run_model(run)
    ids = prompt_ids(tok, prompt, messages)
    if man.get("id_map") and man["weights"] == MODEL_DIR:  # a sliced full fine-tune: new ids in, old out
        from vramsweep.knobs.vocab_slice import IdMap

        idm = IdMap.load(run)
        x = torch.tensor([idm.encode(ids)])
    else:
        idm, x = None, torch.tensor([ids])
    x = x.to(model_device(model))  # a 4-bit base lands on cuda:0 without hooks: the prompt goes there too
    with torch.no_grad():
        out = model.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    new = out[0, x.shape[1] :].cpu()
    if idm is not None:
        new = idm.new_to_old[new]
    return tok.decode(new.tolist(), skip_special_tokens=True)


def export(run: str | Path, out: str | Path, *, merge: bool) -> Path:
    """Write the adapter folder (+ tokenizer) or, with ``merge``, a merged bf16 model folder to ``out``."""
    run, out = Path(run), Path(out)
    man = _manifest(str(run))
    if out.exists() and any(out.iterdir()):
        raise UseError(f"{out} exists and is not empty (give a new folder)")
    if man.get("id_map") and man["weights"] == MODEL_DIR and merge:
        raise UseError(
            f"{run}: a vocab=sliced full fine-tune has only the kept embedding rows; export it "
            "without --merge (model/ + id_map.json)"
        )
    if not merge:
        shutil.copytree(run / man["weights"], out, dirs_exist_ok=True)
        shutil.copytree(run / TOKENIZER_DIR, out, dirs_exist_ok=True)
        if man.get("id_map"):
            shutil.copy2(run / man["id_map"], out / man["id_map"])
        return out
    model, tok, _ = load_run_model(run, quantised=False)
    if man["weights"] == ADAPTER_DIR:
        model = model.merge_and_unload()
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    info: dict[str, Any] = {"run": str(run.resolve()), "merged": True, **man}
    if man["weights"] == ADAPTER_DIR and int(man["quant"]["bits"]) in (4, 8):
        info["merged_vs_trained"] = merge_check(run, model)  # the adapter was fitted to quantised weights
    (out / "vramsweep_export.json").write_text(json.dumps(info, indent=1))
    return out


#: held-out records and tokens per record that :func:`merge_check` compares on
CHECK_RECORDS, CHECK_TOKENS = 4, 128


def held_out_ids(run: Path, tok: Any) -> list[list[int]]:
    """Token ids of up to :data:`CHECK_RECORDS` of the run's held-out examples (its ``config.yaml``'s data,
    through the tokenisation cache), each cut to :data:`CHECK_TOKENS`."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(run / "config.yaml")
    data = trial_data(cfg, tok)
    return [list(e.input_ids[:CHECK_TOKENS]) for e in data.eval[:CHECK_RECORDS]]


def merge_check(run: Path, merged: Any) -> dict[str, Any]:
    """Logits of the merged bf16 model against the model as trained (quantised base + adapter) on a few
    held-out records: ``max_abs``/``mean_abs`` |Δlogit| and the share of positions whose argmax agrees.
    The adapter was fitted to the quantised weights, so the merged model is not the trained one: this says
    by how much (docs/RUNS.md)."""
    import torch

    trained, tok, _ = load_run_model(run)
    try:
        records = held_out_ids(run, tok)
    except Exception as exc:  # no config.yaml, data moved: the check cannot run, say why
        return {"measured": False, "reason": f"held-out records unavailable: {type(exc).__name__}: {exc}"}
    dmax, dsum, n, agree = 0.0, 0.0, 0, 0
    with torch.no_grad():
        for ids in records:
            a = merged(input_ids=torch.tensor([ids]).to(model_device(merged))).logits.float().cpu()
            b = trained(input_ids=torch.tensor([ids]).to(model_device(trained))).logits.float().cpu()
            d = (a - b).abs()
            dmax, dsum, n = max(dmax, d.max().item()), dsum + d.sum().item(), n + d.numel()
            agree += int((a.argmax(-1) == b.argmax(-1)).sum().item())
    positions = sum(len(r) for r in records)
    return {
        "measured": True,
        "records": len(records),
        "positions": positions,
        "max_abs_logit_diff": dmax,
        "mean_abs_logit_diff": dsum / max(n, 1),
        "argmax_agreement": agree / max(positions, 1),
        "definition": "merged bf16 model vs quantised base + adapter as trained, on the run's first held-out "
        f"records (at most {CHECK_RECORDS}, {CHECK_TOKENS} tokens each): |logit difference| and the share of "
        "positions with the same argmax token",
    }


def cmd_generate(args: argparse.Namespace) -> int:
    """``vramsweep generate <run> --prompt TEXT | --messages FILE``."""
    import sys

    try:
        messages = None
        if args.messages:
            try:
                messages = json.loads(Path(args.messages).read_text())
            except (OSError, ValueError) as exc:
                raise UseError(f"--messages {args.messages}: {exc}") from None
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise UseError(
                    f"--messages {args.messages}: a JSON list of {{role, content}} objects is needed"
                )
        elif args.prompt is None:
            raise UseError("give --prompt TEXT or --messages FILE")
        print(generate(args.run, args.prompt, messages, int(args.max_new_tokens)))
    except UseError as exc:
        print(error_line("generate", str(exc)), file=sys.stderr)
        return 2
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``vramsweep export <run> [--merge] <dir>``."""
    import sys

    try:
        out = export(args.run, args.out, merge=bool(args.merge))
    except UseError as exc:
        print(error_line("export", str(exc)), file=sys.stderr)
        return 2
    print(f"{'merged model' if args.merge else 'adapter'}: {out}")
    check = (
        json.loads((out / "vramsweep_export.json").read_text()).get("merged_vs_trained")
        if args.merge
        else None
    )
    if check and check.get("measured"):
        print(
            f"merged vs trained (quantised base + adapter) on {check['records']} held-out records: "
            f"max |dlogit| {check['max_abs_logit_diff']:.3f}, mean {check['mean_abs_logit_diff']:.4f}, "
            f"same argmax at {100 * check['argmax_agreement']:.1f} % of {check['positions']} positions"
        )
    elif check:
        print(f"merged vs trained: not measured ({check['reason']})")
    return 0


def add_parsers(sub: Any) -> None:
    """Register ``generate`` and ``export`` on the CLI's subparsers."""
    g = sub.add_parser("generate", help="generate with a train run's model (base + adapter, chat template)")
    g.add_argument("run", help="the run folder (results/runs/<...>, with run.json)")
    g.add_argument("--prompt", default=None, help="the user message")
    g.add_argument("--messages", default=None, metavar="FILE", help="a JSON list of {role, content} messages")
    g.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="how many tokens to generate at most, greedily (default: %(default)s)",
    )
    g.set_defaults(func=cmd_generate)
    e = sub.add_parser("export", help="write a run's adapter, or with --merge a merged bf16 model folder")
    e.add_argument("run", help="the run folder (with run.json)")
    e.add_argument("out", help="a new (or empty) folder")
    e.add_argument("--merge", action="store_true", help="fold the adapter into the bf16 base")
    e.set_defaults(func=cmd_export)
