"""rms_norm, rotary_embedding, build_rope_cache and silu_and_mul against float64 definitions."""

from __future__ import annotations

import math

import pytest
import torch
from _mops_support import DTYPES, IMPLS, assert_close, using
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo

EXAMPLES = settings(max_examples=max(10, settings.default.max_examples // 4))


@pytest.mark.parametrize("name", IMPLS)
@EXAMPLES
@given(dtype=st.sampled_from(DTYPES), rows=st.integers(1, 9),
       hidden=st.sampled_from([64, 576, 100]), fused=st.booleans(), seed=st.integers(0, 999))
def test_rms_norm(name, dtype, rows, hidden, fused, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(dtype) if fused else None
    weight = torch.rand(hidden, generator=gen).to(dtype)
    with using(name):
        got = mo.rms_norm(x, weight, 1e-6, residual)
    h = x.double() + residual.double() if fused else x.double()
    if fused:
        got, new_residual = got
        assert_close(new_residual, h, dtype)
        h = new_residual.double()  # the normalised value is the rounded residual stream
    expected = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    assert_close(got, expected, dtype)


def rope64(positions, x, theta, is_neox, rot):
    """Rotation by definition: pair (i, i + rot/2) or (2i, 2i + 1) turned by pos * theta^(-2i/rot)."""
    out = x.double().clone()
    half = rot // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / rot)
    angle = positions.double()[:, None, None] * freq
    i = torch.arange(half)
    a, b = (i, i + half) if is_neox else (2 * i, 2 * i + 1)
    xa, xb = x.double()[..., a], x.double()[..., b]
    out[..., a] = xa * angle.cos() - xb * angle.sin()
    out[..., b] = xb * angle.cos() + xa * angle.sin()
    return out


@pytest.mark.parametrize("name", IMPLS)
@EXAMPLES
@given(dtype=st.sampled_from(DTYPES), tokens=st.integers(1, 7), head_dim=st.sampled_from([64, 128]),
       partial=st.booleans(), is_neox=st.booleans(), strided=st.booleans(),
       seed=st.integers(0, 999))
def test_rotary_embedding(name, dtype, tokens, head_dim, partial, is_neox, strided, seed):
    """Against float64; q / k contiguous or (as the model passes them) strided views of one
    fused q|k|v projection, which stays untouched."""
    gen = torch.Generator().manual_seed(seed)
    rot = head_dim // 2 if partial else head_dim
    cache = mo.build_rope_cache(head_dim, 4096, 10000.0, rotary_dim=rot)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    fused = torch.randn(tokens, 10 * head_dim, generator=gen).to(dtype)
    before = fused.clone()
    q, k, _ = fused.split([6 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q, k = q.view(tokens, 6, head_dim), k.view(tokens, 2, head_dim)
    if not strided:
        q, k = q.contiguous(), k.contiguous()
    with using(name):
        q2, k2 = mo.rotary_embedding(positions, q, k, cache, is_neox=is_neox)
    assert_close(q2, rope64(positions, q, 10000.0, is_neox, rot), dtype)
    assert_close(k2, rope64(positions, k, 10000.0, is_neox, rot), dtype)
    assert torch.equal(fused, before)  # inputs are not modified in place


@pytest.mark.parametrize("name", IMPLS)
def test_rotary_embedding_rejects_positions_past_the_cache(name):
    cache = mo.build_rope_cache(64, 16, 10000.0)
    q = torch.zeros(1, 1, 64)
    with using(name), pytest.raises(mo.BlockTableError, match="16"):
        mo.rotary_embedding(torch.tensor([16]), q, q, cache)


@pytest.mark.parametrize("name", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(name, dtype):
    x = (torch.randn(3, 5, 2 * 96) * 4).to(dtype)
    with using(name):
        got = mo.silu_and_mul(x)
    a, b = x.double().chunk(2, dim=-1)
    assert_close(got, a / (1 + torch.exp(-a)) * b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 1024])
def test_native_layer_kernels_themselves_match_float64(dtype, rows):
    """The loaded build's rms_norm (plain and fused), rotary_embedding (strided views, partial
    rotation) and silu_and_mul called directly, so a call they declined (None) fails instead of
    passing on the reference; 1,024 rows cross each kernel's parallel threshold, 2^19 elements
    (RoPE: 16 q heads and 8 k heads of 64), on 2 threads."""
    from mooncake_ops.backends import native

    if not native.has("rms_norm"):
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")
    module, gen = native._load(), torch.Generator().manual_seed(rows)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = (torch.randn(rows, 576, generator=gen) * 3).to(dtype)
        res, w = torch.randn(rows, 576, generator=gen).to(dtype), torch.rand(576).to(dtype)
        plain, fused = module.rms_norm(x, w, 1e-6, None), module.rms_norm(x, w, 1e-6, res)
        cache = mo.build_rope_cache(64, 4096, 10000.0, rotary_dim=32)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        qkv = torch.randn(rows, 32 * 64, generator=gen).to(dtype)
        q, k, _ = qkv.split([16 * 64, 8 * 64, 8 * 64], dim=-1)
        q, k = q.view(rows, 16, 64), k.view(rows, 8, 64)
        rotated = module.rotary_embedding(positions, q, k, cache)
        gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(dtype)
        silu = module.silu_and_mul(gate_up)
    finally:
        torch.set_num_threads(previous)
    assert None not in (plain, fused, rotated, silu), f"a {native.isa()} kernel declined"
    h = x.double() + res.double()
    assert_close(fused[1], h, dtype)
    for got, src in ((plain[0], x.double()), (fused[0], fused[1].double())):
        assert_close(got, src / torch.sqrt(src.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double(),
                     dtype)
    assert_close(rotated[0], rope64(positions, q, 10000.0, True, 32), dtype)
    assert_close(rotated[1], rope64(positions, k, 10000.0, True, 32), dtype)
    a, b = gate_up.double().chunk(2, dim=-1)
    assert_close(silu, a / (1 + torch.exp(-a)) * b, dtype)


SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "dynamic", "factor": 2.0},
]


def hf_inv_freq(scaling, head_dim, theta, max_position):
    """transformers' own rope initialisation for the same config (the reference we follow)."""
    utils = pytest.importorskip("transformers.modeling_rope_utils")
    from transformers import LlamaConfig
    params = dict(scaling, rope_theta=theta)
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                         max_position_embeddings=max_position, rope_parameters=params)
    kind = scaling["rope_type"]
    kwargs = {"seq_len": max_position} if kind == "dynamic" else {}
    inv_freq, factor = utils.ROPE_INIT_FUNCTIONS[kind](config, "cpu", **kwargs)
    return inv_freq.double(), factor


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_rope_scaling_matches_transformers(scaling):
    head_dim, theta, max_position = 128, 500000.0, 16384
    try:
        inv_freq, factor = hf_inv_freq(scaling, head_dim, theta, max_position)
    except (TypeError, ValueError, KeyError) as exc:  # config API drift across versions
        pytest.skip(f"transformers config API differs: {exc}")
    cache = mo.build_rope_cache(head_dim, max_position, theta, rope_scaling=scaling,
                                dtype=torch.float64)
    pos = 1000
    expected = torch.cat([torch.cos(pos * inv_freq), torch.sin(pos * inv_freq)]) * factor
    torch.testing.assert_close(cache[pos], expected, atol=2e-4, rtol=1e-4)


def test_rope_cache_layout_and_errors():
    cache = mo.build_rope_cache(64, 8, 10000.0)
    assert cache.shape == (8, 64) and cache.dtype == torch.float32
    assert torch.allclose(cache[0], torch.cat([torch.ones(32), torch.zeros(32)]))
    assert math.isclose(float(cache[1, 0]), math.cos(1.0), rel_tol=1e-6)
    with pytest.raises(mo.RopeScalingError, match="supported"):
        mo.build_rope_cache(64, 8, 10000.0, rope_scaling={"rope_type": "su"})
    with pytest.raises(mo.RopeScalingError, match="low_freq_factor"):
        mo.build_rope_cache(64, 8, 10000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0})
