"""One rank: its device, its place in the tensor-parallel group, and its model runner.

The executor creates one ``Worker`` per rank (rank 0 in the engine's process, the others in spawned processes) and
calls the methods of :data:`COLLECTIVE_METHODS` on every rank in the same order, since each of them may run
collectives. The rank-0 worker also prepares each step from the scheduler's output and samples it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from pagoda.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagoda.cpu import keep_freed_memory
from pagoda.distributed.parallel import TensorParallel
from pagoda.lora.adapter import LoRAAdapter
from pagoda.worker.kv_sizing import KVCacheShape, gpu_num_blocks
from pagoda.worker.model_runner import ModelRunner
from pagoda.worker.step import ForwardStep, PreparedStep, StepLogits
from pagoda.worker.worker_config import WorkerConfig

# What the executor may run on every rank (each runs the same collectives on every rank, in the same order).
COLLECTIVE_METHODS = frozenset({"run_forward", "allocate_kv_cache", "measure_kv_blocks", "capture_cuda_graphs"})


def device_for_rank(device_type: str, rank: int) -> torch.device:
    """Rank r's device: ``cuda:r`` (made current) on GPUs, the CPU otherwise."""
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


class Worker:
    """One rank's model runner, and what the rank does besides running it (memory profiling, sizing)."""

    def __init__(self, config: WorkerConfig, device: torch.device, tp: TensorParallel) -> None:
        if device.type == "cpu":
            keep_freed_memory()  # per-step tensors reuse pages instead of faulting them in
        self.config = config
        self.device = device
        self.tp = tp
        self.model_runner = ModelRunner(config, device, tp)

    # ---- every rank (collectives) --------------------------------------------------------------------

    def measure_kv_blocks(self, shape: KVCacheShape, gpu_memory_utilization: float, profile_tokens: int) -> int:
        """GPU: the blocks this rank's device holds after the weights and a profiled forward; the smallest over the
        ranks, so every rank allocates the same number."""
        # NCCL allocates its buffers at the first collective: make that happen before memory is measured.
        self.tp.all_reduce(torch.zeros(1, device=self.device))
        runner = self.model_runner
        blocks = gpu_num_blocks(shape, gpu_memory_utilization, self.device, lambda: runner.profile_run(profile_tokens))
        return self.tp.all_reduce_min(blocks)

    def allocate_kv_cache(self, shape: KVCacheShape, num_blocks: int) -> None:
        self.model_runner.allocate_kv_cache(shape, num_blocks)

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        self.model_runner.capture_cuda_graphs(max_num_seqs, max_model_len)

    def run_forward(self, step: ForwardStep) -> StepLogits | None:
        return self.model_runner.run_forward(step)

    # ---- rank 0 ----------------------------------------------------------------------------------------

    def kv_cache_shape(self, block_size: int) -> KVCacheShape:
        return self.model_runner.kv_cache_shape(block_size)

    def prepare_step(self, plan: SchedulerOutput, adapters: Mapping[int, LoRAAdapter]) -> PreparedStep:
        return self.model_runner.prepare_step(plan, adapters)

    def end_step(self) -> None:
        self.model_runner.end_step()

    def sample(self, prepared: PreparedStep, logits: StepLogits) -> ModelRunnerOutput:
        return self.model_runner.sample(prepared, logits)

    def lora_targets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """layer name -> (in_features, output slices) of every layer with LoRA slots ({} without LoRA)."""
        slots = self.model_runner.lora
        return slots.targets if slots is not None else {}

    def resident_loras(self) -> frozenset[int]:
        """The adapters whose weights are in a device slot now."""
        slots = self.model_runner.lora
        return slots.resident() if slots is not None else frozenset()

    def remove_loras(self, lora_ids: list[int]) -> None:
        if self.model_runner.lora is not None:
            self.model_runner.lora.remove(lora_ids)
