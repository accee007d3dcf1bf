"""A latent layout (``num_parts`` 1): MLA's one compressed vector per token and layer, K only.

Its bytes per token are layers x (kv_lora_rank + qk_rope_head_dim) x dtype size, half of a K/V
pool of the same head size; its ranges, pair copies and layer-wise pieces cover exactly the
latent units, and its pool's views are K only.
"""

from __future__ import annotations

import pytest
import torch

from mooncake_kv.layout import KVLayout, KVPart, LayoutError, LayoutKind
from mooncake_kv.pool import KVPool
from mooncake_kv.sizing import KVShape, SizingError

# DeepSeek-V3's latent: kv_lora_rank 512 + qk_rope_head_dim 64 over 61 layers
DEEPSEEK_V3 = KVShape(num_layers=61, num_kv_heads=1, head_dim=512 + 64, block_size=16,
                      dtype="bf16", num_parts=1)


def test_bytes_per_token_are_the_latent_only():
    assert DEEPSEEK_V3.bytes_per_token == 61 * (512 + 64) * 2
    kv = KVShape(num_layers=61, num_kv_heads=1, head_dim=576, block_size=16, dtype="bf16")
    assert kv.bytes_per_token == 2 * DEEPSEEK_V3.bytes_per_token
    assert DEEPSEEK_V3.fingerprint() == "L61-H1-D576-B16-bf16-latent"
    with pytest.raises(SizingError, match=r"num_parts must be 2 \(K and V\) or 1"):
        KVShape(num_layers=2, num_kv_heads=1, head_dim=8, num_parts=3)


@pytest.mark.parametrize("kind", list(LayoutKind))
def test_ranges_cover_exactly_the_latent_units(kind):
    shape = KVShape(num_layers=3, num_kv_heads=1, head_dim=8, block_size=4, dtype="fp32",
                    num_parts=1)
    layout = KVLayout(shape, 10, kind)
    assert layout.parts == (KVPart.K,)
    assert layout.total_bytes == 10 * 3 * 4 * 8 * 4
    covered = sum(r.length for r in layout.batch_ranges([2, 3, 7]))
    assert covered == 3 * shape.bytes_per_block
    one_layer = layout.pair_ranges([2, 3], [5, 6], layer=1)
    assert sum(p.length for p in one_layer) == 2 * 4 * 8 * 4  # two blocks of one layer's latent
    assert sum(r.length for r in layout.layer_ranges([2, 3], 1)) == 2 * 4 * 8 * 4
    with pytest.raises(LayoutError, match="holds K only"):
        layout.segment(0, 0, KVPart.V)


def test_pool_views_are_k_only_and_distinct():
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=6, block_size=4, dtype="fp32",
                    num_parts=1)
    with KVPool.create(KVLayout(shape, 5)) as pool:
        for layer in range(2):
            pool.k_cache(layer).fill_(float(layer + 1))
        assert pool.k_cache(0).shape == (5, 4, 1, 6)
        assert torch.all(pool.k_cache(0) == 1) and torch.all(pool.k_cache(1) == 2)
        assert pool.buffer.numel() == 5 * 2 * 4 * 6 * 4
        with pytest.raises(TypeError, match="latent pool .* has no V cache"):
            pool.v_cache(0)
