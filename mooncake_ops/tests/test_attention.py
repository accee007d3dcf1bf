"""Paged decode and prefill attention against the float64 oracle, on every implementation.

Caches are NaN-poisoned outside written tokens, block tables padded with garbage ids, and
outputs poisoned before each call, so reading or leaving anything out of bounds fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from _mops_support import (
    DTYPES,
    PagedCache,
    assert_close,
    geometry,
    length,
    oracle_decode,
    oracle_prefill,
    tokens64,
    using,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo
from mooncake_ops.backends import sdpa

IMPLS = ("native", "reference", "sdpa")
EXAMPLES = settings(max_examples=max(10, settings.default.max_examples // 2))


def decode(name, q, cache, out):
    args = (q, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens, q.shape[-1] ** -0.5)
    if name == "sdpa":  # the cuda path, run on CPU tensors
        return sdpa.paged_decode_attention(*args, cache.k_scale, cache.v_scale, out)
    with using(name):
        return mo.paged_decode_attention(*args, out=out, **cache.scales())


@st.composite
def decode_cases(draw):
    g = draw(geometry())
    lens = [length(draw, g["block_size"], allow_zero=True) for _ in range(draw(st.integers(1, 4)))]
    return g, lens, draw(st.booleans())


@pytest.mark.parametrize("name", IMPLS)
@EXAMPLES
@given(case=decode_cases())
def test_decode_matches_oracle(name, case):
    g, lens, use_out = case
    cache = PagedCache(g, lens)
    cache.fill()
    q = cache.randn(len(lens), g["num_heads"], g["head_dim"])
    out = torch.full_like(q, math.nan) if use_out else None
    got = decode(name, q, cache, out)
    if use_out:
        assert got.data_ptr() == out.data_ptr()
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, oracle_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                    cache.lens, g["head_dim"] ** -0.5, **cache.scales()), g["dtype"])


def prefill(name, q, k, v, cache, cached, queries, out):
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.block_tables, cached, queries,
            q.shape[-1] ** -0.5)
    if name == "sdpa":
        return sdpa.paged_prefill_attention(*args, cache.k_scale, cache.v_scale, out)
    with using(name):
        return mo.paged_prefill_attention(*args, out=out, **cache.scales())


@st.composite
def prefill_cases(draw):
    g = draw(geometry())
    batch = draw(st.integers(1, 3))
    cached = [draw(st.sampled_from([0, 0, length(draw, g["block_size"])])) for _ in range(batch)]
    queries = [draw(st.sampled_from([1, 2, g["block_size"] + 1, draw(st.integers(0, 40))]))
               for _ in range(batch)]
    return g, cached, queries, draw(st.sampled_from([0, 2]))


@pytest.mark.parametrize("name", IMPLS)
@EXAMPLES
@given(case=prefill_cases())
def test_prefill_matches_oracle(name, case):
    g, cached, queries, spare = case
    cache = PagedCache(g, cached, spare_columns=spare)  # no cached tokens + no spare: 0 columns
    cache.fill()
    total = sum(queries)
    q = cache.randn(total, g["num_heads"], g["head_dim"])
    k, v = (cache.randn(total, g["num_kv_heads"], g["head_dim"]) for _ in range(2))
    queries_t = torch.tensor(queries, dtype=torch.int32)
    out = torch.full_like(q, math.nan)
    got = prefill(name, q, k, v, cache, cache.lens, queries_t, out)
    expected = oracle_prefill(q, k, v, cache.k_cache, cache.v_cache, cache.block_tables,
                              cache.lens, queries_t, g["head_dim"] ** -0.5, **cache.scales())
    assert_close(got, expected, g["dtype"])


@pytest.mark.parametrize("name", IMPLS)
def test_prefill_then_decode_equals_one_long_prefill(name):
    """Chunked prefill over the cache gives the same answer as one whole-prompt prefill."""
    g = dict(block_size=16, num_kv_heads=2, num_heads=6, head_dim=64, dtype=torch.float32,
             int8=False, strided=True, seed=3)
    cache = PagedCache(g, [40], spare_columns=1)
    q, k, v = cache.randn(41, 6, 64), cache.randn(41, 2, 64), cache.randn(41, 2, 64)
    whole = prefill(name, q, k, v, cache, torch.tensor([0], dtype=torch.int32),
                    torch.tensor([41], dtype=torch.int32), None)
    with using("reference"):
        mo.write_kv(k[:40], v[:40], cache.k_cache, cache.v_cache, cache.slots([40]))
    tail = prefill(name, q[40:], k[40:], v[40:], cache, torch.tensor([40], dtype=torch.int32),
                   torch.tensor([1], dtype=torch.int32), None)
    assert_close(tail, whole[40:], torch.float32)


@pytest.mark.parametrize("int8", [False, True])
def test_decode_split_over_threads_matches_oracle(int8):
    """Large calls split each sequence's blocks across threads and merge the partial softmaxes
    (the tests otherwise run on one thread, which never splits)."""
    g = dict(block_size=16, num_kv_heads=1, num_heads=16, head_dim=128, dtype=torch.bfloat16,
             int8=int8, strided=True, seed=9)
    cache = PagedCache(g, [1500, 37, 0])
    cache.fill()
    q = cache.randn(3, 16, 128)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = decode("native", q, cache, torch.full_like(q, math.nan))
    finally:
        torch.set_num_threads(threads)
    assert_close(got, oracle_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                    cache.lens, 128 ** -0.5, **cache.scales()), torch.bfloat16)


@pytest.mark.parametrize("flash", [True, False], ids=["flash", "no-flash-op"])
@pytest.mark.parametrize(("dtype", "int8"), [(torch.float32, False), (torch.bfloat16, False),
                                             (torch.float16, False), (torch.bfloat16, True)])
def test_cpu_prefill_groups_and_shared_prefix_match_oracle(dtype, int8, flash, monkeypatch):
    """The CPU path batches sequences with equal (cached, new) lengths, consecutive or not, and
    gathers a prefix shared by the same block ids once; query_len 0 / 1 and cached_len 0 mixed."""
    if not flash:  # a torch without the flash CPU op: the per-sequence SDPA path
        monkeypatch.setattr(sdpa, "_FLASH_CPU", None)
    g = dict(block_size=16, num_kv_heads=2, num_heads=6, head_dim=64, dtype=dtype, int8=int8,
             strided=True, seed=11)
    cached = [40, 0, 40, 17, 0, 5, 40, 40, 17, 33, 33]
    queries = [5, 7, 5, 1, 7, 0, 5, 3, 1, 4, 4]
    cache = PagedCache(g, cached)
    cache.fill()
    for seq in (2, 6, 7):  # the same cached blocks as sequence 0 (a shared prompt prefix)
        cache.block_tables[seq, :3] = cache.block_tables[0, :3]
    total = sum(queries)
    q = cache.randn(total, 6, 64)
    k, v = (cache.randn(total, 2, 64) for _ in range(2))
    queries_t = torch.tensor(queries, dtype=torch.int32)
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens, queries_t,
            64 ** -0.5)
    got = sdpa.paged_prefill_attention_cpu(*args, cache.k_scale, cache.v_scale,
                                           torch.full_like(q, math.nan))
    assert_close(got, oracle_prefill(*args, **cache.scales()), dtype)
    with using("reference"):  # what the cpu dispatch table runs
        assert torch.equal(mo.paged_prefill_attention(*args, **cache.scales()), got)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_native_int8_prefill_reads_the_prefix_in_place(dtype, threads, seed):
    """With native kernels, an int8 cached prefix is attended by the decode kernel over the
    paged blocks (every new token's query rows of a KV head as its group), not by gathering a
    dequantised copy: the gather is made to fail, and the result must still match the float64
    oracle on fresh random inputs (groups, a shared prefix, splits across threads)."""
    from mooncake_ops.backends import native

    if not native.is_available():
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")

    def no_gather(*args, **kwargs):
        raise AssertionError("the int8 prefix was gathered into a dequantised copy")

    g = dict(block_size=16, num_kv_heads=2, num_heads=6, head_dim=64, dtype=dtype, int8=True,
             strided=True, seed=seed)
    cached = [700, 0, 700, 17, 40, 33, 33]
    queries = [5, 7, 5, 1, 40, 4, 4]
    cache = PagedCache(g, cached)
    cache.fill()
    cache.block_tables[2, :44] = cache.block_tables[0, :44]  # a shared prompt prefix
    total = sum(queries)
    q = cache.randn(total, 6, 64)
    k, v = (cache.randn(total, 2, 64) for _ in range(2))
    queries_t = torch.tensor(queries, dtype=torch.int32)
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens, queries_t,
            64 ** -0.5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with using("native"), pytest.MonkeyPatch.context() as patch:
            patch.setattr(sdpa, "_cached_tokens", no_gather)
            got = mo.paged_prefill_attention(*args, out=torch.full_like(q, math.nan),
                                             **cache.scales())
    finally:
        torch.set_num_threads(previous)
    assert_close(got, oracle_prefill(*args, **cache.scales()), dtype)


@pytest.mark.parametrize("int8", [False, True])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_native_decode_log_sum_exp_matches_float64(int8, seed):
    """The kernel's optional log-sum-exp output (what the prefill merge weighs by), one split
    and several, against log(sum(exp(scaled scores))) in float64; empty contexts give -inf."""
    from mooncake_ops.backends import native

    if not native.is_available():
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")
    g = dict(block_size=16, num_kv_heads=2, num_heads=16, head_dim=64, dtype=torch.float32,
             int8=int8, strided=True, seed=seed)
    cache = PagedCache(g, [2100, 37, 0])  # 2137 tokens x 16 heads x 64: big enough to split
    cache.fill()
    q = cache.randn(3, 16, 64)
    expected = torch.full((3, 16), -math.inf, dtype=torch.float64)
    for b, n in enumerate(cache.lens.tolist()):
        if n:
            keys = tokens64(cache.k_cache, cache.k_scale, cache.block_tables[b], n)  # [n, hk, d]
            group = keys.repeat_interleave(8, dim=1)  # query head h reads KV head h // 8
            scores = torch.einsum("hd,thd->ht", q[b].double(), group) * 64 ** -0.5
            expected[b] = torch.logsumexp(scores, dim=-1)
    previous = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            lse = torch.empty(3, 16)
            native._load().paged_decode_attention(
                q, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens, 64 ** -0.5,
                cache.k_scale, cache.v_scale, None, lse)
        finally:
            torch.set_num_threads(previous)
        torch.testing.assert_close(lse.double(), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES), int8=st.booleans(),
       head_dim=st.sampled_from([64, 128, 256]), group=st.sampled_from([1, 3, 8]),
       block_size=st.sampled_from([5, 16, 32]), strided=st.booleans())
def test_native_decode_kernel_itself_matches_float64(threads, seed, dtype, int8, head_dim, group,
                                                     block_size, strided):
    """The loaded build's decode kernel called directly, so a call it declined (None) fails
    instead of passing on the reference: every dtype over its own or an int8 cache, every
    head_dim it covers, a block size that is not a multiple of the vector width, empty and
    multi-block contexts and one long enough for the kernel's threads (>= 2^21 multiply-adds
    in all), one thread and two."""
    from mooncake_ops.backends import native

    if not native.is_available():
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")
    g = dict(block_size=block_size, num_kv_heads=2, num_heads=2 * group, head_dim=head_dim,
             dtype=dtype, int8=int8, strided=strided, seed=seed)
    parallel = -(-(1 << 21) // (g["num_heads"] * head_dim))  # tokens for the kernel's threads
    lens = [0, 1, block_size - 1, block_size + 1, 7 * block_size + 3, parallel]
    cache = PagedCache(g, lens)
    cache.fill()
    q = cache.randn(len(lens), g["num_heads"], head_dim)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native._load().paged_decode_attention(
            q, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens, head_dim ** -0.5,
            cache.k_scale, cache.v_scale, torch.full_like(q, math.nan))
    finally:
        torch.set_num_threads(previous)
    assert got is not None, f"the {native.isa()} kernel declined a call it covers"
    assert_close(got, oracle_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                    cache.lens, head_dim ** -0.5, cache.k_scale, cache.v_scale),
                 dtype)


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512_bf16" in f.read()
    except OSError:
        return False


def _prefill_kernel_dtypes() -> tuple[torch.dtype, ...]:
    """The q dtypes the loaded build's own prefill kernel takes on this CPU: every float dtype
    for the AVX2 build (fp32 arithmetic), bf16 for the AVX-512 one where the CPU has
    AVX512_BF16; none without a build."""
    from mooncake_ops.backends import native

    if not native.is_available() or not native.has("paged_prefill_attention"):
        return ()
    if native.isa() == "avx2":
        return DTYPES
    return (torch.bfloat16,) if _cpu_has_avx512_bf16() else ()


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), head_dim=st.sampled_from([64, 128, 256]),
       group=st.sampled_from([1, 3, 8]), block_size=st.sampled_from([16, 32]), int8=st.booleans(),
       dtype=st.sampled_from(DTYPES))
def test_native_prefill_kernel_matches_float64(threads, seed, head_dim, group, block_size, int8,
                                               dtype):
    """The loaded build's prefill kernel itself (not a fallback) on fresh random inputs: q/k/v
    as strided views of one fused projection (as the model passes them), several 32-token
    tiles per sequence, key tiles that straddle the cached/new boundary and rows' causal edges
    inside them, a NaN-poisoned pool of q's dtype or int8 (rows dequantised as they are laid
    out) with garbage past each table's used columns, one thread and two. A dtype the build
    does not cover (the AVX-512 kernel takes bf16 only) must be declined (None)."""
    from mooncake_ops.backends import native

    covered = _prefill_kernel_dtypes()
    if not covered:
        pytest.skip("no prefill kernel runs here: the build is absent, or it is the AVX-512 "
                    "one on a CPU without AVX512_BF16 (the SDPA path runs)")
    g = dict(block_size=block_size, num_kv_heads=2, num_heads=2 * group, head_dim=head_dim,
             dtype=dtype, int8=int8, strided=True, seed=seed)
    cached, queries = [75, 0, 0, 33], [70, 1, 97, 2]
    cache = PagedCache(g, cached)
    cache.fill()
    total, q_size, kv_size = sum(queries), g["num_heads"] * head_dim, 2 * head_dim
    fused = cache.randn(total, q_size + 2 * kv_size)
    q, k, v = fused.split([q_size, kv_size, kv_size], dim=-1)
    q, k, v = q.view(total, -1, head_dim), k.view(total, 2, head_dim), v.view(total, 2, head_dim)
    queries_t = torch.tensor(queries, dtype=torch.int32)
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens, queries_t,
            head_dim ** -0.5)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native._load().paged_prefill_attention(*args, out=torch.full_like(q, math.nan),
                                                     **cache.scales())
    finally:
        torch.set_num_threads(previous)
    if dtype not in covered:
        assert got is None, f"the {native.isa()} kernel took a {dtype} call it does not cover"
        return
    assert got is not None, f"the {native.isa()} kernel declined a {dtype} call it covers"
    assert_close(got, oracle_prefill(*args, **cache.scales()), dtype)


@pytest.mark.parametrize("slope", [0.03, 0.2, 0.6, -0.3])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_native_bf16_prefill_kernel_follows_rising_and_falling_scores(slope, seed):
    """Scores that climb by `slope` per key (scaled), so each row's largest score is its last
    key (rising) or its first (falling), with e^(slope x 230) between a row's extremes: the
    loaded build's bf16 kernel subtracts each row's max over the keys it sees (the causal edge
    masked), and keys far below it underflow to 0, not NaN. Against float64, for 190 new
    tokens after 40 cached ones."""
    from mooncake_ops.backends import native

    if torch.bfloat16 not in _prefill_kernel_dtypes():
        pytest.skip("no native bf16 prefill kernel runs here")
    g = dict(block_size=16, num_kv_heads=1, num_heads=3, head_dim=64, dtype=torch.bfloat16,
             int8=False, strided=False, seed=seed)
    cached, new = 40, 190
    cache = PagedCache(g, [cached])
    cache.fill()
    direction = torch.nn.functional.normalize(cache.randn(64).float(), dim=0)
    ramp = torch.arange(cached + new, dtype=torch.float32) * slope / 64 ** -0.5
    keys = (ramp[:, None] * direction + 0.05 * cache.randn(cached + new, 64).float())
    keys = keys.to(torch.bfloat16)
    for j in range(cached):  # the cached part of the ramp goes into the pool
        block, slot = cache.block_tables[0, j // 16], j % 16
        cache.k_cache[block, slot, 0] = keys[j]
    q = (direction + 0.05 * cache.randn(new, 3, 64).float()).to(torch.bfloat16)
    k = keys[cached:, None, :].contiguous()
    v = cache.randn(new, 1, 64)
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.block_tables, cache.lens,
            torch.tensor([new], dtype=torch.int32), 64 ** -0.5)
    got = native._load().paged_prefill_attention(*args, out=torch.full_like(q, math.nan))
    assert got is not None, "the kernel declined a bf16 call it covers"
    assert_close(got, oracle_prefill(*args), torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_native_bf16_prefill_one_new_token_gets_the_decode_kernels_answer(threads, seed):
    """A sequence with one new token in a prefill batch (a decode riding along with a chunk)
    reads its cached context in place through the decode kernel, its own K/V from k / v: the
    rows match float64, and equal bit for bit what paged_decode_attention gives the same token
    once its K/V are in the pool, so a token's output does not depend on the batch it is in."""
    from mooncake_ops.backends import native

    if not native.is_available() or not _cpu_has_avx512_bf16() or native.isa() != "avx512":
        pytest.skip("the AVX512_BF16 kernel's property (the AVX2 kernel runs a one-token "
                    "sequence as a prefill item of its own)")
    g = dict(block_size=16, num_kv_heads=2, num_heads=6, head_dim=64, dtype=torch.bfloat16,
             int8=False, strided=True, seed=seed)
    cached, new = [75, 130, 0, 40], [1, 1, 50, 1]
    totals = [c + n for c, n in zip(cached, new, strict=True)]
    cache = PagedCache(g, totals)
    cache.fill()
    total = sum(new)
    fused = cache.randn(total, 6 * 64 + 2 * 2 * 64)
    q, k, v = fused.split([6 * 64, 2 * 64, 2 * 64], dim=-1)
    q, k, v = q.view(total, 6, 64), k.view(total, 2, 64), v.view(total, 2, 64)
    with using("reference"):  # the new tokens' K/V into the pool, as the model writes them
        mo.write_kv(k, v, cache.k_cache, cache.v_cache, cache.slots(new, starts=cached))
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.block_tables,
            torch.tensor(cached, dtype=torch.int32), torch.tensor(new, dtype=torch.int32), 0.125)
    ones = [b for b, n in enumerate(new) if n == 1]
    rows = [sum(new[:b]) for b in ones]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native._load().paged_prefill_attention(*args, out=torch.full_like(q, math.nan))
        decoded = native._load().paged_decode_attention(
            q[rows].contiguous(), cache.k_cache, cache.v_cache, cache.block_tables[ones],
            torch.tensor(totals, dtype=torch.int32)[ones], 0.125, None, None, None)
    finally:
        torch.set_num_threads(previous)
    assert got is not None and decoded is not None
    assert_close(got, oracle_prefill(*args), torch.bfloat16)
    assert torch.equal(got[rows], decoded)


def test_native_bf16_prefill_kernel_rejects_a_bad_block_id():
    if torch.bfloat16 not in _prefill_kernel_dtypes():
        pytest.skip("no native bf16 prefill kernel runs here")
    g = dict(block_size=16, num_kv_heads=1, num_heads=2, head_dim=64, dtype=torch.bfloat16,
             int8=False, strided=False, seed=1)
    cache = PagedCache(g, [20])
    cache.fill()
    cache.block_tables[0, 1] = cache.k_cache.shape[0]  # one past the pool, inside the context
    q, k, v = cache.randn(3, 2, 64), cache.randn(3, 1, 64), cache.randn(3, 1, 64)
    with using("native"), pytest.raises(mo.BlockTableError, match=r"block_tables\[0, 1\]"):
        mo.paged_prefill_attention(q, k, v, cache.k_cache, cache.v_cache, cache.block_tables,
                                   cache.lens, torch.tensor([3], dtype=torch.int32), 0.125)


@pytest.mark.parametrize("threads", [1, 2])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), head_dim=st.sampled_from([64, 128, 256]),
       group=st.sampled_from([1, 3, 8]), block_size=st.sampled_from([16, 32]))
def test_native_bf16_decode_matches_float64(threads, seed, head_dim, group, block_size):
    """Decode over a bf16 cache (the AVX512_BF16 path when the CPU has it): a batch of 24 with
    empty, odd and multi-block contexts in a NaN-poisoned strided pool, one thread and two."""
    g = dict(block_size=block_size, num_kv_heads=2, num_heads=2 * group, head_dim=head_dim,
             dtype=torch.bfloat16, int8=False, strided=True, seed=seed)
    lens = [0, 1, 2, 31, 33, 100, 161, 17] * 3
    cache = PagedCache(g, lens)
    cache.fill()
    q = cache.randn(len(lens), g["num_heads"], head_dim)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = decode("native", q, cache, torch.full_like(q, math.nan))
    finally:
        torch.set_num_threads(previous)
    assert_close(got, oracle_decode(q, cache.k_cache, cache.v_cache, cache.block_tables,
                                    cache.lens, head_dim ** -0.5), torch.bfloat16)
