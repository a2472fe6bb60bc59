"""The host memory a trial process holds: the figures ``preflight.HOST_PROCESS_HEADROOM_BYTES`` is derived
from (docs/LONG_CONTEXT.md, "Headroom for the process"). Each case runs in a fresh interpreter:

- ``imports``: peak resident set (``VmHWM``) after importing torch, transformers and peft;
- ``trial``: a whole tiny-model trial (``train.steps=3``), its ``meta.host_memory.peak_rss_bytes``;
- ``load``: ``from_pretrained`` of a random-weights bf16 Qwen3 checkpoint with a real vocabulary (4
  layers, hidden 1,024, vocab 151,936; written to a temp folder first): the peak resident set it adds.

Run:  python bench/host_rss.py [--cases imports,trial,load]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from _child import PREFIX, run_child

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
GIB = 2**30
RSS = (
    "def rss():\n"
    "    d = {}\n"
    "    for line in open('/proc/self/status'):\n"
    "        k, _, v = line.partition(':')\n"
    "        if k in ('VmRSS', 'VmHWM'): d[k] = int(v.split()[0]) * 1024\n"
    "    return d\n"
)
CASES = {
    "imports": "import torch, transformers, peft, transformers.modeling_utils\nout = {'peak': rss()['VmHWM']}",
    "trial": (
        "from vramsweep.config import compose\nfrom vramsweep.trial import run_trial\n"
        "ov = ['train.steps=3', 'logger=none', 'results_dir={tmp}']\n"
        "host = run_trial(compose(ov), overrides=ov)['meta']['host_memory']\n"
        "out = {'peak': host['peak_rss_bytes']}"
    ),
    "load": (
        "import torch, transformers\nbefore = rss()['VmRSS']\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained('{tmp}/model', dtype=torch.bfloat16)\n"
        "out = {'peak': rss()['VmHWM'], 'added': rss()['VmHWM'] - before,\n"
        "       'weights': sum(p.numel() * p.element_size() for p in m.parameters())}"
    ),
}
WRITE = (
    "import torch, transformers\ntorch.manual_seed(0)\n"
    "cfg = transformers.Qwen3Config(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,\n"
    "    num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=151936, tie_word_embeddings=False)\n"
    "transformers.Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained('{tmp}/model', max_shard_size='200MB')"
)


def _run(code: str, tmp: str) -> dict:
    body = RSS + code.replace("{tmp}", tmp) + f"\nimport json; print({PREFIX!r} + json.dumps(out))"
    res, _ = run_child([sys.executable, "-c", body], check=True)
    if res is None:
        raise RuntimeError(f"no {PREFIX.strip()} line from the child")
    return res


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="imports,trial,load", help="comma-separated: imports, trial, load")
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad:
        ap.error(f"--cases: unknown {', '.join(bad)} (allowed: {', '.join(CASES)})")
    with tempfile.TemporaryDirectory(prefix="vramsweep-host-rss-") as tmp:
        if "load" in cases:
            subprocess.run(
                [sys.executable, "-c", WRITE.replace("{tmp}", tmp)], check=True, capture_output=True
            )
        for case in cases:
            out = _run(CASES[case], tmp)
            extra = "".join(f", {k} {v / GIB:.2f} GiB" for k, v in out.items() if k != "peak")
            print(f"{case:8s} peak resident set {out['peak'] / GIB:.2f} GiB{extra}")


if __name__ == "__main__":
    main()
