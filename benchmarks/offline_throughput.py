"""Offline throughput of Pagoda against transformers ``generate``, in one run on one machine.

For each model (the built-in stories260K, and a Qwen3-0.6B-shaped random-weight bf16 checkpoint
this script builds once): Pagoda's throughput and time to first token over the whole workload,
transformers sequential and padded static batches, the prefix cache's effect on time to first
token with a long shared prefix, and KV waste under the throughput load. Prints one table and
writes the same numbers as JSON. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402 (the benchmarks folder is not a package)
    BaselineResult,
    Workload,
    ensure_qwen3_shape_checkpoint,
    format_table,
    hf_sequential,
    hf_static_batches,
    load_hf_model,
    log,
    machine_facts,
    machine_rows,
    make_workload,
    mean,
    percentile,
    random_tokens,
    report_rows,
)
from pagoda import LLM, LLMEngine, RequestOutput, SamplingParams  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
PREFIX_LEN = 2000  # the shared prefix the issue asks for; less where the model has fewer positions
PREFIX_SUFFIX_LEN = 16
PREFIX_OUTPUT_LEN = 8
WARMUP_PROMPTS = 4


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One benchmarked model and its default workload."""

    key: str
    label: str
    path: Optional[Path]  # None: the engine's built-in model
    dtype: torch.dtype  # used by both Pagoda and transformers
    vocab_size: int
    prompt_range: tuple[int, int]
    output_range: tuple[int, int]
    sequential_prompts: int  # default size of the transformers sequential subset
    static_prompts: Optional[int]  # default size of the static-batch subset (None: all)
    prefix_len: int  # shared prefix of the prefix-cache measurement (the model's positions bound it)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def model_arg(self) -> Optional[str]:
        return None if self.path is None else str(self.path)

    def model_dir(self) -> Path:
        from pagoda.config import builtin_model_path

        return builtin_model_path() if self.path is None else self.path


def model_specs(bench_dir: Path) -> dict[str, ModelSpec]:
    """The two models of the issue, keyed by their ``--models`` name."""
    stories = ModelSpec(
        key="stories",
        label="stories260K (fp32)",
        path=None,
        dtype=torch.float32,
        vocab_size=512,
        prompt_range=(16, 64),
        output_range=(64, 128),
        sequential_prompts=64,
        static_prompts=None,
        prefix_len=400,  # stories260K has 512 positions
    )
    qwen3 = ModelSpec(
        key="qwen3",
        label="Qwen3-0.6B shape, random bf16",
        path=bench_dir / "qwen3-0.6b-shape",
        dtype=torch.bfloat16,
        vocab_size=151936,
        prompt_range=(32, 128),
        output_range=(32, 32),
        sequential_prompts=16,
        static_prompts=64,
        prefix_len=PREFIX_LEN,
    )
    return {"stories": stories, "qwen3": qwen3}


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding of exactly ``max_tokens`` tokens (EOS ignored)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- Pagoda phases --------------------------------------------------------------------------


class KVWasteSampler:
    """Reads ``kv_slot_usage()`` after every engine step, keeping the time it takes apart.

    Installed over ``engine.step`` for the timed run, so the waste is measured under exactly that
    load (``LLM.generate`` is an ``add_request`` + ``step`` loop) and its own cost is subtracted
    from the run's time.
    """

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds = 0.0
        self.steps = 0
        self.allocated_sum = self.used_sum = self.running_sum = 0
        self.worst = self.peak_usage = 0.0

    def __enter__(self) -> KVWasteSampler:
        step = self.engine.step

        def sampled_step() -> list[RequestOutput]:
            outputs = step()
            self.sample()
            return outputs

        self.engine.step = sampled_step  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc_info: object) -> None:
        del self.engine.step

    def sample(self) -> None:
        start = time.perf_counter()
        allocated, used = self.engine.kv_slot_usage()
        stats = self.engine.get_stats()
        self.peak_usage = max(self.peak_usage, stats.kv_cache_usage)
        if allocated:
            self.steps += 1
            self.allocated_sum += allocated
            self.used_sum += used
            self.running_sum += stats.num_running
            self.worst = max(self.worst, 1 - used / allocated)
        self.seconds += time.perf_counter() - start

    def result(self) -> dict:
        tokens_per_seq = self.used_sum / self.running_sum
        return {
            "steps": self.steps,
            "waste_mean": 1 - self.used_sum / self.allocated_sum,
            "waste_max": self.worst,
            "mean_tokens_per_running_seq": tokens_per_seq,
            "waste_bound": (self.engine.get_stats().block_size - 1) / tokens_per_seq,
            "peak_kv_pool_usage": self.peak_usage,
            "sampling_seconds": self.seconds,
        }


def pagoda_throughput(llm: LLM, spec: ModelSpec, workload: Workload, seed: int) -> tuple[dict, list[list[int]]]:
    """All prompts through one ``LLM.generate`` call, after an untimed warm-up on other prompts;
    KV waste is sampled after every step of it."""
    warmup = make_workload(seed + 1, WARMUP_PROMPTS, spec.prompt_range, (4, 4), spec.vocab_size)
    llm.generate(warmup.prompts, greedy(4), use_tqdm=False)
    before = llm.engine.get_stats()
    params = [greedy(n) for n in workload.output_lens]
    with KVWasteSampler(llm.engine) as sampler:
        start = time.perf_counter()
        outputs = llm.generate(workload.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start - sampler.seconds
    after = llm.engine.get_stats()
    token_ids = [o.outputs[0].token_ids for o in outputs]
    assert [len(t) for t in token_ids] == workload.output_lens, "Pagoda generated the wrong number of tokens"
    # Sampling happens after a step's outputs carry their timestamps, so it delays later tokens:
    # TTFT includes it (it is small next to a step; see kv_waste.sampling_seconds).
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    result = {
        "seconds": seconds,
        "output_tokens": workload.num_output_tokens,
        "prompt_tokens": workload.num_prompt_tokens,
        "output_tokens_per_s": workload.num_output_tokens / seconds,
        "total_tokens_per_s": (workload.num_output_tokens + workload.num_prompt_tokens) / seconds,
        "ttft_mean_s": mean(ttft),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "preemptions": after.num_preemptions - before.num_preemptions,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "num_blocks": after.num_blocks,
        "block_size": after.block_size,
        "kv_waste": sampler.result(),
    }
    return result, token_ids


def prefix_cache_effect(spec: ModelSpec, num_requests: int, seed: int) -> dict:
    """TTFT of requests sharing a long prefix, each sent after the previous one finished,
    with the prefix cache off and on."""
    prefix = random_tokens(seed + 2, spec.prefix_len, spec.vocab_size)
    prompts = [prefix + random_tokens(seed + 100 + i, PREFIX_SUFFIX_LEN, spec.vocab_size) for i in range(num_requests)]
    max_model_len = spec.prefix_len + PREFIX_SUFFIX_LEN + PREFIX_OUTPUT_LEN
    result: dict = {
        "prefix_len": spec.prefix_len,
        "suffix_len": PREFIX_SUFFIX_LEN,
        "output_len": PREFIX_OUTPUT_LEN,
        "requests": num_requests,
        "capped": spec.prefix_len < PREFIX_LEN,
    }
    for caching in (False, True):
        name = "on" if caching else "off"
        log(f"  prefix cache {name}: {num_requests} requests of {spec.prefix_len}+{PREFIX_SUFFIX_LEN} tokens")
        llm = LLM(
            model=spec.model_arg,
            dtype=spec.dtype_name,
            max_model_len=max_model_len,
            max_num_seqs=4,  # one request at a time; keeps the default KV cache small
            enable_prefix_caching=caching,
        )
        llm.generate(random_tokens(seed + 3, 32, spec.vocab_size), greedy(2), use_tqdm=False)  # warm-up
        result["max_positions"] = llm.engine.model_config.max_position_embeddings
        before = llm.engine.get_stats()
        ttft, cached = [], []
        for prompt in prompts:
            (out,) = llm.generate([prompt], greedy(PREFIX_OUTPUT_LEN), use_tqdm=False)
            ttft.append(out.metrics.first_token_time - out.metrics.arrival_time)
            cached.append(out.num_cached_tokens)
        after = llm.engine.get_stats()
        result[name] = {
            "ttft_first_s": ttft[0],
            "ttft_rest_mean_s": mean(ttft[1:]),
            "cached_tokens_rest_mean": mean(cached[1:]),
            "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
            "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        }
        del llm
        gc.collect()
    result["ttft_speedup"] = result["off"]["ttft_rest_mean_s"] / result["on"]["ttft_rest_mean_s"]
    return result


# ---- per model ------------------------------------------------------------------------------


def run_model(spec: ModelSpec, args: argparse.Namespace) -> dict:
    output_range = (args.output_len, args.output_len) if args.output_len else spec.output_range
    workload = make_workload(args.seed, args.num_prompts, spec.prompt_range, output_range, spec.vocab_size)
    result: dict = {
        "label": spec.label,
        "dtype": spec.dtype_name,
        "workload": {
            "prompts": args.num_prompts,
            "prompt_len_range": spec.prompt_range,
            "output_len_range": output_range,
            "prompt_tokens": workload.num_prompt_tokens,
            "output_tokens": workload.num_output_tokens,
        },
    }
    log(f"[{spec.key}] Pagoda: {args.num_prompts} prompts through LLM.generate")
    llm = LLM(
        model=spec.model_arg,
        dtype=spec.dtype_name,
        max_model_len=spec.prompt_range[1] + output_range[1],
        kv_cache_memory=args.kv_cache_memory,
    )
    result["engine"] = {
        "max_num_seqs": llm.engine.scheduler.config.max_num_seqs,
        "max_num_batched_tokens": llm.engine.scheduler.config.max_num_batched_tokens,
    }
    result["pagoda"], pagoda_tokens = pagoda_throughput(llm, spec, workload, args.seed)
    result["kv_waste"] = result["pagoda"].pop("kv_waste")
    log(f"[{spec.key}]   {result['pagoda']['output_tokens_per_s']:.1f} output tok/s")
    del llm
    gc.collect()
    if args.prefix_requests > 1:
        log(f"[{spec.key}] prefix cache effect on TTFT")
        result["prefix_cache"] = prefix_cache_effect(spec, args.prefix_requests, args.seed)
    if not args.skip_transformers:
        result.update(transformers_baselines(spec, workload, pagoda_tokens, args))
    return result


def transformers_baselines(
    spec: ModelSpec, workload: Workload, pagoda_tokens: list[list[int]], args: argparse.Namespace
) -> dict:
    model = load_hf_model(spec.model_dir(), spec.dtype)
    sequential_count = min(args.sequential_prompts or spec.sequential_prompts, len(workload.prompts))
    log(f"[{spec.key}] transformers sequential: {sequential_count} prompts, one at a time")
    seq = hf_sequential(model, workload.head(sequential_count))
    same = sum(a == b for a, b in zip(seq.outputs, pagoda_tokens))
    same_first = sum(a[:1] == b[:1] for a, b in zip(seq.outputs, pagoda_tokens))
    static_count = min(args.static_prompts or spec.static_prompts or len(workload.prompts), len(workload.prompts))
    log(f"[{spec.key}] transformers static batches of {args.hf_batch_size}: {static_count} prompts")
    static = hf_static_batches(model, workload.head(static_count), args.hf_batch_size)
    del model
    gc.collect()
    return {
        "hf_sequential": _baseline_dict(seq),
        "hf_static": {**_baseline_dict(static), "batch_size": args.hf_batch_size},
        "greedy_agreement": {"prompts": sequential_count, "identical": same, "same_first_token": same_first},
    }


def _baseline_dict(result: BaselineResult) -> dict:
    return {
        "prompts": result.num_prompts,
        "seconds": result.seconds,
        "output_tokens": result.output_tokens,
        "generated_tokens": result.generated_tokens,
        "output_tokens_per_s": result.output_tokens_per_s,
    }


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="stories,qwen3", help="comma-separated: stories, qwen3")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, help="fixed output length for every model (default: per model)")
    parser.add_argument("--skip-transformers", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--sequential-prompts", type=int, help="transformers sequential subset (default 64 / 16)")
    parser.add_argument("--static-prompts", type=int, help="transformers static-batch subset (default all / 64)")
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument("--prefix-requests", type=int, default=8, help="requests sharing the prefix (<2 skips)")
    parser.add_argument("--kv-cache-memory", help="Pagoda's KV budget, e.g. 4GiB (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bench-dir", type=Path, default=REPO_ROOT / ".bench", help="checkpoint and JSON folder")
    args = parser.parse_args(argv)
    args.model_keys = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(args.model_keys) - {"stories", "qwen3"}
    if unknown or not args.model_keys:
        parser.error(f"--models takes stories and/or qwen3, got {args.models!r}")
    if args.num_prompts < 1 or args.hf_batch_size < 1:
        parser.error("--num-prompts and --hf-batch-size must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    facts = machine_facts()
    specs = model_specs(args.bench_dir)
    if "qwen3" in args.model_keys:
        ensure_qwen3_shape_checkpoint(specs["qwen3"].path)
    results = {}
    for key in args.model_keys:
        results[key] = run_model(specs[key], args)
    facts["load_avg_1m_end"] = round(os.getloadavg()[0], 2)
    rows: list[tuple[str, ...]] = machine_rows(facts)
    for key, r in results.items():
        rows += [("", "", "", ""), *report_rows(key, r)]
    print(format_table(("model", "measurement", "value", "detail"), rows))
    args.bench_dir.mkdir(parents=True, exist_ok=True)
    out_path = args.bench_dir / "offline_throughput.json"
    settings = {k: v for k, v in vars(args).items() if k != "bench_dir"}
    out_path.write_text(json.dumps({"machine": facts, "settings": settings, "models": results}, indent=2))
    log(f"wrote {out_path}")


if __name__ == "__main__":
    main()
