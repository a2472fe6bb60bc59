"""The bad-input harness: each case runs ``vramsweep <verb>`` in-process (``vramsweep.cli.main``) on the
input files it names, and must exit 2 with one line ``vramsweep <verb>: error: ...`` containing the
expected words, within 10 s of CPU, writing nothing; the bad config overrides of every verb's tests."""

from __future__ import annotations

import json
import time
from collections import namedtuple
from pathlib import Path

from vramsweep.cli import main

FAKE = [
    "hydra.sweeper.trial_fn=fakes:fake_trial",
    "hydra.sweeper.isolation=inprocess",
    "hydra.sweeper.study_name=bad",
]
Usage = namedtuple("Usage", "total used free")  # shutil.disk_usage's result, for a full disk
DOC = {"id": "d1", "title": "t", "sections": [{"heading": "h", "text": "some text"}]}


def _chat(*turns: tuple[str, str]) -> bytes:
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}).encode() + b"\n"


def _chat_inputs() -> dict[str, bytes]:
    """Bad records of the chat, Alpaca and prompt/completion formats, and a template that refuses."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    good = _chat(("user", "hi"), ("assistant", "hello"))
    buf = io.BytesIO()
    pq.write_table(pa.table({"instruction": ["a", "b"], "input": ["", ""]}), buf)
    return {
        "chat_good.jsonl": good * 3,
        "chat_unknown.jsonl": b'{"foo": 1, "bar": 2}\n',
        "chat_role.jsonl": good + _chat(("user", "hi"), ("narrator", "x"), ("assistant", "y")),
        "chat_noassistant.jsonl": good + _chat(("system", "s"), ("user", "hi")),
        "chat_emptycontent.jsonl": good + _chat(("user", "hi"), ("assistant", "  ")),
        "chat_mixed.jsonl": good + b'{"text": "plain"}\n',
        "chat_latin1.json": b'[{"text": "caf\xe9"}]',
        "alpaca_nooutput.parquet": buf.getvalue(),
        "pc_longprompt.jsonl": json.dumps({"prompt": "word " * 200, "completion": "yes"}).encode()
        + b"\n"
        + json.dumps({"prompt": "q", "completion": "a"}).encode()
        + b"\n",
        "chat_long.jsonl": good + _chat(("user", "word " * 200), ("assistant", "fine")) + good,
        "bad_template.jinja": b"{{ raise_exception('this template refuses') }}",
    }


def _inputs(root: Path) -> dict[str, Path]:
    """Every bad input file, written before the snapshot (so they do not count as 'written')."""
    d = root / "in"
    d.mkdir()
    files: dict[str, bytes] = {
        "empty.jsonl": b"",
        "blank.jsonl": b"\n  \n\n",
        "malformed.jsonl": json.dumps(DOC).encode() + b'\n{"id": "x", "sections": [\n',
        "latin1.jsonl": json.dumps(DOC).encode()
        + b"\n"
        + json.dumps(DOC | {"id": "d2"}).encode().replace(b"some text", b"caf\xe9"),
        "utf16.jsonl": (json.dumps(DOC) + "\n").encode("utf-16"),
        "nosections.jsonl": json.dumps({"id": "a", "title": "t"}).encode() + b"\n",
        "emptysections.jsonl": json.dumps({"id": "a", "sections": []}).encode() + b"\n",
        "dupid.jsonl": (json.dumps(DOC) + "\n" + json.dumps(DOC) + "\n").encode(),
        "list.jsonl": b"[1, 2, 3]\n",
        "good.jsonl": (json.dumps(DOC) + "\n").encode(),
        "not_a_dir": b"x",
        **_chat_inputs(),
    }
    out = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        out[name] = d / name
    models = {
        "m_corrupt": '{"hidden_size": 64,',
        "m_list": "[1, 2]",
        "m_missing": json.dumps({"model_type": "qwen3", "num_attention_heads": 4}),
        "m_badvalue": json.dumps(
            {
                "hidden_size": "big",
                "num_attention_heads": 4,
                "num_hidden_layers": 2,
                "intermediate_size": 8,
                "vocab_size": 10,
            }
        ),
    }
    for name, text in models.items():
        (d / name).mkdir()
        (d / name / "config.json").write_text(text)
        out[name] = d / name
    (d / "m_dir").mkdir()
    (d / "m_dir" / "config.json").mkdir()  # unreadable: a folder where the file should be
    out["m_dir"] = d / "m_dir"
    g = d / "garbage_sweep"
    (g / "trials").mkdir(parents=True)
    (g / "study.db").write_bytes(b"this is not a database\x00" * 64)
    (g / "trials" / "0000.json").write_text(json.dumps({"trial": 0, "status": "ok", "metrics": {}}))
    out["garbage_sweep"] = g
    bad_db = d / "garbage_results" / "sweeps" / "bad"
    bad_db.mkdir(parents=True)
    (bad_db / "study.db").write_bytes(b"not a database\x00" * 64)
    out["garbage_results"] = d / "garbage_results"
    (d / "empty_sweep").mkdir()
    out["empty_sweep"] = d / "empty_sweep"
    return out


PW = "s3cret-pw"  # never printed (checked for every case)


def _fill(arg: str, files: dict[str, Path], root: Path) -> str:
    out = arg.replace("{root}", str(root))
    for name, path in files.items():
        out = out.replace("{" + name + "}", str(path))
    return out


def _tree(*roots: Path) -> set[Path]:
    return {p for r in roots if r.exists() for p in r.rglob("*")}


def check_bad_input(tmp_path, capsys, monkeypatch, case_id, verb, argv, env, needle):
    """One case: exit 2, one error line with ``needle``, no password printed, nothing written."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("VRAMSWEEP_FAULT", raising=False)
    files = _inputs(tmp_path)
    for k, v in env.items():
        if k == "_DISK_FULL":
            monkeypatch.setattr(
                "vramsweep.preflight.shutil.disk_usage", lambda p: Usage(2**30, 2**30 - 2**20, 2**20)
            )
        else:
            monkeypatch.setenv(k, v)
    args = [_fill(a, files, tmp_path) for a in argv]
    if verb == "train" and not any(a.startswith("results_dir=") for a in args):
        args.append(f"results_dir={tmp_path / 'res'}")
    userconf = tmp_path / "userconf"  # the user's conf dir: pick would write experiment/ there
    userconf.mkdir()
    monkeypatch.setenv("VRAMSWEEP_CONFIG_DIR", str(userconf))
    experiments = userconf / "experiment"
    before, before_conf = _tree(tmp_path), _tree(experiments)
    capsys.readouterr()
    cpu0 = time.process_time()
    code = main([verb, *args] if verb else args)
    cpu_s = time.process_time() - cpu0
    out, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"exit {code}\nstdout: {out}\nstderr: {err}"
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    prefix = (
        f"vramsweep {verb}: error: "
        if verb in ("train", "estimate", "report", "pick")
        else "vramsweep: error: "
    )
    assert lines[0].startswith(prefix), lines[0]
    assert "usage:" not in err.split("error:", 1)[0], "usage printed before the error line"
    assert needle in lines[0], lines[0]
    assert "HYDRA_FULL_ERROR" not in err and "search path" not in err.lower()
    assert PW not in out + err, "a storage password was printed"
    assert cpu_s < 10, f"{case_id}: {cpu_s:.1f} s of CPU before exit 2 (at most 10 s)"
    assert _tree(tmp_path) == before, f"written: {sorted(map(str, _tree(tmp_path) - before))}"
    assert _tree(experiments) == before_conf


# (overrides, key the error names, words of the allowed values it prints)
CONFIG_BAD = [
    (["quant=nf5"], "quant", "nf4_dq"),
    (["adapter=lorax"], "adapter", "rslora"),
    (["optimizer=sgd"], "optimizer", "adamw_8bit"),
    (["attention=flash3"], "attention", "sdpa"),
    (["hardware=rtx9090"], "hardware", "rtx4080_16gb"),
    (["adapter.r=abc"], "adapter.r", "Integer"),
    (["adapter.rank=8"], "adapter.rank", "adapter"),
    (["adapter.r=0"], "adapter.r", "[1, 4096]"),
    (["adapter.r=100000"], "adapter.r", "[1, 4096]"),
    (["adapter.alpha=-1"], "adapter.alpha", "(0"),
    (["adapter.dropout=1.5"], "adapter.dropout", "[0.0, 1.0)"),
    (["train.lr=0"], "train.lr", "(0.0, 1.0]"),
    (["train.lr=nan"], "train.lr", "finite"),
    (["train.lr=5"], "train.lr", "(0.0, 1.0]"),
    (["train.steps=0"], "train.steps", "[1,"),
    (["train.micro_batch=0"], "train.micro_batch", "[1, 4096]"),
    (["train.grad_accum=-2"], "train.grad_accum", "[1, 4096]"),
    (["train.dtype=fp8"], "train.dtype", "bf16"),
    (["train.schedule=exp"], "train.schedule", "cosine"),
    (["kernels.liger=true", "kernels.unsloth=true"], "kernels", "liger"),
    (["attention=flash_attention_2"], "attention", "sdpa"),
    (["attention=flash_attention_2", "train.dtype=fp32"], "train.dtype", "bf16"),
    (["quant=nf4", "adapter=full"], "quant", "quant=none"),
    (["quant=int8", "adapter=full"], "quant", "quant=none"),
    (["context.max_tokens=100000"], "context.max_tokens", "4096"),
    (["context.max_tokens=8"], "context.max_tokens", "[32,"),
    (["context.truncation=middle"], "context.truncation", "exp_decay"),
    (["context.decay=0"], "context.decay", "(0.0, 1.0]"),
    (["model=local", "model.path=/nonexistent/model"], "model.path", "local HF folder"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "2"),
    (["train.measure_warmup_steps=30"], "train.measure_warmup_steps", "0..29"),
    (["hardware=rtx4080_16gb"], "hardware", "cpu"),
    (["optimizer.kwargs.betas=[0.9,1.5]"], "optimizer.kwargs.betas", "[0, 1)"),
    (["vocab=sliced", "model=qwen3_8b"], "vocab", "full"),
    (["vocab=sliced", "vocab.rows=1000"], "vocab.rows", "only sizes an estimate"),
    (["vocab.rows=1000"], "vocab.rows", "vocab=sliced"),
    (["tiling.attention_heads=3"], "tiling.attention_heads", "num_kv_heads"),
    (["data=jsonl", "data.path=/nonexistent.jsonl"], "data.path", ".jsonl"),
    (["train.dtype=true"], "train.dtype", "bf16"),
]
