"""Helpers for the tests and benchmarks, never imported by the engine itself (tests/test_architecture.py checks it).

- :mod:`pagoda.testing.quant_writers`: writes AWQ, GPTQ and compressed-tensors FP8 checkpoints from a float one.
"""
