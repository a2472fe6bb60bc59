"""What ``vramsweep --help`` and ``vramsweep <verb> --help`` say beyond the flags: the verbs, and the docs
page for each verb, config group and topic (paths in the source repository;
``tests/project/test_docs.py`` checks that every page named here exists)."""

from __future__ import annotations

#: (command, what it does, docs page), in the order a user needs them.
VERBS = (
    ("vramsweep train [overrides]", "one trial; last line result: <path>", "docs/TRIAL.md"),
    ("vramsweep train -m sweep=<name> [overrides]", "a sweep (our Optuna sweeper)", "docs/SWEEPS.md"),
    ("vramsweep report <sweep dir>", "ablation tables, Pareto front, plots", "docs/READING_A_SWEEP.md"),
    ("vramsweep pick <sweep dir> --budget-gib 16", "pinned config that fits", "docs/READING_A_SWEEP.md"),
    ("vramsweep estimate [overrides]", "predicted peak memory, no weights", "docs/ESTIMATOR.md"),
    ("vramsweep data [overrides] [--json]", "records as trained: trained tokens marked", "docs/DATA.md"),
    ("vramsweep check [overrides]", "PASS/FAIL: the training maths on a proxy", "docs/CLI.md"),
    (
        "vramsweep train +experiment=<picked> train.epochs=1",
        "production run: adapter, resume",
        "docs/RUNS.md",
    ),
    ("vramsweep generate <run> --prompt TEXT", "generate with the run's adapter", "docs/RUNS.md"),
    ("vramsweep export <run> [--merge] <dir>", "adapter or merged bf16 model folder", "docs/RUNS.md"),
    ("vramsweep train --cfg job [overrides]", "print the composed config, run nothing", "docs/CLI.md"),
    ("vramsweep env", "versions, GPU, what runs here (bug reports)", "docs/CLI.md"),
)
#: docs page of each verb's ``--help``
VERB_DOCS = {
    "train": "docs/CLI.md (one trial: docs/TRIAL.md; sweeps with -m: docs/SWEEPS.md; knobs: docs/KNOBS.md)",
    "estimate": "docs/ESTIMATOR.md",
    "data": "docs/DATA.md",
    "check": "docs/CLI.md",
    "report": "docs/READING_A_SWEEP.md",
    "pick": "docs/READING_A_SWEEP.md",
    "generate": "docs/RUNS.md",
    "export": "docs/RUNS.md",
    "env": "docs/CLI.md",
}
#: config groups documented outside docs/KNOBS.md (which covers every group)
GROUP_DOCS = (
    ("every group: what each option saves", "docs/KNOBS.md"),
    ("context, checkpointing=offload, tiling, rope, adapter.dtype", "docs/LONG_CONTEXT.md"),
    ("data, context.truncation, vocab", "docs/DATA.md"),
    ("sweep", "docs/SWEEPS.md"),
    ("experiment (written by pick)", "docs/READING_A_SWEEP.md"),
    ("logger=wandb", "docs/WANDB.md"),
    ("hardware, kernels on a GPU", "docs/GPU.md"),
)
#: other topics
TOPIC_DOCS = (
    ("bad input, the pre-flight, exit codes", "docs/CLI.md"),
    ("trial and measurement definitions", "docs/TRIAL.md"),
    ("many GPUs, many hosts, SLURM", "docs/CLUSTER.md"),
    ("the embedded tiny model", "docs/EMBEDDED_MODEL.md"),
    ("measurements by date", "docs/measurements/README.md"),
    ("result JSON and internal contracts", "docs/CONTRACTS.md"),
)


def doc_paths() -> list[str]:
    """Every docs path the help names (for the docs test)."""
    texts = [d for *_, d in VERBS] + list(VERB_DOCS.values()) + [d for _, d in GROUP_DOCS + TOPIC_DOCS]
    return sorted({w.rstrip(";),") for t in texts for w in t.split() if w.startswith("docs/")})


def _rows(rows: tuple[tuple[str, ...], ...] | list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def main_epilog(groups_text: str) -> str:
    """``vramsweep --help``'s text after the flags: verbs, config groups and their options, docs pages."""
    return (
        "verbs (vramsweep <verb> --help for each verb's flags):\n"
        + _rows(VERBS)
        + "\n\nconfig groups and their options (choose with <group>=<option>, e.g. quant=nf4_dq):\n"
        + groups_text
        + "\n\ndocs (docs/ in the source repository):\n"
        + _rows(GROUP_DOCS + TOPIC_DOCS)
        + "\n"
    )


def verb_epilog(verb: str) -> str:
    """The docs line closing ``vramsweep <verb> --help`` (``train``'s lists every verb first: it is the
    help most users open)."""
    verbs = "verbs:\n" + _rows(VERBS) + "\n\n" if verb == "train" else ""
    return f"{verbs}docs: {VERB_DOCS[verb]}\n"
