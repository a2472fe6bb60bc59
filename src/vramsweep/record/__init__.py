"""Recording: atomic result JSON (DESIGN.md §5) and W&B runs."""

from vramsweep.record.result import (
    SCHEMA_VERSION,
    STATUSES,
    atomic_write_json,
    empty_metrics,
    load_result,
    new_result,
)

__all__ = ["SCHEMA_VERSION", "STATUSES", "atomic_write_json", "empty_metrics", "load_result", "new_result"]
