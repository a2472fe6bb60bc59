"""vramsweep: ablation sweeps for memory-bounded LLM fine-tuning."""

__version__ = "0.1.0"

from vramsweep import noise as _noise  # noqa: E402

_noise.install()  # library noise filtered at a terminal, kept in logs (see vramsweep.noise)
