"""Pre-flight: checks that run before any model is built, any trial is spent or any file is written.

``vramsweep train`` (one trial), ``vramsweep train -m`` and every sweep worker call :func:`preflight`
(or the single checks) right after the config is composed and validated. Each check raises
:class:`~vramsweep.config.compose.ConfigError` with one line naming the key, the file (``file:line``
for data) and what would be accepted; the CLI prints it as ``vramsweep train: error: ...`` and exits 2.
Nothing here leaves a file behind: the writability probe is created and removed in the nearest folder
that already exists, and no folder is created.

Checks:

* ``results_dir`` (or the sweep folder) is writable: a probe file, then removed;
* enough free disk there for the results (:data:`MIN_FREE_BYTES` plus :data:`PER_TRIAL_BYTES` a trial);
* ``data=jsonl`` files parse (every line: UTF-8, JSON, the document fields; see
  :func:`vramsweep.data.documents.load_jsonl`);
* ``model.path``'s ``config.json`` is readable JSON with the dimensions the estimator needs;
* named config options exist: ``sweep=<name>`` (the group is optional, so Hydra would silently ignore a
  typo) and ``+experiment=<name>`` (:func:`check_option`, shared with the sweeper);
* ``VRAMSWEEP_FAULT`` (the fault-injection test hook) has one of the forms the trial understands;
* host memory: the pinned pool of ``checkpointing=offload`` (the estimator's ``host_bytes``) plus the trial
  process's own headroom (:data:`HOST_PROCESS_HEADROOM_BYTES`) fits in the RAM this machine has available
  (:func:`check_host_memory`; the trial itself checks again and records ``host_oom`` without building
  anything).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vramsweep.config.compose import ConfigError, list_options
from vramsweep.config.model_folder import check_model_folder
from vramsweep.config.paths import check_path_names, misplaced_hint
from vramsweep.config.rules import FAULT_KINDS, FAULT_RE, check_fault_env  # noqa: F401 - re-exported
from vramsweep.config.schema import DataConfig
from vramsweep.config.weights import arch_path
from vramsweep.data.documents import format_section, load_jsonl
from vramsweep.data.formats import detect_format, normalize_records
from vramsweep.data.prep import USER_SOURCES, build_trial_data, data_format, load_documents, summary_line
from vramsweep.data.sources import read_source
from vramsweep.data.truncation import ContextOverflowError, longest_first
from vramsweep.embedded import ASSET_DIR, _key, asset_info, build_note, embedded_dir
from vramsweep.estimate import estimate
from vramsweep.estimate.dims import check_model_config
from vramsweep.hfmodel import CACHE_ENV, cache_path
from vramsweep.knobs.optim import optimizer_class, optimizer_kwargs
from vramsweep.record.units import GIB

#: Free disk required in the results folder before anything runs (result JSONs, logs, plots, study.db).
MIN_FREE_BYTES = 64 * 2**20
#: Added per trial of a sweep (a result JSON is ~10 KiB, a trial log up to ~100 KiB; generous).
PER_TRIAL_BYTES = 1 * 2**20
#: ``VRAMSWEEP_FAULT`` forms (see ``vramsweep.training.callbacks.fault``): ``<kind>@<step>``.


def _existing_ancestor(path: Path) -> Path:
    p = path.absolute()
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    return p


def _short(text: str, n: int = 80) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


def _check_links(target: Path, key: str, what: str) -> None:
    """A symlink on the way that resolves nowhere (a loop, a dangling link): ``exists()`` says False, the
    probe would run in a folder above it and pass, and the first real write fail after the work."""
    p = target.absolute()
    while True:
        if p.is_symlink() and not p.exists():
            try:
                p.resolve(strict=True)
                why = "does not resolve"
            except RuntimeError:
                why = "is a symlink loop"
            except OSError as exc:
                why = "is a symlink loop" if exc.errno == errno.ELOOP else "is a dangling symlink"
            raise ConfigError(f"{what}: {p} {why}", key=key, allowed=["<a writable folder>"])
        if p.parent == p:
            return
        p = p.parent


def check_writable(path: str | os.PathLike, *, key: str = "results_dir", label: str | None = None) -> Path:
    """Raise unless files can be created at ``path`` (or, when it does not exist yet, where it would be
    created). A probe file is written and removed; no folder is created. Returns the probed folder."""
    target = Path(str(path))
    what = label or f"{key}={_short(str(path))!r}"
    check_path_names(target, key, what)  # a name over 255 bytes: OSError at the first stat, not a line
    _check_links(target, key, what)
    where = _existing_ancestor(target)
    if not where.is_dir():
        raise ConfigError(
            f"{what}: {where} is a file, not a folder", key=key, allowed=["<a writable folder>"]
        )
    try:
        fd, probe = tempfile.mkstemp(prefix=".vramsweep-probe-", dir=where)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise ConfigError(
            f"{what} is not writable (cannot create a file in {where}: {why})",
            key=key,
            allowed=["<a writable folder>"],
        ) from None
    os.close(fd)
    try:
        os.unlink(probe)
    except OSError:
        pass
    return where


def check_disk(
    path: str | os.PathLike, n_trials: int = 1, *, key: str = "results_dir", label: str | None = None
) -> None:
    """Raise when the disk holding ``path`` has less free space than the results need."""
    where = _existing_ancestor(Path(str(path)))
    need = MIN_FREE_BYTES + max(0, int(n_trials)) * PER_TRIAL_BYTES
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return  # cannot tell: the writability probe already ran
    if free < need:
        raise ConfigError(
            f"{label or f'{key}={str(path)!r}'}: only {free / 2**20:.0f} MiB free on {where}, need at least "
            f"{need / 2**20:.0f} MiB for {n_trials} trial(s)",
            key=key,
            allowed=["<a folder on a disk with free space>"],
        )


def check_jsonl(path: str | os.PathLike, *, key: str = "data.path", fmt: str = "auto") -> str:
    """Raise ``<key>: <file>:<line>: <problem>`` unless ``path`` is a readable data file (or dataset folder)
    whose records all parse in one format (:mod:`vramsweep.data.sources`, :mod:`vramsweep.data.formats`;
    sectioned documents in JSON Lines through :func:`vramsweep.data.documents.load_jsonl`). Returns the
    records' format (``fmt``, or the detected one)."""

    try:
        src = read_source(path)
        found = fmt if fmt != "auto" else (detect_format(src.records[0].obj) or "auto")
        if fmt in ("auto", "documents") and src.kind == "jsonl" and found == "documents":
            load_jsonl(path)
        else:
            normalize_records(src.records, fmt)
            if src.held_out:
                normalize_records(src.held_out, fmt)
        return found
    except FileNotFoundError:
        raise ConfigError(
            f"{key}={str(path)!r} does not exist",
            key=key,
            allowed=["<path to .jsonl / .json / .parquet / folder>"],
        ) from None
    except (OSError, ValueError) as exc:  # the readers' messages are "<file>:<line>: <problem>"
        raise ConfigError(f"{key}: {exc}", key=key) from None


def check_option(group: str, name: str, *, hint: str = "") -> None:
    """Raise unless ``<group>/<name>.yaml`` is on the config search path (names the options; shared with
    the sweeper)."""
    opts = list_options(group)
    if name not in opts:
        raise ConfigError(
            f"unknown {group} '{name}'" + (f" ({hint})" if hint else "") + misplaced_hint(group, name),
            key=group,
            allowed=opts or ["(none yet)"],
        )


def named_options(overrides: Iterable[str]) -> list[tuple[str, str]]:
    """``(group, name)`` of the ``sweep=`` / ``+experiment=`` overrides on a command line."""
    out = []
    for ov in overrides:
        key, sep, value = ov.lstrip("+").partition("=")
        # a list/function (sweep=a,b, glob(...)) is the sweeper's to refuse, with its own message
        if (
            sep
            and key in ("sweep", "experiment")
            and value
            and value != "null"
            and not set(value) & set(",()*")
        ):
            out.append((key, value))
    return out


def check_named_options(overrides: Iterable[str]) -> None:
    hints = {
        "experiment": "write one with vramsweep pick",
        "sweep": "a file sweep/<name>.yaml in your conf dir, or one of the shipped sweeps/",
    }
    for group, name in named_options(overrides):
        check_option(group, name, hint=hints[group])


def check_inputs(cfg: Any) -> None:
    """The input files a config names: ``data=jsonl`` files and ``model.path``'s config.json."""
    if str(cfg.data.source) in USER_SOURCES:
        for key in ("path", "eval_path"):
            p = cfg.data.get(key)
            if p:
                found = check_jsonl(str(p), key=f"data.{key}", fmt=str(cfg.data.format))
                _instructions_apply(cfg, found, str(p))
    if str(cfg.model.source) == "path" and cfg.model.get("path"):
        check_model_config(str(cfg.model.path))
    if str(cfg.model.source) == "arch" and cfg.model.get("path"):
        arch_path(cfg.model)  # config.json matches the named architecture


def _instructions_apply(cfg: Any, fmt: str, path: str) -> None:
    """``data.instructions`` prefixes sectioned documents only: a changed one over other records is refused
    (it would be ignored: their prompts come from the records and the chat template)."""
    text = cfg.data.get("instructions")
    if fmt != "documents" and text is not None and str(text) != DataConfig.instructions:
        raise ConfigError(
            f"data.instructions={str(text)[:60]!r} applies to sectioned documents only; {path} holds {fmt} "
            "records, whose prompts come from the records themselves (and the chat template)",
            key="data.instructions",
            allowed=["leave it out", "documents records (docs/DATA.md)"],
        )


def available_host_bytes() -> int:
    """RAM available for new allocations without swapping (``MemAvailable``)."""
    import psutil

    return int(psutil.virtual_memory().available)


#: Host RAM kept free for the trial process itself beside the pinned pool: its own resident set, which the
#: pool must not crowd out (page-locked pages cannot be reclaimed; what is left for the process decides
#: whether the kernel's OOM killer ends it). Derived (docs/LONG_CONTEXT.md, "Host memory of offload"): a
#: whole tiny-model trial process peaks at 0.66 GiB resident (``/usr/bin/time -v vramsweep train
#: train.steps=3``; imports of torch + transformers + peft alone 0.39 GiB), plus 1 GiB for what a CUDA
#: trial adds on the host (the runtime's and cuBLAS's host state, a real tokenizer and its data), rounded
#: up to 2 GiB. A model load is not added: transformers memory-maps the shards (reclaimable pages; a
#: 0.67 GiB bf16 checkpoint raised the peak resident set by 0.10 GiB here) and it ends before the pool is
#: allocated (``python bench/host_rss.py`` measures all three). ``meta.host_memory.peak_rss_bytes`` of a
#: CUDA trial checks the figure.
HOST_PROCESS_HEADROOM_BYTES = 2 * GIB


def check_host_memory(cfg: Any, available: int | None = None, *, estimated: dict | None = None) -> None:
    """Raise when the host memory the config needs beside the device (the page-locked pool of
    ``checkpointing=offload``: layers x tokens x hidden x dtype) plus :data:`HOST_PROCESS_HEADROOM_BYTES`
    for the trial process exceeds the RAM available here (so a pool equal to ``MemAvailable`` is refused);
    the error names the figures and the longest context that would fit. ``estimated``: the config's
    estimate when the caller has it already (host bytes do not depend on calibration)."""

    if str(cfg.hardware.device) == "cpu":
        return _check_cpu_memory(cfg, available, estimated)
    if str(cfg.hardware.device) != "cuda":
        return
    if estimated is None or "host_bytes" not in estimated:
        estimated = estimate(cfg, calibration=False)
    need = int(estimated.get("host_bytes") or 0)
    if need <= 0:
        return
    have = available_host_bytes() if available is None else int(available)
    headroom = HOST_PROCESS_HEADROOM_BYTES
    if need + headroom <= have:
        return
    tokens = int(cfg.context.max_tokens)
    fits = max(0, tokens * (have - headroom) // need)
    raise ConfigError(
        f"checkpointing=offload needs {need / GIB:.2f} GiB of pinned host memory for the layer inputs at "
        f"context.max_tokens={tokens} x train.micro_batch={int(cfg.train.micro_batch)} plus "
        f"{headroom / GIB:.2f} GiB for the trial process, but this machine has {have / GIB:.2f} GiB of RAM "
        "available",
        key="checkpointing",
        allowed=[f"context.max_tokens<={fits}", "checkpointing=on", "a machine with more RAM"],
    )


def _check_cpu_memory(cfg: Any, available: int | None, estimated: dict | None) -> None:
    """On a CPU trial the device memory is the host's: refuse a config whose estimated peak is above the RAM
    available here (``train.micro_batch=4096`` at 512 tokens: ~231 GiB; it used to run until the kernel's
    OOM killer), naming the largest micro-batch that the estimate fits."""
    if estimated is None or "required_bytes" not in estimated:
        estimated = estimate(cfg, calibration=False)
    need = int(estimated.get("required_bytes") or 0) + int(estimated.get("host_bytes") or 0)
    have = available_host_bytes() if available is None else int(available)
    if need <= have:
        return
    mb = int(cfg.train.micro_batch)
    allowed = [f"train.micro_batch<={max(1, mb * have // need)}"] if mb > 1 else []
    raise ConfigError(
        f"the estimated peak of this trial, {need / GIB:.2f} GiB at context.max_tokens="
        f"{int(cfg.context.max_tokens)} x train.micro_batch={mb}, is more than the {have / GIB:.2f} GiB of "
        "RAM available on this machine (hardware=cpu: the trial's memory is the host's)",
        key="train.micro_batch" if mb > 1 else "context.max_tokens",
        allowed=[*allowed, "a smaller context.max_tokens", "a machine with more RAM"],
    )


def preflight(
    cfg: Any,
    *,
    overrides: Iterable[str] = (),
    results_dir: str | os.PathLike | None = None,
    n_trials: int = 1,
    key: str = "results_dir",
    say_data: bool = True,
) -> None:
    """Every pre-flight check for a composed, validated ``cfg``; raise :class:`ConfigError` on the first
    problem. ``results_dir`` defaults to ``cfg.results_dir`` (a sweep passes its sweep folder);
    ``say_data=False``: the data summary line is not printed (a sweep's ``sweep.check`` on its baseline)."""
    _DATA_SUMMARY.clear()
    check_fault_env()
    check_named_options(overrides)
    where = results_dir if results_dir is not None else str(cfg.results_dir)
    check_writable(where, key=key)
    check_disk(where, n_trials, key=key)
    check_cache(cfg)
    check_inputs(cfg)
    check_optimizer(cfg)
    try:
        check_data(cfg)
        if str(cfg.model.source) in ("path", "arch") and cfg.model.get("path"):
            check_model_folder(str(cfg.model.path), data_source=str(cfg.data.source))  # weights, tokenizer
        check_host_memory(cfg)
        note_embedded_build(cfg.model)
    except BaseException:  # bad input is one error line (exit 2): the summary is not said before it
        _DATA_SUMMARY.clear()
        raise
    if say_data:
        say_data_summary()  # what the data step built, said once every check has passed
    _DATA_SUMMARY.clear()


def say_data_summary() -> None:
    """Print the data summary line of the pre-flight's build (the first, the base config's, when a sweep
    built several data settings) on stderr, once."""
    if _DATA_SUMMARY:
        more = len(_DATA_SUMMARY) - 1
        extra = (
            f" (and {more} other data setting{'s' if more != 1 else ''} of the sweep's trials)"
            if more
            else ""
        )
        print(_DATA_SUMMARY[0] + extra, file=sys.stderr, flush=True)
    _DATA_SUMMARY.clear()


def note_embedded_build(mcfg: Any) -> None:
    """Say on stderr, once every check has passed, that the first trial pre-trains a new embedded base
    (a ``model.*`` override changed its recipe) and about how long that takes."""
    import sys

    if (note := build_note(mcfg)) is not None:
        print(note, file=sys.stderr, flush=True)


def check_optimizer(cfg: Any) -> None:
    """``optimizer._target_`` is an importable class and ``optimizer.kwargs`` are keywords it takes (the
    trial's own checks, :mod:`vramsweep.knobs.optim`, run before anything is built)."""
    optimizer_kwargs(cfg, optimizer_class(str(cfg.optimizer["_target_"])))


#: Overrides whose value is an input file or folder (checked for every value a sweep can take).
_INPUT_KEYS = {"data.path": "jsonl", "data.eval_path": "jsonl", "model.path": "model"}


def _input_values(plan: Any) -> list[tuple[str, str]]:
    """``(key, value)`` of every input-path override a sweep plan can run with (fixed, space, design)."""
    out: list[tuple[str, str]] = []

    def add(ov: str) -> None:
        key, sep, value = ov.lstrip("+").partition("=")
        if sep and key in _INPUT_KEYS and value not in ("", "null"):
            out.append((key, value.strip("'\"")))

    for ov in getattr(plan, "fixed", None) or []:
        add(ov)
    for d in getattr(plan, "dims", None) or []:
        if d.key in _INPUT_KEYS and getattr(d, "discrete", False):
            for v in d.values:
                add(f"{d.key}={v}")
    for point in getattr(plan, "points", None) or []:
        for ov in point.overrides:
            add(ov)
    return out


SQLITE_MAGIC = b"SQLite format 3\x00"


def sqlite_path(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL (``None`` for other backends)."""
    if not url.startswith("sqlite:"):
        return None
    path = url.split(":///", 1)[1] if ":///" in url else ""
    return Path(path) if path and path != ":memory:" else None


def check_study_file(storage_url: str) -> None:
    """An existing SQLite study file must be a database (a torn copy or another file is named)."""
    path = sqlite_path(storage_url)
    if path is None or not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
    except OSError as exc:
        raise ConfigError(
            f"hydra.sweeper.storage: cannot read {path}: {exc.strerror or exc}", key="hydra.sweeper.storage"
        ) from None
    if head != SQLITE_MAGIC:
        raise ConfigError(
            f"hydra.sweeper.storage: {path} is not a SQLite database: move it aside (the result "
            "JSONs next to it are kept) or use another hydra.sweeper.study_name/sweep_dir",
            key="hydra.sweeper.storage",
        )


def preflight_sweep(
    plan: Any,
    task_cfg: dict[str, Any],
    arguments: Iterable[str] = (),
    *,
    check_storage: Callable[[str], None] | None = None,
) -> None:
    """The pre-flight of ``vramsweep train -m`` and of every worker, before the study or any folder is
    made: sweep/experiment names, the sweep folder writable with disk to spare, the study storage reachable
    and writable (``check_storage``: the sweeper passes ``vramsweep.sweeper.storage_check.check_storage``;
    this module sits below the sweeper and does not import it), every input file the sweep can use parses.
    Raises :class:`ConfigError`."""
    from omegaconf import OmegaConf

    args = list(arguments)
    check_fault_env()
    check_named_options(args)
    sweep_dir = plan.folder
    key = "hydra.sweeper.sweep_dir" if any("hydra.sweeper.sweep_dir=" in a for a in args) else "results_dir"
    label = f"{key}: the sweep folder {sweep_dir}"
    check_writable(sweep_dir, key=key, label=label)
    check_disk(sweep_dir, int(plan.n_total), key=key, label=label)
    check_study_file(plan.storage_url)
    if check_storage is not None:
        check_storage(plan.storage_url)  # reachable and writable: connect (or probe) now, not mid-sweep
    cfg = OmegaConf.create(task_cfg)
    seen: set[tuple[str, str]] = set()
    if str(OmegaConf.select(cfg, "data.source")) in USER_SOURCES:
        for key in ("path", "eval_path"):
            p = OmegaConf.select(cfg, f"data.{key}")
            if p:
                seen.add((f"data.{key}", str(p)))
    if str(OmegaConf.select(cfg, "model.source")) == "path" and OmegaConf.select(cfg, "model.path"):
        seen.add(("model.path", str(cfg.model.path)))
    for item in _input_values(plan):
        seen.add(item)
    for key, value in sorted(seen):
        if _INPUT_KEYS[key] == "jsonl":
            check_jsonl(value, key=key, fmt=str(OmegaConf.select(cfg, "data.format") or "auto"))
        else:
            check_model_config(value, key=key)
    _check_sweep_data_and_models(plan, cfg, seen)


def _check_sweep_data_and_models(plan: Any, cfg: Any, seen: set[tuple[str, str]]) -> None:
    """What the sweep's data steps would fail on, then every model folder's weights and tokenizer (the data
    summary lines are not said here: a later check's error stays the one line of a refused sweep)."""
    from omegaconf import OmegaConf

    _DATA_SUMMARY.clear()
    try:
        check_sweep_data(plan, cfg)  # after the input files parse: what the data step would fail on
        for key, value in sorted(seen):  # then the weights and tokenizer files of every model folder
            if _INPUT_KEYS[key] == "model":
                check_model_folder(value, key=key, data_source=str(OmegaConf.select(cfg, "data.source")))
        if OmegaConf.select(cfg, "model") is not None:
            note_embedded_build(cfg.model)
    finally:  # the sweep's checks go on after this (study, folder): each trial says its own data line
        _DATA_SUMMARY.clear()


# --- what the data step and the cache would fail on (issue 29.1, 29.6) ---------------------------------


class _Tokens:
    """What the data step needs of the trial's tokenizer, loaded without transformers when the folder has
    ``tokenizer.json`` (the Rust tokenizer a ``PreTrainedTokenizerFast`` wraps: the same ids for
    ``add_special_tokens=False``; the EOS/BOS/SEP roles from ``tokenizer_config.json`` /
    ``special_tokens_map.json``), else through ``AutoTokenizer`` like the trial."""

    def __init__(self, folder: Path):
        import json

        self.folder = folder
        self._fast = None
        self._auto = None
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            self._fast = Tokenizer.from_file(str(folder / "tokenizer.json"))
            spec: dict[str, Any] = {}
            for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
                if (folder / name).is_file():
                    spec.update(json.loads((folder / name).read_text(encoding="utf-8")))
            ids = {}
            for role in ("eos", "bos", "sep"):
                tok = spec.get(f"{role}_token")
                tok = tok.get("content") if isinstance(tok, dict) else tok
                ids[role] = self._fast.token_to_id(tok) if isinstance(tok, str) else None
            self.eos_id, self.bos_id, self.sep_id = ids["eos"], ids["bos"], ids["sep"]
        if self._fast is None:
            from transformers import AutoTokenizer

            self._auto = AutoTokenizer.from_pretrained(str(folder))
            self.eos_id = getattr(self._auto, "eos_token_id", None)
            self.bos_id = getattr(self._auto, "bos_token_id", None)
            self.sep_id = getattr(self._auto, "sep_token_id", None)

    def lengths(self, texts: list[str]) -> list[int]:
        if not texts:
            return []
        if self._fast is not None:
            return [len(e.ids) for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return [len(ids) for ids in self._auto(texts, add_special_tokens=False)["input_ids"]]

    def fixed_tokens(self, instructions: str) -> int:
        """Tokens of every example besides context and target: ``[bos] instructions [sep] .. [sep]``
        (:func:`vramsweep.data.examples.build_examples`)."""
        sep = 1 if self.sep_id is not None else self.lengths(["\n\n"])[0]
        return (1 if self.bos_id is not None else 0) + self.lengths([instructions])[0] + 2 * sep


def _trial_tokenizer_dir(cfg: Any) -> Path | None:
    """The folder the trial loads its tokenizer from (:func:`vramsweep.knobs.build.model_source`), found
    without creating anything; None when the trial has no tokenizer (random tokens) or the embedded model
    would first be built for these dims (its tokenizer does not exist yet)."""
    src = str(cfg.model.source)
    if src == "path":
        folder = Path(str(cfg.model.path))
    elif src == "embedded":
        folder = embedded_dir(cfg.model, root=cache_path())
        if not (folder / "COMPLETE").exists():
            info = asset_info()
            if info is None or info.get("key") != _key(cfg.model):
                return None
            folder = ASSET_DIR  # ensure_embedded copies it as it is
    else:
        return None
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    return folder


def _single_section_error(
    docs: list[dict], key: str, what: str, allowed: list[str], role: str = ""
) -> ConfigError:
    n = len(docs)
    return ConfigError(
        f"{what}: no document has 2 or more sections ({n} "
        f"document{'s' if n != 1 else ''}{' ' + role if role else ''}, {'each ' if n != 1 else ''}with "
        "one): every example predicts a section from the sections before it, so there would be no example",
        key=key,
        allowed=allowed,
    )


def _data_path_error(exc: Exception) -> ConfigError:
    """A data file's problem as the one-line ``data.path`` error (with what is allowed, where it is known)."""
    msg = str(exc)
    if "need at least 2 documents" in msg:
        return ConfigError(
            msg, key="data.path", allowed=["a data.path with >= 2 documents", "data.eval_path=<jsonl>"]
        )
    return ConfigError(f"data.path: {msg}", key="data.path")


def _check_splits_give_examples(d: Any, train: list[dict], held_out: list[dict], jsonl: bool) -> None:
    """Train and held-out documents each give at least one example (a document with >= 2 sections)."""
    sections_allowed = ["documents with >= 2 sections ({heading, text} objects)"]
    if not any(len(doc["sections"]) >= 2 for doc in train):
        what = f"data.path={d.path}" if jsonl else f"data=synthetic (data.num_docs={d.num_docs})"
        role = "for training" if jsonl and not d.eval_path else ""
        raise _single_section_error(
            train, "data.path" if jsonl else "data.num_docs", what, sections_allowed, role
        )
    if not any(len(doc["sections"]) >= 2 for doc in held_out):
        if jsonl and d.eval_path:
            raise _single_section_error(
                held_out, "data.eval_path", f"data.eval_path={d.eval_path}", sections_allowed
            )
        if jsonl:
            n = len(held_out)
            raise ConfigError(
                f"data.path={d.path}: the last {n} document{'s' if n != 1 else ''}, held out for eval "
                "(data.eval_path is unset), "
                f"{'have a single section each' if n != 1 else 'has a single section'}: the eval would have "
                "no example",
                key="data.eval_path",
                allowed=["data.eval_path=<jsonl of documents with >= 2 sections>", *sections_allowed],
            )
        raise _single_section_error(
            held_out, "data.num_eval_docs", "data=synthetic eval documents", sections_allowed
        )


def check_data(cfg: Any, reference: dict | None = None, *, build_documents: bool = True) -> None:
    """What the data step (:func:`vramsweep.data.prep.build_trial_data`) would raise on, found before the
    model is built: too few documents for a held-out split, train or eval documents that give no example
    (a single section each), ``context.max_tokens`` that leaves no room for a target, and with
    ``context.truncation=none`` any example longer than ``context.max_tokens`` (tokenised and counted with
    the trial's own tokenizer: section by section, as the data step does). The examples are built through
    the cache, the held-out ones under ``reference`` (a sweep's eval reference, as its trials build them)."""
    if str(cfg.data.source) == "random":
        return
    folder = _trial_tokenizer_dir(cfg)
    if folder is None and str(cfg.model.source) != "embedded":
        return  # no tokenizer: the trial trains on random tokens of exactly context.max_tokens

    d = cfg.data
    jsonl = str(d.source) in USER_SOURCES
    try:
        fmt = data_format(cfg)
    except (OSError, ValueError) as exc:  # check_inputs names a bad file first; kept for direct calls
        raise _data_path_error(exc) from None
    if fmt != "documents":
        if folder is not None:
            check_records(cfg, folder, reference)
        return
    try:
        train, held_out = load_documents(cfg)
    except FileNotFoundError as exc:  # check_inputs names a missing file first; kept for direct calls
        raise ConfigError(f"data.path: {exc}", key="data.path") from None
    except (OSError, ValueError) as exc:
        raise _data_path_error(exc) from None
    _check_splits_give_examples(d, train, held_out, jsonl)
    if folder is None:
        return  # the embedded model is built for these dims first: its tokenizer does not exist yet
    _check_documents_fit(cfg, folder, train, held_out)
    if build_documents:  # a sweep's own process stays torch-free (the trials build them, once each)
        check_records(cfg, folder, reference)  # the examples built once, through the cache the trials read


def _check_documents_fit(cfg: Any, folder: Path, train: list[dict], held_out: list[dict]) -> None:
    """Sectioned documents, counted with the trial's tokenizer read without transformers: an EOS token,
    room for a target beside ``data.instructions``, and with ``context.truncation=none`` every example."""
    d = cfg.data
    try:
        tok = _Tokens(folder)
    except Exception as exc:  # noqa: BLE001 - an unreadable tokenizer fails the trial the same way
        raise ConfigError(
            f"model: cannot load the tokenizer in {folder}: {type(exc).__name__}: {str(exc)[:300]}",
            key="model.path" if str(cfg.model.source) == "path" else "model",
        ) from None
    if tok.eos_id is None:
        raise ConfigError(
            f"model.path={cfg.model.path}: the tokenizer has no eos_token (every target ends with EOS)",
            key="model.path",
            allowed=["a tokenizer_config.json with eos_token"],
        )
    max_tokens = int(cfg.context.max_tokens)
    fixed = tok.fixed_tokens(str(d.instructions))
    if max_tokens - fixed < 1:
        raise ConfigError(
            f"context.max_tokens={max_tokens} leaves no room for a target: data.instructions and "
            f"the separators alone take {fixed} tokens",
            key="context.max_tokens",
            allowed=[f">= {fixed + 1}", "a shorter data.instructions"],
        )
    if str(cfg.context.truncation) == "none":
        check_sections_fit(
            [doc for doc in [*train, *held_out] if len(doc["sections"]) >= 2], tok, fixed, max_tokens
        )


def check_sections_fit(docs: list[dict], tok: Any, fixed: int, max_tokens: int) -> None:
    """``context.truncation=none``: every example (prompt + whole context + target + EOS) of ``docs`` fits
    ``max_tokens``. Documents are tokenised longest first in batches
    (:func:`vramsweep.data.truncation.longest_first`) and the check stops at the first batch with one
    that does not fit: a large file is refused without tokenising all of it."""
    texts = [[format_section(s) for s in doc["sections"]] for doc in docs]
    worst, over, total, read = (0, "", 0), 0, 0, 0
    for batch in longest_first([sum(map(len, t)) for t in texts]):
        flat, read = iter(tok.lengths([s for j in batch for s in texts[j]])), read + len(batch)
        lengths = {j: [next(flat) for _ in texts[j]] for j in batch}
        for j in sorted(batch):  # file order: the first of equally long examples is named, as in one pass
            lens = lengths[j]
            for i in range(1, len(lens)):
                need = fixed + sum(lens[:i]) + lens[i] + 1  # prompt + whole context + target + EOS
                total += 1
                if need > max_tokens:
                    over += 1
                    if need > worst[0]:
                        worst = (need, str(docs[j].get("id", "")), i)
        if over:
            need, doc_id, i = worst
            of = (
                ""
                if read == len(docs)
                else f" of the {read} of {len(docs)} documents tokenised, longest first,"
            )
            raise ConfigError(
                f"context.truncation=none: {over} of {total} examples{of} are longer than context.max_tokens="
                f"{max_tokens} (the longest, document {doc_id!r} section {i}, needs {need} tokens) and none "
                "cuts nothing",
                key="context.truncation",
                allowed=["head", "tail", "exp_decay", f"context.max_tokens>={need}"],
            )


def _record_error_key(msg: str) -> tuple[str, list[str] | None]:
    for key in ("data.chat_template", "data.train_on", "data.format", "data.eval_path", "data.too_long"):
        if key in msg:
            return key, None
    return "data.path", None


#: the data summary lines of :func:`check_records` since the pre-flight began (:func:`say_data_summary`)
_DATA_SUMMARY: list[str] = []


def check_records(cfg: Any, folder: Path, reference: dict | None = None) -> None:
    """Records of any format (sectioned documents too): build the trial's examples with its tokenizer (the
    tokenisation cache keeps them for the trial, which then neither opens nor parses the file), so a
    template that fails to render a record, a record with no trained token, a ``data.train_on`` that
    does not apply, a missing chat template and, with ``context.truncation=none``, the longest record
    over ``context.max_tokens`` fail here, naming the record."""
    from vramsweep.data.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(folder, embedded=str(cfg.model.source) == "embedded")
    except Exception as exc:  # noqa: BLE001 - an unreadable tokenizer fails the trial the same way
        raise ConfigError(
            f"model: cannot load the tokenizer in {folder}: {type(exc).__name__}: {str(exc)[:300]}",
            key="model.path" if str(cfg.model.source) == "path" else "model",
        ) from None
    try:
        built = build_trial_data(cfg, tok, reference)  # a sweep: the held-out records as its trials see them
    except ContextOverflowError as exc:
        if "data.too_long=error" in str(exc):
            raise ConfigError(
                f"data.too_long=error: {exc}", key="data.too_long", allowed=["truncate", "drop"]
            ) from None
        raise ConfigError(
            f"context.truncation=none: {exc}",
            key="context.truncation",
            allowed=["head", "tail", "exp_decay", "a larger context.max_tokens"],
        ) from None
    except (OSError, ValueError) as exc:
        key, allowed = _record_error_key(str(exc))
        raise ConfigError(
            str(exc) if str(exc).startswith("data.") else f"{key}: {exc}", key=key, allowed=allowed
        ) from None
    _DATA_SUMMARY.append(summary_line(built.stats))


def _cache_bytes_needed(cfg: Any) -> int:
    """Bytes the embedded model adds to the cache: the committed asset's files, or (built for other dims)
    its fp16 weights from the model's dimensions."""

    info = asset_info()
    if info is not None and info.get("key") == _key(cfg.model):
        return sum(p.stat().st_size for p in ASSET_DIR.iterdir() if p.is_file())
    m = cfg.model
    h, i, n, v = int(m.hidden_size), int(m.intermediate_size), int(m.num_layers), int(m.vocab_size)
    return 2 * (v * h * 2 + n * (4 * h * h + 3 * h * i))


def check_cache(cfg: Any) -> None:
    """The artefact cache (``$VRAMSWEEP_CACHE``, default ``~/.cache/vramsweep``) where the trial uses it:
    a folder (not a file, nor under one), and, when the trial will write there (the embedded model is not
    cached yet; architecture weights for ``kernels=unsloth``), writable with room for what it writes.
    Names the variable and the path; creates nothing."""

    src = str(cfg.model.source)
    if not (src == "embedded" or (src == "arch" and bool(cfg.kernels.get("unsloth")))):
        return
    root = cache_path()
    label = (
        f"{CACHE_ENV}={_short(str(root))}"
        if os.environ.get(CACHE_ENV)
        else f"the cache folder {root} ({CACHE_ENV} unset)"
    )
    allowed = [f"{CACHE_ENV}=<a writable folder with free space>"]
    check_path_names(root, CACHE_ENV, label)
    _check_links(root, CACHE_ENV, label)
    where = _existing_ancestor(root)
    if not where.is_dir():
        raise ConfigError(f"{label}: {where} is a file, not a folder", key=CACHE_ENV, allowed=allowed)
    if src == "embedded":
        if (embedded_dir(cfg.model, root=root) / "COMPLETE").exists():
            return  # read only
        need = MIN_FREE_BYTES + _cache_bytes_needed(cfg)
    else:
        need = MIN_FREE_BYTES  # knobs.arch_weights checks the size of what it writes itself
    check_writable(root, key=CACHE_ENV, label=label)
    try:
        free = shutil.disk_usage(where).free
    except OSError:
        return
    if free < need:
        raise ConfigError(
            f"{label}: only {free / 2**20:.0f} MiB free on {where}, the model cache needs "
            f"{need / 2**20:.0f} MiB",
            key=CACHE_ENV,
            allowed=allowed,
        )


#: Plain keys whose value changes what :func:`check_data` finds (a sweep's space or design may vary them).
_DATA_KEYS = (
    "context.truncation",
    "context.max_tokens",
    "data.path",
    "data.eval_path",
    "data.num_docs",
    "data.num_eval_docs",
    "data.seed",
    "data.instructions",
)


def _data_variants(plan: Any) -> list[dict[str, Any]]:
    """The data-relevant settings (:data:`_DATA_KEYS`) the sweep's trials run with, on top of its fixed
    ones: each design point's; for a search space the worst case of the dimensions that can only make it
    worse (``truncation=none`` if it can occur, the shortest ``context.max_tokens``) with each value of the
    others (``data.path`` ...). ``[{}]`` when nothing data-relevant varies."""
    from omegaconf import OmegaConf

    def parse(text: str) -> Any:
        return OmegaConf.create({"v": text.strip("'\"")}).v

    design = getattr(plan, "points", None)
    if design:
        out = []
        for point in design:
            over = {}
            for ov in point.overrides:
                key, sep, value = ov.lstrip("+").partition("=")
                if sep and key in _DATA_KEYS:
                    over[key] = parse(value)
            out.append(over)
        return out
    worst: dict[str, Any] = {}
    each: list[dict[str, Any]] = []
    for d in getattr(plan, "dims", None) or []:
        if d.key not in _DATA_KEYS:
            continue
        if d.key == "context.truncation":
            values = [str(v) for v in d.values]
            worst[d.key] = "none" if "none" in values else values[0]
        elif d.key == "context.max_tokens":
            worst[d.key] = int(min(d.values) if d.discrete and d.values else d.low)
        elif d.discrete:
            each.extend({d.key: v} for v in d.values)
    return [{**o, **worst} for o in each] or [worst]


def check_sweep_data(plan: Any, cfg: Any) -> None:
    """:func:`check_cache` and :func:`check_data` for the sweep's base config and every data-relevant
    setting its trials can take (:func:`_data_variants`); the error says which setting."""
    from omegaconf import OmegaConf

    check_cache(cfg)
    seen: set[str] = set()
    for over in _data_variants(plan):
        tag = repr(sorted(over.items()))
        if tag in seen:
            continue
        seen.add(tag)
        variant = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        for key, value in over.items():
            OmegaConf.update(variant, key, value, merge=False)
        try:
            # sectioned documents are checked without the transformers tokenizer here: it imports torch,
            # which the sweeper's process never does (tests/sweeper/test_sweeper.py)
            check_data(variant, getattr(plan, "eval_reference", None) or None, build_documents=False)
        except ConfigError as exc:
            if not over:
                raise
            where = " ".join(f"{k}={v}" for k, v in over.items())
            raise ConfigError(f"in the sweep's trials with {where}: {exc}", key=exc.key) from None
