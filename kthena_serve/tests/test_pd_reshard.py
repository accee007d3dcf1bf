"""PD between TP instances: the re-sharding copy (pd/reshard.py) on real /dev/shm pools.

Each rank's pool must hold, after the copy, exactly the heads a one-rank pool of the same
model holds at that rank's head range (`kv_head_range`), block for block: the property that
makes a decode rank read the same K/V as a colocated engine of its size."""

from __future__ import annotations

import pytest
import torch

from kthena_core.shape import kv_head_moves, kv_head_range
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import kv_layout_for, layer_caches
from kthena_serve.pd.protocol import PoolRef
from kthena_serve.pd.reshard import RankPools, copy_resharded
from mooncake_kv.pool import KVPool

LAYERS, HEAD_DIM, BLOCKS, BLOCK = 2, 8, 12, 4


def _pools(num_heads: int, tp: int, config: EngineConfig, num_parts: int = 2) -> RankPools:
    pools = [KVPool.create(kv_layout_for(LAYERS, len(kv_head_range(num_heads, tp, r)), HEAD_DIM,
                                         config, num_parts=num_parts), shared=True)
             for r in range(tp)]
    return RankPools(pools, owned=pools)


def _fill(pools: RankPools, whole: list[tuple[torch.Tensor, ...]], num_heads: int) -> None:
    """Each rank's pool = its heads of ``whole`` (a one-rank pool's caches)."""
    for rank, caches in enumerate(pools.caches):
        heads = kv_head_range(num_heads, pools.tp, rank)
        for layer, parts in enumerate(caches):
            for target, source in zip(parts, whole[layer], strict=True):
                target.copy_(source[:, :, heads.start:heads.stop])


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp"),
                         [(2, 2, 2), (3, 1, 2), (3, 2, 1), (2, 1, 4), (4, 4, 2), (2, 4, 1)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_each_decode_rank_gets_exactly_its_heads(num_heads: int, src_tp: int, dst_tp: int,
                                                 kv_cache_dtype: str) -> None:
    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS,
                          kv_cache_dtype=kv_cache_dtype)
    whole = KVPool.create(kv_layout_for(LAYERS, num_heads, HEAD_DIM, config))
    for parts in layer_caches(whole):
        for part in parts:
            part.copy_(torch.randn(part.shape).to(part.dtype) if part.is_floating_point()
                       else torch.randint(-127, 128, part.shape, dtype=part.dtype))
    truth = layer_caches(whole)
    src, dst = _pools(num_heads, src_tp, config), _pools(num_heads, dst_tp, config)
    try:
        _fill(src, truth, num_heads)
        before = [[[p.clone() for p in parts] for parts in caches] for caches in dst.caches]
        src_ids, dst_ids = [1, 2, 5], [7, 0, 3]
        moved = copy_resharded(src, dst, kv_head_moves(num_heads, src_tp, dst_tp),
                               src_ids, dst_ids)
        per_head_token = sum(p[0, 0, 0].numel() * p.element_size() for p in truth[0])
        assert moved == LAYERS * len(src_ids) * BLOCK * per_head_token * sum(
            len(kv_head_range(num_heads, dst_tp, r)) for r in range(dst_tp))
        untouched = [b for b in range(BLOCKS) if b not in dst_ids]
        for rank, caches in enumerate(dst.caches):
            heads = kv_head_range(num_heads, dst_tp, rank)
            for layer, parts in enumerate(caches):
                for i, part in enumerate(parts):
                    want = truth[layer][i][src_ids][:, :, heads.start:heads.stop]
                    assert torch.equal(part[dst_ids], want)
                    assert torch.equal(part[untouched], before[rank][layer][i][untouched])
    finally:
        src.close()
        dst.close()
        whole.close()


def test_a_latent_pool_goes_to_every_decode_rank() -> None:
    """MLA: one latent per token, replicated on every rank (kv_heads_per_rank 1)."""
    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS)
    src, dst = _pools(1, 1, config, num_parts=1), _pools(1, 2, config, num_parts=1)
    try:
        for (latent,) in src.caches[0]:
            latent.copy_(torch.randn(latent.shape))
        copy_resharded(src, dst, kv_head_moves(1, 1, 2), [3, 4], [0, 9])
        for rank in range(2):
            for (want,), (got,) in zip(src.caches[0], dst.caches[rank], strict=True):
                assert torch.equal(got[[0, 9]], want[[3, 4]])
    finally:
        src.close()
        dst.close()


def test_a_pool_ref_names_one_file_per_rank() -> None:
    ref = PoolRef(8, 4, "float32", shm_name="a", tp=2, rank_shm_names=["a", "b"])
    assert ref.rank_names() == ("a", "b")
    assert PoolRef(8, 4, "float32", shm_name="a").rank_names() == ("a",)
    with pytest.raises(ValueError, match="names 0 /dev/shm rank pools for tp=2"):
        PoolRef(8, 4, "float32", tp=2, mooncake_handle="{}").rank_names()


def test_mismatched_block_lists_are_refused() -> None:
    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS)
    src, dst = _pools(2, 1, config), _pools(2, 2, config)
    try:
        with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
            copy_resharded(src, dst, kv_head_moves(2, 1, 2), [0, 1], [0])
    finally:
        src.close()
        dst.close()
