"""Search-path plugin: the user's conf dir in front of vramsweep's packaged defaults.

Acts only when the primary config dir is vramsweep's packaged ``conf`` (``vramsweep train -m``); every
other Hydra app is left alone. The rule lives in :func:`vramsweep.config.compose.layer_user_conf`.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class VramsweepSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from vramsweep.config.compose import layer_user_conf

        layer_user_conf(search_path)
