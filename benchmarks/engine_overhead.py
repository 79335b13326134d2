"""Where an engine step's time goes at 64 running (decoding) requests.

Times every phase of ``LLMEngine.step`` on the real engine: scheduling, input preparation
(tensors, block tables, slot mapping, attention metadata), the model forward, logits, sampling,
the scheduler's bookkeeping and detokenization. "Engine overhead" is everything that is not the
model forward, the logits GEMM or the sampler; the CPU-performance issue wants it below 5% of a
step. Only steps where all requests decode are counted.

    python benchmarks/engine_overhead.py                    # stories260K and the Qwen3-0.6B shape
    python benchmarks/engine_overhead.py --models stories --steps 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import FIRST_PLAIN_TOKEN_ID, ensure_qwen3_shape_checkpoint, format_table, log  # noqa: E402

MODEL_PHASES = ("forward", "logits", "sample")  # the model's own work; the rest is engine overhead


class PhaseTimer:
    """Accumulates wall time per phase for the current step."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, obj: Any, attr: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.current[phase] += time.perf_counter() - start

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        phases, self.current = dict(self.current), defaultdict(float)
        return phases


def instrument(engine: Any, timer: PhaseTimer) -> None:
    runner = engine.executor.driver_worker.model_runner
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.scheduler, "update_from_output", "scheduler update")
    timer.wrap(engine.output_processor, "detokenize", "detokenize")
    timer.wrap(engine.output_processor, "make_outputs", "make outputs")
    timer.wrap(runner, "prepare_step", "plan step")
    timer.wrap(runner, "_step_tensors", "step tensors")
    timer.wrap(runner.attn_backend, "prepare", "attention metadata")
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner.model, "compute_logits", "logits")
    timer.wrap(runner, "sampler", "sample")


def measure(model: Optional[str], dtype: str, batch: int, steps: int, quantization: Optional[str]) -> dict:
    from pagoda import EngineArgs, SamplingParams
    from pagoda.engine.llm_engine import LLMEngine

    engine = LLMEngine(
        EngineArgs(model=model, dtype=dtype, max_num_seqs=batch, enable_prefix_caching=False, quantization=quantization)
    )
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [FIRST_PLAIN_TOKEN_ID + (i * 7919 + j * 104729) % (vocab - FIRST_PLAIN_TOKEN_ID) for j in range(32)]
        engine.add_request(f"r{i}", prompt, params)
    timer = PhaseTimer()
    instrument(engine, timer)
    samples: list[dict[str, float]] = []
    while engine.has_unfinished_requests() and len(samples) < steps:
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        phases = timer.take()
        if engine.last_step_num_tokens == batch and engine.get_stats().num_running == batch:  # all decoding
            samples.append({"step": total, **phases})
    assert samples, "no pure-decode steps were measured"
    return {name: statistics.median(s.get(name, 0.0) for s in samples) for name in samples[0]} | {
        "num_steps": len(samples)
    }


def rows_for(name: str, result: dict) -> list[tuple[str, ...]]:
    step = result["step"]
    overhead = step - sum(result.get(p, 0.0) for p in MODEL_PHASES)
    rows = [(name, "step (median)", f"{step * 1e3:.2f}", "100.0%")]
    for phase, seconds in result.items():
        if phase in ("step", "num_steps"):
            continue
        rows.append(("", phase, f"{seconds * 1e3:.2f}", f"{seconds / step * 100:.1f}%"))
    rows.append(("", "ENGINE OVERHEAD (step - forward - logits - sample)", f"{overhead * 1e3:.2f}", ""))
    rows[-1] = (*rows[-1][:3], f"{overhead / step * 100:.1f}%")
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="stories,qwen3", help="comma-separated: stories, qwen3")
    parser.add_argument("--batch", type=int, default=64, help="running requests")
    parser.add_argument("--steps", type=int, default=40, help="pure-decode steps to time")
    parser.add_argument("--quantization", default=None, choices=["int8"])
    args = parser.parse_args(argv)
    rows: list[tuple[str, ...]] = []
    for key in args.models.split(","):
        if key == "stories":
            model, dtype = None, "float32"
        else:
            model, dtype = str(ensure_qwen3_shape_checkpoint()), "bfloat16"
        log(f"{key}: {args.batch} requests, {args.steps} decode steps")
        result = measure(model, dtype, args.batch, args.steps, args.quantization)
        rows += rows_for(f"{key} ({dtype}, {result['num_steps']} steps)", result)
        rows.append(("", "", "", ""))
    print(format_table(("model", "phase", "ms", "of step"), rows[:-1]))


if __name__ == "__main__":
    main()
