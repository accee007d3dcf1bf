"""ModelRunner: the model, its KV pool, and one forward pass per scheduled batch."""

from __future__ import annotations

import torch

from kthena_serve.config import EngineConfig
from kthena_serve.model_inputs import ModelInputs, build_inputs
from kthena_serve.scheduler import ScheduledBatch
from mooncake_kv.layout import KVLayout, LayoutKind
from mooncake_kv.pool import KVPool
from mooncake_kv.sizing import KVShape

__all__ = ["ModelRunner", "kv_layout_for"]

_KV_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def kv_layout_for(num_layers: int, num_kv_heads: int, head_dim: int,
                  config: EngineConfig) -> KVLayout:
    """The pool layout: ``num_kv_blocks`` exactly, or as many blocks as ``kv_cache_memory`` holds.

    PER_LAYER order keeps each layer's cache one contiguous [blocks, block_size, heads, dim]
    tensor, the shape attention kernels index.

    Raises:
        ValueError: the memory budget holds no block at all.
    """
    shape = KVShape(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=config.block_size,
        dtype=_KV_DTYPES[config.torch_dtype],
    )
    if config.num_kv_blocks is not None:
        return KVLayout(shape, config.num_kv_blocks, LayoutKind.PER_LAYER)
    layout = KVLayout.fit(shape, config.kv_cache_memory, LayoutKind.PER_LAYER)
    if layout is None:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of "
                         f"{shape.bytes_per_block} bytes; give the cache more memory")
    return layout


class ModelRunner:
    """Runs the model over a ScheduledBatch, reading and writing KV in its own pool.

    Args:
        model: a ``LlamaForCausalLM`` (or anything with its forward signature).
        config: the engine config (block size, pool size, dtype).
    """

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.model = model
        self.block_size = config.block_size
        num_layers = model.config.num_hidden_layers
        layout = kv_layout_for(num_layers, model.num_kv_heads_per_rank, model.head_dim, config)
        self.pool = KVPool.create(layout)
        self.kv_caches = [(self.pool.k_cache(i), self.pool.v_cache(i)) for i in range(num_layers)]

    @property
    def num_blocks(self) -> int:
        return self.pool.layout.num_blocks

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward ``batch``; returns fp32 logits [num_requests, vocab] (last new token each)."""
        return self.forward(build_inputs(batch, self.block_size))

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> torch.Tensor:
        return self.model(inputs.input_ids, inputs.positions, inputs.attention, self.kv_caches)

    def close(self) -> None:
        self.pool.close()
