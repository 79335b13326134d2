"""Quantized weights: checkpoint formats (AWQ, GPTQ, FP8), their canonical forms and the kernels' inputs."""
