"""write_kv (plain and int8) and gather/scatter_blocks, by definition and across implementations."""

from __future__ import annotations

import pytest
import torch
from _mops_support import IMPLS, PagedCache, geometry, using
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo

EXAMPLES = settings(max_examples=max(10, settings.default.max_examples // 2))


@st.composite
def write_cases(draw):
    g = draw(geometry())
    lens = [draw(st.integers(0, 2 * g["block_size"] + 3)) for _ in range(draw(st.integers(1, 3)))]
    return g, lens, draw(st.lists(st.booleans(), min_size=sum(lens), max_size=sum(lens)))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal including NaN positions (untouched poisoned slots must stay poisoned)."""
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("name", IMPLS)
@EXAMPLES
@given(case=write_cases())
def test_write_kv_stores_each_token_in_its_slot(name, case):
    g, lens, skipped = case
    cache = PagedCache(g, lens)
    total = sum(lens)
    key = cache.randn(total, g["num_kv_heads"], g["head_dim"])
    value = cache.randn(total, g["num_kv_heads"], g["head_dim"])
    slots = cache.slots(lens)
    slots[torch.tensor(skipped, dtype=torch.bool)] = -1
    before_k = cache.k_cache.clone()
    with using(name):
        mo.write_kv(key, value, cache.k_cache, cache.v_cache, slots, **cache.scales())
    bs = g["block_size"]
    keep = slots >= 0
    blocks, rows = slots[keep] // bs, slots[keep] % bs
    if g["int8"]:
        qk, sk = mo.quantize_int8(key[keep])
        assert torch.equal(cache.k_cache[blocks, rows], qk)
        assert torch.equal(cache.k_scale[blocks, rows], sk)
    else:
        assert same_bits(cache.k_cache[blocks, rows], key[keep])
        assert same_bits(cache.v_cache[blocks, rows], value[keep])
    untouched = torch.ones(cache.k_cache.shape[:2], dtype=torch.bool)
    untouched[blocks, rows] = False
    assert same_bits(cache.k_cache[untouched], before_k[untouched])


def test_native_and_reference_store_identical_bytes():
    """The loaded build's write_kv called directly (a declined call fails) stores the bytes the
    reference stores: int8 values and scales, a zero vector included."""
    from mooncake_ops.backends import native

    if not native.has("write_kv"):
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")
    g = dict(block_size=16, num_kv_heads=3, num_heads=9, head_dim=64, dtype=torch.bfloat16,
             int8=True, strided=True, seed=11)
    caches = []
    for name in IMPLS:
        cache = PagedCache(g, [37, 5])
        key, value = cache.randn(42, 3, 64) * 3, cache.randn(42, 3, 64)
        key[0] = 0  # a zero vector: scale 0, q 0
        args = (key, value, cache.k_cache, cache.v_cache, cache.slots([37, 5]))
        if name == "native":
            scales = cache.scales()
            assert native._load().write_kv(*args, scales["k_scale"], scales["v_scale"]), \
                f"the {native.isa()} write_kv declined"
        else:
            with using(name):
                mo.write_kv(*args, **cache.scales())
        caches.append(cache)
    for attr in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert same_bits(getattr(caches[0], attr), getattr(caches[1], attr)), attr


def test_quantize_roundtrip_error_is_half_a_step():
    """Half a step, plus the float32 rounding of x / scale and q * scale (|x| <= 127 steps, so
    up to ~127 x 2^-24 steps each: 2^-16 of a step covers both)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):  # fresh values each round
        x = torch.randn(50, 4, 128, generator=gen) * torch.rand(50, 4, 1, generator=gen) * 10
        q, scale = mo.quantize_int8(x)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
        err = (mo.dequantize_int8(q, scale) - x).abs()
        assert bool((err <= scale[..., None] * (0.5 + 2**-16)).all())


@pytest.mark.parametrize("name", IMPLS)
def test_write_kv_rejects_a_slot_beyond_the_cache(name):
    k_cache = torch.zeros(4, 16, 2, 64)
    key = torch.ones(2, 2, 64)
    with using(name), pytest.raises(mo.BlockTableError, match="64 slots"):
        mo.write_kv(key, key, k_cache, k_cache.clone(), torch.tensor([3, 64]))
    assert k_cache.abs().sum() == 0  # nothing written before the error


@pytest.mark.parametrize("strided", [False, True])
def test_gather_then_scatter_restores_blocks(strided):
    g = dict(block_size=16, num_kv_heads=2, num_heads=2, head_dim=64, dtype=torch.bfloat16,
             int8=True, strided=strided, seed=5)
    src = PagedCache(g, [60])
    src.fill()
    caches = [src.k_cache, src.v_cache, src.k_scale, src.v_scale]
    ids = [3, 0, 2]
    staging = mo.gather_blocks(caches, ids)
    assert staging.shape == (3, mo.block_nbytes(caches)) and staging.is_contiguous()
    dst = PagedCache(g, [60])
    targets = [dst.k_cache, dst.v_cache, dst.k_scale, dst.v_scale]
    mo.scatter_blocks(staging, targets, [1, 4, 0])
    for a, b in zip(caches, targets, strict=True):
        assert same_bits(a[torch.tensor(ids)], b[torch.tensor([1, 4, 0])])
    out = torch.empty(staging.numel(), dtype=torch.uint8)
    assert torch.equal(mo.gather_blocks(caches, torch.tensor(ids), out=out).view(3, -1), staging)


def test_gather_blocks_rejects_bad_ids_and_buffers():
    caches = [torch.zeros(4, 16, 2, 64)]
    with pytest.raises(mo.BlockTableError, match=r"\[0, 4\)"):
        mo.gather_blocks(caches, [1, 4])
    with pytest.raises(mo.OpsShapeError, match="bytes"):
        mo.gather_blocks(caches, [1], out=torch.empty(10, dtype=torch.uint8))
    with pytest.raises(mo.OpsShapeError, match="blocks"):
        mo.gather_blocks([caches[0], torch.zeros(5, 3)], [0])
