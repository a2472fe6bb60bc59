"""vramsweep: ablation sweeps for memory-bounded LLM fine-tuning."""

__version__ = "0.1.0"
