"""Recording: atomic result JSON (docs/CONTRACTS.md, Result JSON) and W&B runs."""

from vramsweep.record.result import (
    SCHEMA_VERSION,
    STATUSES,
    atomic_write_json,
    empty_metrics,
    load_result,
    new_result,
)

__all__ = ["SCHEMA_VERSION", "STATUSES", "atomic_write_json", "empty_metrics", "load_result", "new_result"]
