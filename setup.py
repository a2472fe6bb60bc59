"""Build hook (everything else is in pyproject.toml): the repository's top-level ``conf/`` (config groups,
``train.yaml``) and ``sweeps/`` (sweep files) are the source of truth; a wheel ships a copy of each inside
the package (``vramsweep/conf``, ``vramsweep/sweeps``), so a non-editable install composes without the
checkout (``vramsweep.config.paths`` looks for the checkout's folders first)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = ("conf", "sweeps")


class BuildPyWithConfig(build_py):
    def run(self) -> None:
        super().run()
        for name in SHIPPED:
            if (ROOT / name).is_dir():
                shutil.copytree(
                    ROOT / name,
                    Path(self.build_lib) / "vramsweep" / name,
                    dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
                )


setup(cmdclass={"build_py": BuildPyWithConfig})
