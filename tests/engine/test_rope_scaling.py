"""RoPE scaling of every type against transformers 5: the same float32 inverse frequencies and attention factor
(bit for bit) from the same config.json, the same cos/sin tables, and tiny models that decode the same tokens.

The sequence-length dependent types (longrope, dynamic) follow the per-token rule documented in
:mod:`pagoda.layers.rotary`; they are held to transformers where that rule and transformers agree, and to the rule
itself (computed here from its definition) where they do not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models import PagedRunner, hf_greedy, hf_logits, hf_model, pagoda_model, random_prompt
from tiny_checkpoints import TinyCheckpoints
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from pagoda.layers.rotary import RotaryEmbedding, apply_rotary, compute_rope_tables
from pagoda.model_config import ModelConfig

HF_ROTARY = {
    "llama": LlamaRotaryEmbedding,
    "qwen2": Qwen2RotaryEmbedding,
    "qwen3": Qwen3RotaryEmbedding,
    "phi3": Phi3RotaryEmbedding,
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
ARCHITECTURES["phi3"] = "Phi3ForCausalLM"


def _factors(n: int, low: float, high: float) -> list[float]:
    """A rising list shaped like Phi-3.5's published factor lists (n values from low to high)."""
    return [low + (high - low) * (i / (n - 1)) ** 2 for i in range(n)]


# config.json fields as the published checkpoints write them (legacy rope_scaling and transformers 5 formats).
CONFIGS: dict[str, dict[str, Any]] = {
    "llama3.1-8b-llama3": dict(
        model_type="llama",
        hidden_size=4096,
        num_attention_heads=32,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "llama-linear-legacy-type": dict(
        model_type="llama",
        hidden_size=2048,
        num_attention_heads=16,
        max_position_embeddings=16384,
        rope_theta=10000.0,
        rope_scaling={"type": "linear", "factor": 4.0},
    ),
    "qwen3-yarn-factor4": dict(
        model_type="qwen3",
        hidden_size=4096,
        num_attention_heads=32,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=1000000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    ),
    "qwen2-yarn-mscale-no-truncate": dict(
        model_type="qwen2",
        hidden_size=1024,
        num_attention_heads=16,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "truncate": False,
        },
    ),
    "llama-dynamic": dict(
        model_type="llama",
        hidden_size=2048,
        num_attention_heads=16,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    ),
    "qwen3-dynamic": dict(
        model_type="qwen3",
        hidden_size=1024,
        num_attention_heads=16,
        head_dim=128,
        max_position_embeddings=32768,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1000000.0, "factor": 4.0},
    ),
    "phi3.5-mini-longrope": dict(
        model_type="phi3",
        hidden_size=3072,
        num_attention_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": _factors(48, 1.0, 2.8), "long_factor": _factors(48, 1.0, 64)},
    ),
    "phi4-mini-partial-longrope": dict(
        model_type="phi3",
        hidden_size=3072,
        num_attention_heads=24,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        partial_rotary_factor=0.75,
        rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": _factors(48, 1.0, 3), "long_factor": _factors(48, 1.0, 40)},
    ),
    "phi3-su-explicit-attention-factor": dict(
        model_type="phi3",
        hidden_size=1024,
        num_attention_heads=16,
        max_position_embeddings=32768,
        original_max_position_embeddings=2048,
        rope_theta=10000.0,
        rope_scaling={
            "type": "su",  # transformers 5 reads an "su" config only with the original length in the dict too
            "original_max_position_embeddings": 2048,
            "short_factor": _factors(32, 1.0, 1.5),
            "long_factor": _factors(32, 1.0, 9),
            "attention_factor": 1.25,
        },
    ),
    "phi3-default-partial": dict(
        model_type="phi3",
        hidden_size=1024,
        num_attention_heads=16,
        max_position_embeddings=4096,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
    ),
}
# Positions past the original / maximum context hold for the static types only.
STATIC = {"llama3.1-8b-llama3", "llama-linear-legacy-type", "qwen3-yarn-factor4", "qwen2-yarn-mscale-no-truncate"}


def write_config(directory: Path, fields: dict[str, Any]) -> Path:
    heads = fields["num_attention_heads"]
    config = dict(
        architectures=[ARCHITECTURES[fields["model_type"]]],
        vocab_size=256,
        num_hidden_layers=1,
        num_key_value_heads=heads,
        intermediate_size=128,
        **fields,
    )
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def both(tmp_path: Path, name: str) -> tuple[Any, RotaryEmbedding, int]:
    """(transformers' rotary module, Pagoda's, head_dim) from one config.json."""
    write_config(tmp_path, CONFIGS[name])
    ours = ModelConfig.from_model_dir(tmp_path)
    hf_config = AutoConfig.from_pretrained(tmp_path)
    reference = HF_ROTARY[CONFIGS[name]["model_type"]](hf_config)
    return reference, RotaryEmbedding(ours.head_dim, ours.rope_theta, ours.rope_scaling), ours.head_dim


def hf_tables(reference: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = reference(torch.zeros(1, dtype=torch.float32), positions[None, :])
    return cos[0], sin[0]


@pytest.mark.parametrize("name", CONFIGS)
def test_inverse_frequencies_and_attention_factor_equal_transformers_bit_for_bit(tmp_path: Path, name: str) -> None:
    reference, ours, _ = both(tmp_path, name)
    assert ours.inv_freq.dtype == torch.float32
    assert torch.equal(ours.inv_freq, reference.inv_freq)
    assert ours.attention_factor == reference.attention_scaling


@pytest.mark.parametrize("name", CONFIGS)
def test_cos_sin_equal_transformers_within_the_original_context(tmp_path: Path, name: str) -> None:
    reference, ours, head_dim = both(tmp_path, name)
    scaling = ModelConfig.from_model_dir(tmp_path).rope_scaling
    original = scaling.original_max_position_embeddings if scaling else None
    context = original or CONFIGS[name]["max_position_embeddings"]
    positions = torch.cat([torch.arange(0, 64), torch.tensor([context // 2, context - 2, context - 1])])
    cos, sin = ours(positions, torch.float32)
    expected_cos, expected_sin = hf_tables(reference, positions)
    assert cos.shape == (len(positions), int(head_dim * (scaling.partial_rotary_factor if scaling else 1)))
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


@pytest.mark.parametrize("name", sorted(STATIC))
def test_static_types_equal_transformers_beyond_the_original_context(tmp_path: Path, name: str) -> None:
    reference, ours, _ = both(tmp_path, name)
    positions = torch.tensor([8191, 8192, 40000, 131071])
    cos, sin = ours(positions, torch.bfloat16)
    expected = reference(torch.zeros(1, dtype=torch.bfloat16), positions[None, :])
    assert torch.equal(cos, expected[0][0]) and torch.equal(sin, expected[1][0])


@pytest.mark.parametrize("name", ["phi3.5-mini-longrope", "phi4-mini-partial-longrope"])
def test_longrope_uses_the_long_factors_from_the_original_context_on_per_token(tmp_path: Path, name: str) -> None:
    """Rule: position p < original_max_position_embeddings rotates with the short factors, p >= with the long ones,
    whatever else is in the batch. transformers, given only positions past the boundary, uses the long factors
    for all of them, so there the two agree; a batch straddling the boundary is each position's own table."""
    reference, ours, _ = both(tmp_path, name)
    beyond = torch.tensor([4096, 4097, 9000, 131071])
    reference(torch.zeros(1), torch.tensor([[4096]]))  # transformers switches its buffer to the long table
    expected = hf_tables(reference, beyond)
    assert all(torch.equal(a, b) for a, b in zip(ours(beyond, torch.float32), expected))
    mixed = torch.tensor([5, 4095, 4096, 9000])
    cos, _ = ours(mixed, torch.float32)
    assert torch.equal(cos[2:], ours(mixed[2:], torch.float32)[0])
    assert torch.equal(cos[:2], ours(mixed[:2], torch.float32)[0])
    fresh, _, _ = both(tmp_path, name)
    assert torch.equal(cos[:2], hf_tables(fresh, mixed[:2])[0])  # the short table, as transformers within context


@pytest.mark.parametrize("name", ["llama-dynamic", "qwen3-dynamic"])
def test_dynamic_ntk_per_token_equals_transformers_at_each_sequence_length(tmp_path: Path, name: str) -> None:
    """Rule: the token at position p uses transformers' base for sequence length max(p + 1, max_position_embeddings)
    -- the table transformers computes when that token is the last of the sequence (its decoding step)."""
    _, ours, _ = both(tmp_path, name)
    limit = CONFIGS[name]["max_position_embeddings"]
    within = hf_tables(both(tmp_path, name)[0], torch.tensor([3, limit - 1]))
    for seq_len in (limit + 1, limit + 7, 3 * limit, 8 * limit + 5):
        reference, _, _ = both(tmp_path, name)
        hf_cos, hf_sin = hf_tables(reference, torch.arange(seq_len))
        cos, sin = ours(torch.tensor([3, limit - 1, seq_len - 1]), torch.float32)
        assert torch.equal(cos[2], hf_cos[-1]) and torch.equal(sin[2], hf_sin[-1]), seq_len
        # the tokens within the context keep the default base, whatever the batch holds
        assert torch.equal(cos[:2], within[0]) and torch.equal(sin[:2], within[1])


def test_partial_rotary_leaves_the_tail_of_each_head_unrotated() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=gen)
    cos, sin = torch.randn(5, 12, generator=gen), torch.randn(5, 12, generator=gen)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 12:], x[..., 12:])
    assert torch.equal(out[..., :12], apply_rotary(x[..., :12].contiguous(), cos, sin))
    bf16 = apply_rotary(x.bfloat16(), cos.bfloat16(), sin.bfloat16())  # the native CPU op where it is built
    half = 6
    rotated = torch.cat((-x[..., half:12], x[..., :half]), dim=-1).bfloat16()
    expected = x[..., :12].bfloat16() * cos.bfloat16()[:, None] + rotated * sin.bfloat16()[:, None]
    assert torch.equal(bf16[..., :12], expected) and torch.equal(bf16[..., 12:], x[..., 12:].bfloat16())


@pytest.mark.parametrize("rope_type", ["mrope", "proportional", "su"])
def test_unknown_rope_types_are_refused_naming_the_type(tmp_path: Path, rope_type: str) -> None:
    # "su" is Phi-3's old name for LongRoPE, accepted for phi3 only (as transformers' Phi3Config does).
    write_config(tmp_path, {**CONFIGS["llama-dynamic"], "rope_scaling": {"type": rope_type, "factor": 2.0}})
    with pytest.raises(ValueError, match=f"RoPE type '{rope_type}' is not supported"):
        ModelConfig.from_model_dir(tmp_path)


def test_longrope_factor_lists_of_the_wrong_length_are_refused(tmp_path: Path) -> None:
    fields = CONFIGS["phi4-mini-partial-longrope"]
    bad = {**fields, "rope_scaling": {**fields["rope_scaling"], "short_factor": [1.0] * 64}}
    config = ModelConfig.from_model_dir(write_config(tmp_path, bad))
    with pytest.raises(ValueError, match="short_factor has 64 entries; rotary dim 96 needs 48"):
        compute_rope_tables(config.head_dim, config.rope_theta, config.rope_scaling)


# --- tiny models: the whole decoder against transformers --------------------------------------------------------

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}


def test_tiny_llama_with_yarn_matches_transformers_within_and_beyond_the_original_context(
    tiny: TinyCheckpoints,
) -> None:
    model_dir = tiny.get("llama", rope_parameters=YARN)
    ref = hf_model(model_dir, torch.float32)
    assert ref.model.rotary_emb.attention_scaling != 1.0
    model = pagoda_model(model_dir, torch.float32)
    prompt = random_prompt(20, seed=11)  # 20 + 24 tokens cross original_max_position_embeddings (32)
    logits = PagedRunner(model).step({0: prompt})[0]
    torch.testing.assert_close(logits, hf_logits(ref, prompt), atol=1e-4, rtol=0)
    assert PagedRunner(model).greedy(prompt, 24) == hf_greedy(ref, prompt, 24)


def test_tiny_qwen3_with_dynamic_ntk_decodes_transformers_tokens_past_max_position_embeddings(
    tiny: TinyCheckpoints,
) -> None:
    """transformers' token-by-token decoding recomputes the NTK base at every step past max_position_embeddings
    (24 here) and keeps its cached keys: exactly the per-token rule, so the greedy tokens agree all the way."""
    model_dir = tiny.get(
        "qwen3", max_position_embeddings=24, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    )
    ref = hf_model(model_dir, torch.float32)
    model = pagoda_model(model_dir, torch.float32)
    prompt = random_prompt(13, seed=12)
    torch.testing.assert_close(PagedRunner(model).step({0: prompt})[0], hf_logits(ref, prompt), atol=1e-4, rtol=0)
    tokens = PagedRunner(model).greedy(prompt, 40)  # up to position 52, twice the context
    assert tokens == hf_greedy(ref, prompt, 40)


def test_triton_kernel_rotates_the_partial_slice_of_each_head_in_place_of_the_torch_path() -> None:
    """apply_rotary_qk's CUDA path hands the kernel q[..., :rotary_dim] views (head stride still head_dim); here
    the kernel runs in Triton's interpreter on the same views and must give the torch path's result."""
    kernels = pytest.importorskip("pagoda_kernels.rotary")
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(1))
    q, k, _ = qkv.split([64, 32, 32], dim=-1)
    q, k = q.view(5, 4, 16), k.view(5, 2, 16)
    cos, sin = RotaryEmbedding(16, 10000.0, None)(torch.arange(5), torch.float32)
    cos, sin = cos[:, :12].contiguous(), sin[:, :12].contiguous()
    q_rot, k_rot = kernels.apply_rotary(q[..., :12], k[..., :12], cos, sin)
    torch.testing.assert_close(q_rot, apply_rotary(q, cos, sin)[..., :12], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(k_rot, apply_rotary(k, cos, sin)[..., :12], rtol=1e-6, atol=1e-6)
