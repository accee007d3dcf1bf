"""The fused decode step against the op chain it replaces, on fresh random layers.

The step's tasks run the ops' own kernel parts, each output element in the op's order, so the
comparison is exact (``torch.equal``): outputs, and every KV cache the step wrote to. Both
builds: the AVX-512 one here, the AVX2 one on a CPU without AVX-512 (or with
``ATEN_CPU_CAPABILITY=avx2`` where that build is installed), each over its own bf16 layout.
"""

from __future__ import annotations

import pytest
import torch
from _mops_support import random_blocks

import mooncake_ops as mo
from mooncake_ops.decode_step import (
    DecodeHead,
    DecodeLayer,
    FusedDecode,
    fused_decode_available,
    max_fused_rows,
    reference_layers,
    reference_logits,
    step_bf16_kernel,
)
from mooncake_ops.gguf_linear import native_gguf_available
from mooncake_ops.gguf_quants import pack_gguf_weight

pytestmark = pytest.mark.skipif(not fused_decode_available(),
                                reason="no native build with the fused step on this CPU")

KERNEL = step_bf16_kernel() if fused_decode_available() else mo.linear.NATIVE_PACKED_BF16
HIDDEN, HEADS, KV_HEADS, INTER, BLOCK = 256, 4, 2, 256, 16  # K-quants: K a multiple of 256
VOCAB = 336


def _w(*shape: int, scale: float = 0.08) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(torch.bfloat16)


def _matmul_weights(weights: str, q: int, kv: int) -> dict[str, torch.Tensor]:
    """bf16 as this build's step takes it (AVX-512: packed, gate/up interleaved; AVX2: dense,
    [gate; up]), int8 rows, or random GGUF blocks of type ``weights`` packed as
    GGUF_WEIGHT_ONLY takes them ([gate; up])."""
    if weights == "bf16":
        pack_gate_up = KERNEL.pack_gate_up or KERNEL.pack
        return {"qkv": KERNEL.pack(_w(q + 2 * kv, HIDDEN)), "o": KERNEL.pack(_w(HIDDEN, q)),
                "gate_up": pack_gate_up(_w(2 * INTER, HIDDEN)),
                "down": KERNEL.pack(_w(HIDDEN, INTER)), "head": KERNEL.pack(_w(VOCAB, HIDDEN))}
    if weights == "int8":  # per-channel int8 rows; gate/up as [gate; up]
        pack = mo.INT8_WEIGHT_ONLY.pack
        return {"qkv": pack(_w(q + 2 * kv, HIDDEN)), "o": pack(_w(HIDDEN, q)),
                "gate_up": pack(_w(2 * INTER, HIDDEN)), "down": pack(_w(HIDDEN, INTER)),
                "head": pack(_w(VOCAB, HIDDEN))}
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    shapes = {"qkv": (q + 2 * kv, HIDDEN), "o": (HIDDEN, q), "gate_up": (2 * INTER, HIDDEN),
              "down": (HIDDEN, INTER), "head": (VOCAB, HIDDEN)}
    return {name: pack_gguf_weight(random_blocks(weights, n, k, gen), weights, k)
            for name, (n, k) in shapes.items()}


def _layers(n: int, head_dim: int, *, bias: bool, qk_norm: bool, blocks: int,
            weights: str = "bf16") -> list[DecodeLayer]:
    return _model(n, head_dim, bias=bias, qk_norm=qk_norm, blocks=blocks, weights=weights)[0]


def _model(n: int, head_dim: int, *, bias: bool, qk_norm: bool, blocks: int,
           weights: str = "bf16") -> tuple[list[DecodeLayer], DecodeHead]:
    """``n`` random layers and a head, every matmul weight of the form ``weights``."""
    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    out = []
    for _ in range(n):
        k_cache, v_cache = (_w(blocks, BLOCK, KV_HEADS, head_dim, scale=1.0) for _ in range(2))
        matmuls = _matmul_weights(weights, q, kv)
        del matmuls["head"]
        out.append(DecodeLayer(
            input_norm=1 + _w(HIDDEN, scale=0.2), post_norm=1 + _w(HIDDEN, scale=0.2),
            qkv_bias=_w(q + 2 * kv) if bias else None,
            q_norm=1 + _w(head_dim, scale=0.2) if qk_norm else None,
            k_norm=1 + _w(head_dim, scale=0.2) if qk_norm else None,
            k_cache=k_cache, v_cache=v_cache, **matmuls))
    head = DecodeHead(norm=1 + _w(HIDDEN, scale=0.2), weight=_matmul_weights(weights, q, kv)["head"])
    return out, head


def _copy(layers: list[DecodeLayer]) -> list[DecodeLayer]:
    import attrs

    return [attrs.evolve(y, k_cache=y.k_cache.clone(), v_cache=y.v_cache.clone()) for y in layers]


def _batch(contexts: list[int], blocks: int) -> tuple[torch.Tensor, ...]:
    """positions, slots, block tables (each sequence its own shuffled blocks), lengths."""
    per_seq = blocks // len(contexts)
    order = torch.randperm(blocks).to(torch.int32)
    tables = torch.stack([order[i * per_seq:(i + 1) * per_seq] for i in range(len(contexts))])
    positions = torch.tensor([c - 1 for c in contexts])
    slots = torch.tensor([int(tables[i, (c - 1) // BLOCK]) * BLOCK + (c - 1) % BLOCK
                          for i, c in enumerate(contexts)])
    return positions, slots, tables, torch.tensor(contexts, dtype=torch.int32)


def _check_parity(head_dim, bias, qk_norm, contexts, threads, weights="bf16"):
    kernel = {"bf16": KERNEL, "int8": mo.INT8_WEIGHT_ONLY}.get(weights, mo.GGUF_WEIGHT_ONLY)
    if len(contexts) > max_fused_rows(kernel.name):
        pytest.skip(f"{len(contexts)} rows: the op chain's {kernel.name} takes another path on "
                    f"this build than the step, which takes at most {max_fused_rows(kernel.name)}")
    blocks = 16 * len(contexts)
    layers, head = _model(3, head_dim, bias=bias, qk_norm=qk_norm, blocks=blocks, weights=weights)
    rope = mo.build_rope_cache(head_dim, 512, 10000.0)
    shape = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": head_dim, "eps": 1e-6,
             "scale": head_dim ** -0.5}
    x = _w(len(contexts), HIDDEN, scale=1.0)
    args = (x, *_batch(contexts, blocks), rope)
    ours, theirs, ours_head, theirs_head = (_copy(layers) for _ in range(4))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = FusedDecode(ours, **shape).run(*args)
        want = reference_layers(theirs, *args, **shape)
        # on to the logits: the final norm and the LM head in the same call
        logits = FusedDecode(ours_head, **shape, head=head).logits(*args)
        want_logits = reference_logits(theirs_head, head, *args, **shape)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    for a, b in zip(ours, theirs, strict=True):  # the same K/V written to the same slots
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)
    assert not torch.equal(got[0], x)  # the layers ran
    assert logits.dtype == torch.float32 and logits.shape == (len(contexts), VOCAB)
    assert torch.equal(logits, want_logits)
    for a, b in zip(ours_head, ours, strict=True):  # the same K/V as without the head
        assert torch.equal(a.k_cache, b.k_cache) and torch.equal(a.v_cache, b.v_cache)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("bias", "qk_norm"), [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("contexts", [[1], [37], [16, 200], [16, 200, 5], [130, 1, 64, 17, 96, 33]])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_equals_the_op_chain(head_dim, bias, qk_norm, contexts, threads):
    torch.manual_seed(hash((head_dim, bias, qk_norm, tuple(contexts), threads)) % 2**31)
    _check_parity(head_dim, bias, qk_norm, contexts, threads)


@pytest.mark.parametrize("weights", ["int8", "Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize(("bias", "contexts"), [(False, [37]), (True, [200, 5]),
                                               (True, [130, 1, 64, 17, 96, 33])])
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_step_over_quantized_weights_equals_the_op_chain(weights, bias, contexts, threads):
    """int8 rows (the int8 op: VNNI where the CPU has it), and GGUF weights as the file stores
    them (grouped where the type allows, else rows); up to 6 rows, which both ops take for bf16
    x."""
    if weights != "int8" and not native_gguf_available():
        pytest.skip("no native GGUF matmul in this build")
    torch.manual_seed(hash((weights, bias, tuple(contexts), threads)) % 2**31)
    _check_parity(64, bias, False, contexts, threads, weights)


def _step(blocks: int = 4) -> tuple[FusedDecode, tuple]:
    layers = _layers(1, 64, bias=False, qk_norm=False, blocks=blocks)
    step = FusedDecode(layers, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=64, eps=1e-6,
                       scale=0.125)
    args = (_w(1, HIDDEN), *_batch([10], blocks), mo.build_rope_cache(64, 64, 10000.0))
    return step, args


@pytest.mark.parametrize(("index", "value", "message"), [
    (1, torch.tensor([64]), r"positions\[0\] = 64 is outside the rope table's \[0, 64\)"),
    (2, torch.tensor([4 * BLOCK]), r"slot_mapping\[0\] = 64 is outside the cache's 64 slots"),
    (4, torch.tensor([0], dtype=torch.int32), r"context_lens\[0\] = 0 must be in \[1, 64\]"),
    (3, torch.tensor([[9]], dtype=torch.int32), r"block_tables\[0, 0\] = 9 is used but outside"),
    (1, torch.tensor([3], dtype=torch.int32), "positions and slot_mapping must be contiguous int64"),
])
def test_bad_step_inputs_are_refused_by_name(index, value, message):
    step, args = _step()
    args = list(args)
    args[index] = value
    with pytest.raises(ValueError, match=message):
        step.run(*args)


def test_bad_layers_are_refused_by_name():
    layers = _layers(2, 64, bias=False, qk_norm=False, blocks=2)
    shape = {"num_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": 64, "eps": 1e-6,
             "scale": 0.125}
    import attrs

    # the other build's bf16 layout
    if KERNEL is mo.linear.NATIVE_PACKED_BF16:
        other, message = torch.zeros(HIDDEN, HEADS * 64), "must be a bf16 weight packed"
    else:
        other, message = torch.zeros(HIDDEN // 16, HEADS * 32, 16, 2), "must be a contiguous dense"
    wrong = attrs.evolve(layers[1], o=other.to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"layer 1 o weight {message}"):
        FusedDecode([layers[0], wrong], **shape)
    half = attrs.evolve(layers[0], q_norm=torch.ones(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="layer 0 q_norm and k_norm come together"):
        FusedDecode([half], **shape)
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        FusedDecode(layers, **{**shape, "num_kv_heads": 3})
    fp32 = attrs.evolve(layers[0], k_cache=layers[0].k_cache.float())
    with pytest.raises(ValueError, match="KV caches must be bf16"):
        FusedDecode([fp32], **shape)
    norm = torch.ones(HIDDEN, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lm_head weight must be"):
        FusedDecode(layers, **shape, head=DecodeHead(norm, other.to(torch.bfloat16)))
    with pytest.raises(ValueError, match=r"the final norm must be a contiguous bf16 tensor of shape \[256\]"):
        FusedDecode(layers, **shape, head=DecodeHead(norm[:64], layers[0].o))
    with pytest.raises(ValueError, match="no LM head: build it with head=DecodeHead"):
        FusedDecode(layers, **shape).logits(*_step()[1])
