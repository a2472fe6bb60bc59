"""Hydra Sweeper plugin ``hydra/sweeper=vramsweep``: Optuna 5 sweeps of vramsweep trials.

Discovered by Hydra's plugin scan (``hydra_plugins`` is a namespace package; do not add an
``__init__.py`` to it). The engine lives in :mod:`vramsweep.sweeper`; this package only adapts it to
Hydra's Sweeper interface and registers the settings schema (``hydra.sweeper.*``).
"""

__version__ = "0.1.0"
