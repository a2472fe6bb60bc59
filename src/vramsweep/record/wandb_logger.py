"""One W&B run per trial. Offline when there is no API key or the server is unreachable; never crashes.

``logger=none`` -> no run. ``logger=wandb`` with ``logger.mode=auto`` goes online only when
``WANDB_API_KEY`` is set (else offline: ``wandb/offline-run-*``, upload later with ``wandb sync``).
An online init that fails (no key, unreachable server) falls back to offline once; if that fails too,
the trial carries on and ``meta.wandb`` says why.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


class WandbLogger:
    def __init__(self, run: Any, result: dict):
        self.run = run
        self.result = result

    def log(self, data: dict, step: int | None = None) -> None:
        try:
            self.run.log(data, step=step)
        except Exception as exc:  # never let tracking kill a measurement
            self.result["meta"].setdefault("wandb", {})["log_error"] = str(exc)[:200]

    def finish(self, result: dict) -> None:
        try:
            summary = {
                k: v for k, v in result["metrics"].items() if isinstance(v, int | float) and v is not None
            }
            summary["status"] = result["status"]
            if result.get("reason"):
                summary["reason"] = result["reason"]
            self.run.summary.update(summary)
            self.run.finish(exit_code=0 if result["status"] == "ok" else 1)
        except Exception as exc:
            result["meta"].setdefault("wandb", {})["finish_error"] = str(exc)[:200]


def start_logger(cfg: DictConfig, *, name: str, group: str | None, result: dict) -> WandbLogger | None:
    if cfg.logger.name != "wandb":
        return None
    info: dict[str, Any] = {}
    result["meta"]["wandb"] = info
    try:
        import wandb
    except Exception as exc:
        info["error"] = f"wandb not importable: {exc}"
        return None
    mode = str(cfg.logger.mode)
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        mode = os.environ["WANDB_MODE"]
    wdir = Path(str(cfg.logger.dir)) if cfg.logger.dir else Path(str(cfg.results_dir))
    wdir.mkdir(parents=True, exist_ok=True)
    kw = dict(
        project=str(cfg.logger.project),
        name=name,
        group=group,
        dir=str(wdir),
        config=OmegaConf.to_container(cfg, resolve=True),
        reinit="finish_previous",
    )
    for attempt in [mode, "offline"] if mode == "online" else [mode]:
        try:
            settings = wandb.Settings(init_timeout=20, silent=True, console="off")
            run = wandb.init(mode=attempt, settings=settings, **kw)
            info.update({"mode": attempt, "run_id": run.id, "dir": str(getattr(run, "dir", wdir))})
            return WandbLogger(run, result)
        except Exception as exc:
            info.setdefault("errors", []).append(f"{attempt}: {type(exc).__name__}: {str(exc)[:200]}")
    return None
