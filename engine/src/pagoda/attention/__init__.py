"""Attention over the paged KV cache: the per-step metadata and backend protocol (:mod:`pagoda.attention.protocol`),
the PyTorch / native CPU backend (:mod:`pagoda.attention.torch_backend`), the Triton backend for CUDA
(:mod:`pagoda.attention.triton_backend`) and which of them runs (:mod:`pagoda.attention.choice`)."""
