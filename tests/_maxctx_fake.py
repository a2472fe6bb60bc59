"""Test helper: a deterministic stand-in trial for max-context searches (peak linear in the tokens)."""

from vramsweep.record.result import new_result

MIB = 2**20


def peak_for(tokens: int, overrides) -> int:
    per = MIB // 64 if "checkpointing=on" in overrides else MIB // 16
    return 2 * MIB + tokens * per


def trial(overrides, **_):
    tokens = int(next(o.split("=", 1)[1] for o in overrides if o.startswith("context.max_tokens=")))
    peak = peak_for(tokens, overrides)
    if peak > 64 * MIB:  # far over: the allocator would have failed
        res = new_result(status="oom", overrides=list(overrides), reason="OutOfMemoryError: fake")
        return res
    res = new_result(status="ok", overrides=list(overrides))
    res["metrics"].update(peak_memory_bytes=peak, tokens_per_s=1000.0 - tokens / 100, memory_kind="fake")
    return res
