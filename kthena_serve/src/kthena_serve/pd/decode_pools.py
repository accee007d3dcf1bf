"""The decode workers' pools a prefill worker writes into on its own host (``shm``): each is
mapped once (pool_share.py: a POSIX shared-memory file, or CUDA memory through CUDA IPC) and
gets its own ``ModelRunner`` over this worker's model. A decode worker that restarts exports a
new pool; the old one is unmapped as soon as no queued prefill runs over it (its creator owns
the name and unlinks it). Every pool's layout is checked against what this worker computes:
the KV dtype must match, or its blocks would be read with the wrong element type.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import ModelRunner, kv_dtype_name, kv_layout_for
from kthena_serve.pd.pool_share import open_pool, pool_key
from kthena_serve.pd.protocol import PoolRef
from mooncake_kv.layout import KVLayout

__all__ = ["DecodePools"]


class DecodePools:
    """The runners over the decode pools mapped here, by pool (see the module docs).

    Args:
        model: this worker's loaded model.
        config: this worker's config (its block size, dtype and KV dtype).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self._runners: dict[str, ModelRunner] = {}

    def layout_for(self, num_blocks: int, block_size: int | None = None,
                   dtype: str | None = None, kv_cache_dtype: str | None = None) -> KVLayout:
        """The layout of a pool of ``num_blocks`` (a decode worker's: its block size, dtype
        and KV dtype; this worker's own where not given).

        Raises:
            ValueError: the pool's KV dtype is not the one this worker computes (int8 vs not):
                its blocks would be read with the wrong element type.
        """
        cfg = EngineConfig(model=self.config.model, dtype=dtype or self.config.dtype,
                           block_size=block_size or self.config.block_size,
                           num_kv_blocks=num_blocks,
                           kv_cache_dtype=kv_cache_dtype or self.config.kv_cache_dtype)
        if kv_dtype_name(cfg) != kv_dtype_name(self.config):
            raise ValueError(f"the decode pool holds {kv_dtype_name(cfg)} KV but this prefill "
                             f"worker writes {kv_dtype_name(self.config)}: start both with the "
                             "same --dtype and --kv-cache-dtype")
        m = self.model
        return kv_layout_for(m.config.shape.num_layers, m.num_kv_heads_per_rank, m.head_dim, cfg,
                             num_parts=m.kv_parts)

    def check(self, ref: PoolRef) -> tuple[str, KVLayout]:
        """The key of the pool ``ref`` names here, and its layout (checked on every task, not
        only on the first attach: a KV dtype mismatch is refused).

        Raises:
            ValueError: no such pool here (``PoolShareError``), or a KV dtype mismatch.
        """
        key = pool_key(ref)
        return key, self.layout_for(ref.num_blocks, ref.block_size, ref.dtype, ref.kv_cache_dtype)

    def runner(self, ref: PoolRef, key: str, layout: KVLayout,
               in_use: Collection[int]) -> ModelRunner:
        """The runner over ``ref``'s pool (``key`` and ``layout`` from ``check``), mapped now if
        it is new; a new pool unmaps the old ones whose runners' ids are not ``in_use`` (a
        restarted decode worker's). The caller serialises calls."""
        runner = self._runners.get(key)
        if runner is None:
            runner = ModelRunner(self.model, open_pool(ref, layout))
            for name, old in list(self._runners.items()):
                if id(old) not in in_use:
                    old.close()
                    del self._runners[name]
            self._runners[key] = runner
        return runner

    def close(self) -> None:
        """Unmap every pool."""
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()
