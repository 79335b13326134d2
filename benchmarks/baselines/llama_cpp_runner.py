"""llama.cpp runner (through llama-cpp-python's low-level API) for the CPU comparison; see protocol.py.

Runs inside the llama.cpp virtual environment, not Pagoda's:

    /work/baselines/llamacpp/bin/python benchmarks/baselines/llama_cpp_runner.py \
        --model DIR --workload W.json --out R.json [--threads N] [--quant bf16|q8_0|q4_0|q4_k_m] [--gguf FILE] \
        [--n-ctx N] [--flash-attn auto|on|off] [--omp-wait-policy passive|active|unset]

The Hugging Face checkpoint is converted once to ``DIR/ggml-model-<quant>.gguf`` by gguf_export.py (run
as a subprocess) and reused afterwards; Q4_0 and Q4_K_M are the BF16 GGUF run through llama.cpp's own quantizer. A batch of B prompts is decoded for real as a batch: one
context with ``n_seq_max = B`` and a unified KV cache, the prompts prefilled together, then one
``llama_decode`` per step carrying one token for each of the B sequences, greedy argmax over each
sequence's logits (EOS ignored). ``OMP_WAIT_POLICY`` is left as llama.cpp ships it (spinning threads): on a
quiet machine that is its fastest setting at batch 1 (22.0 vs 16.9 tok/s with PASSIVE, measured); on a
machine shared with other work, ``--omp-wait-policy passive`` keeps spinning threads from halving its speed.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import protocol  # noqa: E402

_FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


def add_options(parser: argparse.ArgumentParser) -> None:
    """llama.cpp-specific command-line options."""
    parser.add_argument("--quant", choices=["bf16", "q8_0", "q4_0", "q4_k_m"], default="bf16", help="GGUF weight type")
    parser.add_argument("--gguf", default=None, help="use this GGUF instead of the cached conversion")
    parser.add_argument("--n-ctx", type=int, default=None, help="KV cache size in tokens (default: from workload)")
    parser.add_argument("--flash-attn", choices=sorted(_FLASH_ATTN), default="auto")
    parser.add_argument(
        "--extra-bufts",
        choices=["on", "off"],
        default="on",
        help="llama.cpp's extra weight buffers (the AMX repack on AMX hosts); off: plain CPU buffers",
    )
    parser.add_argument(
        "--omp-wait-policy",
        choices=["passive", "active", "unset"],
        default="unset",
        help="OMP_WAIT_POLICY for llama.cpp's OpenMP threads (passive: idle threads sleep, not spin)",
    )


def ensure_gguf(model_dir: Path, quant: str) -> Path:
    """The cached GGUF next to the checkpoint, converted by gguf_export.py when missing."""
    path = model_dir / f"ggml-model-{quant}.gguf"
    if not path.exists():
        started = time.perf_counter()
        exporter = Path(__file__).with_name("gguf_export.py")
        subprocess.run([sys.executable, str(exporter), "--model", str(model_dir), "--quant", quant], check=True)
        protocol.progress(f"converted to {path.name} in {time.perf_counter() - started:.1f} s")
    return path


def workload_sizes(workload: dict) -> tuple[int, int, int]:
    """(KV tokens, tokens in one decode call, sequences) the workload needs at most."""
    cases = [([workload["prefill"]["prompt"]], 1)] if "prefill" in workload else []
    cases += [(case["prompts"], 1 + case["new_tokens"]) for case in workload.get("decode", [])]
    n_ctx = max(sum(len(p) + new for p in prompts) for prompts, new in cases)
    n_batch = max(sum(len(p) for p in prompts) for prompts, _ in cases)
    n_seq = max(len(prompts) for prompts, _ in cases)
    return -(-n_ctx // 256) * 256, max(n_batch, n_seq), n_seq


class BatchedGreedy:
    """One llama.cpp context decoding up to ``n_seq`` sequences together, greedily."""

    def __init__(
        self,
        gguf: Path,
        n_ctx: int,
        n_batch: int,
        n_seq: int,
        threads: int,
        flash_attn: int,
        extra_bufts: bool = True,
    ) -> None:
        """Load ``gguf`` and make a context for ``n_seq`` sequences sharing ``n_ctx`` KV slots."""
        import llama_cpp as ll

        self.ll = ll
        ll.llama_backend_init()
        model_params = ll.llama_model_default_params()
        # 0.3.36's AMX repack segfaults in the first decode of Q4_0 / Q4_K_M models on an AMX Xeon host (seen with a
        # tiny dense Qwen3 and with Qwen3-MoE); BF16 there ran, as did Q4 on the Zen 4 hosts (no AMX).
        model_params.use_extra_bufts = extra_bufts
        self.model = ll.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        params = ll.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_batch, min(n_batch, 512)
        params.n_seq_max, params.kv_unified = n_seq, True
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = flash_attn
        params.no_perf = True
        self.ctx = ll.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.batch = ll.llama_batch_init(n_batch, 0, 1)

    def reset(self) -> None:
        """Forget every sequence's KV cache."""
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One ``llama_decode`` over (token, position, sequence, wants logits) entries."""
        batch = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        status = self.ll.llama_decode(self.ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def argmax(self, index: int) -> int:
        """Greedy token from the logits of batch entry ``index`` of the last decode."""
        row = self.ll.llama_get_logits_ith(self.ctx, index)
        return int(np.ctypeslib.as_array(ctypes.cast(row, ctypes.POINTER(ctypes.c_float)), (self.n_vocab,)).argmax())

    def prefill(self, prompts: list[list[int]]) -> list[int]:
        """Prefill every prompt (chunked to ``n_batch`` tokens a call); return each one's first token."""
        entries = [(t, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        firsts: list[int] = []
        for start in range(0, len(entries), self.n_batch):
            chunk = entries[start : start + self.n_batch]
            self.decode(chunk)
            firsts += [self.argmax(i) for i, entry in enumerate(chunk) if entry[3]]
        return firsts

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedily generate exactly ``max_tokens`` tokens for every prompt, all sequences per step."""
        self.reset()
        outputs = [[token] for token in self.prefill(prompts)]
        for step in range(1, max_tokens):
            self.decode([(out[-1], len(p) + step - 1, seq, True) for seq, (p, out) in enumerate(zip(prompts, outputs))])
            for seq, out in enumerate(outputs):
                out.append(self.argmax(seq))
        return outputs

    def close(self) -> None:
        """Free the batch, the context and the model."""
        self.ll.llama_batch_free(self.batch)
        self.ll.llama_free(self.ctx)
        self.ll.llama_model_free(self.model)


def build(args: argparse.Namespace, workload: dict) -> BatchedGreedy:
    """Convert (if needed) and load the model sized for ``workload``."""
    gguf = Path(args.gguf) if args.gguf else ensure_gguf(Path(args.model), args.quant)
    n_ctx, n_batch, n_seq = workload_sizes(workload)
    threads = args.threads or os.cpu_count() or 1
    started = time.perf_counter()
    flash_attn, extra_bufts = _FLASH_ATTN[args.flash_attn], args.extra_bufts == "on"
    engine = BatchedGreedy(gguf, args.n_ctx or n_ctx, n_batch, n_seq, threads, flash_attn, extra_bufts)
    protocol.progress(f"llama.cpp loaded {gguf.name} in {time.perf_counter() - started:.1f} s (n_ctx {n_ctx})")
    return engine


def main() -> None:
    """Run the workload through llama.cpp and write the result JSON."""
    args = protocol.parse_args(add_options)
    if args.omp_wait_policy != "unset":  # must be set before libgomp is loaded with llama_cpp
        os.environ.setdefault("OMP_WAIT_POLICY", args.omp_wait_policy.upper())
    import llama_cpp

    workload = protocol.load_workload(args.workload)
    engine = build(args, workload)
    measured = protocol.measure(engine.generate, workload)
    system_info = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    protocol.write_result(
        args.out,
        "llama.cpp",
        llama_cpp.__version__,
        measured,
        quant=args.quant,
        threads=args.threads or os.cpu_count(),
        flash_attn=args.flash_attn,
        extra_bufts=args.extra_bufts,
        omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "unset"),
        system_info=system_info,
    )
    engine.close()


if __name__ == "__main__":
    main()
