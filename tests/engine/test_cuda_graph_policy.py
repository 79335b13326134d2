"""When decode steps are captured in CUDA graphs. Tensor parallelism on GPUs runs eagerly: a captured step would
replay NCCL all-reduces, which no GPU run has verified yet. Decided from the configuration alone, so it is tested
here without a GPU (a ``torch.device("cuda")`` object needs none); not run on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagoda.config import EngineArgs
from pagoda.engine.engine_config import eager_reason, resolve_engine_config

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(
    ("enforce_eager", "tp", "device", "eager"),
    [
        (False, 1, CUDA, False),  # one GPU: graphs
        (False, 2, CUDA, True),  # tensor parallel: eager even without --enforce-eager
        (False, 8, CUDA, True),
        (True, 1, CUDA, True),
        (False, 2, CPU, False),  # CPU never captures graphs anyway: nothing to decide
    ],
)
def test_decode_runs_eagerly_for_enforce_eager_and_for_tensor_parallel_gpus(enforce_eager, tp, device, eager) -> None:
    assert (eager_reason(enforce_eager, tp, device) is not None) == eager


def test_the_reason_for_tensor_parallel_names_the_size_and_the_unverified_all_reduce() -> None:
    reason = eager_reason(False, 4, CUDA)
    assert reason is not None and "tensor_parallel_size=4" in reason and "NCCL all-reduces" in reason
    assert eager_reason(True, 4, CUDA) == "--enforce-eager"


def test_a_tensor_parallel_gpu_engine_hands_its_executor_enforce_eager() -> None:
    config = resolve_engine_config(EngineArgs(max_model_len=64))
    assert config.cache.enforce_eager is False
    tensor_parallel = dataclasses.replace(
        config, device=CUDA, args=dataclasses.replace(config.args, tensor_parallel_size=2)
    )
    assert tensor_parallel.cache.enforce_eager is True
    assert dataclasses.replace(tensor_parallel, args=config.args).cache.enforce_eager is False


def test_quantized_experts_run_eagerly_on_a_gpu_and_dense_ones_are_captured() -> None:
    """A mixture of experts whose experts are quantized runs them one by one over their routed tokens, reading the
    routing back to the host, which a CUDA graph cannot hold; dense experts take the fused kernel."""
    reason = eager_reason(False, 1, CUDA, quantized_experts=True)
    assert reason is not None and "experts are quantized" in reason
    assert eager_reason(False, 1, CUDA, quantized_experts=False) is None
    assert eager_reason(False, 1, CPU, quantized_experts=True) is None
