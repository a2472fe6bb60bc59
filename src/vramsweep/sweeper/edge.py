"""``sweep.edge_screen`` and ``sweep.edge_start``: a search with a memory budget learns the wall from the
estimator instead of from trials (the screen: on by default with ``sweep.preflight``), and may start at the
edge of what fits (the start: an option; ``vramsweep.sweeper.settings.EDGE_DEFAULTS`` says why).

When a new search study is created (never on a resume), a bounded sample of the search space is estimated
(:func:`screen`): every point when the space has at most :data:`MAX_CANDIDATES` points, else that many
points drawn at random (seeded by ``hydra.sweeper.seed``); estimating stops after :data:`TIME_S` CPU seconds
whatever is left (~14 ms a point on our 2-core machine: 128 points take ~1.8 s), so a 400k-point space starts
as fast as a 48-point one. Points are not composed one by one (0.3-0.8 s each): the fixed overrides are
composed once and each point's config-group options are swapped into a copy (:class:`FastConfigs`, as
``vramsweep estimate --suggest`` does), checked against one real compose of the first edge point (the others
are checked against the config rules).

* **Edge points** (``edge_start``): the :data:`EDGE_K` points with the highest estimated peak that the
  estimator puts inside ``hardware.budget_gib`` as the pre-flight counts it (required bytes <= budget +
  :data:`MARGIN`, the points ``sweep.preflight`` would run: the wall is where the estimate is uncertain),
  picked greedily with a bonus for differing from the points already picked (so the start spans the knobs
  that do not move the peak, such as the learning rate). They fill the first slots (``fixed_params``), in
  that order; the list is kept in the study (:data:`EDGE_ATTR`), so a resumed sweep, or one with a larger
  ``n_trials``, gives each slot the same point.
* **Screened points** (``edge_screen``): up to :data:`MAX_RECORDED` sampled points the estimator puts over the
  budget by more than the pre-flight's 10 % margin are recorded as finished trials without a trial process:
  status ``infeasible_estimate``, state PRUNED, constraint ``vram_over_budget_gib`` = estimated excess (the
  outcome rules of :mod:`.outcome`, as ``sweep.preflight`` records them), and a result JSON
  (``meta.screened``). They carry :data:`SCREENED` and do not count toward ``n_trials`` (like copies of
  re-proposed points); TPE reads their constraint, so it learns the wall before its first trial, and a
  proposal of one of them is a duplicate (its outcome is copied, nothing runs).
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

import yaml
from omegaconf import OmegaConf

from vramsweep.config.compose import check_rules, compose
from vramsweep.config.paths import find_option
from vramsweep.config.schema import _SCHEMAS, CONFIG_GROUPS
from vramsweep.estimate import estimate
from vramsweep.record.metrics import MetricName
from vramsweep.record.result import new_result, write_result
from vramsweep.record.status import Status
from vramsweep.record.units import GIB
from vramsweep.sweeper.outcome import CONSTRAINT_KEY, DASHBOARD_CONSTRAINTS_KEY, classify, user_attrs
from vramsweep.sweeper.space import Param, merge_overrides, override_key, params_to_overrides, space_size
from vramsweep.sweeper.storage import SCREENED

#: Study user attr: the edge points (slot k < len gets point k) and what the screen did.
EDGE_ATTR = "vramsweep:edge_start"
EDGE_K = 4
MAX_CANDIDATES = 128
MAX_RECORDED = 64
TIME_S = 2.0
#: Pre-flight margin: a point is screened out only when its estimate exceeds the budget by more than this.
MARGIN = 0.10
#: Weight of "differs from the edge points already picked" against the estimated peak (a fraction of the
#: budget).
DIVERSITY = 0.1
#: Relative disagreement between the fast path and a real compose above which no point is recorded.
AGREE = 0.01


@dataclass
class Screen:
    """What :func:`screen` found: the edge points, the points over the budget, and how much it looked at."""

    edge: list[dict[str, Any]] = field(default_factory=list)
    infeasible: list[tuple[dict[str, Any], dict[str, Any], float]] = field(default_factory=list)
    space: float = 0.0
    estimated: int = 0
    fits: int = 0
    seconds: float = 0.0
    note: str = ""


def candidates(dims: list[Param], seed: Any, n: int) -> list[dict[str, Any]]:
    """Every point of a space of at most ``n`` discrete points, else ``n`` distinct points drawn at random
    (at most ``8 n`` draws): never the whole of a large space."""
    keys = [d.key for d in dims]
    if space_size(dims) <= n and all(d.discrete for d in dims):
        return [dict(zip(keys, c)) for c in itertools.product(*[list(d.values) for d in dims])]
    rng = random.Random(f"{seed}:edge")
    seen: set[str] = set()
    out: list[dict[str, Any]] = []
    for _ in range(8 * n):
        point = {d.key: _draw(d, rng) for d in dims}
        key = repr(sorted(point.items()))
        if key not in seen:
            seen.add(key)
            out.append(point)
            if len(out) >= n:
                break
    return out


def _draw(d: Param, rng: random.Random) -> Any:
    if d.discrete:
        return rng.choice(list(d.values))
    lo, hi = float(d.low), float(d.high)  # type: ignore[arg-type]
    if d.integer:
        if d.log:
            return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        return rng.randint(int(lo), int(hi))
    return math.exp(rng.uniform(math.log(lo), math.log(hi))) if d.log else rng.uniform(lo, hi)


class FastConfigs:
    """The sweep's base config (fixed overrides, composed once) with a point's values put in place: a
    config-group choice is that option's file over the group's schema (what Hydra composes for
    ``group=option``), then the fixed overrides under that group and the point's dotted values."""

    def __init__(self, fixed: list[str], dims: list[Param]) -> None:
        self.fixed = fixed
        base = compose(fixed, rules="none")
        self.cfg = OmegaConf.create(OmegaConf.to_container(base, resolve=True))
        self._undo: list[tuple[str, Any]] = []
        self.groups = [d.key for d in dims if d.key in CONFIG_GROUPS]
        self.refix = [
            o for o in fixed if override_key(o).split(".")[0] in self.groups and "." in override_key(o)
        ]
        self._nodes: dict[tuple[str, str], Any] = {}

    def node(self, group: str, option: str) -> Any:
        """``conf/<group>/<option>.yaml`` (the highest config layer that has it) over the group's schema."""
        key = (group, option)
        if key not in self._nodes:
            path = find_option(group, option)
            raw = (yaml.safe_load(path.read_text()) if path is not None else None) or {}
            defaults = raw.pop("defaults", None) or []
            if path is None or any(d not in (f"base_{group}", "_self_") for d in defaults):
                raise LookupError(f"{group}={option}: not a plain option file")
            node = OmegaConf.merge(OmegaConf.structured(_SCHEMAS[group]), raw)
            self._nodes[key] = OmegaConf.to_container(node, resolve=False)
        return self._nodes[key]

    def config(self, params: dict[str, Any]) -> Any:
        """The point's config: put in place in one workspace config (building a whole config costs tens of
        milliseconds, a group's node well under one), the previous point's changes undone first. Raises
        ``LookupError`` when an option cannot be swapped."""
        cfg = self.cfg
        for key, old in reversed(self._undo):
            OmegaConf.update(cfg, key, copy.deepcopy(old), merge=False, force_add=True)
        self._undo = []
        for g in self.groups:
            self._set(g, copy.deepcopy(self.node(g, str(params[g]))))
        for o in self.refix:
            key, _, text = o.lstrip("+").partition("=")
            self._set(key, _value(text))
        for k, v in params.items():
            if k not in self.groups:
                self._set(k, v)
        return cfg

    def _set(self, key: str, value: Any) -> None:
        old = OmegaConf.select(self.cfg, key, default=None)
        self._undo.append((key, OmegaConf.to_container(old) if OmegaConf.is_config(old) else old))
        OmegaConf.update(self.cfg, key, value, merge=False, force_add=True)


def _value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _distance(a: dict[str, Any], b: dict[str, Any], dims: list[Param]) -> float:
    """How much two points differ, 0..1 (categorical: differs or not; numeric ranges: the scaled gap)."""
    total = 0.0
    for d in dims:
        x, y = a[d.key], b[d.key]
        if d.discrete or x == y:
            total += float(x != y)
            continue
        lo, hi = float(d.low), float(d.high)  # type: ignore[arg-type]
        if d.log and lo > 0:
            x, y, lo, hi = math.log(x), math.log(y), math.log(lo), math.log(hi)
        total += min(1.0, abs(float(x) - float(y)) / max(hi - lo, 1e-12))
    return total / max(1, len(dims))


def pick_edge(fitting: list[tuple[dict[str, Any], float]], dims: list[Param], k: int) -> list[dict[str, Any]]:
    """``k`` points of ``fitting`` (``(point, required / budget)``): the highest estimate first, then each
    next one maximising its estimate plus :data:`DIVERSITY` x its distance to the nearest point picked."""
    pool = sorted(fitting, key=lambda pr: -pr[1])[: max(16, 8 * k)]
    picked: list[tuple[dict[str, Any], float]] = []
    while pool and len(picked) < k:
        if not picked:
            best = pool[0]
        else:
            best = max(
                pool, key=lambda pr: pr[1] + DIVERSITY * min(_distance(pr[0], q, dims) for q, _ in picked)
            )
        picked.append(best)
        pool.remove(best)
    return [p for p, _ in picked]


def screen(
    fixed: list[str],
    dims: list[Param],
    seed: Any,
    *,
    k: int = EDGE_K,
    n: int = MAX_CANDIDATES,
    time_s: float = TIME_S,
) -> Screen:
    """Estimate a bounded sample of the space (see the module doc); never raises for a point it cannot
    estimate (that point is left to the sampler)."""
    t0 = time.perf_counter()
    out = Screen(space=space_size(dims))
    fast = FastConfigs(fixed, dims)
    cpu0 = time.process_time()  # the budget is for estimating (the base compose and the checks are bounded)
    fitting: list[tuple[dict[str, Any], float]] = []
    ests: dict[int, dict[str, Any]] = {}
    for point in candidates(dims, seed, n):
        if time.process_time() - cpu0 > time_s:  # CPU seconds: the same work on a loaded machine
            out.note = f"stopped after {time_s:g} CPU s"
            break
        try:
            cfg = fast.config(point)
            est = estimate(cfg)
        except Exception:  # an option that cannot be swapped or estimated: the sampler may still take it
            continue
        out.estimated += 1
        budget = est.get("budget_bytes")
        if not budget:
            continue
        ratio = float(est["required_bytes"]) / float(budget)
        if ratio <= 1.0 + MARGIN:  # inside the budget as the pre-flight counts it: these would run
            fitting.append((point, ratio))
            ests[id(point)] = est
        elif ratio > 1.0 + MARGIN and len(out.infeasible) < MAX_RECORDED:
            out.infeasible.append((point, est, float(cfg.hardware.budget_gib)))
    out.fits = len(fitting)
    out.edge = _checked_edge(fast, dims, pick_edge(fitting, dims, 2 * k), ests, out, k)
    out.seconds = time.perf_counter() - t0
    return out


def _checked_edge(
    fast: FastConfigs,
    dims: list[Param],
    ranked: list[dict[str, Any]],
    ests: dict[int, dict[str, Any]],
    out: Screen,
    k: int,
) -> list[dict[str, Any]]:
    """The first ``k`` of ``ranked`` that pass the config rules (at most ``2 k`` checked: a point a rule
    refuses would only be recorded ``unsupported``). The first of them is composed for real and
    re-estimated: when that disagrees with the fast path, nothing is recorded and the sweep starts as
    without the screen."""
    edge: list[dict[str, Any]] = []
    for point in ranked[: 2 * k]:
        if len(edge) >= k:
            break
        try:
            if not edge:
                cfg = compose(merge_overrides(fast.fixed, params_to_overrides(point, dims)), rules="config")
                real = float(estimate(cfg)["required_bytes"])
                guess = float(ests[id(point)]["required_bytes"])
                if abs(real - guess) > AGREE * max(guess, 1.0):
                    out.note = _join(out.note, "the fast estimates disagree with a real compose: not used")
                    out.infeasible = []
                    return []
            else:
                check_rules(fast.config(point), "config")
        except Exception:  # a rule refuses the point (or it cannot be estimated): not an edge point
            continue
        edge.append(point)
    if ranked and not edge:
        out.note = _join(
            out.note, f"none of the {min(len(ranked), 2 * k)} best-fitting points passes the rules"
        )
    return edge


def _join(note: str, more: str) -> str:
    return f"{note}; {more}" if note else more


def start_at_the_edge(book: Any) -> list[dict[str, Any]]:
    """The study's edge points: screened once, when the study is new (this records the screened points),
    else read back from the study. Call under the storage lock, before the slots are topped up."""
    plan, study = book.plan, book.study
    start, screened = getattr(plan, "edge_start", False), getattr(plan, "edge_screen", False)
    if not (start or screened) or plan.points is not None:
        return []
    stored = study.user_attrs.get(EDGE_ATTR)
    if stored is not None:
        record_pending(book, stored)  # a screen a kill cut short ends now, as it would have
        return [dict(p) for p in stored.get("points") or []]
    if study.get_trials(deepcopy=False):
        return []
    found = screen(plan.fixed, plan.dims, plan.seed)
    if not screened:  # sweep.edge_screen=false: the start alone, nothing recorded unrun
        found.infeasible = []
    info = {
        "points": found.edge if start else [],
        "screened": len(found.infeasible),
        "estimated": found.estimated,
        "fits": found.fits,
        "space": found.space if math.isfinite(found.space) else None,
        "seconds": round(found.seconds, 3),
        "note": found.note,
        # what the screen records, kept first: a kill while it records resumes with the same points
        "pending": [{"point": p, "estimate": e, "budget_gib": b} for p, e, b in found.infeasible],
    }
    study.set_user_attr(EDGE_ATTR, info)
    record_pending(book, info)
    book.say(describe(info))
    return list(info["points"])


def record_pending(book: Any, info: dict[str, Any]) -> None:
    """Record the screen's points (``info["pending"]``) that the study does not hold yet, in order."""
    pending = info.get("pending") or []
    if not pending:
        return
    done = [t.params for t in book.study.get_trials(deepcopy=False) if t.system_attrs.get(SCREENED)]
    for item in pending:
        point = dict(item["point"])
        if point in done:
            continue
        record_screened(book, point, item["estimate"], float(item["budget_gib"]))


def describe(info: dict[str, Any]) -> str:
    """One line: what the edge screen (and the edge start, when on) did."""
    space = info.get("space")
    of = f" of {int(space)}" if space is not None else ""
    note = f"; {info['note']}" if info.get("note") else ""
    n_edge = len(info["points"])
    start = f"{n_edge} near its edge run first" if n_edge else "no edge start (sweep.edge_start=false)"
    return (
        f"vramsweep: edge screen: {info['estimated']}{of} points estimated in {info['seconds']:.1f} s: "
        f"{info['fits']} fit the budget (+{MARGIN:.0%} margin), {start}; {info['screened']} over it "
        f"recorded infeasible_estimate without a trial (not counted toward n_trials){note}"
    )


def record_screened(book: Any, point: dict[str, Any], est: dict[str, Any], budget_gib: float) -> None:
    """Record a point over the budget as a finished trial: result JSON + PRUNED trial with its constraint."""
    from optuna.trial import TrialState, create_trial

    s, dims = book.plan, book.plan.dims
    number = len(book.study.get_trials(deepcopy=False))
    overrides = merge_overrides(book.plan.fixed, params_to_overrides(point, dims))
    res = new_result(
        status=Status.INFEASIBLE_ESTIMATE.value,
        sweep=s.name,
        trial=number,
        overrides=overrides,
        reason=(
            f"estimated peak {est[MetricName.PEAK_MEMORY_BYTES] / GIB:.2f} GiB > "
            f"hardware.budget_gib={budget_gib:g} (+{MARGIN:.0%} margin): not run (sweep.edge_start "
            "screened it before the first trial)"
        ),
        config={"hardware": {"budget_gib": budget_gib}},
    )
    res["estimate"] = est
    outcome = classify(res, s.goals, budget_gib=budget_gib)
    res["meta"] = {
        "design": {"kind": "search"},
        "screened": True,
        "wall_s": 0.0,
        "optuna": outcome.to_dict() | {"trial_number": number, "study": s.study_key},
    }
    path = book.result_path(number)
    write_result(path, res)
    excess = float(outcome.constraint or 0.0)
    book.study.add_trial(
        create_trial(
            state=TrialState.PRUNED,
            params=dict(point),
            distributions={d.key: d.distribution() for d in dims},
            user_attrs=user_attrs(res, outcome, f"trials/{path.name}")
            | {"overrides": overrides, "design": {"kind": "search"}},
            system_attrs={SCREENED: True, DASHBOARD_CONSTRAINTS_KEY: [excess]},
            constraints={CONSTRAINT_KEY: excess},
        )
    )
