"""Long-context memory techniques, each a plain PyTorch component that works on CPU and CUDA:

* :mod:`.loss` — chunked linear cross-entropy: ``lm_head`` + loss + its gradient per chunk of tokens,
  never materialising the ``tokens x vocab`` logits (our own implementation, no Liger needed).
* :mod:`.mlp` — sequence-tiled MLP: the SwiGLU block runs tile by tile and is recomputed tile by tile
  in backward, so its ``tokens x intermediate`` tensors exist for one tile at a time.
* :mod:`.offload` — offloaded activation checkpoints: each decoder layer keeps only its input, in
  pinned host memory, copied on a side stream and prefetched for the backward pass.

Arctic Long Sequence Training (arXiv 2506.13996) combines the same three (DeepSpeed ``TiledMLP``,
``TiledFusedLogitsLoss``, checkpoint offload); Unsloth's ``use_gradient_checkpointing="unsloth"`` is the
offload part. See docs/LONG_CONTEXT.md for the memory arithmetic.
"""
