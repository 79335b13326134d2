"""Shared pieces of the offline benchmarks: workloads, the Qwen3-shaped checkpoint, the
transformers baselines, machine facts, and the rows of the final table."""

from __future__ import annotations

import json
import os
import platform
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

_START = time.monotonic()

REPO_ROOT = Path(__file__).resolve().parent.parent
# Checkpoints, logs and JSON results of the benchmarks (git ignores it).
BENCH_DIR = REPO_ROOT / ".bench"
# The Qwen3-shaped checkpoint every benchmark that runs it shares (built once).
QWEN3_SHAPE_NAME = "qwen3-0.6b-shape"  # the folder of the Qwen3-0.6B-shaped checkpoint under a bench dir
QWEN3_SHAPE_DIR = BENCH_DIR / QWEN3_SHAPE_NAME

# Real Qwen3-0.6B dimensions: config.json fields for transformers' Qwen3Config; only the weights are random.
QWEN3_SHAPE: dict = json.loads((Path(__file__).resolve().parent / "qwen3_shape.json").read_text())
# Token ids below this are special in the synthetic tokenizer; prompts never use them.
FIRST_PLAIN_TOKEN_ID = 3


def log(message: str) -> None:
    """Progress line on stderr, prefixed with the seconds since the benchmark started."""
    print(f"[{time.monotonic() - _START:7.1f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts and how many tokens each one must generate (EOS ignored)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, count: int) -> Workload:
        return Workload(self.prompts[:count], self.output_lens[:count])


def make_workload(
    seed: int, num_prompts: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab_size: int
) -> Workload:
    """Uniformly random prompt lengths, output lengths and token ids (all ranges inclusive)."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(rng.randint(*prompt_range))]
        for _ in range(num_prompts)
    ]
    output_lens = [rng.randint(*output_range) for _ in range(num_prompts)]
    return Workload(prompts, output_lens)


def random_tokens(seed: int, count: int, vocab_size: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_PLAIN_TOKEN_ID, vocab_size) for _ in range(count)]


# ---- the Qwen3-shaped checkpoint ------------------------------------------------------------


def ensure_qwen3_shape_checkpoint(model_dir: Path = QWEN3_SHAPE_DIR, shape: Optional[dict] = None) -> Path:
    """Build (once) a bf16 checkpoint with Qwen3-0.6B's shapes (or ``shape``) and random weights in ``model_dir``."""
    if (model_dir / "config.json").is_file() and (model_dir / "tokenizer.json").is_file():
        log(f"reusing the Qwen3-shaped checkpoint in {model_dir}")
        return model_dir
    from transformers import Qwen3Config, Qwen3ForCausalLM

    log(f"building a Qwen3-shaped random-weight checkpoint in {model_dir} (once)")
    config = Qwen3Config(**(shape or QWEN3_SHAPE))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(config, dtype=torch.bfloat16)  # init: normal(std=0.02)
    # Written aside and renamed, so an interrupted build is never mistaken for a finished one.
    partial = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model.save_pretrained(partial, safe_serialization=True)
    _save_word_tokenizer(partial, config.vocab_size)
    shutil.rmtree(model_dir, ignore_errors=True)
    partial.rename(model_dir)
    log(f"checkpoint written ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters)")
    return model_dir


def _save_word_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """A word-level tokenizer covering every id, so the engine's detokenizer does real work for
    every generated token (the Qwen tokenizer itself cannot be downloaded here)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {token: i for i, token in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<unk>"
    )
    tokenizer.save_pretrained(model_dir)


# ---- transformers baselines -----------------------------------------------------------------


@dataclass(slots=True)
class BaselineResult:
    """One transformers run: useful output tokens (the ones requested) over wall time."""

    num_prompts: int
    output_tokens: int
    generated_tokens: int  # including what padded static batches generate beyond a request's length
    seconds: float
    outputs: list[list[int]]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def load_hf_model(model_dir: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy generation of exactly ``max_new_tokens`` per prompt; left padding for a batch."""
    width = max(len(p) for p in prompts)
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        # Like ignore_eos: EOS neither stops generation nor is masked. (min_new_tokens would mask
        # it, and stories260K counts BOS as an EOS, which random prompts often make the argmax.)
        eos_token_id=None,
        do_sample=False,
        pad_token_id=0,
    )
    assert out.shape[1] == width + max_new_tokens, "transformers stopped before max_new_tokens"
    return out[:, width:].tolist()


def hf_sequential(model, workload: Workload) -> BaselineResult:
    """One request at a time, each generating exactly its own output length."""
    hf_generate(model, workload.prompts[:1], 4)  # warm-up
    outputs = []
    start = time.perf_counter()
    for prompt, output_len in zip(workload.prompts, workload.output_lens):
        outputs.extend(hf_generate(model, [prompt], output_len))
    seconds = time.perf_counter() - start
    n = workload.num_output_tokens
    return BaselineResult(len(workload.prompts), n, n, seconds, outputs)


def hf_static_batches(model, workload: Workload, batch_size: int) -> BaselineResult:
    """Fixed batches in arrival order; each batch runs until its longest request is done."""
    hf_generate(model, workload.prompts[:2], 4)  # warm-up
    outputs: list[list[int]] = []
    generated = 0
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lens = workload.output_lens[first : first + batch_size]
        batch_out = hf_generate(model, prompts, max(lens))
        outputs.extend(row[:n] for row, n in zip(batch_out, lens))
        generated += max(lens) * len(prompts)
    seconds = time.perf_counter() - start
    return BaselineResult(len(workload.prompts), workload.num_output_tokens, generated, seconds, outputs)


# ---- reporting ------------------------------------------------------------------------------


def machine_facts() -> dict[str, object]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[min(int(rank), len(ordered)) - 1]


def mean(values: list[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def format_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Plain aligned columns; a row of empty strings becomes a separator line."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    rule = "  ".join("-" * w for w in widths)

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()

    body = [rule if not any(r) else line(r) for r in rows]
    return "\n".join([line(header), rule, *body])


# ---- table rows from the results dict -----------------------------------------------------


def report_rows(key: str, r: dict) -> list[tuple[str, ...]]:
    """The table rows of one model's results."""
    w, p = r["workload"], r["pagoda"]
    lo, hi = w["prompt_len_range"]
    olo, ohi = w["output_len_range"]
    outputs = str(olo) if olo == ohi else f"{olo}-{ohi}"
    rows = [
        (key, "model", r["label"], f"dtype {r['dtype']}"),
        (key, "workload", f"{w['prompts']} prompts", f"prompt {lo}-{hi} tok, output {outputs} tok, ignore_eos"),
        (key, "engine", f"{p['num_blocks']} KV blocks", _engine_detail(r)),
        (
            key,
            "Pagoda output tok/s",
            f"{p['output_tokens_per_s']:.1f}",
            f"{p['output_tokens']} tok in {p['seconds']:.1f} s",
        ),
        (key, "Pagoda total tok/s", f"{p['total_tokens_per_s']:.1f}", f"+ {p['prompt_tokens']} prompt tok"),
        (
            key,
            "Pagoda TTFT mean/p50/p99",
            _secs(p["ttft_mean_s"], p["ttft_p50_s"], p["ttft_p99_s"]),
            "all submitted at t=0",
        ),
        (key, "Pagoda preemptions", str(p["preemptions"]), ""),
        (key, "Pagoda prefix-cache hits", f"{p['prefix_cache_hits']} tok", f"of {p['prefix_cache_queries']} looked up"),
    ]
    if "hf_sequential" in r:
        rows += _baseline_rows(key, r)
    if "prefix_cache" in r:
        rows += _prefix_rows(key, r["prefix_cache"])
    if "kv_waste" in r:
        k = r["kv_waste"]
        rows += [
            (
                key,
                "KV waste mean",
                f"{k['waste_mean']:.1%}",
                f"1 - used/allocated slots, after each of {k['steps']} steps of the timed run",
            ),
            (key, "KV waste max", f"{k['waste_max']:.1%}", "worst single step"),
            (
                key,
                "KV waste bound",
                f"{k['waste_bound']:.1%}",
                f"(block_size-1) / {k['mean_tokens_per_running_seq']:.0f} mean tok per running seq",
            ),
            (key, "KV pool peak usage", f"{k['peak_kv_pool_usage']:.1%}", "of all blocks"),
        ]
    return rows


def _engine_detail(r: dict) -> str:
    e, p = r["engine"], r["pagoda"]
    return f"block {p['block_size']}, max_num_seqs {e['max_num_seqs']}, batched tokens {e['max_num_batched_tokens']}"


def _secs(*values: float) -> str:
    return " / ".join(f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.2f} s" for v in values)


def _baseline_rows(key: str, r: dict) -> list[tuple[str, ...]]:
    p, seq, static, agree = r["pagoda"], r["hf_sequential"], r["hf_static"], r["greedy_agreement"]
    pad_note = f"{static['generated_tokens']} generated incl. padding to batch max"
    return [
        (key, "HF sequential tok/s", f"{seq['output_tokens_per_s']:.1f}", f"subset: first {seq['prompts']} prompts"),
        (key, "  Pagoda / HF sequential", f"{p['output_tokens_per_s'] / seq['output_tokens_per_s']:.1f}x", ""),
        (
            key,
            f"HF static batch {static['batch_size']} tok/s",
            f"{static['output_tokens_per_s']:.1f}",
            f"{static['prompts']} prompts, left-padded; {pad_note}",
        ),
        (key, "  Pagoda / HF static", f"{p['output_tokens_per_s'] / static['output_tokens_per_s']:.1f}x", ""),
        (
            key,
            "greedy match vs HF",
            f"{agree['identical']}/{agree['prompts']} identical",
            f"{agree['same_first_token']}/{agree['prompts']} same first token (sequential subset)",
        ),
    ]


def _prefix_rows(key: str, c: dict) -> list[tuple[str, ...]]:
    shape = f"{c['prefix_len']}-tok shared prefix + {c['suffix_len']}-tok suffix, one at a time"
    if c["capped"]:
        shape += f" (prefix capped: model has {c['max_positions']} positions)"
    on, off = c["on"], c["off"]
    rate = on["prefix_cache_hits"] / max(on["prefix_cache_queries"], 1)
    return [
        (key, "prefix: TTFT req 2..N, cache off", _secs(off["ttft_rest_mean_s"]), f"{c['requests']} requests, {shape}"),
        (
            key,
            "prefix: TTFT req 2..N, cache on",
            _secs(on["ttft_rest_mean_s"]),
            f"first (cold) request {_secs(on['ttft_first_s'])}",
        ),
        (key, "  cache off / on", f"{c['ttft_speedup']:.1f}x", ""),
        (
            key,
            "prefix: cache hits",
            f"{on['prefix_cache_hits']}/{on['prefix_cache_queries']} tok",
            f"{rate:.0%} of looked-up tokens; {on['cached_tokens_rest_mean']:.0f} cached per later request",
        ),
    ]


def machine_rows(facts: dict) -> list[tuple[str, ...]]:
    load = f"1-min load avg {facts['load_avg_1m_start']} at start, {facts['load_avg_1m_end']} at end"
    return [
        ("machine", "cpu", f"{facts['cpu']} x{facts['cpus']}", facts["cuda"] or "no GPU"),
        ("machine", "torch", facts["torch"], f"{facts['torch_threads']} threads; transformers {facts['transformers']}"),
        ("machine", "load", "", load),
    ]
