"""ModelRunner: a model over a given KV pool, and one forward pass per scheduled batch.

The pool is injected: host memory, POSIX shared memory (a PD decode worker's, or one a PD
prefill worker attached to) or device memory; the runner runs where the pool lives.
``Runner`` is what the engine needs of any runner: this one, or ``ParallelModelRunner``
(tp x pp ranks, this process rank 0).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import torch

from kthena_core.dtypes import canonical_dtype
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_inputs import ModelInputs, build_inputs
from kthena_serve.engine.scheduled import ScheduledBatch
from mooncake_kv.layout import KVLayout, LayoutKind
from mooncake_kv.pool import KVPool
from mooncake_kv.sizing import KVShape

__all__ = ["ModelRunner", "Runner", "create_pool", "kv_dtype_name", "kv_layout_for", "layer_caches",
           "sampled_logits"]


def kv_dtype_name(config: EngineConfig) -> str:
    """The pool's element type as mooncake_kv names it: ``"int8"``, or the compute dtype's
    ``"bf16"`` / ``"fp16"`` / ``"fp32"`` for ``kv_cache_dtype="auto"``."""
    return "int8" if config.kv_cache_dtype == "int8" else canonical_dtype(config.dtype)


def layer_caches(pool: KVPool) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, the views the model's attention reads: ``(k_cache, v_cache)``, for an int8
    pool ``(k_cache, v_cache, k_scale, v_scale)`` (float32 scales, one per token per head), and
    for a latent pool (MLA) ``(latent_cache,)``."""
    layers = range(pool.layout.shape.num_layers)
    if pool.layout.shape.num_parts == 1:  # MLA: one latent per token and layer, K's place
        return [(pool.k_cache(i),) for i in layers]
    if pool.layout.shape.dtype.is_quantized:
        return [(pool.k_cache(i), pool.v_cache(i), pool.k_scale(i), pool.v_scale(i))
                for i in layers]
    return [(pool.k_cache(i), pool.v_cache(i)) for i in layers]


def kv_layout_for(num_layers: int, num_kv_heads: int, head_dim: int,
                  config: EngineConfig, *, num_parts: int = 2) -> KVLayout:
    """The pool layout: ``num_kv_blocks`` exactly, or as many blocks as ``kv_cache_memory`` holds.

    PER_LAYER order keeps each layer's cache one contiguous [blocks, block_size, heads, dim]
    tensor, the shape attention kernels index. An int8 pool's float32 scales count in the
    budget (``KVShape.bytes_per_block``), so it holds a little under twice bf16's blocks.
    ``num_parts`` 1 is a latent pool (MLA: one vector of ``head_dim`` per token and layer).

    Raises:
        ValueError: the memory budget holds no block at all.
    """
    shape = KVShape(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=config.block_size,
        dtype=kv_dtype_name(config),
        num_parts=num_parts,
    )
    if config.num_kv_blocks is not None:
        return KVLayout(shape, config.num_kv_blocks, LayoutKind.PER_LAYER)
    layout = KVLayout.fit(shape, config.kv_cache_memory, LayoutKind.PER_LAYER)
    if layout is None:
        raise ValueError(f"kv_cache_memory={config.kv_cache_memory} bytes holds no KV block of "
                         f"{shape.bytes_per_block} bytes; give the cache more memory")
    return layout


def create_pool(layout: KVLayout, config: EngineConfig, *, shared: bool = False,
                device: torch.device | None = None) -> KVPool:
    """The engine's pool: on ``device`` (a rank's own, e.g. ``cuda:1``), by default
    ``config.device``. ``shared`` (a PD decode worker's pool, which prefill workers write):
    on cpu a /dev/shm file; on cuda / npu ordinary device memory, which a prefill worker on
    the host maps through CUDA IPC (cuda: pd/pool_share.py) or reaches through Mooncake
    registration (cuda, npu: pd/transfer.py).

    Raises:
        ValueError: a shared pool on a device type with neither route.
    """
    where = device or config.device
    kind = str(where).partition(":")[0]  # not torch.device: it knows npu only with torch_npu
    if shared and kind not in ("cpu", "cuda", "npu"):
        raise ValueError(f"a shared KV pool on {kind} is not supported: prefill workers reach "
                         "a decode pool in /dev/shm (cpu), through CUDA IPC (cuda) or through "
                         "Mooncake (cuda, npu) only")
    return KVPool.create(layout, shared=shared and kind == "cpu", device=where)


def sampled_logits(logits: torch.Tensor, batch: ScheduledBatch) -> torch.Tensor:
    """The rows of the sequences that sample this step (all of them in a decode step)."""
    rows = batch.sampled_rows
    return logits if len(rows) == len(batch.seqs) else logits[rows]


class Runner(Protocol):
    """What the engine needs of whatever runs the model: one forward per scheduled batch over
    a KV pool it owns.

    Attributes:
        model: the (rank 0) model; ``model.config`` gives the context length and vocabulary.
        pool: the (rank 0) KV pool; blocks are numbered ``0 .. num_blocks - 1``.
        device: where the pool and the logits live.
    """

    model: torch.nn.Module
    pool: KVPool
    device: torch.device

    @property
    def num_blocks(self) -> int: ...

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """fp32 logits [num sampled sequences, vocab] of ``batch``, in batch order."""
        ...

    def close(self) -> None:
        """Release the pool (and any rank processes); idempotent."""
        ...


class ModelRunner:
    """Runs the model over a ScheduledBatch, reading and writing KV in the pool it is given.

    Args:
        model: a ``LlamaForCausalLM`` (or anything with its forward signature), on the pool's
            device.
        pool: the KV pool; the runner owns it from now on (``close`` closes it).
    """

    def __init__(self, model: torch.nn.Module, pool: KVPool) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.buffer.device
        self.block_size = pool.layout.shape.block_size
        self.kv_caches = layer_caches(pool)

    @property
    def num_blocks(self) -> int:
        return self.pool.layout.num_blocks

    def execute(self, batch: ScheduledBatch,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Forward ``batch``; fp32 logits [num sampled sequences, vocab], in batch order.

        ``on_layer(layer)`` runs after each layer has written its K/V (the model's hook).
        """
        return sampled_logits(
            self.forward(build_inputs(batch, self.block_size, self.device), on_layer), batch)

    @torch.inference_mode()
    def execute_prompt_logits(self, batch: ScheduledBatch, request_ids: Collection[str],
                              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`execute`, plus fp32 logits at every position of the chunks of ``request_ids``
        (prompt logprobs): ``(sampled rows, {request id: [chunk tokens, vocab]})``; row j of
        a chunk predicts the token after its j-th token."""
        inputs = build_inputs(batch, self.block_size, self.device)
        index, last, spans = [], [], {}
        offset = 0
        for seq in batch.seqs:
            count = len(seq.token_ids)
            if seq.request_id in request_ids:
                spans[seq.request_id] = (len(index), count)
                index.extend(range(offset, offset + count))
            else:
                index.append(offset + count - 1)
            last.append(len(index) - 1)
            offset += count
        logits = self.model(inputs.input_ids, inputs.positions, inputs.attention, self.kv_caches,
                            logits_index=torch.tensor(index, device=self.device))
        sampled = logits[[last[i] for i in batch.sampled_rows]]
        return sampled, {rid: logits[start:start + count] for rid, (start, count) in spans.items()}

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        if on_layer is None:
            return self.model(inputs.input_ids, inputs.positions, inputs.attention,
                              self.kv_caches)
        return self.model(inputs.input_ids, inputs.positions, inputs.attention, self.kv_caches,
                          on_layer=on_layer)

    def close(self) -> None:
        self.pool.close()
