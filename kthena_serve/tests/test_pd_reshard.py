"""PD between TP instances: the re-sharding copy (pd/reshard.py) on real /dev/shm pools.

Each rank's pool must hold, after the copy, exactly the heads a one-rank pool of the same
model holds at that rank's head range (`kv_head_range`), block for block: the property that
makes a decode rank read the same K/V as a colocated engine of its size."""

from __future__ import annotations

import pytest
import torch

from kthena_core.shape import kv_head_moves, kv_head_range
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.layer_copy import LayerCopy, RankCopier, moved_bytes
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


def _randomize(pools: RankPools) -> None:
    """Fresh random values in every part of every rank's pool (int8 parts: -127..127)."""
    for caches in pools.caches:
        for parts in caches:
            for part in parts:
                part.copy_(torch.randn(part.shape).to(part.dtype) if part.is_floating_point()
                           else torch.randint(-127, 128, part.shape, dtype=part.dtype))


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


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp"),
                         [(2, 2, 2), (3, 2, 1), (3, 1, 2), (4, 4, 2)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_each_ranks_layer_copies_equal_the_whole_copy(num_heads: int, src_tp: int, dst_tp: int,
                                                      kv_cache_dtype: str) -> None:
    """Layer-wise between TP instances: every prefill rank runs its own moves of each layer
    (`RankCopier`, as in its forward), and the decode pools end as `copy_resharded` leaves
    them; `moved_bytes` is what the copy moved."""
    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS,
                          kv_cache_dtype=kv_cache_dtype)
    src, whole_copy, layered = (_pools(num_heads, src_tp, config),
                                _pools(num_heads, dst_tp, config),
                                _pools(num_heads, dst_tp, config))
    copiers = []
    try:
        _randomize(src)
        moves = kv_head_moves(num_heads, src_tp, dst_tp)
        src_ids, dst_ids = [1, 2, 5], [7, 0, 3]
        moved = copy_resharded(src, whole_copy, moves, src_ids, dst_ids)
        assert moved_bytes(src.caches, moves, len(src_ids)) == moved
        plan = LayerCopy([p.name for p in layered.pools], [p.layout for p in layered.pools],
                         moves, src_ids, dst_ids)
        for rank, pool in enumerate(src.pools):
            copiers.append(RankCopier(rank, pool))
            hook = copiers[-1].hook([plan])
            assert hook is not None  # every prefill rank is the source of some move
            for layer in range(LAYERS):
                hook(layer)
        for want, got in zip(whole_copy.caches, layered.caches, strict=True):
            for want_parts, got_parts in zip(want, got, strict=True):
                for a, b in zip(want_parts, got_parts, strict=True):
                    assert torch.equal(a, b)
    finally:
        for copier in copiers:
            copier.close()
        for pools in (src, whole_copy, layered):
            pools.close()


def test_a_layer_copy_refuses_what_does_not_fit() -> None:
    moves = kv_head_moves(2, 1, 2)
    with pytest.raises(ValueError, match="3 source blocks for 2 destination blocks"):
        LayerCopy(["a", "b"], [None, None], moves, [1, 2, 3], [4, 5])
    with pytest.raises(ValueError, match="destination rank 1; the destination has 1 ranks"):
        LayerCopy(["a"], [None], moves, [1], [4])


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


@pytest.mark.parametrize(("num_heads", "src_tp", "dst_tp"),
                         [(2, 2, 2), (3, 1, 2), (3, 2, 1), (2, 1, 4), (4, 4, 2)])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_head_ranges_move_what_the_copy_moves(num_heads: int, src_tp: int, dst_tp: int,
                                              kv_cache_dtype: str) -> None:
    """The byte ranges a put over Mooncake moves (``KVLayout.head_pair_ranges``, one list per
    head move: pd/reshard_put.py), applied as plain byte copies, leave every decode rank's pool
    byte for byte as the re-sharding copy does, and count the same bytes."""
    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS,
                          kv_cache_dtype=kv_cache_dtype)
    src = _pools(num_heads, src_tp, config)
    copied, put = _pools(num_heads, dst_tp, config), _pools(num_heads, dst_tp, config)
    try:
        _randomize(src)
        moves = kv_head_moves(num_heads, src_tp, dst_tp)
        src_ids, dst_ids = [1, 2, 5, 6], [7, 8, 0, 3]
        moved = copy_resharded(src, copied, moves, src_ids, dst_ids)
        num_bytes = 0
        for move in moves:
            source, target = src.pools[move.src_rank], put.pools[move.dst_rank]
            for pair in source.layout.head_pair_ranges(
                    src_ids, dst_ids, target.layout, src_head=move.src_start,
                    dst_head=move.dst_start, num_heads=move.count):
                target.buffer[pair.dst_offset:pair.dst_offset + pair.length] = (
                    source.buffer[pair.src_offset:pair.src_offset + pair.length])
                num_bytes += pair.length
        assert num_bytes == moved
        for want, got in zip(copied.pools, put.pools, strict=True):
            assert torch.equal(want.buffer, got.buffer)
    finally:
        for pools in (src, copied, put):
            pools.close()


def test_a_head_slice_outside_a_layout_is_refused() -> None:
    from mooncake_kv.layout import LayoutMismatchError

    config = EngineConfig(dtype="float32", block_size=BLOCK, num_kv_blocks=BLOCKS)
    two, one = (kv_layout_for(LAYERS, n, HEAD_DIM, config) for n in (2, 1))
    with pytest.raises(ValueError, match=r"destination heads \[1, 2\) are not within its 1"):
        two.head_pair_ranges([0], [0], one, src_head=0, dst_head=1, num_heads=1)
    other = kv_layout_for(LAYERS + 1, 1, HEAD_DIM, config)
    with pytest.raises(LayoutMismatchError, match="only the head counts may differ"):
        two.head_pair_ranges([0], [0], other, src_head=0, dst_head=0, num_heads=1)


def test_a_pool_ref_names_one_mooncake_handle_per_rank() -> None:
    ref = PoolRef(8, 4, "float32", mooncake_handle="a", tp=2, rank_mooncake_handles=["a", "b"])
    assert ref.rank_handles() == ("a", "b")
    assert PoolRef(8, 4, "float32", mooncake_handle="a").rank_handles() == ("a",)
    with pytest.raises(ValueError, match="names 0 Mooncake rank pools for tp=2"):
        PoolRef(8, 4, "float32", tp=2, rank_shm_names=["a", "b"]).rank_handles()
