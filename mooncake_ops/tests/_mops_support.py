"""Float64 oracles, Hypothesis strategies and the implementation switch shared by the tests.

The oracles restate each op from its definition (per token, per head, float64) and share no
code with the implementations they judge.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import strategies as st

import mooncake_ops as mo
from mooncake_ops.backends import native

IMPLS = ("native", "reference")
# |actual - oracle| <= ATOL + RTOL * |oracle|, per compute dtype (outputs are rounded to it).
TOLERANCES = {torch.float32: (2e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2),
              torch.float16: (2e-3, 2e-3)}


@contextlib.contextmanager
def using(name: str):
    if name == "native" and not native.is_available():
        pytest.skip(f"native kernels not built: {native.unavailable_reason()}")
    previous = mo.use_native(name == "native")
    try:
        yield
    finally:
        mo.use_native(previous)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    atol, rtol = TOLERANCES[dtype]
    assert not actual.isnan().any(), "output has NaN (an element was never written?)"
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# ---- oracles --------------------------------------------------------------------------------
def tokens64(cache, scale, table_row, n):
    """Tokens 0..n-1 of one sequence, by definition: block table_row[t // B], row t % B."""
    block_size = cache.shape[1]
    t = torch.arange(n)
    blocks, rows = table_row.long()[t // block_size], t % block_size
    x = cache[blocks, rows].double()
    return x if scale is None else x * scale[blocks, rows].double()[..., None]


def attend64(q, keys, values, scale):
    """q [heads, d] over keys/values [n, kv_heads, d]; zeros when n == 0."""
    group = q.shape[0] // keys.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        if keys.shape[0]:
            p = torch.softmax(keys[:, h // group] @ q[h].double() * scale, dim=0)
            out[h] = p @ values[:, h // group]
    return out


def oracle_decode(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale=None,
                  v_scale=None):
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, n in enumerate(context_lens.tolist()):
        keys = tokens64(k_cache, k_scale, block_tables[b], n)
        values = tokens64(v_cache, v_scale, block_tables[b], n)
        out[b] = attend64(q[b], keys, values, scale)
    return out


def oracle_prefill(q, k, v, k_cache, v_cache, block_tables, cached_lens, query_lens, scale,
                   k_scale=None, v_scale=None):
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for b, (c, n) in enumerate(zip(cached_lens.tolist(), query_lens.tolist(), strict=True)):
        keys = torch.cat([tokens64(k_cache, k_scale, block_tables[b], c), k[start:start + n].double()])
        values = torch.cat([tokens64(v_cache, v_scale, block_tables[b], c), v[start:start + n].double()])
        for i in range(n):
            out[start + i] = attend64(q[start + i], keys[:c + i + 1], values[:c + i + 1], scale)
        start += n
    return out


# ---- paged cases ----------------------------------------------------------------------------
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@st.composite
def geometry(draw):
    block_size = draw(st.sampled_from([16, 32, 128]))
    num_kv_heads = draw(st.sampled_from([1, 2]))
    return dict(block_size=block_size, num_kv_heads=num_kv_heads,
                num_heads=num_kv_heads * draw(st.sampled_from([1, 3, 8])),
                head_dim=draw(st.sampled_from([64, 128])),
                dtype=draw(st.sampled_from(DTYPES)), int8=draw(st.booleans()),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)))


def length(draw, block_size: int, allow_zero: bool = False) -> int:
    choices = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 7,
               draw(st.integers(1, 3 * block_size))]
    return draw(st.sampled_from(([0] if allow_zero else []) + choices))


class PagedCache:
    """A NaN-poisoned paged cache (optionally strided views of a block-major pool) holding
    sequences of the given lengths in shuffled blocks; block tables padded with garbage."""

    def __init__(self, g: dict, lens: list[int], spare_columns: int = 2):
        self.g, gen = g, torch.Generator().manual_seed(g["seed"])
        bs, hk, d, dtype = g["block_size"], g["num_kv_heads"], g["head_dim"], g["dtype"]
        needed = [math.ceil(n / bs) for n in lens]
        num_blocks = sum(needed) + 3
        cache_dtype = torch.int8 if g["int8"] else dtype
        self.k_cache, self.v_cache = self._pool(num_blocks, (bs, hk, d), cache_dtype, g["strided"])
        self.k_scale = self.v_scale = None
        if g["int8"]:
            self.k_scale, self.v_scale = self._pool(num_blocks, (bs, hk), torch.float32, g["strided"])
        order = torch.randperm(num_blocks, generator=gen).tolist()
        width = max(needed, default=0) + spare_columns
        self.block_tables = torch.randint(-5, 10**6, (len(lens), width), generator=gen, dtype=torch.int32)
        for b, k in enumerate(needed):
            self.block_tables[b, :k] = torch.tensor(order[:k], dtype=torch.int32)
            order = order[k:]
        self.lens = torch.tensor(lens, dtype=torch.int32)
        self.gen = gen

    @staticmethod
    def _pool(num_blocks, inner, dtype, strided):
        poison = 0 if dtype == torch.int8 else float("nan")
        if strided:  # [block][k|v][...], like mooncake_kv's block-major pool
            pool = torch.full((num_blocks, 2, *inner), poison, dtype=dtype)
            return pool[:, 0], pool[:, 1]
        return (torch.full((num_blocks, *inner), poison, dtype=dtype),
                torch.full((num_blocks, *inner), poison, dtype=dtype))

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.g["dtype"])

    def fill(self) -> None:
        """Write every sequence's tokens with the reference write_kv (fills scales for int8)."""
        g = self.g
        total = int(self.lens.sum())
        key = self.randn(total, g["num_kv_heads"], g["head_dim"])
        value = self.randn(total, g["num_kv_heads"], g["head_dim"])
        with using("reference"):
            mo.write_kv(key, value, self.k_cache, self.v_cache, self.slots(self.lens.tolist()),
                        k_scale=self.k_scale, v_scale=self.v_scale)

    def slots(self, lens, starts=None):
        bs, out = self.g["block_size"], []
        for b, n in enumerate(lens):
            first = 0 if starts is None else starts[b]
            t = torch.arange(first, first + n)
            out.append(self.block_tables[b].long()[t // bs] * bs + t % bs)
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)

    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


# GGUF: byte offsets of a block's fp16 scales, per type
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
          "Q6_K": (208,)}  # byte offsets of a block's fp16 scales


def random_blocks(kind: str, rows: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [rows, K / block_size * block_bytes] as a file stores them: random bytes, with
    finite fp16 scales of both signs (any bytes are a valid block but for NaN / inf scales)."""
    t = mo.GGUF_TYPES[kind]
    blocks = torch.randint(0, 256, (rows, in_features // t.block_size, t.block_bytes),
                           dtype=torch.uint8, generator=gen)
    for at in SCALES[kind]:
        scale = torch.randn(rows, blocks.shape[1], 1, generator=gen) * 0.02
        blocks[..., at:at + 2] = scale.half().view(torch.uint8)
    return blocks.reshape(rows, -1)
