"""MLA attention over the paged latent cache (`mooncake_ops.mla`) against a float64 oracle.

Every tolerance is derived, per output element, from the float64 computation of the same
inputs: a first-order bound on what rounding the scores, the probabilities and the output to
the compute dtype (unit roundoff u_c) and accumulating in fp32 (u_acc) can change, doubled for
second-order terms (`attend64`). A test also checks the bound is tight enough to catch an
off-by-one in the causal mask. Caches are NaN outside the written entries and block tables
hold garbage past each sequence, so reading anything not written fails.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_ops as mo
from mooncake_ops import mla

PATHS = ("api", "reference", *mla.CANDIDATES)
DTYPES = (torch.float32, torch.bfloat16)
LORA, ROPE, NOPE = 32, 8, 16  # small DeepSeek-like dims: entry D = 40, value = latent = 32
U32 = torch.finfo(torch.float32).eps / 2
EXAMPLES = settings(max_examples=max(8, settings.default.max_examples // 4))


# ---- the float64 oracle and its rounding bound -------------------------------------------------
def attend64(q, keys, values, scale, first_position, u_c, u_acc):
    """Causal attention by definition in float64, and a bound on a float computation's error.

    q [n, H, E] at positions first_position.. ; keys [G, K, E], values [G, K, V] with G = 1
    (MLA: one latent "head" for all) or G = H. Returns (out [n, H, V], bound [n, H, V]).

    With s = scale q.k, p = softmax(s), o = sum p v: perturbing s_k by d_k moves o by
    sum p_k d_k (v_k - o), so scores rounded to the compute dtype (|d_k| <= u_c |s_k|) or
    accumulated in fp32 over E terms (|d_k| <= E u_acc scale sum |q e|) move it by at most
    u sum p |s| |v - o|; probabilities rounded move it by u_c sum p |v|, their fp32 softmax
    (exp, a sum of K terms) by (K + 8) u_acc sum p |v|, the output's rounding by u_c |o|.
    |v - o| <= |v| + |o| keeps it to matmuls.
    """
    n, heads = q.shape[:2]
    q, keys, values = q.double(), keys.double().expand(heads, -1, -1), values.double()
    values = values.expand(heads, -1, -1)
    s = torch.einsum("nhe,hke->nhk", q, keys) * scale
    mass = torch.einsum("nhe,hke->nhk", q.abs(), keys.abs()) * scale
    visible = (torch.arange(keys.shape[1]) <= first_position + torch.arange(n)[:, None])[:, None]
    p = torch.softmax(s.masked_fill(~visible, -math.inf), dim=-1)
    out = torch.einsum("nhk,hkv->nhv", p, values)

    def spread(weight):  # >= sum_k p_k weight_k |v_k - o|
        pw = p * weight.masked_fill(~visible, 0.0)
        return torch.einsum("nhk,hkv->nhv", pw, values.abs()) + pw.sum(-1, keepdim=True) * out.abs()

    mean_abs = torch.einsum("nhk,hkv->nhv", p, values.abs())
    num_keys = visible.sum(-1, keepdim=True)
    bound = (u_c * (spread(s.abs()) + mean_abs + out.abs())
             + u_acc * (q.shape[-1] * spread(mass) + (num_keys + 8) * mean_abs))
    return out, 2 * bound


def unit_roundoff(dtype):
    return torch.finfo(dtype).eps / 2


def oracle(q, cache, block_tables, cached_lens, query_lens, scale, v_dim, shift=0):
    """Every sequence by definition (token t at block_tables[s, t // B], row t % B), float64;
    ``shift`` moves the causal edge (a deliberately wrong oracle). Returns (out, bound)."""
    out, bound = [], []
    start, block_size = 0, cache.shape[1]
    for seq, (c, n) in enumerate(zip(cached_lens.tolist(), query_lens.tolist(), strict=True)):
        if n:
            t = torch.arange(c + n)
            entries = cache[block_tables[seq].long()[t // block_size], t % block_size][None]
            o, b = attend64(q[start:start + n], entries, entries[..., :v_dim], scale, c + shift,
                            unit_roundoff(q.dtype), U32)
            out.append(o)
            bound.append(b)
        start += n
    empty = torch.zeros(0, q.shape[1], v_dim, dtype=torch.float64)
    return torch.cat(out) if out else empty, torch.cat(bound) if bound else empty


def run(path, q, cache, block_tables, cached_lens, query_lens, scale, v_dim):
    if path == "api":
        return mo.paged_mla_attention(q, cache, block_tables, cached_lens, query_lens, scale,
                                      v_dim)
    if path == "reference":
        return mo.paged_mla_attention_reference(q, cache, block_tables, cached_lens, query_lens,
                                                scale, v_dim)
    lens = mla._check_attention(q, cache, block_tables, cached_lens, query_lens, scale, v_dim)
    return mla.CANDIDATES[path](q, cache, block_tables, lens, scale, v_dim)


def assert_within(got, expected, bound):
    assert not got.isnan().any(), "NaN in the output (a row never written, or garbage read)"
    err = (got.double() - expected).abs()
    worst = (err - bound).argmax() if err.numel() else None
    assert bool((err <= bound).all()), (
        f"error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g} at flat "
        f"index {int(worst)}")


# ---- paged latent caches ----------------------------------------------------------------------
class LatentCache:
    """A NaN-poisoned latent cache (optionally a strided view of a layer-interleaved pool)
    whose sequences hold shuffled, non-contiguous blocks; table columns past a sequence's
    blocks hold garbage ids."""

    def __init__(self, contexts, block_size, dtype, seed, strided=False, dim=LORA + ROPE):
        self.gen = torch.Generator().manual_seed(seed)
        self.block_size, self.dtype, self.dim = block_size, dtype, dim
        needed = [math.ceil(c / block_size) for c in contexts]
        num_blocks = sum(needed) + 3
        pool = torch.full((num_blocks, 2 if strided else 1, block_size, dim), math.nan, dtype=dtype)
        self.cache = pool[:, -1]  # strided: every other block-sized slab belongs to another layer
        order = torch.randperm(num_blocks, generator=self.gen).tolist()
        self.block_tables = torch.randint(-7, 10**6, (len(contexts), max(needed, default=0) + 2),
                                          generator=self.gen, dtype=torch.int32)
        for seq, count in enumerate(needed):
            self.block_tables[seq, :count] = torch.tensor(order[:count], dtype=torch.int32)
            order = order[count:]

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def slots(self, seq, first, count):
        t = torch.arange(first, first + count)
        return self.block_tables[seq].long()[t // self.block_size] * self.block_size + t % self.block_size

    def write(self, seq, first, count):
        """Random entries at positions first .. first+count-1 of ``seq``, via write_latent."""
        mo.write_latent(self.randn(count, self.dim), self.cache, self.slots(seq, first, count))


def lens_tensor(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


def written_batch(cached, queries, block_size, dtype, seed, strided=False, heads=4):
    """A cache holding every sequence's cached and new entries, and the new tokens' queries."""
    cache = LatentCache([c + n for c, n in zip(cached, queries, strict=True)], block_size, dtype,
                        seed, strided)
    for seq, (c, n) in enumerate(zip(cached, queries, strict=True)):
        cache.write(seq, 0, c + n)
    q = cache.randn(sum(queries), heads, LORA + ROPE)
    return cache, q, lens_tensor(cached), lens_tensor(queries)


SCALE = (NOPE + ROPE) ** -0.5


# ---- parity on fresh random batches -----------------------------------------------------------
@st.composite
def batches(draw):
    block_size = draw(st.sampled_from([4, 16]))
    batch = draw(st.integers(1, 6))
    cached = [draw(st.sampled_from([0, 1, block_size - 1, block_size, draw(st.integers(0, 70))]))
              for _ in range(batch)]
    queries = [draw(st.sampled_from([0, 1, 1, 1, block_size + 1, draw(st.integers(1, 20))]))
               for _ in range(batch)]
    return cached, queries, block_size, draw(st.booleans()), draw(st.integers(0, 2**31 - 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
@EXAMPLES
@given(case=batches())
def test_matches_float64_on_mixed_batches(path, dtype, case):
    """Prefill chunks (with and without cached prefixes), decode and sequences with no new
    tokens, in one batch, on every path."""
    cached, queries, block_size, strided, seed = case
    cache, q, cached_t, queries_t = written_batch(cached, queries, block_size, dtype, seed, strided)
    got = run(path, q, cache.cache, cache.block_tables, cached_t, queries_t, SCALE, LORA)
    assert got.shape == (sum(queries), 4, LORA) and got.dtype == dtype
    assert_within(got, *oracle(q, cache.cache, cache.block_tables, cached_t, queries_t, SCALE,
                               LORA))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("path", PATHS)
def test_decode_groups_with_ragged_contexts(path, dtype):
    """Decode only: short contexts close together (batched into padded groups, partial last
    blocks whose unwritten rows are NaN), one long context, one of length 1; int64 indices."""
    contexts = [19, 23, 17, 21, 300, 1, 18, 24]
    cache, q, cached_t, queries_t = written_batch([c - 1 for c in contexts], [1] * len(contexts),
                                                  16, dtype, seed=5)
    groups = mla._decode_groups([(s, s, c - 1, 1) for s, c in enumerate(contexts)])
    assert max(len(g) for g in groups) > 1  # the padded batched code runs
    args = (q, cache.cache, cache.block_tables.long(), cached_t.long(), queries_t.long())
    assert_within(run(path, *args, SCALE, LORA), *oracle(*args, SCALE, LORA))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_deepseek_v2_lite_sizes(dtype):
    """16 heads, kv_lora_rank 512, rope 64: decode of three sequences and a prefill chunk."""
    cached, queries = [0, 100, 700, 37], [1, 1, 1, 9]
    cache = LatentCache([c + n for c, n in zip(cached, queries, strict=True)], 16, dtype, seed=11,
                        dim=512 + 64)
    for seq, (c, n) in enumerate(zip(cached, queries, strict=True)):
        cache.write(seq, 0, c + n)
    q = cache.randn(sum(queries), 16, 512 + 64)
    args = (q, cache.cache, cache.block_tables, lens_tensor(cached), lens_tensor(queries))
    assert_within(mo.paged_mla_attention(*args, (128 + 64) ** -0.5, 512),
                  *oracle(*args, (128 + 64) ** -0.5, 512))


def test_bound_catches_an_off_by_one_causal_mask():
    """The float32 tolerance is tight: an oracle that lets each new token see the next one
    disagrees with the op beyond it."""
    cache, q, cached_t, queries_t = written_batch([5], [6], 4, torch.float32, seed=1)
    args = (q, cache.cache, cache.block_tables, cached_t, queries_t, SCALE, LORA)
    got = mo.paged_mla_attention(*args)
    leaky, bound = oracle(*args, shift=1)
    assert bool(((got.double() - leaky).abs()[:-1] > bound[:-1]).any())


def test_chunked_prefill_then_decode():
    """One sequence written and attended chunk by chunk (7 new, then 5, then two decode
    steps) gives each token what the oracle gives it over the final cache."""
    chunks = [7, 5, 1, 1]
    cache = LatentCache([sum(chunks)], 4, torch.float32, seed=2)
    q = cache.randn(sum(chunks), 4, LORA + ROPE)
    table, got, done = cache.block_tables, [], 0
    for n in chunks:
        cache.write(0, done, n)
        got.append(mo.paged_mla_attention(q[done:done + n], cache.cache, table,
                                          lens_tensor([done]), lens_tensor([n]), SCALE, LORA))
        done += n
    assert_within(torch.cat(got), *oracle(q, cache.cache, table, lens_tensor([0]),
                                          lens_tensor([done]), SCALE, LORA))


@pytest.mark.parametrize("path", PATHS)
def test_empty_batch(path):
    cache = LatentCache([], 4, torch.float32, seed=0)
    got = run(path, torch.zeros(0, 4, LORA + ROPE), cache.cache,
              torch.zeros(0, 0, dtype=torch.int32), lens_tensor([]), lens_tensor([]), SCALE, LORA)
    assert got.shape == (0, 4, LORA)


def test_long_prefill_runs_in_slices(monkeypatch):
    """A chunk whose score matrix passes the budget runs in slices of query rows."""
    monkeypatch.setattr(mla, "_SCORE_ELEMENTS", 4 * 4 * 40)  # 4 heads x 40 keys: 4 rows a slice
    cache, q, cached_t, queries_t = written_batch([25], [15], 4, torch.float32, seed=3)
    args = (q, cache.cache, cache.block_tables, cached_t, queries_t, SCALE, LORA)
    assert_within(mo.paged_mla_attention(*args), *oracle(*args))


# ---- decode grouping ---------------------------------------------------------------------------
@given(contexts=st.lists(st.integers(1, 600), max_size=40))
def test_decode_groups_partition_and_bound_padding(contexts):
    items = [(s, s, c - 1, 1) for s, c in enumerate(contexts)]
    groups = mla._decode_groups(items)
    assert sorted(it for g in groups for it in g) == sorted(items)
    for group in groups:
        longest = max(it[2] + 1 for it in group)
        if len(group) > 1:
            assert longest <= mla._BATCH_CONTEXT
            assert len(group) * longest <= mla._GROUP_KEYS
            assert all(it[2] + 1 >= mla._GROUP_FILL * longest for it in group)


# ---- absorbed (the op) == non-absorbed (standard MHA over up-projected K and V) ----------------
V_HEAD = 12


def causal_mha(q, keys, values, scale, first_position):
    """Plain MHA in q's dtype: q [n, H, E], keys [H, K, E], values [H, K, V] -> [n, H, V]."""
    s = torch.einsum("nhe,hke->nhk", q, keys) * scale
    hidden = torch.arange(keys.shape[1]) > first_position + torch.arange(q.shape[0])[:, None]
    p = torch.softmax(s.masked_fill(hidden[:, None], -math.inf), dim=-1)
    return torch.einsum("nhk,hkv->nhv", p, values)


def non_absorbed(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, cached, queries):
    """DeepSeek's attention as written: per head K = [c_kv W_UK_h^T | k_pe], V = c_kv W_UV_h^T,
    every sequence on its own (c_kv / k_pe: the sequences' tokens back to back)."""
    out, start, token = [], 0, 0
    for c, n in zip(cached, queries, strict=True):
        c_seq, pe_seq = c_kv[token:token + c + n], k_pe[token:token + c + n]
        keys = torch.cat([torch.einsum("tl,hpl->htp", c_seq, w_uk),
                          pe_seq.expand(w_uk.shape[0], -1, -1)], dim=-1)
        values = torch.einsum("tl,hvl->htv", c_seq, w_uv)
        q = torch.cat([q_nope[start:start + n], q_pe[start:start + n]], dim=-1)
        out.append(causal_mha(q, keys, values, SCALE, c))
        start, token = start + n, token + c + n
    return torch.cat(out)


def absorbed(q_nope, q_pe, cache, block_tables, w_uk, w_uv, cached, queries, attention):
    """The decode form: q_abs = [q_nope W_UK_h | q_pe] over the latent cache, then W_UV."""
    q_abs = torch.cat([torch.einsum("nhp,hpl->nhl", q_nope, w_uk), q_pe], dim=-1)
    latent = attention(q_abs, cache, block_tables, lens_tensor(cached), lens_tensor(queries),
                       SCALE, LORA)
    return torch.einsum("nhl,hvl->nhv", latent, w_uv)


def test_absorbed_equals_non_absorbed():
    """The op with W_UK absorbed into the query and W_UV applied after equals standard MHA over
    the up-projected keys and values: exactly in float64 (to far below one float32 rounding),
    and in float32 as closely as the standard float32 computation itself is to float64."""
    heads, cached, queries = 4, [9, 20, 0], [6, 1, 3]
    cache = LatentCache([c + n for c, n in zip(cached, queries, strict=True)], 4, torch.float32,
                        seed=7)
    total = sum(cached) + sum(queries)
    c_kv, k_pe = cache.randn(total, LORA), cache.randn(total, ROPE)
    token = 0
    for seq, ctx in enumerate(c + n for c, n in zip(cached, queries, strict=True)):
        mo.write_latent(torch.cat([c_kv, k_pe], -1)[token:token + ctx], cache.cache,
                        cache.slots(seq, 0, ctx))
        token += ctx
    w_uk, w_uv = cache.randn(heads, NOPE, LORA) / LORA ** 0.5, cache.randn(heads, V_HEAD, LORA)
    q_nope, q_pe = cache.randn(sum(queries), heads, NOPE), cache.randn(sum(queries), heads, ROPE)
    args = (q_nope, q_pe, c_kv, k_pe, w_uk, w_uv)
    exact = non_absorbed(*(a.double() for a in args), cached, queries)
    standard32 = non_absorbed(*args, cached, queries)

    exact_absorbed = absorbed(q_nope.double(), q_pe.double(), cache.cache.double(),
                              cache.block_tables, w_uk.double(), w_uv.double(), cached, queries,
                              lambda *a: oracle(*a)[0])
    absorbed32 = absorbed(q_nope, q_pe, cache.cache, cache.block_tables, w_uk, w_uv, cached,
                          queries, mo.paged_mla_attention)

    scale_of = exact.norm()
    assert (exact_absorbed - exact).norm() <= U32 * scale_of  # the identity, in float64
    yardstick = max((standard32.double() - exact).norm(), U32 * scale_of)
    assert (absorbed32.double() - exact).norm() <= 4 * yardstick
    assert (absorbed32 - standard32).double().norm() <= 5 * yardstick


# ---- write_latent ------------------------------------------------------------------------------
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_latent_writes_each_slot_and_skips_negative(dtype, index_dtype):
    cache = LatentCache([10], 4, dtype, seed=4, strided=True)
    pool_before = cache.cache.clone()
    latent = cache.randn(4, LORA + ROPE)
    slots = torch.tensor([13, 2, -1, 7], dtype=index_dtype)  # blocks 3, 0, skipped, 1
    mo.write_latent(latent, cache.cache, slots)
    expected = pool_before.clone()
    for row, slot in ((0, 13), (1, 2), (3, 7)):
        expected[slot // 4, slot % 4] = latent[row]
    torch.testing.assert_close(cache.cache, expected, rtol=0, atol=0, equal_nan=True)


def latent_args(**over):
    args = dict(latent=torch.zeros(3, 40), cache=torch.zeros(4, 4, 40),
                slot_mapping=torch.tensor([0, 5, 15]))
    args.update(over)
    return args


BAD_WRITES = [
    ("latent rank", dict(latent=torch.zeros(3, 1, 40)), mo.OpsShapeError, "2-D"),
    ("latent size", dict(latent=torch.zeros(3, 32)), mo.OpsShapeError, "entry size"),
    ("cache rank", dict(cache=torch.zeros(4, 4, 1, 40)), mo.OpsShapeError, "3-D"),
    ("dtypes", dict(latent=torch.zeros(3, 40, dtype=torch.bfloat16)), mo.OpsDTypeError,
     "no int8 MLA cache"),
    ("int8 cache", dict(cache=torch.zeros(4, 4, 40, dtype=torch.int8)), mo.OpsDTypeError,
     "allowed"),
    ("slot count", dict(slot_mapping=torch.tensor([0, 1])), mo.OpsShapeError, "num_tokens"),
    ("slot dtype", dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), mo.OpsDTypeError, "int64"),
    ("slot list", dict(slot_mapping=[0, 1, 2]), mo.OpsTypeError, "torch.tensor"),
    ("slot past cache", dict(slot_mapping=torch.tensor([0, 1, 16])), mo.BlockTableError,
     "only 16 slots"),
]


@pytest.mark.parametrize("case", BAD_WRITES, ids=[c[0] for c in BAD_WRITES])
def test_write_latent_rejects(case):
    _, over, error, message = case
    with pytest.raises(error, match=message):
        mo.write_latent(**latent_args(**over))


# ---- attention misuse --------------------------------------------------------------------------
def attention_args(**over):
    args = dict(q=torch.zeros(3, 4, 40), cache=torch.zeros(4, 4, 40),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                cached_lens=lens_tensor([5, 7]), query_lens=lens_tensor([2, 1]), scale=0.2,
                v_dim=32)
    args.update(over)
    return args


BAD_ATTENTION = [
    ("q rank", dict(q=torch.zeros(3, 40)), mo.OpsShapeError, "3-D"),
    ("q dtype", dict(q=torch.zeros(3, 4, 40, dtype=torch.float64)), mo.OpsDTypeError, "allowed"),
    ("q entry size", dict(q=torch.zeros(3, 4, 32)), mo.OpsShapeError, "entry size"),
    ("cache rank", dict(cache=torch.zeros(4, 4, 1, 40)), mo.OpsShapeError, "3-D"),
    ("cache dtype", dict(cache=torch.zeros(4, 4, 40, dtype=torch.bfloat16)), mo.OpsDTypeError,
     "the cache is torch.bfloat16"),
    ("v_dim too big", dict(v_dim=41), mo.OpsShapeError, "1..40"),
    ("v_dim zero", dict(v_dim=0), mo.OpsShapeError, "1..40"),
    ("v_dim float", dict(v_dim=32.0), mo.OpsTypeError, "v_dim must be a Python int"),
    ("scale", dict(scale=None), mo.OpsTypeError, "scale must be"),
    ("table dtype", dict(block_tables=torch.zeros(2, 2)), mo.OpsDTypeError, "int32"),
    ("table rank", dict(block_tables=torch.zeros(4, dtype=torch.int32)), mo.OpsShapeError, "2-D"),
    ("lens batch", dict(cached_lens=lens_tensor([5])), mo.OpsShapeError, "batch size"),
    ("lens list", dict(query_lens=[2, 1]), mo.OpsTypeError, "torch.tensor"),
    ("query sum", dict(query_lens=lens_tensor([1, 1])), mo.OpsShapeError, "sum to num_tokens"),
    ("query negative", dict(query_lens=lens_tensor([4, -1])), mo.OpsShapeError, ">= 0"),
    ("cached negative", dict(cached_lens=lens_tensor([-2, 7])), mo.BlockTableError, ">= 0"),
    ("past table", dict(cached_lens=lens_tensor([5, 8])), mo.BlockTableError, "2 blocks x 4"),
    ("bad block", dict(block_tables=torch.tensor([[0, 1], [2, 4]], dtype=torch.int32)),
     mo.BlockTableError, "outside the cache's 4 blocks"),
]


@pytest.mark.parametrize("path", ["api", "reference"])
@pytest.mark.parametrize("case", BAD_ATTENTION, ids=[c[0] for c in BAD_ATTENTION])
def test_attention_rejects(path, case):
    _, over, error, message = case
    with pytest.raises(error, match=message):
        run(path, **attention_args(**over))


def test_unused_table_entries_are_never_read():
    """Columns past a sequence's blocks may hold any id (here: far outside the cache)."""
    args = attention_args(block_tables=torch.tensor([[0, 1, -9], [2, 3, 10**6]]))
    assert mo.paged_mla_attention(**args).shape == (3, 4, 32)
