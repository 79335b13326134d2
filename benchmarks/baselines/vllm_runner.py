"""vLLM (CPU build) runner for the CPU comparison; see protocol.py for the measurement protocol.

Runs inside the vLLM virtual environment, not Pagoda's:

    /work/baselines/vllm/bin/python benchmarks/baselines/vllm_runner.py \
        --model DIR --workload W.json --out R.json [--threads N] [--kv-cache-gib 4] [--max-model-len 2048] \
        [--no-eager] [--multiprocessing]

Prompts go in as token ids (``TokensPrompt``), the tokenizer is not initialised, and sampling is
greedy with ``ignore_eos`` and ``min_tokens == max_tokens`` so every request makes exactly
``max_tokens`` tokens. The CPU backend's OpenMP threads are pinned to cores ``0..threads-1`` with no
core reserved for the front end: on a 2-core machine reserving one would halve the compute. The
engine core runs in-process by default (no busy front-end process competing for the 2 cores), and the
runner re-executes itself with vLLM's recommended ``LD_PRELOAD`` (the venv's Intel OpenMP
``libiomp5.so``, plus ``libtcmalloc_minimal.so.4`` when the system has it) unless ``--no-preload``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import protocol  # noqa: E402


def add_options(parser: argparse.ArgumentParser) -> None:
    """vLLM-specific command-line options."""
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (whole GiB)")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--no-eager", action="store_true", help="allow torch.compile / graph capture")
    parser.add_argument(
        "--no-preload", action="store_true", help="do not LD_PRELOAD the venv's libiomp5 / system tcmalloc"
    )
    parser.add_argument(
        "--multiprocessing",
        action="store_true",
        help="run the engine core in its own process (vLLM's default); off: in-process, less CPU contention",
    )


def preload_libraries(args: argparse.Namespace) -> list[str]:
    """Re-exec with vLLM's recommended LD_PRELOAD (Intel OpenMP from the venv, tcmalloc if installed).

    Returns the preloaded libraries (after the re-exec, or at once when nothing needs changing)."""
    preloaded = [lib for lib in os.environ.get("LD_PRELOAD", "").split(":") if lib]
    if args.no_preload or os.environ.get("_VLLM_RUNNER_PRELOADED"):
        return preloaded
    candidates = [
        Path(sys.prefix) / "lib" / "libiomp5.so",
        Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
    ]
    wanted = [str(lib) for lib in candidates if lib.exists() and str(lib) not in preloaded]
    if not wanted:
        return preloaded
    os.environ["LD_PRELOAD"] = ":".join(preloaded + wanted)
    os.environ["_VLLM_RUNNER_PRELOADED"] = "1"
    os.execv(sys.executable, [sys.executable, *sys.argv])
    return []  # not reached


def configure_environment(args: argparse.Namespace) -> int:
    """Set vLLM's CPU-backend environment before vllm is imported; returns the thread count."""
    threads = args.threads or os.cpu_count() or 1
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if args.multiprocessing else "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return threads


def build_generate(args: argparse.Namespace) -> tuple[protocol.GenerateFn, str]:
    """Load the model into a ``vllm.LLM``; return the protocol's ``generate`` and vLLM's version."""
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        enforce_eager=not args.no_eager,
        seed=0,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,  # prompts repeat across timed runs: measure real prefill every time
    )
    protocol.progress(f"vLLM {vllm.__version__} loaded {args.model} in {time.perf_counter() - started:.1f} s")

    def generate(prompts: list[list[int]], max_tokens: int) -> None:
        """One batch through ``llm.generate``: greedy, exactly ``max_tokens`` tokens per prompt."""
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, detokenize=False
        )
        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        outputs = llm.generate(requests, params, use_tqdm=False)
        for output in outputs:
            produced = len(output.outputs[0].token_ids)
            if produced != max_tokens:
                raise RuntimeError(f"vLLM produced {produced} tokens, expected {max_tokens}")

    return generate, vllm.__version__


def main() -> None:
    """Run the workload through vLLM and write the result JSON."""
    args = protocol.parse_args(add_options)
    preloaded = preload_libraries(args)
    threads = configure_environment(args)
    workload = protocol.load_workload(args.workload)
    generate, version = build_generate(args)
    measured = protocol.measure(generate, workload)
    protocol.write_result(
        args.out,
        "vllm",
        version,
        measured,
        threads=threads,
        enforce_eager=not args.no_eager,
        kv_cache_gib=args.kv_cache_gib,
        multiprocessing=args.multiprocessing,
        ld_preload=preloaded,
    )


if __name__ == "__main__":
    main()
