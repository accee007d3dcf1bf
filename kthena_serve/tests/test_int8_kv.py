"""int8 KV cache in the served path: the default model (SmolLM2-135M-Instruct, bf16 compute)
over an int8 pool, against the same model over a bf16 pool.

The int8 pool stores K/V as int8 with one float32 scale per token per KV head
(``mooncake_ops.quant``), written by ``write_kv`` and read inside paged attention. A prompt's
own prefill attends to its exact K/V (the cache is not read back), so the first token is the
bf16 engine's; every later step reads the quantised cache. The bounds below come from
measurements on this model (see each test); the engine features must work unchanged:
prefix reuse, preemption, TP=2 (a pool per rank) and the PD zero-copy / Mooncake hand-off
(scales move with the blocks).
"""

from __future__ import annotations

import argparse

import pytest
import torch
from _greedy_agreement import QUESTIONS, agreed, gap_at_divergence

import mooncake_ops
from kthena_serve.config import EngineConfig
from kthena_serve.engine import LLMEngine
from kthena_serve.model import load_model
from kthena_serve.model_runner import (
    ModelRunner,
    create_pool,
    kv_dtype_name,
    kv_layout_for,
    layer_caches,
)
from kthena_serve.pd.prefill import PrefillExecutor
from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json
from kthena_serve.sampling_params import SamplingParams
from mooncake_kv.paged import paged_batch
from mooncake_kv.pool import SHM_DIR
from mooncake_ops.backends import native

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5)
MEMORY = "32MiB"


@pytest.fixture(scope="module")
def loaded():
    threads = torch.get_num_threads()
    yield load_model("default", dtype=torch.bfloat16)
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:  # noqa: ANN001
    tokenizer = loaded[1]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
            for q in QUESTIONS]


def _engine(loaded, **options) -> LLMEngine:  # noqa: ANN001
    model, tokenizer = loaded
    config = EngineConfig(**{"kv_cache_memory": MEMORY, "num_threads": 1,
                             "check_invariants": True, **options})
    return LLMEngine.from_config(config, model=model, tokenizer=tokenizer)


def _run(engine: LLMEngine, prompts, params=GREEDY, *, one_at_a_time: bool = False):  # noqa: ANN001
    """Final outputs in prompt order (all added at once, or each run to the end alone)."""
    finals = {}
    groups = [[i] for i in range(len(prompts))] if one_at_a_time else [range(len(prompts))]
    for group in groups:
        for i in group:
            engine.add_request(f"q{i}", prompts[i], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
    return [finals[f"q{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def both(loaded, prompts):  # noqa: ANN001
    bf16, int8 = _engine(loaded), _engine(loaded, kv_cache_dtype="int8")
    try:
        yield (bf16, _run(bf16, prompts)), (int8, _run(int8, prompts))
    finally:
        bf16.close()
        int8.close()


def test_int8_pool_holds_about_twice_the_blocks_of_bf16(both):
    """1 + 4/64 bytes per cached element (head_dim 64) instead of 2: 1.88x the blocks."""
    (bf16, _), (int8, _) = both
    assert bf16.runner.pool.layout.shape.dtype.value == "bf16"
    assert int8.runner.pool.layout.shape.dtype.value == "int8"
    ratio = int8.runner.num_blocks / bf16.runner.num_blocks
    print(f"\nblocks in {MEMORY}: bf16 {bf16.runner.num_blocks}, int8 {int8.runner.num_blocks} "
          f"({ratio:.3f}x)")
    assert ratio >= 1.8
    assert int8.runner.pool.layout.total_bytes <= EngineConfig(kv_cache_memory=MEMORY).kv_cache_memory
    k_cache, v_cache, k_scale, v_scale = int8.runner.kv_caches[0]
    assert (k_cache.dtype, v_cache.dtype) == (torch.int8, torch.int8)
    assert (k_scale.dtype, k_scale.shape) == (torch.float32, k_cache.shape[:3])
    assert len(bf16.runner.kv_caches[0]) == 2  # a bf16 pool has no scales
    assert int8.processor.limits.kv_cache_dtype == "int8"
    assert bf16.processor.limits.kv_cache_dtype == "bf16"


def test_greedy_tokens_agree_with_the_bf16_engine(both):
    """Measured: 86 of the 96 first tokens agree before the first difference (prompt by
    prompt: 16, 16, 14, 16, 16, 8), and both divergences are near-ties of the bf16 engine (its
    pick ahead by 0.125 nats, one bf16 logit step). With other kernels the flips move (one
    build measured 76, with an exact tie of the bf16 engine's top two logits at a prompt's
    4th token: either pick is then its own coin toss).

    On a Zen 3 with the AVX2 decode kernel alone: 74 of 96 (9, 1, 16, 16, 16, 16), the second
    prompt flipping at its first decode step where the bf16 engine led by 0.1875 nats; with the
    AVX2 build's KV write, layer ops and matmuls too: 90 of 96 (16, 12, 14, 16, 16, 16), both
    divergences at 0.125 nats.

    The floor (64 of 96; a prompt below 6 only where the bf16 engine led by at most 0.25 nats,
    within the largest change of a top-10 log-probability int8 makes at the first decode step,
    0.25-0.28 measured) leaves room for another CPU's kernel order; the near-tie bound (0.5
    nats, ~1.8x that change) says an int8 flip may only pick a token the bf16 engine nearly
    picked itself."""
    (_, ref), (_, got) = both
    counts = [agreed(r, g) for r, g in zip(ref, got, strict=True)]
    gaps = [gap_at_divergence(r, g) for r, g in zip(ref, got, strict=True)]
    print(f"\nint8 vs bf16 greedy: {sum(counts)} of {NUM_TOKENS * len(ref)} tokens agree "
          f"(per prompt {counts}); bf16 margin at each divergence {gaps}")
    assert all(len(g.token_ids) == NUM_TOKENS for g in got)
    assert sum(counts) >= 64
    assert all(c >= 6 or gap <= 0.25 for c, gap in zip(counts, gaps, strict=True))
    assert all(gap is None or gap < 0.5 for gap in gaps)


def _first_decode_logits(loaded, kv_cache_dtype: str, prompt: list[int],  # noqa: ANN001
                         token: int, split: int | None = None) -> torch.Tensor:
    """fp32 logits of the first decode step (``token`` after ``prompt``): the first step that
    reads the cache back. The model is driven directly over a fresh pool of this dtype."""
    model = loaded[0]
    config = EngineConfig(num_kv_blocks=8, kv_cache_dtype=kv_cache_dtype)
    layout = kv_layout_for(model.config.num_hidden_layers, model.num_kv_heads_per_rank,
                           model.head_dim, config)
    pool = create_pool(layout, config)
    try:
        caches, n = layer_caches(pool), len(prompt)
        split = n if split is None else split

        def step(ids: list[int], start: int) -> torch.Tensor:
            batch = paged_batch([(range(8), start, len(ids))], block_size=config.block_size)
            with torch.inference_mode():
                return model(torch.tensor(ids), batch.positions, batch, caches)[0]

        step(prompt[:split], 0)
        if split < n:
            step(prompt[split:], split)
        return step([token], n)
    finally:
        pool.close()


def _errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float, float]:
    """(max |a - b| over the vocabulary, over a's 10 likeliest tokens, KL(a || b)) of two
    log-softmax rows."""
    diff = a - b
    return (float(diff.abs().max()), float(diff[a.topk(10).indices].abs().max()),
            float((a.exp() * diff).sum()))


# bf16 native vs PyTorch kernels, worst of the 6 prompts (max over the vocabulary, over the 10
# likeliest tokens, KL), measured on a Zen 4 (AVX512_BF16) where both run.
_BF16_KERNEL_NOISE = (0.62, 0.37, 5.1e-3)


def test_first_decode_step_logit_error_is_bounded(loaded, prompts, both):  # noqa: ANN001
    """The first decode step of each prompt (the first that reads the cache), log-softmax over
    the vocabulary. What int8 itself changes is measured with the kernels held fixed: int8 pool
    vs bf16 pool, both through the PyTorch kernels (``use_native(False)``). The yardstick is
    bf16's own numerical noise: the same bf16 pool through the native kernels vs the PyTorch
    ones (same data, other kernels; a prompt prefilled in two chunks is no yardstick, the native
    prefill gives it bit for bit the same answer). Measured (worst of 6 prompts; max over the
    vocabulary, over the 10 likeliest tokens, KL): int8 0.53, 0.25, 2.4e-3; yardstick 0.62,
    0.37, 5.1e-3. So int8's error must stay within 1.5x the yardstick's. The served paths
    (native kernels, which differ per pool: bf16 decode vs the int8 kernel) measured 1.52, 0.63,
    KL 2.0e-2 on one prompt, the others <= 0.75, 0.37, 5e-3: bounded outright at 1 nat over the
    10 likeliest tokens and KL 5e-2. Where the native kernels do not run (no build) both sides
    of the yardstick are the PyTorch kernels, and where only the AVX2 build runs (a CPU without
    AVX-512) the prefill attention and (beyond 32 rows) the matmuls are the same on both sides
    (measured on a Zen 3: 0.82, 0.32, 5.3e-3; with the decode attention alone native, 0.31,
    0.12, 6.1e-4): the yardstick is then at least the one measured above on Zen 4,
    `_BF16_KERNEL_NOISE`, where every kernel differs (int8 measured 0.47-0.56, 0.24-0.25,
    2.4e-3-2.9e-3 on that Zen 3; served 1.01, 0.32, 6.9e-3)."""
    (_, ref), _ = both
    int8, noise, served = [], [], []
    for prompt, out in zip(prompts, ref, strict=True):
        first = out.token_ids[0]
        a = torch.log_softmax(_first_decode_logits(loaded, "auto", prompt, first), -1)
        b = torch.log_softmax(_first_decode_logits(loaded, "int8", prompt, first), -1)
        previous = mooncake_ops.use_native(False)  # the PyTorch kernels for both pools
        try:
            c = torch.log_softmax(_first_decode_logits(loaded, "auto", prompt, first), -1)
            d = torch.log_softmax(_first_decode_logits(loaded, "int8", prompt, first), -1)
        finally:
            mooncake_ops.use_native(previous)
        int8.append(_errors(c, d))
        noise.append(_errors(a, c))
        served.append(_errors(a, b))
    worst_int8, worst_noise, worst_served = ([max(col) for col in zip(*rows, strict=True)]
                                             for rows in (int8, noise, served))
    print(f"\nfirst decode step (max over vocab, over top 10, KL), worst of {len(prompts)}: "
          f"int8 {[f'{x:.3g}' for x in worst_int8]}, bf16 native vs PyTorch kernels "
          f"{[f'{x:.3g}' for x in worst_noise]}, served int8 vs bf16 "
          f"{[f'{x:.3g}' for x in worst_served]}")
    assert worst_int8[0] > 0  # the int8 path really ran (a bf16 pool would match exactly)
    if not (native.is_available() and mooncake_ops.dispatch.native_enabled()):
        assert worst_noise == [0.0, 0.0, 0.0]  # the same kernels on both sides
    if not (native.isa() == "avx512" and mooncake_ops.dispatch.native_enabled()):
        worst_noise = [max(x, y) for x, y in zip(worst_noise, _BF16_KERNEL_NOISE, strict=True)]
    assert all(x <= 1.5 * y for x, y in zip(worst_int8, worst_noise, strict=True))
    assert worst_served[1] < 1.0 and worst_served[2] < 5e-2


def test_prefix_reuse_on_int8_gives_the_tokens_of_no_reuse(loaded, prompts):  # noqa: ANN001
    """The second prompt shares the first 32 tokens of the first. The reference computes
    those 32 in its own first chunk (a 32-token step budget, no prefix cache), so both read
    the same int8 blocks for them: the tokens must be identical."""
    shared = prompts[0][:32]
    pair = [prompts[0], shared + prompts[1][20:]]
    reused = _engine(loaded, kv_cache_dtype="int8", max_num_batched_tokens=32)
    plain = _engine(loaded, kv_cache_dtype="int8", max_num_batched_tokens=32,
                    enable_prefix_caching=False)
    try:
        got = _run(reused, pair, one_at_a_time=True)
        want = _run(plain, pair, one_at_a_time=True)
        assert got[1].num_cached_tokens == 32 and want[1].num_cached_tokens == 0
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert reused.kv.stats().num_used_blocks == 0
    finally:
        reused.close()
        plain.close()


def test_preemption_on_a_tiny_int8_pool_completes(loaded, prompts, both):  # noqa: ANN001
    """Six requests in 12 blocks (each needs 3-4 over its life): the scheduler preempts and
    recomputes. A recomputed prefill attends to exact K/V where the first run read int8, so a
    token may differ only where the large-pool int8 run was at a near-tie."""
    (_, _), (_, roomy) = both
    engine = _engine(loaded, kv_cache_dtype="int8", num_kv_blocks=12)
    try:
        outs = _run(engine, prompts)
        assert engine.stats().num_preemptions > 0
        assert all(len(o.token_ids) == NUM_TOKENS for o in outs)
        gaps = [gap_at_divergence(r, o) for r, o in zip(roomy, outs, strict=True)]
        print(f"\npreempted {engine.stats().num_preemptions} times; margins {gaps}")
        assert all(gap is None or gap < 0.5 for gap in gaps)
        assert engine.kv.stats().num_used_blocks == 0
    finally:
        engine.close()


def test_tp2_int8_pools_give_the_tokens_of_one_rank(loaded, prompts, both):  # noqa: ANN001
    """TP=2: each rank builds its own int8 pool (its KV head) and passes scales to its layers.
    The all-reduce changes bf16 summation order, so a token may differ only at a near-tie."""
    (_, _), (_, one_rank) = both
    engine = LLMEngine.from_config(EngineConfig(kv_cache_memory=MEMORY, kv_cache_dtype="int8",
                                                tp=2))
    try:
        assert engine.processor.limits.kv_cache_dtype == "int8"
        outs = _run(engine, prompts[:2])
    finally:
        engine.close()
    gaps = [gap_at_divergence(r, o) for r, o in zip(one_rank, outs, strict=False)]
    assert all(len(o.token_ids) == NUM_TOKENS for o in outs)
    assert all(gap is None or gap < 0.5 for gap in gaps), gaps


# ---- PD: the prefill worker computes into the decode worker's int8 pool ----------------------
@pytest.fixture(scope="module")
def pd_pair(loaded):  # noqa: ANN001
    model, tokenizer = loaded
    config = EngineConfig(num_kv_blocks=64, kv_cache_dtype="int8", num_threads=1)
    layout = kv_layout_for(model.config.num_hidden_layers, model.num_kv_heads_per_rank,
                           model.head_dim, config)
    decode = LLMEngine(config, ModelRunner(model, create_pool(layout, config, shared=True)),
                       tokenizer)
    executor = PrefillExecutor(model, config, own_pool=True)
    yield decode, executor
    segment = SHM_DIR / decode.runner.pool.name
    executor.close()
    decode.close()
    assert not segment.exists()  # the decode pool's shm segment is gone with its engine


def _pool_ref(decode: LLMEngine, **changes) -> PoolRef:
    pool, config = decode.runner.pool, decode.config
    fields = dict(num_blocks=pool.layout.num_blocks, block_size=config.block_size,
                  dtype=config.dtype, shm_name=pool.name, kv_cache_dtype=config.kv_cache_dtype)
    return PoolRef(**(fields | changes))


def _task(decode: LLMEngine, rid: str, ids: list[int], ref: PoolRef) -> PrefillTask:
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    reservation = decode.reserve(decode.processor.make_request(rid, ids, params, cache_salt=rid))
    assert reservation is not None and reservation.num_cached_tokens == 0
    return PrefillTask(rid, tuple(ids), 0, reservation.block_ids, params_to_json(params), ref,
                       cache_salt=rid)


def _decode_all(decode: LLMEngine, firsts: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Each prefilled request decoded to its end alone, as ``_run(..., one_at_a_time=True)``
    runs the colocated reference. Where the kernels are not batch-invariant (the PyTorch
    reference decode attention, on a CPU without AVX-512, pads every context to the batch's
    longest, so its matmuls sum in another order), a 3-sequence decode step may round a logit
    differently from a 1-sequence one and flip a near-tie. What this checks is the handoff;
    batched against batch-1 decode is test_engine_real.py's."""
    tokens = {}
    for rid, token in firsts.items():
        decode.admit_prefilled(rid, token)
        while decode.has_unfinished_requests():
            for out in decode.step():
                if out.finished:
                    tokens[out.request_id] = tuple(out.token_ids)
    return tokens


def test_pd_zero_copy_handoff_on_int8_pools_matches_colocated(loaded, prompts, pd_pair):  # noqa: ANN001
    decode, executor = pd_pair
    colocated = _engine(loaded, kv_cache_dtype="int8", num_kv_blocks=64,
                        enable_prefix_caching=False)
    try:
        want = [o.token_ids for o in _run(colocated, prompts[:3], one_at_a_time=True)]
    finally:
        colocated.close()
    firsts = {}
    for i, ids in enumerate(prompts[:3]):
        task = _task(decode, f"shm-{i}", ids, _pool_ref(decode))
        firsts[task.request_id] = executor.submit_shared(task).result(timeout=120).first_token_id
    got = _decode_all(decode, firsts)
    assert [got[f"shm-{i}"] for i in range(3)] == want
    assert decode.kv.stats().num_used_blocks == 0


def _prompt_bytes(pool, block_ids, num_tokens: int) -> list[torch.Tensor]:  # noqa: ANN001
    """Per layer: the prompt's int8 K, V and float32 scales as the pool holds them."""
    ids = torch.tensor(block_ids)
    views = []
    for layer in range(pool.layout.shape.num_layers):
        for part in (pool.k_cache, pool.v_cache, pool.k_scale, pool.v_scale):
            views.append(part(layer)[ids].flatten(0, 1)[:num_tokens].clone())
    return views


def test_pd_mooncake_put_moves_the_int8_scales(loaded, prompts, pd_pair):  # noqa: ANN001
    """Cross-host path on loopback: the prefill worker's own int8 pool, pushed layer by layer
    into the decode pool, lands the same K/V bytes and scales as a zero-copy prefill of the
    same prompt, and decodes the same tokens."""
    from kthena_serve.pd.transfer import BlockPutter, register_pool

    decode, executor = pd_pair
    engine, handle = register_pool(decode.runner.pool, "127.0.0.1", 30.0)
    putter = BlockPutter(executor.pool, "127.0.0.1", 30.0)
    try:
        ref = _pool_ref(decode, mooncake_handle=handle.to_json())
        put = _task(decode, "put", prompts[0], ref)
        layout = executor.layout_for(ref.num_blocks, ref.block_size, ref.dtype,
                                     ref.kv_cache_dtype)
        pushed = executor.submit_local(put, putter.session(
            ref.mooncake_handle, layout, layerwise=True)).result(timeout=120)
    finally:
        putter.close()
        engine.close()
    shm = _task(decode, "shm", prompts[0], _pool_ref(decode))
    shared = executor.submit_shared(shm).result(timeout=120)
    assert pushed.handoff_bytes > 0 and pushed.first_token_id == shared.first_token_id
    n, pool = len(prompts[0]), decode.runner.pool
    landed, computed = (_prompt_bytes(pool, t.block_ids, n) for t in (put, shm))
    assert all(torch.equal(a, b) for a, b in zip(landed, computed, strict=True))
    assert bool((landed[2] > 0).all())  # layer 0's K scales: every prompt token's arrived
    got = _decode_all(decode, {"put": pushed.first_token_id, "shm": shared.first_token_id})
    assert got["put"] == got["shm"]
    assert decode.kv.stats().num_used_blocks == 0


def test_pd_refuses_a_kv_dtype_mismatch(pd_pair):  # noqa: ANN001
    """A task naming a bf16 decode pool, sent to an int8 prefill worker (what /pd/prefill
    answers 400 for): refused before anything is written."""
    decode, executor = pd_pair
    assert kv_dtype_name(executor.config) == "int8"
    ref = _pool_ref(decode, kv_cache_dtype="auto")
    task = PrefillTask("mismatch", tuple(range(3, 40)), 0, (0, 1, 2), params_to_json(GREEDY), ref)
    with pytest.raises(ValueError, match="the decode pool holds bf16 KV but this prefill worker "
                                         "writes int8: start both with the same --dtype and "
                                         "--kv-cache-dtype"):
        executor.submit_shared(task)
    assert executor.num_queued_running() == (0, 0)


# ---- flags and config ------------------------------------------------------------------------
def test_cli_flag_and_yaml_compression_select_int8(tmp_path):  # noqa: ANN001
    from kthena_core.cli import build_parser
    from kthena_serve.cli import spec_from_args
    from kthena_serve.serve_args import add_engine_args
    from kthena_serve.spec import engine_config

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_engine_args(parser)
    assert "int8" in parser.format_help()
    flags = vars(parser.parse_args(["--kv-cache-dtype", "int8"]))
    assert engine_config(flags).kv_cache_dtype == "int8"
    path = tmp_path / "kthena_config.yaml"
    base = "cluster: {topology: auto}\nparallelism: {strategy: auto}\n"
    for compression, expected in [("{method: int8, group_size: 64}", "int8"),
                                  ("{method: int8}", "int8"), ("{method: none}", "auto")]:
        path.write_text(base + f"kv_cache: {{compression: {compression}}}\n")
        args = build_parser().parse_args(["serve", "--config", str(path)])
        assert spec_from_args(args).engine.kv_cache_dtype == expected
    path.write_text(base + "kv_cache: {compression: {method: int8, group_size: 128}}\n")
    with pytest.raises(ValueError, match=r"group_size: got 128; allowed: 64 \(the model's "
                                         r"head_dim\)"):
        spec_from_args(build_parser().parse_args(["serve", "--config", str(path)]))


def test_metrics_export_the_kv_dtype_and_block_count():
    from _tiny import tiny_engine

    from kthena_serve.async_engine import AsyncLLM
    from kthena_serve.server.metrics import ServerMetrics

    for kv_cache_dtype, name in (("int8", "int8"), ("auto", "fp32")):
        engine = AsyncLLM(tiny_engine(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=40))
        try:
            text = ServerMetrics(engine).render().decode()
        finally:
            engine.shutdown()
        assert (f'kthena_kv_cache_info{{block_size="4",dtype="{name}",num_blocks="40"}} 1.0'
                in text), text
