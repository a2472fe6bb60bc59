"""Config source ``vramsweep-sweeps://<folder>``: a folder of sweep files seen as the config group ``sweep``.

vramsweep keeps its sweep files in the top-level ``sweeps/`` folder (``sweeps/<name>.yaml``), beside the
config groups in ``conf/``. Hydra finds a group only as a sub-folder of a search-path entry, so this source
shows the folder as the group ``sweep``: ``sweep=<name>`` composes ``<folder>/<name>.yaml``. The search
path (:func:`vramsweep.config.compose.layer_user_conf`) puts it after the user's conf dir and the packaged
``conf``, so a user's ``<conf dir>/sweep/<name>.yaml`` wins over a shipped sweep of the same name.
Discovered by Hydra's plugin scan, like the sweeper.
"""

from __future__ import annotations

import os

from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from omegaconf import OmegaConf

#: The config group the folder stands for.
GROUP = "sweep"


class SweepsConfigSource(ConfigSource):
    def __init__(self, provider: str, path: str) -> None:
        if "://" not in path:
            path = f"{self.scheme()}://{path}"
        super().__init__(provider=provider, path=path)

    @staticmethod
    def scheme() -> str:
        return "vramsweep-sweeps"

    def _file(self, config_path: str) -> str | None:
        """``sweep/<name>.yaml`` -> ``<folder>/<name>.yaml``; anything else is not in this source."""
        head, _, tail = config_path.strip("/").partition("/")
        if head != GROUP or not tail or "/" in tail:
            return None
        return os.path.join(self.path, tail)

    def load_config(self, config_path: str) -> ConfigResult:
        path = self._file(self._normalize_file_name(config_path))
        if path is None or not os.path.isfile(path):
            raise ConfigLoadError(f"Config not found : {config_path} in {self.path}")
        with open(path, encoding="utf-8") as f:
            header = ConfigSource._get_header_dict(f.read(512))
            f.seek(0)
            cfg = OmegaConf.load(f)
        return ConfigResult(
            config=cfg, path=f"{self.scheme()}://{self.path}", provider=self.provider, header=header
        )

    def available(self) -> bool:
        return os.path.isdir(self.path)

    def is_group(self, config_path: str) -> bool:
        return config_path.strip("/") in ("", GROUP) and self.available()

    def is_config(self, config_path: str) -> bool:
        path = self._file(self._normalize_file_name(config_path))
        return path is not None and os.path.isfile(path)

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        where = config_path.strip("/")
        if not self.available():
            return []
        if where == "":
            return [GROUP] if results_filter in (None, ObjectType.GROUP) else []
        if where != GROUP or results_filter not in (None, ObjectType.CONFIG):
            return []
        return sorted(f[: -len(".yaml")] for f in os.listdir(self.path) if f.endswith(".yaml"))
