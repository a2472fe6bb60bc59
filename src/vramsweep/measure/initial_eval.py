"""The initial (pre-training) eval, computed once per sweep and shared by every trial that would score the
same model on the same held-out tokens.

Before the first step a LoRA/rsLoRA/DoRA adapter is the identity (``lora_B`` is zero; DoRA's magnitude is
the weight norm) and full fine-tuning has not changed a weight, so the initial eval scores the base model:
the same figure for every trial with the same base, quantisation, dtype, vocabulary, attention/kernels/loss
path, device and held-out batches, whatever its optimizer, seed, checkpointing or adapter. The first such
trial of a sweep computes it and stores it in ``<sweep dir>/initial_eval/<key>.json``; the others read it
(``meta.initial_eval.shared``). Trials running at once may both compute it before either stored it.

Not shared: an adapter initialised away from the identity, and a trial outside a sweep folder. 4-bit
bases on CPU are shared too: the build keeps bitsandbytes from repacking their weights on the first eval
forward (``vramsweep.knobs.quant.keep_trainable_4bit_layout``), so skipping the eval changes nothing that
follows (``tests/knobs/test_quant_grads.py``: the gradients with and without a prior eval are bitwise equal).

:func:`key_parts` is the one place that says what the figure depends on; extend it (e.g. a different
fingerprint of the held-out set) and the key follows.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.record.result import atomic_write_json, read_json_file

#: The sweep folder of a sweep trial process (set by the sweeper; ``report/wandb_run.py`` reads it too).
SWEEP_DIR_ENV = "VRAMSWEEP_SWEEP_DIR"
FOLDER = "initial_eval"
#: Config groups whose every key can change the base model's eval figure.
MODEL_GROUPS = ("model", "quant", "vocab", "attention", "kernels", "rope", "hardware")
#: PEFT ``init_lora_weights`` values that start the adapter at the identity.
IDENTITY_INITS = (True, "true", "True", None, "gaussian")


def eval_set_fingerprint(batches: list[dict]) -> str:
    """sha256 of the held-out batches exactly as scored (token ids, labels, masks, positions; shapes)."""
    h = hashlib.sha256()
    for b in batches:
        for k in ("input_ids", "labels", "attention_mask", "position_ids"):
            t = b.get(k)
            if t is None or not hasattr(t, "numpy"):
                continue
            h.update(f"{k}{tuple(t.shape)}{t.dtype}".encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def not_shared(cfg: DictConfig) -> str | None:
    """Why this trial's initial eval is its own (None: it can be shared)."""
    init = cfg.adapter.get("init_lora_weights", None)
    if str(cfg.adapter.get("method", "lora")) != "full" and init not in IDENTITY_INITS:
        return f"adapter.init_lora_weights={init}: the adapter does not start at the identity"
    return None


def key_parts(cfg: DictConfig, batches: list[dict]) -> dict[str, Any]:
    """What the initial eval depends on: the model-side config groups, the dtype, the loss path (tiling,
    chunks), the held-out batches' fingerprint and the package versions."""
    parts: dict[str, Any] = {
        g: OmegaConf.to_container(cfg[g], resolve=True) for g in MODEL_GROUPS if g in cfg
    }
    parts["train.dtype"] = str(cfg.train.dtype)
    parts["tiling"] = OmegaConf.to_container(cfg.tiling, resolve=True) if "tiling" in cfg else None
    parts["eval_set"] = eval_set_fingerprint(batches)
    parts["versions"] = _versions()  # a sweep folder resumed after an upgrade does not reuse old figures
    return parts


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for dist in ("vramsweep", "torch", "transformers", "peft", "bitsandbytes"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    return out


def key_of(parts: dict[str, Any]) -> str:
    """A short stable key of :func:`key_parts`."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


class SharedInitialEval:
    """The sweep's store of initial evals: :meth:`load` a stored one, :meth:`store` a computed one."""

    def __init__(self, folder: Path, key: str, trial: int | None):
        self.folder, self.key, self.trial = Path(folder), key, trial

    @property
    def path(self) -> Path:
        return self.folder / FOLDER / f"{self.key}.json"

    def load(self) -> dict | None:
        try:
            data = read_json_file(self.path)
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and "loss" in data else None

    def store(self, loss: float | None, task_score: float | None, seconds: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(
            self.path,
            {"loss": loss, "score": task_score, "trial": self.trial, "seconds": round(seconds, 3)},
        )


def for_trial(cfg: DictConfig, batches: list[dict], result: dict) -> tuple[SharedInitialEval | None, str]:
    """The store this trial shares its initial eval through, or None with why not."""
    folder = os.environ.get(SWEEP_DIR_ENV)
    if result.get("sweep") is None or not folder or not Path(folder).is_dir():
        return None, "not a trial of a sweep folder"
    why = not_shared(cfg)
    if why is not None:
        return None, why
    return SharedInitialEval(Path(folder), key_of(key_parts(cfg, batches)), result.get("trial")), ""
