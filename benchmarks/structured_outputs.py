"""What grammar-constrained decoding costs: decode steps at batch 32, and time to first token for a new schema.

Per model, four interleaved runs (plain, json_schema, json_schema, plain) of ``--batch`` requests that all decode
for ``--steps`` steps; a step's time is the median over those steps. The schema has 64 required integer fields,
so no output completes inside the measured steps and every row is masked in every step. ``mask`` is the time
spent filling and applying the batch's token bitmask (``apply_grammar_masks``) per step.

Time to first token for one request on an idle engine: a schema never seen before (compiled on the request
path) against the same schema again (a cached grammar), plus the compile alone.

The Qwen3-0.6B shape needs a tokenizer of its 151,936 tokens that can write JSON (the real one cannot be
downloaded here): a byte-level BPE is trained once on a synthetic corpus (random words with Zipf frequencies,
digits and JSON) and stored next to the shape's random weights in ``.bench/``.

    python benchmarks/structured_outputs.py                   # stories260K and the Qwen3-0.6B shape
    python benchmarks/structured_outputs.py --models stories --steps 48
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import QWEN3_SHAPE, ensure_qwen3_shape_checkpoint, format_table, log, machine_facts  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
FIRST_PLAIN_TOKEN_ID = 3


def wide_schema(tag: str = "field", count: int = 64) -> dict[str, Any]:
    names = [f"{tag}_{i:02d}" for i in range(count)]
    return {
        "type": "object",
        "properties": {name: {"type": "integer"} for name in names},
        "required": names,
        "additionalProperties": False,
    }


def nested_schema(tag: str) -> dict[str, Any]:
    """A schema of the size a tool or a typed response has (a fresh ``tag`` makes it uncached)."""
    item = {
        "type": "object",
        "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 999},
            "price": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}, "maxItems": 3},
        },
        "required": ["sku", "quantity", "price"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            f"order_{tag}": {"type": "string", "maxLength": 32},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "email": {"type": "string", "format": "email"}},
                "required": ["name"],
            },
            "items": {"type": "array", "items": item, "minItems": 1},
            "status": {"enum": ["open", "paid", "shipped", "cancelled"]},
            "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        },
        "required": [f"order_{tag}", "customer", "items", "status"],
        "additionalProperties": False,
    }


# ---- the Qwen3-shaped checkpoint with a byte-level BPE tokenizer ------------------------------------


def ensure_qwen3_bpe_checkpoint(root: Path) -> Path:
    """The Qwen3-0.6B-shaped weights with a 151,936-token byte-level BPE tokenizer (built once)."""
    shape_dir = ensure_qwen3_shape_checkpoint(root / "qwen3-0.6b-shape")
    model_dir = root / "qwen3-0.6b-shape-bpe"
    if (model_dir / "tokenizer.json").is_file():
        return model_dir
    model_dir.mkdir(parents=True, exist_ok=True)
    for item in shape_dir.iterdir():
        if not item.name.startswith(("tokenizer", "special_tokens", "vocab", "chat_template")):
            target = model_dir / item.name
            if not target.exists():
                target.symlink_to(item.resolve())
    log("training a 151,936-token byte-level BPE tokenizer for the Qwen3 shape (once, about a minute)")
    tokenizer = train_bpe_tokenizer(QWEN3_SHAPE["vocab_size"])
    tokenizer.save_pretrained(model_dir)
    return model_dir


def train_bpe_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<s>", "</s>"]  # ids 0, 1, 2: QWEN3_SHAPE's pad, bos and eos
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_synthetic_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<|pad|>"
    )
    missing = vocab_size - len(tokenizer)
    if missing > 0:  # the corpus ran out of merges: fill up with plain tokens so every id decodes
        tokenizer.add_tokens([f"<filler_{i}>" for i in range(missing)])
    assert len(tokenizer) == vocab_size, (len(tokenizer), vocab_size)
    return tokenizer


def _synthetic_corpus(num_words: int = 400_000, lines: int = 60_000):
    rng = random.Random(0)
    alphabet = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choices(alphabet, k=rng.randint(2, 11))) for _ in range(num_words)]
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) ** 0.8 for rank in range(num_words)))
    for i in range(lines):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=40)
        yield " ".join(words)
        yield json.dumps({words[0]: rng.randint(-(10**6), 10**6), words[1]: [words[2], rng.random()], "id": i})
    yield from lexicon  # every word at least once: merges up to whole words


# ---- measurements ---------------------------------------------------------------------------------


def decode_step_times(engine: Any, batch: int, steps: int, params: Any) -> tuple[list[float], list[float]]:
    """(step seconds, mask seconds per step) over ``steps`` steps in which all ``batch`` requests decode."""
    from pagoda.worker import sampler

    mask_time = [0.0]
    inner = sampler.apply_grammar_masks

    def timed(*args: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            mask_time[0] += time.perf_counter() - start

    sampler.apply_grammar_masks = timed
    try:
        rng = random.Random(1)
        vocab = engine.model_config.vocab_size
        for i in range(batch):
            prompt = [rng.randrange(FIRST_PLAIN_TOKEN_ID, min(vocab, 400)) for _ in range(32)]
            engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, params)
        while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        ):
            engine.step()  # prefill (and any grammar still compiling)
        step_times, mask_times = [], []
        for _ in range(steps):
            mask_time[0] = 0.0
            start = time.perf_counter()
            engine.step()
            step_times.append(time.perf_counter() - start)
            mask_times.append(mask_time[0])
        assert engine.scheduler.num_running == batch, "every request must still be decoding"
        engine.abort_request([r.external_id for r in list(engine.scheduler.running)])
        return step_times, mask_times
    finally:
        sampler.apply_grammar_masks = inner


def first_token_seconds(engine: Any, params: Any) -> float:
    start = time.perf_counter()
    engine.add_request(f"ttft-{time.monotonic_ns()}", list(range(FIRST_PLAIN_TOKEN_ID, 35)), params)
    while True:
        for output in engine.step():
            if output.outputs[0].token_ids:
                engine.abort_request(output.request_id)
                return time.perf_counter() - start


def measure(model_dir: Optional[str], dtype: str, batch: int, steps: int) -> list[tuple[str, ...]]:
    from pagoda import EngineArgs, LLMEngine, SamplingParams, StructuredOutputsParams

    engine = LLMEngine(EngineArgs(model=model_dir, dtype=dtype, max_num_seqs=batch, max_model_len=512))
    plain = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 8, ignore_eos=True)
    constrained = SamplingParams(
        temperature=1.0, seed=0, max_tokens=steps + 8, structured_outputs=StructuredOutputsParams(json=wide_schema())
    )
    engine.compile_structured_output(constrained.structured_outputs).result()
    decode_step_times(engine, batch, 2, plain)  # warm-up
    runs: dict[str, list[float]] = {"plain": [], "json_schema": []}
    masks: list[float] = []
    for name in ("plain", "json_schema", "json_schema", "plain"):
        log(f"  {name}: {batch} requests x {steps} decode steps")
        step_times, mask_times = decode_step_times(engine, batch, steps, plain if name == "plain" else constrained)
        runs[name].append(statistics.median(step_times))
        if name == "json_schema":
            masks.append(statistics.median(mask_times))
    rows = []
    base, grammar = statistics.mean(runs["plain"]), statistics.mean(runs["json_schema"])
    rows.append(("decode step, plain", " / ".join(f"{t * 1e3:.1f}" for t in runs["plain"]), "ms", ""))
    rows.append(("decode step, json_schema", " / ".join(f"{t * 1e3:.1f}" for t in runs["json_schema"]), "ms", ""))
    rows.append(("  of which mask fill + apply", " / ".join(f"{t * 1e3:.2f}" for t in masks), "ms", ""))
    rows.append(("grammar overhead per step", f"{(grammar / base - 1) * 100:+.1f}", "%", f"{grammar / base:.3f}x"))
    rows += ttft_rows(engine)
    return rows


def ttft_rows(engine: Any, repeats: int = 3) -> list[tuple[str, ...]]:
    from pagoda import SamplingParams, StructuredOutputsParams

    def params(schema: dict) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=4, structured_outputs=StructuredOutputsParams(json=schema))

    plain = SamplingParams(temperature=1.0, max_tokens=4)
    first_token_seconds(engine, plain)
    fresh, cached, compile_only, unconstrained = [], [], [], []
    for i in range(repeats):
        schema = nested_schema(f"{i}_{time.monotonic_ns()}")
        fresh.append(first_token_seconds(engine, params(schema)))
        cached.append(first_token_seconds(engine, params(schema)))
        spec = StructuredOutputsParams(json=nested_schema(f"c{i}_{time.monotonic_ns()}"))
        start = time.perf_counter()
        engine.compile_structured_output(spec).result()
        compile_only.append(time.perf_counter() - start)
        unconstrained.append(first_token_seconds(engine, plain))

    def ms(values: list[float]) -> str:
        return " / ".join(f"{v * 1e3:.1f}" for v in values)

    return [
        ("TTFT, unconstrained", ms(unconstrained), "ms", ""),
        ("TTFT, new schema (compiled on the way)", ms(fresh), "ms", ""),
        ("TTFT, same schema again (cached)", ms(cached), "ms", ""),
        ("compile a new schema alone", ms(compile_only), "ms", ""),
    ]


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="stories,qwen3", help="comma-separated: stories, qwen3")
    parser.add_argument("--batch", type=int, default=32, help="running requests")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per run")
    args = parser.parse_args(argv)
    facts = machine_facts()
    rows: list[tuple[str, ...]] = [("machine", f"{facts['cpu']} x{facts['cpus']}", "", facts["torch"])]
    for key in args.models.split(","):
        if key == "stories":
            model, dtype = None, "float32"
        else:
            model, dtype = str(ensure_qwen3_bpe_checkpoint(REPO_ROOT / ".bench")), "bfloat16"
        log(f"{key}: batch {args.batch}, {args.steps} decode steps per run")
        rows.append(("", "", "", ""))
        rows.append((f"{key} ({dtype})", "", "", ""))
        rows += measure(model, dtype, args.batch, args.steps)
    print(format_table(("", "value (runs)", "unit", "ratio"), rows))


if __name__ == "__main__":
    main()
