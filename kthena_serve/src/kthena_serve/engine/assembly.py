"""The engine's default parts made from an ``EngineConfig``: the runner over its KV pool
(``build_runner``: one process, or ``tp x pp`` pinned ranks) with the tokenizer, and the KV cache
manager over the runner's blocks (``create_kv_manager``). ``LLMEngine.from_config`` assembles
them; a PD prefill worker builds its own pool's manager with the same function.
"""

from __future__ import annotations

import torch

from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import ModelRunner, Runner, create_pool, kv_layout_for
from kthena_serve.engine.threads import configure_threads
from kthena_serve.model import Tokenizer
from mooncake_kv import KVCacheManager

__all__ = ["build_runner", "create_kv_manager"]


def create_kv_manager(config: EngineConfig, num_blocks: int) -> KVCacheManager:
    """The KV cache manager ``config`` asks for, over ``num_blocks`` blocks."""
    return KVCacheManager(num_blocks, config.block_size, index=config.prefix_index,
                          hash_algo=config.hash_algorithm,
                          enable_prefix_caching=config.enable_prefix_caching,
                          check_invariants=config.check_invariants)


def build_runner(config: EngineConfig, model: torch.nn.Module | None = None,
                 tokenizer: Tokenizer | None = None, *,
                 shared_pool: bool = False) -> tuple[Runner, Tokenizer]:
    """(runner, tokenizer): parallel ranks for ``tp * pp > 1``, else the given or loaded model.

    Args:
        model, tokenizer: an already loaded pair (tests); loaded from ``config.model`` if None.
        shared_pool: put the KV pool in POSIX shared memory (a PD decode worker's pool); with
            tp > 1 every rank's pool (``ParallelModelRunner.rank_pools`` names them), which
            ``--kv-offload`` at tp > 1 always asks for (rank 0's offloader maps them).

    Raises:
        ValueError: ``shared_pool`` with ``pp > 1`` (a stage's pool holds some layers only).
    """
    if config.world_size > 1 or config.ranks_from == "env":
        if shared_pool and config.pp > 1:
            raise ValueError(f"a shared KV pool with pp={config.pp} is not supported: a PD "
                             "worker's ranks split its heads (tp), not its layers; run PD "
                             "workers with pp=1")
        from kthena_serve.engine.parallel_runner import ParallelModelRunner

        shared_pool = shared_pool or config.kv_offload is not None  # engine/rank_blocks.py

        rank_env = None
        if config.ranks_from == "env":
            from kthena_comm.env import RankEnv

            rank_env = RankEnv.from_env()  # ranks_from="env" asks for the launcher's variables
        # pins this process to one core
        runner = ParallelModelRunner(config, rank_env, shared_pool=shared_pool)
        return runner, runner.tokenizer
    configure_threads(config.num_threads)
    if model is None:
        from kthena_serve.model import load_model

        model, tokenizer = load_model(config.model, dtype=config.torch_dtype,
                                      device=config.device, quantization=config.quantization,
                                      kernels=config.kernels, kv_block_size=config.block_size)
    layout = kv_layout_for(model.config.shape.num_layers, model.num_kv_heads_per_rank,
                           model.head_dim, config, num_parts=model.kv_parts)
    return ModelRunner(model, create_pool(layout, config, shared=shared_pool)), tokenizer
