"""Synthetic sweeps for the report tests: result dicts with chosen numbers, a sweep folder of them, the
cells of a report table, and a user's project folder for ``pick``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vramsweep.record.result import atomic_write_json, new_result
from vramsweep.record.units import GIB as G

OBJECTIVES = [
    {"metric": "peak_memory_bytes", "direction": "minimize"},
    {"metric": "tokens_per_s", "direction": "maximize"},
    {"metric": "eval_loss", "direction": "minimize"},
]


# ---------------------------------------------------------------------------------------------
# synthetic result sets
# ---------------------------------------------------------------------------------------------
def _typed(v: str) -> Any:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def _config(overrides: list[str], budget: float | None) -> dict[str, Any]:
    """A minimal composed-config stand-in: groups as {"name": option}, dotted keys nested."""
    cfg: dict[str, Any] = {}
    for o in overrides:
        k, v = o.split("=", 1)
        if "." in k:
            sec, leaf = k.split(".", 1)
            cfg.setdefault(sec, {})[leaf] = _typed(v)
        else:
            cfg.setdefault(k, {})["name"] = v
    if budget is not None:
        cfg.setdefault("hardware", {})["budget_gib"] = budget
    return cfg


def result(
    n: int,
    overrides: list[str],
    *,
    status: str = "ok",
    peak: float | None = None,
    tps: float | None = None,
    loss: float | None = None,
    est: float | None = None,
    design: dict | None = None,
    budget: float | None = None,
    reason: str | None = None,
    config: dict | None = None,
    breakdown: bool = True,
) -> dict[str, Any]:
    """One result dict; ``peak``/``est`` in GiB."""
    r = new_result(
        status=status,
        reason=reason or (None if status == "ok" else f"synthetic {status}"),
        sweep="syn",
        trial=n,
        overrides=overrides,
        config=config if config is not None else _config(overrides, budget),
    )
    m = r["metrics"]
    if peak is not None:
        m["peak_memory_bytes"] = int(round(peak * G))
        m["memory_kind"] = "cuda_reserved"
        if breakdown:
            m["memory_breakdown_bytes"] = {
                "params": int(peak * G * 0.5),
                "grads": int(peak * G * 0.1),
                "optimizer": int(peak * G * 0.1),
                "activations": int(peak * G * 0.3),
                "other": 0,
            }
    m["tokens_per_s"] = tps
    m["eval_loss"] = loss
    if est is not None:
        r["estimate"] = {"peak_memory_bytes": int(round(est * G)), "breakdown_bytes": {}}
    r["meta"] = {
        "device": "synthetic",
        "versions": {"torch": "2.13.0", "vramsweep": "0.1.0"},
        "git_sha": "abc123",
    }
    if design is not None:
        r["meta"]["design"] = design
    return r


def write_sweep(folder: Path, results: list[dict], **settings: Any) -> Path:
    """A sweep folder: sweep.json (name 'syn' unless given) + trials/NNNN.json."""
    folder.mkdir(parents=True, exist_ok=True)
    settings.setdefault("name", "syn")
    settings.setdefault("objectives", OBJECTIVES)
    atomic_write_json(folder / "sweep.json", settings)
    for r in results:
        atomic_write_json(folder / "trials" / f"{r['trial']:04d}.json", r)
    return folder


def cells(table) -> list[dict[str, str]]:
    heads = [c.header for c in table.columns]
    return [dict(zip(heads, row)) for row in table.cells()]


BASE = ["quant=none", "optimizer=adamw"]


def ablation_results(with_meta: bool) -> list[dict]:
    """Baseline ×2 repeats, quant=nf4 ×2, optimizer=adamw_8bit ×2 (one oom)."""

    def d(role: str, change: list[str], rep: int) -> dict | None:
        return {"kind": "ablation", "role": role, "change": change, "repeat": rep} if with_meta else None

    return [
        result(
            0, BASE + ["train.seed=0"], peak=10.0, tps=1000, loss=2.0, est=10.5, design=d("baseline", [], 0)
        ),
        result(1, BASE + ["train.seed=1"], peak=10.2, tps=1100, loss=2.2, design=d("baseline", [], 1)),
        result(
            2,
            ["quant=nf4", "optimizer=adamw", "train.seed=0"],
            peak=6.0,
            tps=800,
            loss=2.3,
            design=d("factor", ["quant=nf4"], 0),
        ),
        result(
            3,
            ["quant=nf4", "optimizer=adamw", "train.seed=1"],
            peak=6.2,
            tps=900,
            loss=2.3,
            design=d("factor", ["quant=nf4"], 1),
        ),
        result(
            4,
            ["quant=none", "optimizer=adamw_8bit", "train.seed=0"],
            peak=9.0,
            tps=1040,
            loss=2.1,
            design=d("factor", ["optimizer=adamw_8bit"], 0),
        ),
        result(
            5,
            ["quant=none", "optimizer=adamw_8bit", "train.seed=1"],
            status="oom",
            reason="CUDA out of memory. Tried to allocate 2.00 GiB",
            design=d("factor", ["optimizer=adamw_8bit"], 1),
        ),
    ]


def _conf_copy(tmp_path: Path, monkeypatch) -> Path:
    """A user's project folder: ``./conf`` (not there yet) is the conf dir pick writes and compose reads."""
    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    monkeypatch.delenv("VRAMSWEEP_CONFIG_DIR", raising=False)
    return project / "conf"
