"""Turns a step's plan into tensors, runs one flattened forward, and samples."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Optional

import torch

from pagoda.attention.choice import choose_prefill_attention
from pagoda.attention.protocol import AttentionBackend, AttentionMetadata, build_metadata, is_fp8, token_positions
from pagoda.attention.torch_backend import TorchAttentionBackend
from pagoda.attention.triton_backend import TritonAttentionBackend
from pagoda.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagoda.cpu import cpu_ops
from pagoda.distributed.parallel import TensorParallel
from pagoda.layers.linear_kernels import prepare_linear_layers
from pagoda.loader import load_model
from pagoda.lora.adapter import LoRAAdapter
from pagoda.lora.slots import LoRASlots
from pagoda.request import Request
from pagoda.worker.cuda_graphs import DecodeCudaGraphs
from pagoda.worker.kv_sizing import KVCacheShape, kv_cache_torch_dtype
from pagoda.worker.logits_processing import PenaltyCounts, SamplingRow
from pagoda.worker.sampler import Sampler, compute_prompt_logprobs
from pagoda.worker.step import ForwardStep, PreparedStep, StepLogits, lora_runs, plan_forward
from pagoda.worker.worker_config import WorkerConfig

logger = logging.getLogger(__name__)


class ModelRunner:
    """Owns one rank's model, its KV cache tensors, the attention backend, the sampler and the LoRA device slots.

    Every rank has one, over its shard of the model. The rank-0 runner also turns the scheduler's output into the
    step every rank runs (:meth:`prepare_step`) and samples from the logits (:meth:`sample`); :meth:`run_forward`
    is what every rank runs. Who sends the step to the other ranks is the executor's business, not the runner's.
    """

    def __init__(self, config: WorkerConfig, device: torch.device, tp: TensorParallel) -> None:
        assert config.lora is None or tp.world_size == 1, "adapters are not sharded across ranks"
        self.model_config = config.model_config
        self.tp = tp
        self.dtype = config.dtype
        self.device = device
        assert config.attention_backend in ("torch", "triton"), config.attention_backend
        self.attn_backend: AttentionBackend = (
            TritonAttentionBackend() if config.attention_backend == "triton" else TorchAttentionBackend()
        )
        self.cuda_graphs: Optional[DecodeCudaGraphs] = None
        self.kv_cache_dtype = config.kv_cache_dtype  # auto | fp8_e4m3 | fp8_e5m2
        self.model = load_model(
            config.model_path, self.attn_backend, self.dtype, device, self.model_config, tp, config.quantization
        )
        self.linear_kernels = prepare_linear_layers(self.model, device, self.dtype, config.quantization)
        self.lora: Optional[LoRASlots] = None
        if config.lora is not None:
            self.lora = LoRASlots(self.model, config.lora.max_loras, config.lora.max_rank, self.dtype, device)
        self.sampler = Sampler()
        if device.type == "cpu":
            # Build and load the native ops now, not in the first step that needs them (a grammar mask, say): the
            # build takes tens of seconds and importing torch's extension loader holds the GIL for ~0.3 s.
            cpu_ops()
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

    def allocate_kv_cache(self, shape: KVCacheShape, num_blocks: int) -> None:
        """Create every layer's cache once; zeroed so padded reads never see NaN garbage. On CPU, also time the two
        prefill-attention kernels for this model's head layout (see :mod:`pagoda.attention.choice`)."""
        if self.device.type == "cpu" and isinstance(self.attn_backend, TorchAttentionBackend):
            spec = self.model.model.layers[0].self_attn.attn.spec
            choose_prefill_attention(self.attn_backend, spec, self.dtype, cache_dtype=shape.dtype)
        self.kv_shape = shape
        self.kv_caches = [
            torch.zeros(shape.layer_shape(num_blocks), dtype=shape.dtype, device=self.device)
            for _ in range(shape.num_layers)
        ]

    def capture_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Capture the decode forward for the batch sizes up to ``max_num_seqs`` (after the KV cache exists)."""
        assert self.kv_caches, "allocate the KV cache before capturing"
        assert self.device.type == "cuda" and isinstance(self.attn_backend, TritonAttentionBackend)
        self.cuda_graphs = DecodeCudaGraphs(self.model, self.kv_caches, max_num_seqs, max_model_len)
        self.cuda_graphs.capture()

    # ---- one step: prepare (rank 0), run_forward (every rank), sample (rank 0) ----------------------------

    @torch.inference_mode()
    def prepare_step(self, plan: SchedulerOutput, adapters: Mapping[int, LoRAAdapter]) -> PreparedStep:
        """The step every rank runs, with the step's adapters in slots (``adapters``: the weights of those that no
        slot holds). :meth:`end_step` must follow, whether the forward ran or failed."""
        scheduled = plan.scheduled
        if self.lora is not None:  # each adapter's rows in one run
            scheduled = sorted(scheduled, key=lambda s: LoRASlots.slot_order(s.request.lora_id))
        prepared = plan_forward(plan.block_copies, scheduled)
        if self.lora is not None:
            self.lora.prepare_step(*lora_runs(scheduled, prepared), adapters)
        return prepared

    def end_step(self) -> None:
        if self.lora is not None:
            self.lora.clear_step()

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

    @torch.inference_mode()
    def sample(self, prepared: PreparedStep, logits: StepLogits) -> ModelRunnerOutput:
        """Rank 0: prompt logprobs of the step's spans, and a token for every sequence that reached its end."""
        out = ModelRunnerOutput()
        for (request, _, count), span_logits in zip(prepared.spans, logits.prompt):
            first = request.num_computed_tokens + 1  # the prompt token scored by the first row
            targets = request.prompt_token_ids[first : first + count]
            out.prompt_logprobs[request.request_id] = compute_prompt_logprobs(
                span_logits, targets, request.sampling_params.prompt_logprobs
            )
        if logits.sample is not None:
            self._sample(logits.sample, prepared.sample_requests, out)
        return out

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

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        output_rows: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] (or of ``output_rows``): a graph replay for a pure-decode step, else
        an eager forward. Pure decode samples every row, so graphs never see ``output_rows``."""
        with_adapters = self.lora is not None and self.lora.step_has_adapters  # graphs hold no adapter rows
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
