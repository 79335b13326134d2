"""Turning a schedule into tensors: model runner, attention backends, sampler."""
