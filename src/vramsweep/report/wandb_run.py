"""One W&B run per trial. Offline when there is no API key or the server is unreachable; never crashes.

``logger=none`` -> no run. ``logger=wandb`` with ``logger.mode=auto`` goes online only when
``WANDB_API_KEY`` is set (else offline: ``wandb/offline-run-*``, upload later with ``wandb sync``).
An online init that fails (no key, unreachable server) falls back to offline once; if that fails too,
the trial carries on and ``meta.wandb`` says why. Every later W&B call is guarded the same way.

What a W&B user gets (docs/WANDB.md):

* ``job_type="trial"``, ``group=<sweep>``, name ``<sweep>-<trial>``;
* tags ``status:<status>``, ``design:<baseline|ablation|stacking|grid|search>``, ``quant:<name>``,
  ``kernels:<name>``, ``adapter:<name>`` (the status tag is added at finish);
* config: ``trial``, ``sweep``, every overridden knob as a top-level key (``quant: nf4``,
  ``adapter.r: 16``), ``overrides``, ``design`` and the whole composed config under ``config``;
* history (one row per optimizer step, logged by the trial loop): ``train/*``, ``memory/*``, ``eval/loss``;
* summary (:func:`summary_of`): status/reason, the metrics, ``memory/*`` breakdown, ``estimate/*`` and
  its error, MFU, ``step_phase/*``, the device.

Trials of a sweep write to ``<sweep dir>/wandb`` (the same folder as the sweep-summary run of
:mod:`vramsweep.report.wandb_summary`); a single trial writes to ``<results_dir>/wandb``;
``logger.dir`` overrides both.
"""

from __future__ import annotations

import math
import os
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vramsweep.record.metrics import METRICS, MetricName, column, scaled
from vramsweep.record.status import Status
from vramsweep.report.load import TrialRecord, override_dict

#: Environment variable naming the sweep folder (set by the sweeper for its trials; optional).
SWEEP_DIR_ENV = "VRAMSWEEP_SWEEP_DIR"
#: Config groups whose option name becomes a tag (``quant:nf4``).
TAG_GROUPS = ("quant", "kernels", "adapter")
MAX_TAG = 64  # W&B rejects longer tags


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def design_role(design: dict | None) -> str | None:
    """``baseline`` | ``ablation`` | ``stacking`` | ``grid`` | ``search`` for a ``meta.design`` dict, else
    None."""
    if not isinstance(design, dict) or not design.get("kind"):
        return None
    kind = str(design["kind"])
    if kind == "ablation":
        return "baseline" if design.get("role") == "baseline" else "ablation"
    if kind == "stacking":
        return "baseline" if not design.get("step") else "stacking"
    if kind == "search" and design.get("sampler") == "grid":
        return "grid"  # a grid design (command-line lists): as the sweep's summary run says
    return kind


def _tag(key: str, value: Any) -> str:
    return f"{key}:{value}"[:MAX_TAG]


def start_tags(config: dict, design: dict | None) -> list[str]:
    """Tags known when the run starts: design role and the quant/kernels/adapter option names."""
    tags = []
    role = design_role(design)
    if role:
        tags.append(_tag("design", role))
    for group in TAG_GROUPS:
        node = config.get(group)
        name = node.get("name") if isinstance(node, dict) else None
        if name is not None:
            tags.append(_tag(group, name))
    return tags


def varied_params(overrides: list[str] | tuple[str, ...], config: dict) -> dict[str, Any]:
    """Each overridden knob as ``{key: value}`` with the value the trial ran with (typed from the
    composed config; a config group gives its option name): ``quant=nf4`` -> ``{"quant": "nf4"}``,
    ``adapter.r=16`` -> ``{"adapter.r": 16}``. Deletions and ``hydra.*``/``sweep.*`` are skipped."""

    rec = TrialRecord(
        number=-1, status=Status.OK.value, overrides=[str(o) for o in overrides or ()], config=config
    )
    out: dict[str, Any] = {}
    for key, text in override_dict(rec.overrides).items():
        value = rec.knob_value(key)
        out[key] = text if isinstance(value, dict | list) and not value else value
    return out


def run_config(cfg_dict: dict, result: dict, design: dict | None) -> dict[str, Any]:
    """The W&B run config: trial number, sweep name, the varied knobs at top level, the composed config."""
    params = varied_params(result.get("overrides") or [], cfg_dict)
    out: dict[str, Any] = {"trial": result.get("trial"), "sweep": result.get("sweep")}
    for key, value in params.items():
        if key not in ("trial", "sweep", "config", "overrides", "design"):
            out[key] = value
    out["overrides"] = list(result.get("overrides") or [])
    out["design"] = design
    out["config"] = cfg_dict
    return out


def summary_of(result: dict) -> dict[str, Any]:
    """The run summary of a finished trial (only numbers that were measured or estimated)."""
    metrics = result.get("metrics") or {}
    meta = result.get("meta") or {}
    s: dict[str, Any] = {k: v for k, v in metrics.items() if _finite(v)}
    status = result.get("status")
    # the value, as tags and tables say it: W&B writes an Enum member by its name ("OK")
    s["status"] = str(status.value if isinstance(status, Enum) else status)
    s["reason"] = str(result.get("reason") or "")[:1000]  # always there (docs/WANDB.md): "" when ok
    mfu = MetricName.MFU.value  # a plain str key (W&B and JSON take it as it is)
    info = meta.get(mfu)
    if not _finite(metrics.get(mfu)):
        # no `mfu: null` (W&B's reader drops null summary values): why it is missing, always
        s.pop(mfu, None)
        why = info.get("reason") if isinstance(info, dict) else None
        s[f"{mfu}/reason"] = str(why or f"not measured (trial status {s['status']})")
    _memory_summary(s, metrics)
    _estimate_summary(s, result, metrics.get(MetricName.PEAK_MEMORY_BYTES))
    for m in METRICS:  # the registry's W&B aliases: eval/loss (the final eval, beside the intermediate
        # ones in history), eval/ppl, train/tokens_per_s
        if m.wandb and _finite(metrics.get(m.name)):
            s[m.wandb] = metrics[m.name]
    _meta_summary(s, meta, info)
    return s


def _memory_summary(s: dict[str, Any], metrics: dict) -> None:
    """Add the measured memory to summary ``s``: its kind, the peak (bytes and display unit), the breakdown
    and the state bytes (finite values only)."""
    if metrics.get(MetricName.MEMORY_KIND):
        s["memory/kind"] = metrics[MetricName.MEMORY_KIND]
    peak_name = MetricName.PEAK_MEMORY_BYTES
    peak = metrics.get(peak_name)
    if _finite(peak):
        s["memory/peak_bytes"] = peak
        s[f"memory/{column(peak_name)}"] = scaled(peak_name, peak)
    for part, value in (metrics.get(MetricName.MEMORY_BREAKDOWN_BYTES) or {}).items():
        if _finite(value):
            s[f"memory/breakdown/{part}_bytes"] = value
    for part, value in (metrics.get(MetricName.STATE_BYTES) or {}).items():
        if _finite(value):
            s[f"memory/state/{part}_bytes"] = value


def _estimate_summary(s: dict[str, Any], result: dict, peak: Any) -> None:
    """Add the trial's estimate (if any) to summary ``s``: its peak (and its error against the measured
    ``peak``), breakdown, peak phase and whether it fits."""
    peak_name = MetricName.PEAK_MEMORY_BYTES
    est = result.get("estimate") if isinstance(result.get("estimate"), dict) else None
    if est:
        epeak = est.get(peak_name)
        if _finite(epeak):
            s["estimate/peak_bytes"] = epeak
            s[f"estimate/{column(peak_name)}"] = scaled(peak_name, epeak)
            if _finite(peak) and peak > 0:
                s["estimate/error"] = epeak / peak - 1.0  # > 0: the estimator over-predicts
        for part, value in (est.get("breakdown_bytes") or {}).items():
            if _finite(value):
                s[f"estimate/breakdown/{part}_bytes"] = value
        if est.get("peak_phase"):
            s["estimate/peak_phase"] = est["peak_phase"]
        if isinstance(est.get("fits"), bool):
            s["estimate/fits"] = est["fits"]


def _meta_summary(s: dict[str, Any], meta: dict, info: Any) -> None:
    """Add the MFU's details (``info``), the step phases (host and device seconds), the device, git sha,
    hardware profile and emulation, and the wall time to summary ``s``."""
    _mfu_summary(s, info)
    _step_phase_summary(s, meta.get("step_phases_s") or {})
    _environment_summary(s, meta)
    if _finite(meta.get("wall_s")):
        s["wall_s"] = meta["wall_s"]


def _mfu_summary(s: dict[str, Any], info: Any) -> None:
    """Add the MFU's details (``info``: its finite numbers and strings) to summary ``s``."""
    mfu = MetricName.MFU.value
    if isinstance(info, dict):
        for k, v in info.items():
            if _finite(v) or isinstance(v, str):
                s[f"{mfu}/{k}"] = v


def _step_phase_summary(s: dict[str, Any], phases: dict) -> None:
    """Add the step phases' finite host seconds, then their device seconds (``device_s``), to summary
    ``s``."""
    for phase, sec in phases.items():
        if _finite(sec):
            s[f"step_phase/{phase}_s"] = sec
    for phase, sec in (phases.get("device_s") or {}).items():  # CUDA events: the device's seconds
        if _finite(sec):
            s[f"step_phase/device/{phase}_s"] = sec


def _environment_summary(s: dict[str, Any], meta: dict) -> None:
    """Add the device, git sha, hardware profile and hardware emulation (its non-null entries) to summary
    ``s``."""
    if meta.get("device"):
        s["device"] = str(meta["device"])
    if meta.get("git_sha"):
        s["git_sha"] = str(meta["git_sha"])  # W&B's own git probe is off (it costs every trial time)
    if meta.get("hardware_profile"):
        s["hardware_profile"] = str(meta["hardware_profile"])
    emu = meta.get("hardware_emulation")
    if isinstance(emu, dict):
        for k, v in emu.items():
            if v is not None:
                s[f"hardware_emulation/{k}"] = v


class WandbLogger:
    def __init__(self, run: Any, result: dict):
        self.run = run
        self.result = result

    def _error(self, what: str, exc: BaseException) -> None:
        self.result["meta"].setdefault("wandb", {})[what] = f"{type(exc).__name__}: {str(exc)[:200]}"

    def log(self, data: dict, step: int | None = None) -> None:
        try:
            self.run.log(data, step=step)
        except Exception as exc:  # never let tracking kill a measurement
            self._error("log_error", exc)

    def finish(self, result: dict) -> None:
        """Summary, final tags (status is only known now) and close; a W&B failure is recorded, not raised."""
        self.result = result
        try:
            tags = [t for t in (self.run.tags or ()) if not str(t).startswith("status:")]
            role = design_role((result.get("meta") or {}).get("design"))
            if role and _tag("design", role) not in tags:
                tags.append(_tag("design", role))
            tags.append(_tag("status", result.get("status")))
            self.run.tags = tuple(tags)
        # broad on purpose: W&B must never fail the trial; the error is recorded
        except Exception as exc:
            self._error("tags_error", exc)
        try:
            self.run.summary.update(summary_of(result))
        # broad on purpose: W&B must never fail the trial; the error is recorded
        except Exception as exc:
            self._error("summary_error", exc)
        try:
            self.run.finish(exit_code=0 if result.get("status") == Status.OK else 1)
        # broad on purpose: W&B must never fail the trial; the error is recorded
        except Exception as exc:
            self._error("finish_error", exc)


def wandb_root(cfg: DictConfig, result: dict, sweep_dir: str | os.PathLike | None = None) -> Path:
    """The folder W&B writes ``wandb/`` into: ``logger.dir``, else the sweep folder (one ``wandb``
    folder per sweep, shared with the sweep-summary run), else ``results_dir``."""
    if cfg.logger.get("dir"):
        return Path(str(cfg.logger.dir))
    if sweep_dir:
        return Path(sweep_dir)
    if os.environ.get(SWEEP_DIR_ENV):
        return Path(os.environ[SWEEP_DIR_ENV])
    results_dir = Path(str(cfg.results_dir))
    sweep = result.get("sweep")
    if sweep and result.get("trial") is not None:
        default = results_dir / "sweeps" / str(sweep)  # the sweeper's default sweep_dir
        if (default / "sweep.json").is_file():
            return default
    return results_dir


def start_logger(
    cfg: DictConfig,
    *,
    name: str,
    group: str | None,
    result: dict,
    sweep_dir: str | os.PathLike | None = None,
    design: dict | None = None,
    resume_id: str | None = None,
) -> WandbLogger | None:
    """Start the trial's W&B run (None with ``logger=none`` or when W&B cannot start at all).

    Args:
        sweep_dir: the sweep folder (trial runs then land in ``<sweep_dir>/wandb``); default: the
            ``VRAMSWEEP_SWEEP_DIR`` environment variable, else ``<results_dir>/sweeps/<sweep>`` when it
            holds a ``sweep.json``, else ``results_dir``.
        design: the design point (``meta.design``); default ``result["meta"]["design"]``.
        resume_id: a resumed production run's W&B run id (from its checkpoint): that run is reopened
            (``wandb.init(id=..., resume="allow")``), so its charts continue instead of a second run.
    """
    if cfg.logger.name != "wandb":
        return None
    info: dict[str, Any] = {}
    result["meta"]["wandb"] = info
    try:
        import wandb
    # broad on purpose: W&B is optional; a broken install must not fail the trial (recorded)
    except Exception as exc:
        info["error"] = f"wandb not importable: {exc}"
        return None
    mode = str(cfg.logger.mode)
    if mode == "auto":
        mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        mode = os.environ["WANDB_MODE"]
    if design is None:
        design = result["meta"].get("design")
    try:
        cfg_dict = OmegaConf.to_container(cfg, resolve=True)
        config = run_config(cfg_dict, result, design)  # type: ignore[arg-type]
        tags = start_tags(cfg_dict, design)  # type: ignore[arg-type]
        wdir = wandb_root(cfg, result, sweep_dir)
        wdir.mkdir(parents=True, exist_ok=True)
    # broad on purpose: W&B must never fail the trial; the error is recorded in meta.wandb
    except Exception as exc:
        info["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return None
    kw = dict(
        project=str(cfg.logger.project),
        name=name,
        group=group,
        job_type="trial",
        tags=tags,
        dir=str(wdir),
        config=config,
        reinit="create_new",  # a sweep summary run may be open in the same process
    )
    if resume_id:
        kw.update(id=resume_id, resume="allow")
        info["resumed_run_id"] = resume_id
    for attempt in [mode, "offline"] if mode == "online" else [mode]:
        try:
            settings = wandb.Settings(
                init_timeout=20, silent=True, console="off", disable_git=True, save_code=False
            )
            run = wandb.init(mode=attempt, settings=settings, **kw)  # type: ignore[arg-type]
            info.update(
                {
                    "mode": attempt,
                    "run_id": run.id,
                    "name": name,
                    "dir": str(getattr(getattr(run, "settings", None), "sync_dir", None) or wdir),
                }
            )
            return WandbLogger(run, result)
        # broad on purpose: W&B must never fail the trial; each attempt's error is recorded
        except Exception as exc:
            info.setdefault("errors", []).append(f"{attempt}: {type(exc).__name__}: {str(exc)[:200]}")
    return None
