"""Turns a step's plan into tensors, runs one flattened forward, and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch

from pagoda.core.scheduler_output import ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pagoda.distributed.errors import WorkerDiedError
from pagoda.distributed.parallel import SINGLE, TensorParallel
from pagoda.layers.linear_kernels import prepare_linear_layers
from pagoda.loader import load_model
from pagoda.lora.manager import LoRAManager, LoRASettings
from pagoda.model_config import ModelConfig
from pagoda.request import Request
from pagoda.worker.attention import (
    AttentionBackend,
    AttentionMetadata,
    TorchAttentionBackend,
    build_metadata,
    is_fp8,
    token_positions,
)
from pagoda.worker.attention_choice import choose_prefill_attention
from pagoda.worker.attention_triton import TritonAttentionBackend
from pagoda.worker.cuda_graphs import DecodeCudaGraphs
from pagoda.worker.kv_sizing import KVCacheShape, gpu_num_blocks, kv_cache_torch_dtype
from pagoda.worker.logits_processing import PenaltyCounts
from pagoda.worker.sampler import Sampler, SamplingRow, compute_prompt_logprobs

if TYPE_CHECKING:
    from pagoda.distributed.executor import WorkerGroup

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardStep:
    """What every tensor-parallel rank needs to run one step (plain lists: rank 0 broadcasts it pickled)."""

    block_copies: list[tuple[int, int]]  # (src, dst) blocks to copy before the forward (copy-on-write)
    token_ids: list[int]  # [num_tokens] the flat batch
    query_lens: list[int]  # per scheduled request
    seq_lens: list[int]
    block_tables: list[list[int]]
    # The rows the forward returns when it need not return all (the sampled ones, no prompt logprobs): the last
    # layer then skips the rest. None: every token's row.
    output_rows: Optional[list[int]]
    prompt_logprob_spans: list[tuple[int, int]]  # (first flat index, count) whose logits score the prompt
    sample_rows: list[int]  # rows of the forward's output whose logits are sampled


@dataclass(slots=True)
class StepLogits:
    """Rank 0's logits of one step (float32): one tensor per prompt-logprob span, and the sampled rows'."""

    prompt: list[torch.Tensor]
    sample: Optional[torch.Tensor]  # [num_sampling_reqs, vocab]; None when nothing samples


class ModelRunner:
    """Owns the model, the KV cache tensors, the attention backend and the sampler.

    Under tensor parallelism every rank has one, over its shard of the model; rank 0's also plans each step from
    the scheduler's output and samples, and hands the plan to the other ranks through ``workers`` (one broadcast)
    before running its own part: see :meth:`on_all_ranks`.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        model_path: Path,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str = "torch",
        quantization: Optional[str] = None,
        lora: Optional[LoRASettings] = None,
        tp: TensorParallel = SINGLE,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``attention_backend`` is a resolved name, 'torch' or 'triton' (see ``resolve_attention_backend``)."""
        assert lora is None or tp.world_size == 1, "adapters are not sharded across ranks"
        self.model_config = model_config
        self.tp = tp
        self.workers: Optional[WorkerGroup] = None  # rank 0 under tensor parallelism: ranks 1..N-1
        self.dtype = dtype
        self.device = device
        assert attention_backend in ("torch", "triton"), attention_backend
        self.attn_backend: AttentionBackend = (
            TritonAttentionBackend() if attention_backend == "triton" else TorchAttentionBackend()
        )
        self.cuda_graphs: Optional[DecodeCudaGraphs] = None
        self.kv_cache_dtype = kv_cache_dtype  # auto | fp8_e4m3 | fp8_e5m2
        self.model = load_model(model_path, self.attn_backend, dtype, device, model_config, tp, quantization)
        self.linear_kernels = prepare_linear_layers(self.model, device, dtype, quantization)
        self.lora: Optional[LoRAManager] = None
        if lora is not None:
            self.lora = LoRAManager(
                self.model, lora.max_loras, lora.max_rank, lora.max_cpu_loras, dtype, device, lora.download_dir
            )
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.kv_shape: KVCacheShape | None = None

    def kv_cache_shape(self, block_size: int) -> KVCacheShape:
        """This rank's cache per block (its KV heads only, in the cache's dtype: the model's, or fp8 for
        ``kv_cache_dtype`` fp8_e4m3 / fp8_e5m2) and the number of ranks that hold one."""
        spec = self.model.kv_cache_spec
        cache_dtype = kv_cache_torch_dtype(self.kv_cache_dtype, self.dtype)
        return KVCacheShape(
            spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, cache_dtype, self.tp.world_size
        )

    def on_all_ranks(self, method: str, *args: Any) -> Any:
        """Run ``self.<method>(*args)`` on every rank (rank 0: the other ranks get it by one broadcast first) and
        return rank 0's result. Every method that runs collectives (the forward, profiling) goes through here."""
        if self.workers is None:
            return getattr(self, method)(*args)
        self.workers.broadcast(method, args)
        try:
            return getattr(self, method)(*args)
        except BaseException as exc:  # a collective failed (a rank died or hung), or rank 0 itself (Ctrl-C, a bug)
            # The workers may be a collective ahead now: nothing may run on these ranks again.
            self.workers.poison(f"rank 0 failed during {method}: {exc!r}")
            if isinstance(exc, RuntimeError) and not isinstance(exc, WorkerDiedError):
                raise WorkerDiedError(f"tensor parallelism failed during {method}: {exc}") from exc
            raise

    def measure_kv_blocks(self, shape: KVCacheShape, gpu_memory_utilization: float, profile_tokens: int) -> int:
        """GPU: the blocks this rank's device holds after the weights and a profiled forward; the smallest over the
        ranks, so every rank allocates the same number."""
        # NCCL allocates its buffers at the first collective: make that happen before memory is measured.
        self.tp.all_reduce(torch.zeros(1, device=self.device))
        blocks = gpu_num_blocks(shape, gpu_memory_utilization, self.device, lambda: self.profile_run(profile_tokens))
        return self.tp.all_reduce_min(blocks)

    def allocate_kv_cache(self, shape: KVCacheShape, num_blocks: int) -> None:
        """Create every layer's cache once; zeroed so padded reads never see NaN garbage. On CPU, also time the two
        prefill-attention kernels for this model's head layout (see :mod:`pagoda.worker.attention_choice`)."""
        if self.device.type == "cpu" and isinstance(self.attn_backend, TorchAttentionBackend):
            spec = self.model.model.layers[0].self_attn.attn.spec
            choose_prefill_attention(self.attn_backend, spec, self.dtype, cache_dtype=shape.dtype)
        self.kv_shape = shape
        self.kv_caches = [
            torch.zeros(shape.layer_shape(num_blocks), dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run the model over every scheduled token and sample where a sequence reaches its end (rank 0)."""
        scheduled = plan.scheduled
        if self.lora is not None:  # each adapter's rows in one run
            scheduled = sorted(scheduled, key=lambda s: self.lora.slot_order(s.request.lora_id))
        step, sample_requests, spans = self._plan_step(plan.block_copies, scheduled)
        if self.lora is not None:
            self.lora.prepare_step(*_lora_runs(scheduled, step, sample_requests))
        try:
            logits = self.on_all_ranks("run_forward", step)
        finally:
            if self.lora is not None:
                self.lora.clear_step()
        out = ModelRunnerOutput()
        for (request, _, count), span_logits in zip(spans, logits.prompt):
            first = request.num_computed_tokens + 1  # the prompt token scored by the first row
            targets = request.prompt_token_ids[first : first + count]
            out.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                span_logits, targets, request.sampling_params.prompt_logprobs
            )
        if logits.sample is None:
            return out
        self._sample(logits.sample, sample_requests, out)
        return out

    @torch.inference_mode()
    def run_forward(self, step: ForwardStep) -> Optional[StepLogits]:
        """Every rank: copy blocks, run the forward over the step's tokens, compute the logits it needs. Rank 0
        gets them; the other ranks return None (they only contribute their vocabulary slices)."""
        self._copy_blocks(step.block_copies)
        input_ids, positions, meta, output_rows = self._step_tensors(step)
        hidden = self._forward(input_ids, positions, meta, output_rows)
        prompt = [
            self.model.compute_logits(hidden[start : start + count]) for start, count in step.prompt_logprob_spans
        ]
        sample = None
        if step.sample_rows:
            rows = hidden if output_rows is not None else hidden[step.sample_rows]
            sample = self.model.compute_logits(rows)  # [num_sampling_reqs, vocab] on rank 0
        return StepLogits(prompt, sample) if self.tp.is_first else None

    def _sample(self, logits: torch.Tensor, sample_requests: list[Request], out: ModelRunnerOutput) -> None:
        rows: list[SamplingRow] = []
        row_logits: list[int] = []
        for i, request in enumerate(sample_requests):
            for generator in _sequence_generators(request):
                rows.append(_sampling_row(request, generator, logits.shape[1], logits.device))
                row_logits.append(i)
        if len(row_logits) != logits.shape[0]:  # an n > 1 prompt samples n times from one row
            logits = logits[row_logits]
        sampled = self.sampler(logits, rows)
        row = 0
        for request in sample_requests:
            count = len(_sequence_generators(request))
            failure = next((sampled.failed_rows[r] for r in range(row, row + count) if r in sampled.failed_rows), None)
            if failure is not None:  # no token for this request: it fails alone, the batch goes on
                out.errors[request.request_id] = failure
            else:
                out.sampled_token_ids[request.request_id] = sampled.token_ids[row : row + count]
                if request.sampling_params.logprobs is not None:
                    out.logprobs[request.request_id] = sampled.logprobs[row : row + count]
            row += count

    def _plan_step(
        self, block_copies: list[tuple[int, int]], scheduled: list[ScheduledRequest]
    ) -> tuple[ForwardStep, list[Request], list[tuple[Request, int, int]]]:
        """The step every rank runs, the requests that sample (in logits order) and the prompt-logprob spans
        (request, first flat index, count)."""
        token_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_requests: list[Request] = []
        sample_indices: list[int] = []
        spans: list[tuple[Request, int, int]] = []
        for item in scheduled:
            request, start = item.request, item.request.num_computed_tokens
            end = start + item.num_tokens
            flat_start = len(token_ids)
            token_ids.extend(request.all_token_ids[start:end])
            query_lens.append(item.num_tokens)
            seq_lens.append(end)
            block_tables.append(item.block_ids)
            if request.pending_prompt_logprobs:
                # position p scores prompt token p + 1; the last prompt position samples instead
                count = min(end, request.num_prompt_tokens - 1) - start
                if count > 0:
                    spans.append((request, flat_start, count))
            if item.samples:
                sample_requests.append(request)
                sample_indices.append(len(token_ids) - 1)
        output_rows = None
        # A prompt chunk: most rows only feed the cache. (A step that samples nothing keeps every row: no kernel
        # then sees an empty batch.)
        if not spans and 0 < len(sample_indices) < len(token_ids):
            output_rows = sample_indices
        step = ForwardStep(
            block_copies=list(block_copies),
            token_ids=token_ids,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables,
            output_rows=output_rows,
            prompt_logprob_spans=[(start, count) for _, start, count in spans],
            sample_rows=sample_indices,
        )
        return step, sample_requests, spans

    def _step_tensors(
        self, step: ForwardStep
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, Optional[torch.Tensor]]:
        """input_ids [num_tokens], positions [num_tokens], the attention metadata and output_rows [num_out]."""
        meta = build_metadata(step.query_lens, step.seq_lens, step.block_tables, self.kv_shape.block_size)
        positions, _ = token_positions(torch.tensor(step.query_lens), torch.tensor(step.seq_lens))
        if self.device.type != "cpu":
            meta.slot_mapping = meta.slot_mapping.to(self.device, non_blocking=True)
            meta.block_tables = meta.block_tables.to(self.device, non_blocking=True)
        output_rows = None
        if step.output_rows is not None:
            output_rows = torch.tensor(step.output_rows, dtype=torch.int64, device=self.device)
        input_ids = torch.tensor(step.token_ids, dtype=torch.int64, device=self.device)
        return input_ids, positions.to(self.device), meta, output_rows

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward for the batch sizes up to ``max_num_seqs`` (after the KV cache exists)."""
        assert self.kv_caches, "allocate the KV cache before capturing"
        assert self.device.type == "cuda" and isinstance(self.attn_backend, TritonAttentionBackend)
        self.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_caches, max_num_seqs, max_model_len)
        self.cuda_graphs.capture()

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (or of ``output_rows``): a graph replay for a pure-decode step, else
        an eager forward. Pure decode samples every row, so graphs never see ``output_rows``."""
        with_adapters = self.lora is not None and self.lora.context.full is not None  # graphs hold no adapter rows
        if (
            self.cuda_graphs is not None
            and output_rows is None
            and not with_adapters
            and self.cuda_graphs.can_run(meta)
        ):
            return self.cuda_graphs.run(input_ids, positions, meta)
        self.attn_backend.prepare(meta)
        return self.model(input_ids, positions, self.kv_caches, meta, output_rows)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for cache in self.kv_caches:  # [2, num_blocks, block_size, kv_heads, head_dim]
            cache = cache.view(torch.uint8) if is_fp8(cache.dtype) else cache  # fp8 codes: copy the bytes
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def profile_run(self, num_tokens: int) -> None:
        """One forward over ``num_tokens`` dummy prompt tokens, to measure the activation peak.

        Uses a scratch KV cache just big enough for it, so it runs before the real cache exists.
        """
        assert self.kv_shape is None, "profile before allocating the KV cache"
        shape = self.kv_cache_shape(16)
        num_blocks = -(-num_tokens // shape.block_size)
        scratch = [
            torch.zeros(shape.layer_shape(num_blocks), dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]
        meta = build_metadata([num_tokens], [num_tokens], [list(range(num_blocks))], shape.block_size)
        meta.slot_mapping = meta.slot_mapping.to(self.device)
        meta.block_tables = meta.block_tables.to(self.device)
        self.attn_backend.prepare(meta)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        hidden = self.model(input_ids, positions, scratch, meta)
        self.model.compute_logits(hidden[-1:])
        del scratch, hidden


def _lora_runs(
    scheduled: list[ScheduledRequest], step: ForwardStep, sample_requests: list[Request]
) -> tuple[list, Optional[list]]:
    """(lora id, first row, end row) runs over the flat batch, and over the rows the last layer keeps (None: all).
    ``scheduled`` is grouped by adapter, so consecutive equal ids merge into one run."""
    runs: list[list] = []
    row = 0
    for item in scheduled:
        _extend_run(runs, item.request.lora_id, row, row + item.num_tokens)
        row += item.num_tokens
    kept: Optional[list[list]] = None
    if step.output_rows is not None:
        kept = []
        for index, request in enumerate(sample_requests):
            _extend_run(kept, request.lora_id, index, index + 1)
    return [tuple(r) for r in runs], None if kept is None else [tuple(r) for r in kept]


def _extend_run(runs: list[list], lora_id: Optional[int], start: int, end: int) -> None:
    if runs and runs[-1][0] == lora_id and runs[-1][2] == start:
        runs[-1][2] = end
    else:
        runs.append([lora_id, start, end])


def _sequence_generators(request: Request) -> list:
    """One generator per sequence that samples from this request's logits row."""
    if request.needs_fork:
        return [request.generator, *(request.sibling_generators or [None] * (request.sampling_params.n - 1))]
    return [request.generator]


def _sampling_row(request: Request, generator, vocab: int, device: torch.device) -> SamplingRow:
    params = request.sampling_params
    stop_ids = params.all_stop_token_ids if params.ignore_eos else params.all_stop_token_ids | request.eos_token_ids
    if params.has_penalties and request.penalty_counts is None:
        # Kept on the sequence from its first sampled token on; a forked child starts its own.
        request.penalty_counts = PenaltyCounts(
            request.prompt_token_ids, vocab, device, with_prompt=params.repetition_penalty != 1.0
        )
    return SamplingRow(
        params=params,
        generator=generator,
        prompt_token_ids=request.prompt_token_ids,
        output_token_ids=request.output_token_ids,
        min_tokens_stop_ids=stop_ids,
        penalty_counts=request.penalty_counts,
        grammar=request.grammar,
    )
