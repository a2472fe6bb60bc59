"""Measurement: tracked CPU memory by category, CUDA allocator/NVML peaks, throughput, MFU."""

from vramsweep.measure.cpu import CATEGORIES, TensorMemoryTracker, model_state_tensors

__all__ = ["CATEGORIES", "TensorMemoryTracker", "model_state_tensors"]
