"""A rank's view of its tensor-parallel group and the three collectives the model needs."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from pagoda.distributed.shm_comm import ShmCommunicator
from pagoda.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``world_size``. ``group`` carries tensors (NCCL on GPUs, gloo on CPU); ``cpu_group`` (gloo)
    carries the engine's control messages. A world of one has neither and every collective is the identity."""

    rank: int = 0
    world_size: int = 1
    group: Optional[Any] = None
    cpu_group: Optional[Any] = None
    shm: Optional[ShmCommunicator] = None  # CPU ranks on one host: collectives through shared memory

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (the row-parallel projections' partial products)."""
        if self.world_size > 1 and not (self.shm is not None and self.shm.all_reduce(tensor)):
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """Concatenate every rank's ``tensor`` [n, k] along the last dim on rank 0 ([n, world_size * k]); None on the
        other ranks (the vocab-parallel logits: only rank 0 samples)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        if self.shm is not None:
            done, gathered = self.shm.gather_to_first(tensor)
            if done:
                return gathered
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(tensor, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled over the gloo group: the step plan, commands)."""
        assert self.world_size > 1
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` of any rank (e.g. the KV blocks every rank's memory can hold)."""
        if self.world_size == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(tensor.item())


SINGLE = TensorParallel()


def init_tensor_parallel(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout_s: float,
    shm: Optional[ShmCommunicator] = None,
) -> TensorParallel:
    """Join the group (blocks until every rank has joined, or ``timeout_s``). Every collective then fails after
    ``timeout_s`` instead of waiting forever for a dead or hung peer. ``shm`` (CPU): this rank's view of the
    shared-memory segment that carries the collectives that fit it."""
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout, **kwargs
    )
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    logger.info("tensor parallel rank %d of %d joined (%s)", rank, world_size, backend)
    return TensorParallel(rank, world_size, group, cpu_group, shm)


def check_shardable(config: ModelConfig, world_size: int) -> None:
    """Refuse (ValueError naming the size) a model this many ranks cannot split evenly. The vocabulary need not
    divide: its last shard is padded."""
    if world_size == 1:
        return
    for name in ("num_attention_heads", "intermediate_size"):
        size = getattr(config, name)
        if size % world_size:
            raise ValueError(
                f"--tensor-parallel-size {world_size} does not divide the model's {name} ({size}); "
                f"choose a size that divides it"
            )
    kv = config.num_key_value_heads
    if kv % world_size and world_size % kv:
        raise ValueError(
            f"--tensor-parallel-size {world_size} and the model's num_key_value_heads ({kv}): one must divide the "
            "other (KV heads are split across ranks, or replicated when there are fewer heads than ranks)"
        )
