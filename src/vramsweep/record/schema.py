"""Typed view of the trial result JSON: :class:`TrialResult`, :class:`Metrics`, :class:`Estimate`,
:class:`Meta`.

The JSON file is the record (docs/CONTRACTS.md, "Result JSON"); these types read and check it.
``TrialResult.from_json(d)`` checks every known key's type and raises :class:`ResultSchemaError` (one line
naming the key, the value and what is allowed); ``to_json()`` gives the dict back. The round trip is exact:
``TrialResult.from_json(d).to_json() == d`` for every valid result.

* **Absent keys stay absent.** A key missing from an older or hand-written file loads as its default
  (``None``, ``[]``, ``{}``) and is not added by ``to_json()``: old files still load and round-trip.
* **Unknown keys are kept**, verbatim, in ``extra`` (top level, ``metrics``, ``estimate``, ``meta``) and
  written back after the known ones: a newer writer or a user's trial function may add fields, and a
  reader that does not know them passes them through. They are not checked.
* **Setting a declared key writes it.** On a record read by ``from_json``, assigning a key the source did
  not have (``r.meta.result_path = ...``) adds it to ``to_json()``; keys left alone stay as they were.
* ``status`` must be one of :class:`~vramsweep.record.status.Status`; ``schema`` must not be newer than
  :data:`SCHEMA_VERSION`.

Writers and readers both go through these types. :func:`vramsweep.record.result.write_result` takes a
:class:`TrialResult` (or a dict, which it checks with ``from_json``) and writes nothing when the result
breaks the contract; :meth:`TrialResult.new` builds a fresh one in code (``new_result`` is its dict form,
for the sweeper's dict-shaped results); ``run_trial`` builds a :class:`TrialResult` with :class:`Status`
members; the report reads every file through ``from_json`` (:mod:`vramsweep.report.load`, tolerant of
files that fail it). Metric fields come from the registry (:mod:`vramsweep.record.metrics`), so a new
metric needs no change here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from vramsweep.record.metrics import BY_NAME, empty_metrics
from vramsweep.record.status import STATUSES, Status, parse_status

SCHEMA_VERSION = 1


class ResultSchemaError(ValueError):
    """A result dict does not follow the contract (one line: key, value, what is allowed)."""


# ---------------------------------------------------------------------------------------------
# value checks: each returns an error text or None
# ---------------------------------------------------------------------------------------------
def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


_CHECKS: dict[str, tuple[str, Any]] = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "number": ("a number", _is_num),
    "text": ("a string", lambda v: isinstance(v, str)),
    "bool": ("true/false", lambda v: isinstance(v, bool)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "texts": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "numbers": (
        "an object of numbers",
        lambda v: isinstance(v, dict) and all(x is None or _is_num(x) for x in v.values()),
    ),
    "any": ("any JSON value", lambda v: True),
}


def _check(where: str, value: Any, kind: str, nullable: bool = True) -> None:
    if value is None and nullable:
        return
    what, ok = _CHECKS[kind]
    if not ok(value):
        allowed = f"{what} or null" if nullable else what
        raise ResultSchemaError(f"{where}={_short(value)} (allowed: {allowed})")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _need_dict(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ResultSchemaError(f"{where}={_short(value)} (allowed: an object)")
    return value


# ---------------------------------------------------------------------------------------------
# records with declared keys (absent keys stay absent, unknown keys go to ``extra``)
# ---------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class _Record:
    #: key -> (check kind, nullable); subclasses declare their JSON keys here, in file order.
    KEYS: ClassVar[dict[str, tuple[str, bool]]] = {}
    WHERE: ClassVar[str] = ""
    #: Built in code (not read): write every declared key (True) or only those not None (False).
    WRITE_NULLS: ClassVar[bool] = False

    extra: dict[str, Any] = field(default_factory=dict)
    #: The declared keys the source dict had (None: built in code, see ``WRITE_NULLS``).
    present: frozenset[str] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_built", True)

    def __setattr__(self, name: str, value: Any) -> None:
        # After construction, assigning a declared key of a record read from a dict makes it present: the
        # key is written by ``to_json`` even when the source had no such key.
        object.__setattr__(self, name, value)
        if name in self.KEYS and self.__dict__.get("_built") and self.present is not None:
            object.__setattr__(self, "present", self.present | {name})

    @classmethod
    def _read(cls, data: Any, where: str | None = None) -> dict[str, Any]:
        where = where or cls.WHERE
        data = _need_dict(where, data)
        kw: dict[str, Any] = {}
        for key, (kind, nullable) in cls.KEYS.items():
            if key in data:
                _check(f"{where}.{key}", data[key], kind, nullable)
                kw[key] = data[key]
        kw["extra"] = {k: v for k, v in data.items() if k not in cls.KEYS}
        kw["present"] = frozenset(k for k in cls.KEYS if k in data)
        return kw

    def _has(self, key: str) -> bool:
        if self.present is None:
            return self.WRITE_NULLS or getattr(self, key) is not None
        return key in self.present

    def _write(self, values: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in values.items() if self._has(k)}
        out.update(self.extra)
        return out


@dataclass(kw_only=True)
class Estimate(_Record):
    """``result.estimate``: the analytic memory estimate of the config
    (:func:`vramsweep.estimate.estimate`)."""

    KEYS: ClassVar[dict[str, tuple[str, bool]]] = {
        "peak_memory_bytes": ("number", True),
        "required_bytes": ("number", True),
        "breakdown_bytes": ("numbers", True),
        "budget_bytes": ("number", True),
        "fits": ("bool", True),
        "assumptions": ("texts", True),
        "components_bytes": ("numbers", True),
        "phases_bytes": ("numbers", True),
        "peak_phase": ("text", True),
        "seq_len": ("int", True),
        "calibration": ("any", True),
    }
    WHERE: ClassVar[str] = "estimate"

    peak_memory_bytes: float | None = None
    required_bytes: float | None = None
    breakdown_bytes: dict[str, float] | None = None
    budget_bytes: float | None = None
    fits: bool | None = None
    assumptions: list[str] | None = None
    components_bytes: dict[str, float] | None = None
    phases_bytes: dict[str, float] | None = None
    peak_phase: str | None = None
    seq_len: int | None = None
    calibration: Any = None

    @classmethod
    def from_json(cls, data: Any) -> Estimate:
        return cls(**cls._read(data))

    def to_json(self) -> dict[str, Any]:
        return self._write({k: getattr(self, k) for k in self.KEYS})


@dataclass(kw_only=True)
class Meta(_Record):
    """``result.meta``: provenance and measurement notes. Open by design: the typed keys below are the ones
    the sweeper and the report act on; the trial's measurement notes (docs/CONTRACTS.md) live in ``extra``."""

    KEYS: ClassVar[dict[str, tuple[str, bool]]] = {
        "design": ("dict", True),
        "wall_s": ("number", True),
        "started": ("text", True),
        "finished": ("text", True),
        "device": ("text", True),
        "optuna": ("dict", True),
        "retry_of": ("int", True),
        "retries": ("int", True),
        "lost": ("bool", True),
        "duplicate_of": ("int", True),
        "result_path": ("text", True),
        "max_context_probe": ("dict", True),
        "eval_set": ("dict", True),
        "gpu_share": ("dict", True),
    }
    WHERE: ClassVar[str] = "meta"

    design: dict[str, Any] | None = None
    wall_s: float | None = None
    started: str | None = None
    finished: str | None = None
    device: str | None = None
    optuna: dict[str, Any] | None = None
    retry_of: int | None = None
    retries: int | None = None
    lost: bool | None = None
    duplicate_of: int | None = None
    result_path: str | None = None
    max_context_probe: dict[str, Any] | None = None
    #: what the held-out metrics are over (vramsweep.data.evalset): {fingerprint, examples, ...}
    eval_set: dict[str, Any] | None = None
    #: the trial's GPU seat: ``device``, ``trials_per_gpu``, ``alone`` (why it held the GPU alone),
    #: ``shared`` (another trial ran on its GPU meanwhile: its throughput is not the card's own), ``with``
    #: (those trials), ``exact`` (false: the trial's own conservative mark, the sweeper stopped first)
    gpu_share: dict[str, Any] | None = None

    @classmethod
    def from_json(cls, data: Any) -> Meta:
        return cls(**cls._read(data))

    def to_json(self) -> dict[str, Any]:
        return self._write({k: getattr(self, k) for k in self.KEYS})

    def get(self, key: str, default: Any = None) -> Any:
        """Any meta key, typed or extra."""
        if key in self.KEYS:
            value = getattr(self, key)
            return default if value is None else value
        return self.extra.get(key, default)


_METRIC_KIND = {"number": "number", "text": "text", "map": "numbers", "list": "list"}


@dataclass(kw_only=True)
class Metrics:
    """``result.metrics``: registered metrics (:mod:`vramsweep.record.metrics`) checked against their kind;
    unregistered keys kept in ``extra``. ``values`` holds the registered keys the source had (null =
    not measured)."""

    values: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any) -> Metrics:
        data = _need_dict("metrics", data)
        values, extra = {}, {}
        for key, value in data.items():
            m = BY_NAME.get(key)
            if m is None:
                extra[key] = value
                continue
            _check(f"metrics.{key}", value, _METRIC_KIND[m.kind])
            values[key] = value
        return cls(values=values, extra=extra)

    def to_json(self) -> dict[str, Any]:
        return dict(self.values) | self.extra

    def get(self, name: str, default: Any = None) -> Any:
        """A metric's value (registered or extra); dotted names reach into map metrics."""
        node: Any = self.to_json()
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def number(self, name: str) -> float | None:
        """A finite numeric metric, else None."""
        v = self.get(name)
        if not _is_num(v) or not math.isfinite(float(v)):
            return None
        return float(v)

    def __getitem__(self, name: str) -> Any:
        return self.to_json()[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values or name in self.extra


@dataclass(kw_only=True)
class TrialResult(_Record):
    """One trial's result (``trials/NNNN.json``): what ``run_trial`` builds and ``write_result`` writes
    (``run_trial`` returns its ``to_json()``). :meth:`new` builds one in code, :meth:`from_json` reads one."""

    KEYS: ClassVar[dict[str, tuple[str, bool]]] = {
        "schema": ("int", False),
        "status": ("text", False),
        "reason": ("text", True),
        "sweep": ("text", True),
        "trial": ("int", True),
        "overrides": ("texts", False),
        "config": ("dict", False),
        "metrics": ("dict", False),
        "estimate": ("dict", True),
        "meta": ("dict", False),
    }
    WHERE: ClassVar[str] = "result"
    WRITE_NULLS: ClassVar[bool] = True

    status: Status
    schema: int = SCHEMA_VERSION
    reason: str | None = None
    sweep: str | None = None
    trial: int | None = None
    overrides: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    metrics: Metrics = field(default_factory=Metrics)
    estimate: Estimate | None = None
    meta: Meta = field(default_factory=Meta)

    @classmethod
    def new(
        cls,
        *,
        status: Status | str = Status.OK,
        reason: str | None = None,
        sweep: str | None = None,
        trial: int | None = None,
        overrides: list[str] | tuple[str, ...] | None = None,
        config: dict[str, Any] | None = None,
    ) -> TrialResult:
        """A fresh result built in code: every key is written, every core metric null until measured,
        ``estimate`` null, ``meta`` empty. ``status`` may be a string; an unknown one is a ``ValueError``
        naming the allowed statuses."""
        return cls(
            status=parse_status(status),
            reason=reason,
            sweep=sweep,
            trial=trial,
            overrides=list(overrides or []),
            config=config or {},
            metrics=Metrics(values=empty_metrics()),
        )

    @classmethod
    def from_json(cls, data: Any) -> TrialResult:
        """Check and type a result dict; :class:`ResultSchemaError` on the first contract violation."""
        kw = cls._read(data)
        if "status" not in kw:
            raise ResultSchemaError(f"result has no status (allowed: {', '.join(STATUSES)})")
        if kw["status"] not in STATUSES:
            raise ResultSchemaError(f"result.status={kw['status']!r} (allowed: {', '.join(STATUSES)})")
        kw["status"] = Status(kw["status"])
        if kw.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
            raise ResultSchemaError(
                f"result.schema={kw['schema']} (allowed: <= {SCHEMA_VERSION}; written by a newer vramsweep)"
            )
        if "metrics" in kw:
            kw["metrics"] = Metrics.from_json(kw["metrics"])
        if kw.get("estimate") is not None:
            kw["estimate"] = Estimate.from_json(kw["estimate"])
        if "meta" in kw:
            kw["meta"] = Meta.from_json(kw["meta"])
        return cls(**kw)

    def to_json(self) -> dict[str, Any]:
        """The result dict (plain JSON types; exactly the source dict for one read by :meth:`from_json`)."""
        values: dict[str, Any] = {}
        for f in fields(self):
            if f.name not in self.KEYS:
                continue
            v = getattr(self, f.name)
            if f.name == "status":
                v = Status(v).value
            elif isinstance(v, Metrics | Estimate | Meta):
                v = v.to_json()
            values[f.name] = v
        return self._write({k: values[k] for k in self.KEYS})


def check_result(data: Any) -> TrialResult:
    """:meth:`TrialResult.from_json` plus the round-trip check (``to_json()`` gives ``data`` back)."""
    typed = TrialResult.from_json(data)
    back = typed.to_json()
    if back != data:
        diff = sorted(k for k in set(back) | set(data) if back.get(k) != data.get(k))
        raise ResultSchemaError(f"result does not round-trip (keys {', '.join(diff)})")
    return typed


__all__ = [
    "SCHEMA_VERSION",
    "Estimate",
    "Meta",
    "Metrics",
    "ResultSchemaError",
    "TrialResult",
    "check_result",
]
