"""Recording: the result contract (statuses, metric registry, feasibility rule, typed result) and the
atomic result JSON writer. docs/CONTRACTS.md ("Result JSON") is the schema's prose."""

from vramsweep.record.feasibility import budget_gib, feasible, fits, over_budget_gib
from vramsweep.record.metrics import METRIC_KEYS, METRICS, Metric, direction, empty_metrics
from vramsweep.record.result import atomic_write_json, load_result, new_result, write_result
from vramsweep.record.schema import (
    SCHEMA_VERSION,
    Estimate,
    Meta,
    Metrics,
    ResultSchemaError,
    TrialResult,
    check_result,
)
from vramsweep.record.status import FAILURE_STATUSES, STATUSES, Status
from vramsweep.record.units import GIB, MIB

__all__ = [
    "FAILURE_STATUSES",
    "GIB",
    "METRICS",
    "METRIC_KEYS",
    "MIB",
    "SCHEMA_VERSION",
    "STATUSES",
    "Estimate",
    "Meta",
    "Metric",
    "Metrics",
    "ResultSchemaError",
    "Status",
    "TrialResult",
    "atomic_write_json",
    "budget_gib",
    "check_result",
    "direction",
    "empty_metrics",
    "feasible",
    "fits",
    "load_result",
    "new_result",
    "over_budget_gib",
    "write_result",
]
