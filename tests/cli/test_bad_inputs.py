"""Bad input, every verb: exit code 2, one line ``vramsweep <verb>: error: ...`` naming the problem,
and nothing written (no result, no folder, no probe file left behind).

Run in-process through ``vramsweep.cli.main`` (the console script's entry point) to stay fast; the
sweep cases use the fake trial function so that a case that *did* start would finish in milliseconds
(and fail the "nothing written" check) rather than train.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _bad_inputs import CONFIG_BAD, FAKE, PW, check_bad_input
from vramsweep.cli import main

# (id, verb, argv with {placeholders}, env, substring the one-line message must contain)
CASES: list[tuple[str, str, list[str], dict[str, str], str]] = [
    # --- results folder
    (
        "results-in-proc",
        "train",
        ["results_dir=/proc/vramsweep-x"],
        {},
        "results_dir='/proc/vramsweep-x' is not writable",
    ),
    ("results-is-file", "train", ["results_dir={not_a_dir}"], {}, "is a file, not a folder"),
    ("results-under-file", "train", ["results_dir={not_a_dir}/sub"], {}, "is a file, not a folder"),
    ("results-disk-full", "train", ["results_dir={root}/res"], {"_DISK_FULL": "1"}, "MiB free"),
    # --- data=jsonl: file:line and the problem
    (
        "jsonl-empty",
        "train",
        ["data=jsonl", "data.path={empty.jsonl}"],
        {},
        "empty.jsonl:1: no records (the file is empty)",
    ),
    (
        "jsonl-blank",
        "train",
        ["data=jsonl", "data.path={blank.jsonl}"],
        {},
        "blank.jsonl:1: no records (only 3 blank",
    ),
    (
        "jsonl-malformed",
        "train",
        ["data=jsonl", "data.path={malformed.jsonl}"],
        {},
        "malformed.jsonl:2: invalid JSON",
    ),
    (
        "jsonl-latin1",
        "train",
        ["data=jsonl", "data.path={latin1.jsonl}"],
        {},
        "latin1.jsonl:2: not UTF-8 (byte 0xe9",
    ),
    ("jsonl-latin1-named", "train", ["data=jsonl", "data.path={latin1.jsonl}"], {}, "Latin-1"),
    (
        "jsonl-utf16",
        "train",
        ["data=jsonl", "data.path={utf16.jsonl}"],
        {},
        "utf16.jsonl:1: the file is UTF-16",
    ),
    (
        "jsonl-no-sections",
        "train",
        ["data=jsonl", "data.path={nosections.jsonl}"],
        {},
        "nosections.jsonl:1: unknown format: keys found ['id', 'title']; accepted formats: messages",
    ),
    (
        "jsonl-empty-sections",
        "train",
        ["data=jsonl", "data.path={emptysections.jsonl}"],
        {},
        "emptysections.jsonl:1: 'sections' must be a non-empty list",
    ),
    ("jsonl-dup-id", "train", ["data=jsonl", "data.path={dupid.jsonl}"], {}, "dupid.jsonl:2: duplicate id"),
    ("jsonl-not-object", "train", ["data=jsonl", "data.path={list.jsonl}"], {}, "list.jsonl:1:"),
    (
        "jsonl-bad-eval",
        "train",
        ["data=jsonl", "data.path={good.jsonl}", "data.eval_path={malformed.jsonl}"],
        {},
        "data.eval_path: ",
    ),
    (
        "jsonl-eval-missing",
        "train",
        ["data=jsonl", "data.path={good.jsonl}", "data.eval_path={root}/nope.jsonl"],
        {},
        "data.eval_path",
    ),
    # --- data=file, every format: file:line, before any model is built
    (
        "fmt-unknown",
        "train",
        ["data=file", "data.path={chat_unknown.jsonl}"],
        {},
        "chat_unknown.jsonl:1: unknown format: keys found ['bar', 'foo']; accepted formats: messages",
    ),
    (
        "fmt-role",
        "train",
        ["data=file", "data.path={chat_role.jsonl}"],
        {},
        "chat_role.jsonl:2: messages[1]: unknown role 'narrator'; roles are system, user, assistant, tool",
    ),
    (
        "fmt-no-assistant",
        "train",
        ["data=file", "data.path={chat_noassistant.jsonl}"],
        {},
        "chat_noassistant.jsonl:2: 'messages' has no assistant turn",
    ),
    (
        "fmt-empty-content",
        "train",
        ["data=file", "data.path={chat_emptycontent.jsonl}"],
        {},
        "chat_emptycontent.jsonl:2: messages[1] (assistant) has empty content",
    ),
    (
        "fmt-mixed",
        "train",
        ["data=file", "data.path={chat_mixed.jsonl}"],
        {},
        "chat_mixed.jsonl:2: this record is in format 'text' but",
    ),
    (
        "fmt-json-latin1",
        "train",
        ["data=file", "data.path={chat_latin1.json}"],
        {},
        "chat_latin1.json:1: not UTF-8",
    ),
    (
        "fmt-parquet-column",
        "train",
        ["data=file", "data.path={alpaca_nooutput.parquet}", "data.format=alpaca"],
        {},
        "alpaca_nooutput.parquet:row 1: data.format=alpaca needs the column(s) ['output']",
    ),
    (
        "fmt-template-fails",
        "train",
        ["data=file", "data.path={chat_good.jsonl}", "data.chat_template={bad_template.jinja}"],
        {},
        "chat_good.jsonl:1: the chat template failed to render this record",
    ),
    (
        "fmt-no-trained-token",
        "train",
        ["data=file", "data.path={pc_longprompt.jsonl}", "context.max_tokens=32", "context.truncation=head"],
        {},
        "pc_longprompt.jsonl:1: no trained token after masking",
    ),
    (
        "fmt-none-too-long",
        "train",
        ["data=file", "data.path={chat_long.jsonl}", "context.max_tokens=64", "context.truncation=none"],
        {},
        "chat_long.jsonl:2: ",
    ),
    (
        "fmt-train-on",
        "train",
        ["data=file", "data.path={chat_good.jsonl}", "data.train_on=completion"],
        {},
        "data.train_on=completion does not apply to format 'messages'",
    ),
    (
        "fmt-num-docs",
        "train",
        ["data=file", "data.path={chat_good.jsonl}", "data.num_docs=8"],
        {},
        "data.num_docs=8 does not apply to data.source=file",
    ),
    (  # before: accepted and ignored (chat prompts come from the records and the template)
        "fmt-instructions",
        "train",
        ["data=file", "data.path={chat_good.jsonl}", "data.instructions=Summarise it."],
        {},
        "data.instructions='Summarise it.' applies to sectioned documents only",
    ),
    (
        "fmt-unknown-template",
        "train",
        ["data=file", "data.path={chat_good.jsonl}", "data.chat_template=nope"],
        {},
        "data.chat_template='nope' is neither a built-in template (chatml, embedded)",
    ),
    # --- model.path config.json
    (
        "model-corrupt",
        "train",
        ["model=local", "model.path={m_corrupt}"],
        {},
        "m_corrupt/config.json:1: not valid JSON",
    ),
    ("model-list", "train", ["model=local", "model.path={m_list}"], {}, "expected a JSON object, got list"),
    ("model-missing-dim", "train", ["model=local", "model.path={m_missing}"], {}, "missing 'hidden_size'"),
    ("model-bad-dim", "train", ["model=local", "model.path={m_badvalue}"], {}, "bad dimension value"),
    ("model-config-is-dir", "train", ["model=local", "model.path={m_dir}"], {}, "has no config.json"),
    # --- names and overrides
    ("unknown-sweep", "train", ["sweep=nope"], {}, "unknown sweep 'nope'"),
    ("unknown-experiment", "train", ["+experiment=nope"], {}, "unknown experiment 'nope'"),
    ("empty-option", "train", ["quant="], {}, "quant= needs an option (allowed: fp4"),
    ("empty-choice", "train", ["quant=choice()"], {}, "cannot parse override 'quant=choice()'"),
    ("choice-without-m", "train", ["quant=choice(nf4,none)"], {}, "requires --multirun"),
    ("delete-quant", "train", ["~quant"], {}, "the quant group is required"),
    ("delete-adapter", "train", ["~adapter"], {}, "the adapter group is required"),
    ("delete-quant-value", "train", ["~quant=nf4"], {}, "the quant group is required"),
    (
        "fault-bogus",
        "train",
        [],
        {"VRAMSWEEP_FAULT": "bogus"},
        "VRAMSWEEP_FAULT='bogus' is not a fault spec (allowed: oom@<step>",
    ),
    ("fault-no-step", "train", [], {"VRAMSWEEP_FAULT": "oom"}, "VRAMSWEEP_FAULT='oom'"),
    ("fault-bad-step", "train", [], {"VRAMSWEEP_FAULT": "nan@x"}, "VRAMSWEEP_FAULT='nan@x'"),
    ("fault-unknown-kind", "train", [], {"VRAMSWEEP_FAULT": "segv@1"}, "error@<step>"),
    # --- sweeps: the same pre-flight before the study or any folder exists
    (
        "m-results-in-proc",
        "train",
        ["-m", "results_dir=/proc/vramsweep-x", "adapter.r=8,16", *FAKE],
        {},
        "the sweep folder /proc/vramsweep-x/sweeps",
    ),
    (
        "m-jsonl-malformed",
        "train",
        ["-m", "data=jsonl", "data.path={malformed.jsonl}", "adapter.r=8,16", *FAKE],
        {},
        "malformed.jsonl:2: invalid JSON",
    ),
    (
        "m-jsonl-latin1",
        "train",
        ["-m", "data=jsonl", "data.path={latin1.jsonl}", "adapter.r=8,16", *FAKE],
        {},
        "not UTF-8",
    ),
    (
        "m-jsonl-in-space",
        "train",
        ["-m", "data=jsonl", "data.path={good.jsonl},{empty.jsonl}", *FAKE],
        {},
        "empty.jsonl:1: no records",
    ),
    (
        "m-model-corrupt",
        "train",
        ["-m", "model=local", "model.path={m_corrupt}", "adapter.r=8,16", *FAKE],
        {},
        "not valid JSON",
    ),
    (
        "m-fault-bogus",
        "train",
        ["-m", "adapter.r=8,16", *FAKE],
        {"VRAMSWEEP_FAULT": "bogus"},
        "VRAMSWEEP_FAULT='bogus'",
    ),
    ("m-unknown-sweep", "train", ["-m", "sweep=nope", *FAKE], {}, "unknown sweep 'nope'"),
    (
        "m-garbage-db",
        "train",
        ["-m", "results_dir={garbage_results}", "adapter.r=8,16", *FAKE],
        {},
        "is not a SQLite database",
    ),
    ("m-disk-full", "train", ["-m", "adapter.r=8,16", *FAKE], {"_DISK_FULL": "1"}, "MiB free"),
    (
        "m-unknown-option",
        "train",
        ["-m", "quant=nf5", "adapter.r=8,16", *FAKE],
        {},
        "unknown option quant=nf5",
    ),
    ("m-empty-option", "train", ["-m", "quant=", "adapter.r=8,16", *FAKE], {}, "quant= needs an option"),
    ("m-empty-choice", "train", ["-m", "quant=choice()", *FAKE], {}, "quant=choice()"),
    ("m-syntax", "train", ["-m", "adapter.r=choice(8,16", *FAKE], {}, "choice(8,16"),
    ("m-unknown-key", "train", ["-m", "adapter.rank=8,16", *FAKE], {}, "adapter.rank"),
    ("m-bad-value", "train", ["-m", "adapter.r=choice(8,abc)", *FAKE], {}, "adapter.r"),
    (
        "m-sweep-check-not-bool",
        "train",
        ["-m", "+sweep.check=maybe", "adapter.r=8,16", *FAKE],
        {},
        "sweep.check='maybe' must be true or false (allowed: true, false)",
    ),
    (
        "m-sweep-check-max-context",
        "train",
        ["-m", "sweep=max_context_tiny", "+sweep.check=true", *FAKE],
        {},
        "sweep.check=true does not apply to design max_context",
    ),
    (
        "m-bad-sampler",
        "train",
        ["-m", "quant=none,nf4", "hydra.sweeper.sampler=simulated_annealing", *FAKE],
        {},
        "hydra.sweeper.sampler",
    ),
    (
        "m-bad-objective",
        "train",
        ["-m", "quant=none,nf4", "hydra.sweeper.objectives=[vram]", *FAKE],
        {},
        "vram",
    ),
    # --- estimate
    (
        "estimate-model-corrupt",
        "estimate",
        ["model=local", "model.path={m_corrupt}"],
        {},
        "m_corrupt/config.json:1: not valid JSON",
    ),
    (
        "estimate-model-missing",
        "estimate",
        ["model=local", "model.path={m_missing}"],
        {},
        "missing 'hidden_size'",
    ),
    ("estimate-unknown-option", "estimate", ["quant=nf5"], {}, "unknown option quant=nf5"),
    ("estimate-fault-bogus", "estimate", [], {"VRAMSWEEP_FAULT": "bogus"}, "VRAMSWEEP_FAULT"),
    ("estimate-calibrate-missing", "estimate", ["--calibrate", "{root}/nope"], {}, "is not a folder"),
    ("estimate-delete-group", "estimate", ["~quant"], {}, "the quant group is required"),
    # --- report / pick
    ("report-missing", "report", ["{root}/nope"], {}, "no such sweep folder"),
    ("report-not-a-sweep", "report", ["{good.jsonl}"], {}, "is not a sweep folder"),
    ("report-garbage-db", "report", ["{garbage_sweep}"], {}, "is not a readable Optuna study database"),
    ("report-garbage-db-file", "report", ["{garbage_sweep}/study.db"], {}, "cannot open storage"),
    ("pick-missing", "pick", ["{root}/nope", "--budget-gib", "16"], {}, "no such sweep folder"),
    (
        "pick-negative-budget",
        "pick",
        ["{empty_sweep}", "--budget-gib", "-1"],
        {},
        "--budget-gib must be a positive number",
    ),
    (
        "pick-headroom",
        "pick",
        ["{empty_sweep}", "--budget-gib", "4", "--headroom-gib", "5"],
        {},
        "--headroom-gib",
    ),
]
CASES += [
    (f"config-{' '.join(ov)}", "train", list(ov), {"VRAMSWEEP_FORCE_NO_CUDA": "1"}, hint)
    for ov, _key, hint in CONFIG_BAD
]

# --- every hydra.sweeper.* setting out of type or range (SETTING_RULES), before anything runs
SWEEPER_BAD: list[tuple[str, str]] = [
    ("timeout_s=-5", "hydra.sweeper.timeout_s=-5.0 is out of range (allowed: a number >= 1"),
    ("timeout_s=0", "hydra.sweeper.timeout_s=0.0 is out of range"),
    ("timeout_s=0.5", "hydra.sweeper.timeout_s=0.5 is out of range"),
    ("timeout_s=inf", "hydra.sweeper.timeout_s=inf is not finite"),
    ("timeout_s=nan", "hydra.sweeper.timeout_s=nan is not finite"),
    ("timeout_s=soon", "hydra.sweeper.timeout_s=soon"),
    (
        "n_jobs=100000",
        "hydra.sweeper.n_jobs=100000 is out of range (allowed: auto (one per GPU seat, 1 on CPU) or an integer "
        "in 1..256)",
    ),
    ("n_jobs=257", "hydra.sweeper.n_jobs=257 is out of range"),
    ("n_jobs=0", "hydra.sweeper.n_jobs=0 is out of range"),
    ("n_jobs=-1", "hydra.sweeper.n_jobs=-1 is out of range"),
    ("n_jobs=abc", "hydra.sweeper.n_jobs='abc' is not auto"),
    ("trials_per_gpu=0", "hydra.sweeper.trials_per_gpu=0 is out of range (allowed: auto (as many capped"),
    ("trials_per_gpu=abc", "hydra.sweeper.trials_per_gpu='abc' is not auto"),
    (
        "gpu_reserve_gib=-1",
        "hydra.sweeper.gpu_reserve_gib=-1.0 is out of range (allowed: a number in [0, 1024])",
    ),
    ("share_below=0", "hydra.sweeper.share_below=0.0 is out of range (allowed: a number in (0, 1])"),
    ("share_below=1.5", "hydra.sweeper.share_below=1.5 is out of range"),
    ("n_jobs=2.5", "hydra.sweeper.n_jobs=2.5"),
    ("n_trials=-1", "hydra.sweeper.n_trials=-1 is out of range"),
    ("n_trials=1000000", "hydra.sweeper.n_trials=1000000 is out of range (allowed: an integer in 0..10,000"),
    ("seed=-1", "hydra.sweeper.seed=-1 is out of range"),
    ("seed=5000000000", "hydra.sweeper.seed=5000000000 is out of range"),
    (
        "max_failure_rate=1.5",
        "hydra.sweeper.max_failure_rate=1.5 is out of range (allowed: a number in [0, 1])",
    ),
    ("max_failure_rate=-0.1", "hydra.sweeper.max_failure_rate=-0.1 is out of range"),
    ("max_failure_rate=nan", "hydra.sweeper.max_failure_rate=nan is not finite"),
    ("min_trials_for_failure_rate=0", "hydra.sweeper.min_trials_for_failure_rate=0 is out of range"),
    ("heartbeat_s=0", "hydra.sweeper.heartbeat_s=0.0 is out of range (allowed: a number in (0, 3600])"),
    ("heartbeat_s=-1", "hydra.sweeper.heartbeat_s=-1.0 is out of range"),
    ("heartbeat_s=7200", "hydra.sweeper.heartbeat_s=7200.0 is out of range"),
    ("grace_s=0", "hydra.sweeper.grace_s=0.0 is out of range"),
    ("grace_s=5", "hydra.sweeper.grace_s=5 must be at least 2 x hydra.sweeper.heartbeat_s=10"),
    ("grace_s=inf", "hydra.sweeper.grace_s=inf is not finite"),
    ("retry_stale=-1", "hydra.sweeper.retry_stale=-1 is out of range (allowed: an integer in 0..100)"),
    ("retry_stale=1000", "hydra.sweeper.retry_stale=1000 is out of range"),
    ("isolation=thread", "hydra.sweeper.isolation='thread' is not known (allowed: fork, spawn, inprocess"),
    ("trial_fn=nocolon", "hydra.sweeper.trial_fn='nocolon' must be 'module:function'"),
    ("trial_fn=a:b:c", "hydra.sweeper.trial_fn='a:b:c' must be 'module:function'"),
    ("sampler={name:annealing}", "hydra.sweeper.sampler.name='annealing' is not known (allowed: tpe, random"),
    ("sampler=[tpe]", "hydra.sweeper.sampler=['tpe'] must be a name or a dict"),
    ("pruner=null", "hydra.sweeper.pruner=null cannot be null"),
    ("pruner=bogus", "hydra.sweeper.pruner='bogus' is not known"),
    ("direction=up", "hydra.sweeper.direction='up' is not known (allowed: minimize, maximize)"),
    ("direction=[minimize,sideways]", "hydra.sweeper.direction="),
    ("sweep_dir=", "hydra.sweeper.sweep_dir='' is empty"),
    ("storage=", "hydra.sweeper.storage='' is empty"),
    ("custom_search_space=nodot", "hydra.sweeper.custom_search_space='nodot' does not resolve"),
    ("dedup=maybe", "hydra.sweeper.dedup=maybe"),
    ("progress=sometimes", "hydra.sweeper.progress=sometimes"),
    ("preload=5", "hydra.sweeper.preload=5"),
    ("cuda_devices=0", "hydra.sweeper.cuda_devices=0"),
    ("params=5", "hydra.sweeper.params"),
    ("n_trails=5", "hydra.sweeper.n_trails"),
]
CASES += [
    (f"sweeper-{ov}", "train", ["-m", "adapter.r=8,16", *FAKE, f"hydra.sweeper.{ov}"], {}, needle)
    for ov, needle in SWEEPER_BAD
]
# --- a storage that cannot be reached or written: exit 2 in the pre-flight, password masked
STORAGE_BAD: list[tuple[str, str, str]] = [
    ("proc", "sqlite:////proc/vramsweep-x/study.db", "the folder /proc/vramsweep-x is not writable"),
    ("under-file", "sqlite:///{not_a_dir}/study.db", "is a file, not a folder"),
    ("is-folder", "sqlite:///{root}", "is a folder, not a database file"),
    ("in-memory", "sqlite://", "names no database file"),
    ("in-memory-named", "sqlite:///:memory:", "names no database file"),
    ("garbage-file", "sqlite:///{garbage_sweep}/study.db", "is not a SQLite database"),
    (
        "pg-refused",
        f"postgresql://u:{PW}@127.0.0.1:1/db",
        "cannot connect to postgresql+psycopg2://u:***@127.0.0.1:1/db: connection to server",
    ),
    ("pg-refused-localhost", f"postgresql://u:{PW}@localhost:1/db", "u:***@localhost:1/db"),
    ("pg-unknown-host", f"postgresql://u:{PW}@no-such-host.invalid/db", "no-such-host.invalid"),
    ("pg-bad-port", "postgresql://u@127.0.0.1:notaport/db", "hydra.sweeper.storage"),
    ("redis", "redis://localhost/0", "is not a supported URL"),
]
CASES += [
    (f"storage-{cid}", "train", ["-m", "adapter.r=8,16", *FAKE, f"hydra.sweeper.storage={url}"], {}, needle)
    for cid, url, needle in STORAGE_BAD
]
# --- one error shape for argparse refusals, internal names and Hydra's lexer (verb "" = none)
QUOTE = "must be quoted for Hydra"
CASES += [
    (
        "verb-typo",
        "trian",
        [],
        {},
        "unknown verb 'trian' (allowed: train, estimate, data, check, report, pick, generate, export, env); "
        "did you mean train?",
    ),
    ("verb-typo-report", "reprot", ["x"], {}, "did you mean report?"),
    ("verb-unknown", "fly", [], {}, "unknown verb 'fly'"),
    ("verb-missing", "", [], {}, "no verb given (allowed: train, estimate, data, check, report, pick"),
    ("flag-train", "train", ["--bogus"], {}, "unknown option --bogus (usage: vramsweep train --help)"),
    ("flag-train-multirun", "train", ["--multirn", "adapter.r=8,16"], {}, "unknown option --multirn"),
    ("flag-estimate", "estimate", ["--jsn"], {}, "unknown option --jsn; did you mean --json?"),
    ("flag-estimate-maxctx", "estimate", ["--max-contxt"], {}, "did you mean --max-context?"),
    ("flag-report", "report", ["{empty_sweep}", "--bogus"], {}, "unknown option --bogus"),
    ("flag-report-study", "report", ["{empty_sweep}", "--studdy", "x"], {}, "did you mean --study?"),
    (
        "flag-pick-typo",
        "pick",
        ["{empty_sweep}", "--buget-gib", "16"],
        {},
        "unknown option --buget-gib; did you mean --budget-gib?",
    ),
    (
        "flag-pick-extra",
        "pick",
        ["{empty_sweep}", "extra", "--budget-gib", "16"],
        {},
        "unexpected argument 'extra'",
    ),
    (
        "pick-budget-missing",
        "pick",
        ["{empty_sweep}"],
        {},
        "missing --budget-gib (usage: vramsweep pick --help)",
    ),
    (
        "pick-budget-abc",
        "pick",
        ["{empty_sweep}", "--budget-gib", "abc"],
        {},
        "--budget-gib='abc' is not a number",
    ),
    (
        "pick-budget-empty",
        "pick",
        ["{empty_sweep}", "--budget-gib", ""],
        {},
        "--budget-gib='' is not a number",
    ),
    ("pick-budget-no-value", "pick", ["{empty_sweep}", "--budget-gib"], {}, "--budget-gib needs a value"),
    (
        "pick-budget-nan",
        "pick",
        ["{empty_sweep}", "--budget-gib", "nan"],
        {},
        "--budget-gib must be a positive number",
    ),
    (
        "pick-budget-inf",
        "pick",
        ["{empty_sweep}", "--budget-gib", "inf"],
        {},
        "--budget-gib must be a positive number",
    ),
    (
        "pick-budget-zero",
        "pick",
        ["{empty_sweep}", "--budget-gib", "0"],
        {},
        "--budget-gib must be a positive number",
    ),
    (
        "pick-headroom-abc",
        "pick",
        ["{empty_sweep}", "--budget-gib", "4", "--headroom-gib", "x"],
        {},
        "--headroom-gib='x' is not a number",
    ),
    (
        "pick-tps-abc",
        "pick",
        ["{empty_sweep}", "--budget-gib", "4", "--min-tokens-per-s", "fast"],
        {},
        "--min-tokens-per-s='fast'",
    ),
    (
        "pick-prefer",
        "pick",
        ["{empty_sweep}", "--budget-gib", "4", "--prefer", "cheap"],
        {},
        "--prefer='cheap' is not known (allowed: quality, speed)",
    ),
    ("pick-no-target", "pick", ["--budget-gib", "4"], {}, "missing target"),
    ("pick-no-results", "pick", ["{empty_sweep}", "--budget-gib", "4"], {}, "no trial results"),
    ("report-no-target", "report", [], {}, "missing target"),
    ("report-no-results", "report", ["{empty_sweep}"], {}, "no trial results in"),
    (
        "calibrate-no-results",
        "estimate",
        ["--calibrate", "{empty_sweep}"],
        {},
        "--calibrate: no usable trials",
    ),
    ("internal-quant", "train", ["quant=base_quant"], {}, "unknown option quant=base_quant (allowed: fp4"),
    ("internal-estimate", "estimate", ["quant=base_quant"], {}, "unknown option quant=base_quant"),
    ("internal-sweep", "train", ["-m", "quant=nf4,base_quant", *FAKE], {}, "unknown option quant=base_quant"),
    ("lexer-two-in-one", "train", ["quant=nf4 adapter=lora"], {}, QUOTE),
    ("lexer-parens", "train", ["data=jsonl", "data.path={root}/a(1).jsonl"], {}, QUOTE),
    (
        "lexer-space-parens-m",
        "train",
        ["-m", "data=jsonl", "data.path={root}/my docs(1).jsonl", "adapter.r=8,16", *FAKE],
        {},
        QUOTE,
    ),
    ("lexer-brackets", "estimate", ["model=local", "model.path={root}/x [copy]"], {}, QUOTE),
    ("lexer-quote", "train", ["data=jsonl", "data.path={root}/it's.jsonl"], {}, QUOTE),
]
# the max_context design (its own driver) checks the same table
CASES += [
    (
        f"sweeper-maxctx-{ov}",
        "train",
        ["-m", "sweep=max_context_16gb", *FAKE, f"hydra.sweeper.{ov}"],
        {"VRAMSWEEP_FORCE_NO_CUDA": "1"},
        needle,
    )
    for ov, needle in SWEEPER_BAD[:1] + SWEEPER_BAD[6:7]
]


def test_every_sweeper_setting_has_a_rule():
    """SETTING_RULES is the one table of hydra.sweeper.* types and ranges: no key is left unchecked."""
    from vramsweep.sweeper.settings import SETTING_RULES, SweeperConf

    assert set(SETTING_RULES) == set(SweeperConf.__dataclass_fields__)
    checked = {ov.partition("=")[0] for ov, _ in SWEEPER_BAD}
    missing = {k for k, r in SETTING_RULES.items() if r.kind not in ("any", "str")} - checked
    assert not missing, f"no bad-input case for {sorted(missing)}"


def test_the_suite_is_large_enough():
    assert len(CASES) >= 60 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("case_id", "verb", "argv", "env", "needle"), CASES, ids=[c[0] for c in CASES])
def test_bad_input(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle):
    check_bad_input(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle)


# --- read-only commands never modify what they read (hash of the input folder before/after)
#: Files a read-only command may add to the sweep folder it reads: its own outputs, never an input.
OWN_OUTPUTS = {"ablation.md", "ablation.csv", "production.md"}
OWN_SUFFIXES = (".png", ".svg", ".html")
DB_KINDS = ("nodb", "empty", "garbage", "truncated", "not-optuna", "optuna")


def _db_bytes() -> bytes:
    """A real sweep's study.db (WAL mode, made by the sweeper's storage) with one finished trial."""
    import gc
    import tempfile

    import optuna

    from vramsweep.sweeper.storage import make_storage

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with tempfile.TemporaryDirectory() as d:
        url = f"sqlite:///{d}/study.db"
        storage = make_storage(url)
        st = optuna.create_study(study_name="syn", storage=storage, directions=["minimize"])
        st.add_trial(optuna.trial.create_trial(values=[2.0]))
        storage.engine.dispose()
        del st, storage
        gc.collect()
        return (Path(d) / "study.db").read_bytes()


@pytest.fixture(scope="module")
def study_db() -> bytes:
    return _db_bytes()


def _sweep_folder(root: Path, kind: str, db: bytes) -> Path:
    import sqlite3

    from _reports import result, write_sweep

    folder = root / "results" / "sweeps" / kind
    write_sweep(
        folder,
        [
            result(0, ["quant=none"], peak=4.0, tps=100, loss=2.0),
            result(1, ["quant=nf4"], peak=2.0, tps=80, loss=2.1),
        ],
        study_name="syn",
    )
    path = folder / "study.db"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "garbage":
        path.write_bytes(b"not a database\x00" * 64)
    elif kind == "truncated":
        path.write_bytes(db[: len(db) // 3])
    elif kind == "optuna":
        path.write_bytes(db)
    elif kind == "not-optuna":
        conn = sqlite3.connect(path)
        conn.execute("CREATE TABLE notes (x TEXT)")
        conn.commit()
        conn.close()
    return folder


def _hashes(folder: Path) -> dict[str, str]:
    import hashlib

    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


READ_ONLY = {
    "report-out": (["report", "{sweep}", "--out", "{root}/out"], False),
    "report-db-file": (["report", "{sweep}/study.db", "--out", "{root}/out"], False),
    "report-in-place": (["report", "{sweep}"], True),
    "pick": (["pick", "{sweep}", "--budget-gib", "16", "--config-dir", "{root}/conf"], True),
    "calibrate": (["estimate", "--calibrate", "{sweep}"], False),
}


@pytest.mark.parametrize("kind", DB_KINDS)
@pytest.mark.parametrize("command", list(READ_ONLY))
def test_read_only_commands_change_nothing(tmp_path, monkeypatch, capsys, study_db, command, kind):
    """report/pick/estimate --calibrate on an empty, damaged, foreign or real study.db: every file of the
    sweep folder is byte-identical afterwards (no schema written into an empty file, no -wal/-shm left);
    only the command's own outputs may appear. A refusal is one error line with exit 2."""
    monkeypatch.chdir(tmp_path)
    sweep = _sweep_folder(tmp_path, kind, study_db)
    before = _hashes(sweep)
    argv, in_place = READ_ONLY[command]
    args = [a.replace("{sweep}", str(sweep)).replace("{root}", str(tmp_path)) for a in argv]
    capsys.readouterr()
    code = main(args)
    err = capsys.readouterr().err
    after = _hashes(sweep)
    changed = sorted(k for k in before if after.get(k) != before[k])
    added = sorted(set(after) - set(before))
    assert not changed, f"{command} on a {kind} study.db changed {changed}"
    allowed = [a for a in added if in_place and (a in OWN_OUTPUTS or a.endswith(OWN_SUFFIXES))]
    assert added == allowed, f"{command} on a {kind} study.db wrote {added} into its input"
    if code == 2:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith(f"vramsweep {args[0]}: error: "), err
    else:
        assert code == 0, err
    if kind in ("garbage", "truncated") and command.startswith("report"):
        assert code == 2 and "not a readable Optuna study database" in err or "cannot open storage" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--cfg", "results_dir={root}/results"],
        ["train", "--cfg", "hydra", "results_dir={root}/results"],
        ["train", "-m", "--cfg", "hydra", "adapter.r=8,16", "results_dir={root}/results", *FAKE],
        ["train", "-m", "--info", "adapter.r=8,16", "results_dir={root}/results", *FAKE],
    ],
    ids=["cfg", "cfg-hydra", "m-cfg-hydra", "m-info"],
)
def test_cfg_reads_and_writes_nothing(tmp_path, monkeypatch, capsys, study_db, argv):
    """``--cfg``/``--info`` print and run nothing: no folder, no study, the results folder untouched."""
    monkeypatch.chdir(tmp_path)
    sweep = _sweep_folder(tmp_path, "optuna", study_db)
    (tmp_path / "results" / "sweeps" / "bad").symlink_to(sweep)  # the study this command line names
    before = _hashes(tmp_path)
    code = main([a.replace("{root}", str(tmp_path)) for a in argv])
    capsys.readouterr()
    assert code == 0
    assert _hashes(tmp_path) == before
