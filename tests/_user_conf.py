"""A user's conf dir to layer over the packaged one: a new hardware option, a replacement for
``hardware=cpu`` and a sweep file."""

from __future__ import annotations

from pathlib import Path

HW = "# {what}\ndefaults: [base_hardware, _self_]\nname: {name}\ndevice: cpu\nbudget_gib: {gib}\n"
SWEEP = """# @package _global_
# Launch: vramsweep train -m sweep=mine
defaults:
  - override /hydra/sweeper: vramsweep
sweep:
  name: mine
  design: ablation
  objectives:
    - {metric: peak_memory_bytes, direction: minimize}
  baseline: [hardware=mine]
  factors:
    - [adapter.r=4]
"""


def user_conf(folder: Path) -> Path:
    """A user's conf dir: a new hardware option, a replacement for the packaged ``hardware=cpu``, a sweep."""
    (folder / "hardware").mkdir(parents=True)
    (folder / "sweep").mkdir()
    (folder / "hardware" / "mine.yaml").write_text(HW.format(what="my card", name="mine", gib=7))
    (folder / "hardware" / "cpu.yaml").write_text(HW.format(what="my cpu budget", name="cpu", gib=3.5))
    (folder / "sweep" / "mine.yaml").write_text(SWEEP)
    return folder
