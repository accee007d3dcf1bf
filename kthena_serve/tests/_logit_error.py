"""How far a quantised model's next-token log-probabilities move, and the yardsticks that say
how far is acceptable, all measured in the same run on the same CPU (the int8 KV and int8
weight tests).

Every figure is taken at the first decode step of a prompt (the prompt prefilled, then one
token): the first step that reads the KV cache back. Four kinds of run are compared::

    exact      float32 model, float32 pool, PyTorch kernels     the reference
    format     float32 model, the quantised cache or weights    what the format itself loses
    fp8        float32 model, K/V or weights rounded to e4m3    the known-good yardstick
    served     bf16 model as the engine runs it (bf16 / int8)   what a user gets

The float32 runs use the PyTorch kernels and do not depend on the CPU beyond float32 rounding
(3e-5 nats between the native and PyTorch float32 kernels here), so the format and fp8 figures
are the same on every machine; what varies with the CPU (AVX-512 vs AMX bf16 kernels, their
summation order) is the bf16 error, and it is measured in the run.

fp8 (e4m3: 3 mantissa bits) is vLLM's ``--kv-cache-dtype fp8`` (scale 1.0) and its
per-channel fp8 weight-only checkpoints: a quantisation in wide use, so "int8 loses no more
than fp8 on the same tensors" is the acceptance line. int8's step (the vector's or channel's
absmax / 127) is finer than e4m3's (at least |x| / 16) for every value above about absmax / 8,
coarser below: which loses more depends on the tensors, so it is measured on them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

import kthena_serve.model.llama as llama
import mooncake_ops
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import create_pool, kv_layout_for, layer_caches
from mooncake_kv.paged import paged_batch

Errors = tuple[float, float, float]  # (max over the vocabulary, over the top 10, KL)
FP8 = torch.float8_e4m3fn
_FP8_MAX = 448.0  # the largest finite e4m3 value


def first_decode_logprobs(model, prompt: Sequence[int], token: int,  # noqa: ANN001
                          kv_cache_dtype: str = "auto") -> torch.Tensor:
    """float32 log-softmax of the first decode step (``token`` after ``prompt``), the model
    driven directly over a fresh pool of ``kv_cache_dtype`` in the model's own dtype."""
    dtype = str(model.embed_weight.dtype).removeprefix("torch.")
    config = EngineConfig(num_kv_blocks=8, kv_cache_dtype=kv_cache_dtype, dtype=dtype)
    layout = kv_layout_for(model.config.shape.num_layers, model.num_kv_heads_per_rank,
                           model.head_dim, config)
    pool = create_pool(layout, config)
    try:
        caches, n = layer_caches(pool), len(prompt)

        def step(ids: Sequence[int], start: int) -> torch.Tensor:
            batch = paged_batch([(range(8), start, len(ids))], block_size=config.block_size)
            with torch.inference_mode():
                return model(torch.tensor(list(ids)), batch.positions, batch, caches)[0]

        step(prompt, 0)
        return torch.log_softmax(step([token], n).float(), -1)
    finally:
        pool.close()


@contextlib.contextmanager
def reference_kernels() -> Iterator[None]:
    """The PyTorch kernels (the float32 runs; a no-op where there is no native build)."""
    previous = mooncake_ops.use_native(False)
    try:
        yield
    finally:
        mooncake_ops.use_native(previous)


@contextlib.contextmanager
def fp8_kv() -> Iterator[None]:
    """K/V rounded to e4m3 as they are written to the cache (vLLM's fp8 KV cache, scale 1.0).
    As with an int8 pool, a prompt's own prefill attends to its exact K/V and later steps read
    the rounded cache."""
    write_kv = llama.write_kv

    def rounded(k, v, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return write_kv(k.to(FP8).to(k.dtype), v.to(FP8).to(v.dtype), *args, **kwargs)

    llama.write_kv = rounded
    try:
        yield
    finally:
        llama.write_kv = write_kv


def fp8_weights(model):  # noqa: ANN001, ANN201
    """``model`` (dense, unpacked) with every matmul weight rounded to e4m3 with one scale per
    output channel (absmax / 448), as ``quantize_linear_weights`` does for int8: the LM head
    too, the embedding table left dense (a tied head gets its own copy)."""
    for module in model.modules():
        for name in llama._MATMUL_WEIGHTS:
            weight = getattr(module, name, None)
            if isinstance(weight, torch.Tensor):
                scale = weight.abs().amax(-1, keepdim=True).clamp_min(1e-30) / _FP8_MAX
                rounded = (weight / scale).to(FP8).to(weight.dtype) * scale
                setattr(module, name, torch.nn.Parameter(rounded, requires_grad=False))
    return model


def errors(exact: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> Errors:
    """(max |a - b| over the vocabulary, max over the exact run's 10 likeliest tokens,
    KL(a || b)) of two log-softmax rows. One token set per prompt for every pair, so the
    first two obey the triangle inequality."""
    diff = a - b
    return (float(diff.abs().max()), float(diff[exact.topk(10).indices].abs().max()),
            float((a.exp() * diff).sum()))


def worst(rows: Sequence[Errors]) -> Errors:
    """Each measure's worst over the prompts."""
    return tuple(max(column) for column in zip(*rows, strict=True))  # type: ignore[return-value]


def served_bound(fp8: Errors, bf16: Errors) -> Errors:
    """How far the served quantised engine may be from the served bf16 one: the fp8 format's
    error plus the bf16 error of each side (the bf16 engine's against the exact run, and the
    quantised engine's against its own format, which is the same kind of error), by the
    triangle inequality. KL is quadratic in a small change of the log-probabilities (KL ~
    1/2 sum p d^2), so its square root adds like the other two."""
    return (fp8[0] + 2 * bf16[0], fp8[1] + 2 * bf16[1],
            (math.sqrt(max(fp8[2], 0.0)) + 2 * math.sqrt(max(bf16[2], 0.0))) ** 2)


def fmt(values: Sequence[float]) -> str:
    return "(" + ", ".join(f"{x:.3g}" for x in values) + ")"


def assert_within_yardsticks(got: dict[str, Errors]) -> None:
    """Print the first decode step's errors (``got``: worst over the prompts of int8's
    ``int8_format``, ``fp8_format``, ``bf16`` and ``served``) and check them against the
    yardsticks: int8's format error at most fp8's, and the served int8 engine within
    ``served_bound`` of the served bf16 one. Nonzero int8 errors show the int8 path really
    ran."""
    print("\nfirst decode step (max over vocab, over top 10, KL), worst of 6: "
          f"int8 format {fmt(got['int8_format'])}, fp8 format {fmt(got['fp8_format'])}, "
          f"bf16 {fmt(got['bf16'])}, served int8 vs bf16 {fmt(got['served'])} "
          f"(bound {fmt(served_bound(got['fp8_format'], got['bf16']))})")
    assert got["int8_format"][0] > 0 and got["served"][0] > 0
    assert all(x <= y for x, y in zip(got["int8_format"], got["fp8_format"], strict=True))
    bound = served_bound(got["fp8_format"], got["bf16"])
    assert all(x <= y for x, y in zip(got["served"], bound, strict=True))
