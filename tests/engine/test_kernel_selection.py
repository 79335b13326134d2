"""Measured CPU linear-kernel selection: the decision on fake timings, the per-machine cache, the row-count dispatch,
the environment override, AMX detection, and the engine's tokens with each kernel kind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_models import assert_tokens_are_hf_argmax, hf_model, random_prompt

from pagoda import LLM, SamplingParams
from pagoda.config import builtin_model_path
from pagoda.cpu import cpu_features
from pagoda.cpu import kernel_selection as ks
from pagoda.layers.cpu_linear import (
    NATIVE_BF16,
    NATIVE_INT8,
    NativeBf16Linear,
    NativeGatedBf16Linear,
    PackedLinear,
    RowDispatchLinear,
    native_linear_support,
    onednn_packing_available,
)
from pagoda.layers.int8_cpu import Int8OnednnLinear, Int8WeightOnlyLinear

BIG = ks.ShapeKey(1024, 4096, "linear", "bfloat16", "none")
ROWS = BIG.rows()  # (1, 8, 32, 512)
needs_native = pytest.mark.skipif(not native_linear_support(NATIVE_BF16), reason="no native bf16 kernel here")
needs_onednn = pytest.mark.skipif(not onednn_packing_available(torch.bfloat16), reason="no oneDNN bf16 here")
HAS_AMX = {"amx_tile", "amx_bf16"} <= cpu_features.cpu_flags()


class FakeTimes:
    """``time_fn`` from a table: candidate -> rows -> seconds, with a function for rows not in the table."""

    def __init__(self, **per_candidate) -> None:
        self.per_candidate = per_candidate
        self.calls: list[tuple[str, int]] = []

    def __call__(self, candidate: str, rows: int) -> float:
        self.calls.append((candidate, rows))
        spec = self.per_candidate[candidate]
        return spec(rows) if callable(spec) else spec[rows]


def flat(**seconds: float) -> FakeTimes:
    return FakeTimes(**{c: dict.fromkeys(ROWS, t) for c, t in seconds.items()})


# ---- the decision ----------------------------------------------------------------------------------------------


def test_a_single_winner_everywhere_is_used_alone() -> None:
    sel = ks.select(BIG, ["native", "onednn"], flat(native=2.0, onednn=1.0))
    assert sel.segments == ((1, "onednn"),) and sel.crossover is None and sel.how == "measured"


def test_within_tolerance_the_preferred_candidate_wins_without_a_second_pass() -> None:
    times = flat(native=1.02, onednn=1.0)  # native 2% slower: within TOLERANCE
    assert ks.select(BIG, ["native", "onednn"], times).segments == ((1, "native"),)
    assert len(times.calls) == 2 * len(ROWS)  # the preferred kernel kept: no confirmation pass


def test_different_winners_split_at_a_measured_crossover() -> None:
    # native wins decode, oneDNN from 100 rows on (as oneDNN's AMX tiles do in prefill)
    times = FakeTimes(native=lambda r: 1.0 + r, onednn=lambda r: 1.0 + r * (2.0 if r < 100 else 0.5))
    sel = ks.select(BIG, ["native", "onednn"], times)
    assert sel.segments[0] == (1, "native") and sel.segments[1][1] == "onednn"
    bisected = sorted({r for _, r in times.calls} - set(ROWS))
    assert bisected == [64, 128]  # geometric midpoints of 32..512, then of 32..128
    assert sel.crossover == 128  # the smallest row count measured to favour oneDNN
    assert sel.candidate_for(1) == sel.candidate_for(32) == "native" and sel.candidate_for(512) == "onednn"


def test_alternating_winners_are_noise_not_a_split() -> None:
    times = FakeTimes(native={1: 1.0, 8: 2.0, 32: 1.0, 512: 2.0}, onednn={1: 2.0, 8: 1.0, 32: 2.0, 512: 1.0})
    assert ks.decide({c: {r: times(c, r) for r in ROWS} for c in ("native", "onednn")})[0] in (
        ((1, "native"),),
        ((1, "onednn"),),
    )


def test_passes_that_disagree_keep_the_preferred_kernel() -> None:
    onednn_calls = []

    def onednn(rows: int) -> float:  # pass 1: fast, pass 2: slow, pass 3: fast (a busy neighbour comes and goes)
        onednn_calls.append(rows)
        return 0.5 if (len(onednn_calls) - 1) // len(ROWS) % 2 == 0 else 2.0

    sel = ks.select(BIG, ["native", "onednn"], FakeTimes(native=dict.fromkeys(ROWS, 1.0), onednn=onednn))
    assert len(onednn_calls) == ks.MAX_PASSES * len(ROWS)
    assert sel.how == "noisy" and sel.segments == ((1, "native"),)


def test_a_second_pass_that_agrees_confirms_the_change() -> None:
    times = flat(native=2.0, onednn=1.0)
    assert ks.select(BIG, ["native", "onednn"], times).segments == ((1, "onednn"),)
    assert len(times.calls) == 2 * 2 * len(ROWS)


def test_timings_taken_on_busy_cores_keep_the_preferred_kernel_and_are_not_cached(tmp_path: Path) -> None:
    times = flat(native=2.0, onednn=1.0)
    times.noisy = True  # as KernelTimer reports when most calls took far longer than the fastest
    cache = ks.SelectionCache(tmp_path / "sel.json")
    sel = ks.select(BIG, ["native", "onednn"], times, cache=cache)
    assert sel.how == "noisy" and sel.segments == ((1, "native"),)
    assert not cache.entries


def test_forced_modes_skip_timing(monkeypatch) -> None:
    times = flat(native=2.0, onednn=1.0)
    for mode in ("native", "onednn"):
        monkeypatch.setenv(ks.ENV_KERNELS, mode.upper())
        assert ks.kernel_mode() == mode
        assert ks.select(BIG, ["native", "onednn"], times, ks.kernel_mode()).segments == ((1, mode),)
    assert ks.select(BIG, ["onednn"], times, "native").segments == ((1, "onednn"),)  # absent: what there is
    assert times.calls == []
    monkeypatch.setenv(ks.ENV_KERNELS, "fastest")
    with pytest.raises(ValueError, match="PAGODA_CPU_KERNELS"):
        ks.kernel_mode()


def test_small_layers_and_single_candidates_are_not_timed() -> None:
    times = flat(native=2.0, onednn=1.0)
    small = ks.ShapeKey(64, 128, "linear", "bfloat16", "none")
    assert ks.select(small, ["native", "onednn"], times).how == "untimed"
    assert ks.select(BIG, ["onednn"], times).how == "only"
    assert times.calls == []


def test_the_lm_head_is_timed_at_decode_rows_only() -> None:
    logits = ks.ShapeKey(1024, 151936, "logits", "bfloat16", "none")
    times = flat(native=1.0, onednn=2.0)
    ks.select(logits, ["native", "onednn"], times)
    assert {r for _, r in times.calls} == set(ks.DECODE_ROWS)


# ---- the cache -------------------------------------------------------------------------------------------------


def test_a_cache_hit_skips_timing_and_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "sel.json"
    cache = ks.SelectionCache(path)
    first = ks.select(BIG, ["native", "onednn"], flat(native=2.0, onednn=1.0), cache=cache)
    cache.save()
    times = flat(native=1.0, onednn=2.0)
    again = ks.select(BIG, ["native", "onednn"], times, cache=ks.SelectionCache(path))
    assert times.calls == [] and again.how == "cached" and again.segments == first.segments
    assert again.timings == first.timings
    # a candidate that is gone (e.g. no compiler for the native kernels any more) is measured again
    assert ks.select(BIG, ["native"], times, cache=ks.SelectionCache(path)).segments == ((1, "native"),)


@pytest.mark.parametrize("content", ["{not json", '{"identity": 3}', '{"identity": {}, "entries": []}', "[]"])
def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path: Path, content: str) -> None:
    path = tmp_path / "sel.json"
    path.write_text(content)
    cache = ks.SelectionCache(path)
    times = flat(native=2.0, onednn=1.0)
    assert ks.select(BIG, ["native", "onednn"], times, cache=cache).how == "measured" and times.calls
    cache.save()
    assert json.loads(path.read_text())["entries"][BIG.cache_key()]["segments"] == [[1, "onednn"]]


def test_the_cache_is_keyed_by_cpu_flags_and_threads(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "sel.json"
    cache = ks.SelectionCache(path)
    ks.select(BIG, ["native", "onednn"], flat(native=2.0, onednn=1.0), cache=cache)
    cache.save()
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512f", "amx_tile", "amx_bf16"}))
    times = flat(native=1.0, onednn=2.0)
    assert ks.select(BIG, ["native", "onednn"], times, cache=ks.SelectionCache(path)).segments == ((1, "native"),)
    assert times.calls  # another CPU: measured again
    monkeypatch.undo()
    other_threads = dict(ks.machine_identity(), threads=torch.get_num_threads() + 1)
    assert ks.SelectionCache(path, other_threads).get(BIG, ["native", "onednn"]) is None


def test_the_cache_path_is_overridable(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(ks.ENV_CACHE, str(tmp_path / "x.json"))
    assert ks.default_cache_path() == tmp_path / "x.json"


# ---- kernels ---------------------------------------------------------------------------------------------------


@needs_native
@needs_onednn
@pytest.mark.parametrize("gated", [False, True])
def test_the_dispatching_kernel_is_bit_identical_to_the_member_it_uses(gated: bool) -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(128, 96, dtype=torch.bfloat16), torch.randn(128, dtype=torch.bfloat16)
    native = (NativeGatedBf16Linear if gated else NativeBf16Linear).from_weight(weight, bias)
    onednn = PackedLinear.from_weight(weight, bias)
    kernel = RowDispatchLinear.of(native, onednn, crossover=16)
    for rows, member in ((1, native), (15, native), (16, onednn), (40, onednn)):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(kernel(x), member(x))
        assert torch.equal(kernel.float_output(x), member.float_output(x))
        fused = kernel.silu_and_mul(x)
        if gated and member is native:
            assert torch.equal(fused, native.silu_and_mul(x))
        else:
            assert fused is None  # PackedLinear has no epilogue: the layer applies the op itself


@needs_onednn
@pytest.mark.skipif(not native_linear_support(NATIVE_INT8), reason="no native int8 kernel here")
def test_int8_through_onednn_matches_the_native_int8_kernel() -> None:
    torch.manual_seed(0)
    weight, bias = torch.randn(192, 256) * 0.05, torch.randn(192) * 0.1
    native = Int8WeightOnlyLinear.from_weight(weight.bfloat16(), bias.bfloat16())
    onednn = Int8OnednnLinear.from_weight(weight.bfloat16(), bias.bfloat16())
    for rows in (1, 8, 300):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        torch.testing.assert_close(onednn(x).float(), native(x).float(), rtol=2e-2, atol=2e-2)


# ---- AMX -------------------------------------------------------------------------------------------------------


def test_amx_detection_gives_a_sane_answer() -> None:
    assert isinstance(cpu_features.amx_available(), bool)
    if not HAS_AMX:
        assert cpu_features.amx_available() is False
    assert set(cpu_features.isa_flags()) == set(cpu_features.ISA_FLAGS)


@pytest.mark.skipif(not HAS_AMX, reason="no AMX tiles on this CPU (amx_tile, amx_bf16 absent from /proc/cpuinfo)")
def test_onednn_bf16_on_amx_tiles_matches_the_float32_reference() -> None:
    assert cpu_features.amx_available(), "the CPU has tiles but Linux refused the tile-data permission"
    torch.manual_seed(0)
    weight, bias = torch.randn(1024, 2048, dtype=torch.bfloat16) * 0.02, torch.randn(1024, dtype=torch.bfloat16)
    packed = PackedLinear.from_weight(weight, bias)
    for rows in (1, 32, 512):  # 512: the prefill GEMM that runs on the tiles
        x = torch.randn(rows, 2048, dtype=torch.bfloat16)
        reference = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        torch.testing.assert_close(packed(x).float(), reference, rtol=1.6e-2, atol=1e-2)


# ---- the engine ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["native", "onednn", "auto"])
def test_engine_bf16_tokens_are_transformers_argmax_with_each_kernel_kind(tiny, mode, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ks.ENV_KERNELS, mode)
    monkeypatch.setenv(ks.ENV_CACHE, str(tmp_path / "sel.json"))
    model_dir = tiny.get("qwen3", torch.bfloat16)
    llm = LLM(model=str(model_dir), tokenizer=str(builtin_model_path()), block_size=4, max_model_len=128, dtype="auto")
    kernels = set(llm.engine.executor.driver_worker.model_runner.linear_kernels)
    if mode == "onednn" and onednn_packing_available(torch.bfloat16):
        assert kernels == {"onednn-packed"}
    if mode == "native" and native_linear_support(NATIVE_BF16):
        assert kernels == {"native-bf16", "native-bf16-gated"}
    reference = hf_model(model_dir, torch.bfloat16)
    prompts = [random_prompt(length, seed) for seed, length in enumerate((5, 19, 33))]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for prompt, output in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_tokens_are_hf_argmax(reference, prompt, output.outputs[0].token_ids)
