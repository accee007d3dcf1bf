"""Batched PD prefill: several requests' chunks in one forward, each handed off on its own.

A decode ``LLMEngine`` over a shared-memory pool (the decode worker's) reserves the blocks,
the prefill worker's ``PrefillExecutor`` fills them (zero copy over shm, or its own pool and a
Mooncake put over 127.0.0.1), and the decode engine admits and decodes. The default model,
greedy, a 64-block pool on each side, a 256-token step budget: the three prompts (150, 140
and 120 tokens) take two forwards batched, three one at a time.

The compute thread is held on an event while the jobs are queued, so which chunks share a
forward is fixed, not a matter of timing. Over Mooncake the KV goes layer by layer (each
layer's completed blocks put from the model's per-layer hook) or in one batch after the
prefill: both must land the same bytes and give the same tokens.
"""

from __future__ import annotations

import contextlib
import os
import threading

import attrs
import pytest
import torch
from _tiny import finish_all

from kthena_comm.errors import TransferError, TransferTimeoutError
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.model_runner import ModelRunner, create_pool, kv_layout_for
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.model import load_model
from kthena_serve.pd.metrics import PDMetrics
from kthena_serve.pd.prefill import PrefillCancelled, PrefillExecutor
from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json
from kthena_serve.pd.transfer import (
    BlockPutter,
    PushSession,
    register_pool,
    shm_engine,
    shm_segment_pool,
)

BUDGET = 256
LENGTHS = (150, 140, 120)  # one forward: 150 + 106 of the second; the next: 34 + 120
PARAMS = SamplingParams(temperature=0, max_tokens=8)
TEXT = ("Chunked prefill splits a long prompt into pieces that fit the step's token budget, so "
        "several prompts can share one forward pass while each keeps its own block table. ")


@pytest.fixture(scope="module")
def model():
    return load_model("default")


@pytest.fixture(scope="module")
def decode(model):  # noqa: ANN001
    """The decode worker's engine: its pool in shared memory, as PD runs it."""
    net, tokenizer = model
    config = EngineConfig(num_kv_blocks=64, max_num_seqs=8)
    layout = kv_layout_for(net.config.shape.num_layers, net.num_kv_heads_per_rank,
                           net.head_dim, config)
    engine = LLMEngine(config, ModelRunner(net, create_pool(layout, config, shared=True)),
                       tokenizer)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prefill(model):  # noqa: ANN001
    """The prefill worker's executor (its own pool for the Mooncake path) and its metrics."""
    metrics = PDMetrics("prefill")
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=BUDGET)
    executor = PrefillExecutor(model[0], config, own_pool=True, on_batch=metrics.observe_batch)
    yield executor, metrics
    executor.close()


@pytest.fixture(scope="module")
def prompts(model) -> list[list[int]]:  # noqa: ANN001
    ids = model[1].encode(TEXT * 12)
    return [ids[i * 7 : i * 7 + n] for i, n in enumerate(LENGTHS)]


def pool_ref(decode: LLMEngine, mooncake_handle: str | None = None) -> PoolRef:
    pool = decode.runner.pool
    return PoolRef(pool.layout.num_blocks, decode.config.block_size, decode.config.dtype,
                   pool.name, mooncake_handle)


def reserve(decode: LLMEngine, rid: str, ids: list[int], ref: PoolRef, salt: str) -> PrefillTask:
    """Reserve on the decode side (a salt per run: no decode-side prefix hit) and make the task."""
    request = decode.processor.make_request(rid, ids, PARAMS, cache_salt=salt)
    reservation = decode.reserve(request)
    assert reservation is not None and reservation.num_cached_tokens == 0
    return PrefillTask(rid, tuple(ids), 0, reservation.block_ids, params_to_json(PARAMS), ref,
                       cache_salt=salt)


def admit_and_decode(decode: LLMEngine, first_tokens: dict[str, int]) -> dict[str, str]:
    for rid, token in first_tokens.items():
        decode.admit_prefilled(rid, token)
    return {rid: out.text for rid, out in finish_all(decode).items()}


@contextlib.contextmanager
def over_mooncake(decode: LLMEngine, executor: PrefillExecutor):
    """The decode pool registered for Mooncake on 127.0.0.1 and a putter from the executor's
    pool: yields (the pool's ``PoolRef`` with its Mooncake handle, the putter); closes both."""
    engine, handle = register_pool(decode.runner.pool, "127.0.0.1", 30.0)
    putter = BlockPutter(executor.pool, "127.0.0.1", 30.0)
    try:
        yield pool_ref(decode, handle.to_json()), putter
    finally:
        putter.close()
        engine.close()


@contextlib.contextmanager
def compute_held(executor: PrefillExecutor):
    """Hold the compute thread until the block ends: jobs queued meanwhile share steps."""
    gate = threading.Event()
    executor.call(gate.wait)
    try:
        yield
    finally:
        gate.set()


def forwards(metrics: PDMetrics) -> tuple[float, float]:
    """(forwards run, prompts summed over them) from kthena_pd_prefill_batch_size."""
    get = metrics.registry.get_sample_value
    labels = {"role": "prefill"}
    return (get("kthena_pd_prefill_batch_size_count", labels) or 0.0,
            get("kthena_pd_prefill_batch_size_sum", labels) or 0.0)


def assert_no_blocks_held(decode: LLMEngine, executor: PrefillExecutor) -> None:
    assert decode.kv.stats().num_used_blocks == 0
    assert executor.kv.stats().num_used_blocks == 0
    assert executor.num_queued_running() == (0, 0)


@pytest.fixture(scope="module")
def one_at_a_time(decode, prefill, prompts) -> dict[str, str]:  # noqa: ANN001
    """Each prompt prefilled alone (one forward each), then decoded: the reference texts."""
    executor, metrics = prefill
    before = forwards(metrics)
    firsts = {}
    for i, ids in enumerate(prompts):
        task = reserve(decode, f"alone-{i}", ids, pool_ref(decode), "alone")
        firsts[task.request_id] = executor.submit_shared(task).result(timeout=120).first_token_id
    assert forwards(metrics)[0] - before[0] == len(prompts)
    texts = admit_and_decode(decode, firsts)
    assert len(texts) == len(prompts) and all(texts.values())
    return {rid.removeprefix("alone-"): text for rid, text in texts.items()}


def test_batched_prefill_equals_one_at_a_time_in_fewer_forwards(  # noqa: ANN001
        decode, prefill, prompts, one_at_a_time) -> None:
    executor, metrics = prefill
    before = forwards(metrics)
    with compute_held(executor):
        futures = [executor.submit_shared(reserve(decode, f"batched-{i}", ids,
                                                  pool_ref(decode), "batched"))
                   for i, ids in enumerate(prompts)]
    results = [future.result(timeout=120) for future in futures]
    num_forwards, num_prompts = (a - b for a, b in zip(forwards(metrics), before, strict=True))
    assert (num_forwards, num_prompts) == (2, 4)  # [150 + 106], [34 + 120]: fewer than 3
    assert [r.num_computed_tokens for r in results] == list(LENGTHS)
    texts = admit_and_decode(decode, {r.request_id: r.first_token_id for r in results})
    assert {rid.removeprefix("batched-"): text for rid, text in texts.items()} == one_at_a_time
    assert_no_blocks_held(decode, executor)


def test_a_failed_handoff_fails_alone(decode, prefill, prompts, one_at_a_time) -> None:  # noqa: ANN001
    """Mooncake: the middle request's reservation is released and its task names blocks past
    the decode pool's registered memory; its put fails, its batch-mates' puts land."""
    executor, _ = prefill
    with over_mooncake(decode, executor) as (ref, putter):
        tasks = [reserve(decode, f"put-{i}", ids, ref, "put") for i, ids in enumerate(prompts)]
        assert decode.release("put-1")
        offset = ref.num_blocks  # a reservation in a pool twice the size of the registered one
        tasks[1] = attrs.evolve(tasks[1], pool=attrs.evolve(ref, num_blocks=2 * offset),
                                block_ids=tuple(b + offset for b in tasks[1].block_ids))

        def put(task: PrefillTask):  # noqa: ANN202
            layout = executor.layout_for(task.pool.num_blocks)
            return putter.session(task.pool.mooncake_handle, layout, layerwise=False)

        with compute_held(executor):
            futures = [executor.submit_local(task, put(task)) for task in tasks]
        with pytest.raises(TransferError, match="exceeds the registered"):
            futures[1].result(timeout=120)
        results = [futures[0].result(timeout=120), futures[2].result(timeout=120)]
        assert all(r.handoff_bytes > 0 for r in results)
        texts = admit_and_decode(decode, {r.request_id: r.first_token_id for r in results})
        assert texts == {"put-0": one_at_a_time["0"], "put-2": one_at_a_time["2"]}
        assert_no_blocks_held(decode, executor)


def test_a_cancelled_prefill_fails_alone(decode, prefill, prompts, one_at_a_time) -> None:  # noqa: ANN001
    """The second prompt is cancelled between its two chunks (its decode worker released the
    reservation): it is dropped before the next forward; the others finish."""
    executor, metrics = prefill
    between, after_first = threading.Event(), threading.Event()
    with compute_held(executor):
        futures = [executor.submit_shared(reserve(decode, f"cancel-{i}", ids,
                                                  pool_ref(decode), "cancel"))
                   for i, ids in enumerate(prompts)]
        # queued behind the first step; the second step is queued behind this
        executor.call(lambda: between.set() or after_first.wait())
    assert between.wait(timeout=120)
    assert futures[0].done()  # finished in the first forward
    assert executor.cancel("cancel-1") is False  # between forwards: nothing of it runs
    assert decode.release("cancel-1")
    before = forwards(metrics)
    after_first.set()
    with pytest.raises(PrefillCancelled):
        futures[1].result(timeout=120)
    results = [futures[0].result(), futures[2].result(timeout=120)]
    assert forwards(metrics)[1] - before[1] == 1  # the last forward ran the third prompt alone
    texts = admit_and_decode(decode, {r.request_id: r.first_token_id for r in results})
    assert texts == {"cancel-0": one_at_a_time["0"], "cancel-2": one_at_a_time["2"]}
    assert_no_blocks_held(decode, executor)


class StuckPush:
    """A batched push whose put outlives ``finish``'s deadline (a partitioned link holds it in
    the kernel): ``finish`` times out while the put goes on until ``land`` is set."""

    layerwise = False

    def __init__(self) -> None:
        self.land = threading.Event()

    def push_layer(self, layer: int, src_ids, dst_ids) -> None:  # noqa: ANN001
        raise AssertionError("a batched push gets no layers")

    def finish(self, src_ids, dst_ids) -> int:  # noqa: ANN001
        raise TransferTimeoutError("mooncake", "10.0.0.2:1", "put", "not complete after 8s")

    def settled(self) -> bool:
        return self.land.is_set()


def test_a_timed_out_push_keeps_its_request_busy_until_its_put_ends(decode, prefill,  # noqa: ANN001
                                                                    prompts) -> None:
    """The decode worker frees a failed request's reservation once ``cancel`` says nothing of
    it runs: a put that the hand-off stopped waiting for may still land, so it is busy until
    the put has ended (test_network_faults.py makes this with a real partition)."""
    executor, _ = prefill
    task = reserve(decode, "stuck", prompts[0], pool_ref(decode), "stuck")
    push = StuckPush()
    future = executor.submit_local(task, push)
    with pytest.raises(TransferTimeoutError):
        future.result(timeout=120)
    assert executor.cancel("stuck") is True  # the put may still write the reserved blocks
    assert executor.cancel("stuck") is True
    push.land.set()
    assert executor.cancel("stuck") is False
    assert decode.release("stuck")
    assert_no_blocks_held(decode, executor)
    assert executor.cancel("stuck") is False


def test_a_prompt_waits_for_a_batch_mates_blocks(model, decode, prompts, one_at_a_time) -> None:  # noqa: ANN001
    """Own pool of 16 blocks over Mooncake: the first prompt takes 10, the third needs 8. It
    waits until the first one's put has given its blocks back, rather than failing."""
    metrics = PDMetrics("prefill")
    executor = PrefillExecutor(model[0], EngineConfig(num_kv_blocks=16,
                                                      max_num_batched_tokens=BUDGET),
                               own_pool=True, on_batch=metrics.observe_batch)
    try:
        with over_mooncake(decode, executor) as (ref, putter):
            layout = executor.layout_for(ref.num_blocks)
            tasks = [reserve(decode, f"wait-{i}", prompts[i], ref, "wait") for i in (0, 2)]
            with compute_held(executor):
                futures = [executor.submit_local(task, putter.session(
                    ref.mooncake_handle, layout, layerwise=True)) for task in tasks]
            results = [future.result(timeout=120) for future in futures]
            assert forwards(metrics) == (2, 2)  # one prompt per forward: the pool held one
            texts = admit_and_decode(decode, {r.request_id: r.first_token_id for r in results})
            assert texts == {"wait-0": one_at_a_time["0"], "wait-2": one_at_a_time["2"]}
            assert_no_blocks_held(decode, executor)
    finally:
        executor.close()


def prompt_kv(pool, block_ids, num_tokens: int) -> torch.Tensor:  # noqa: ANN001
    """[layers, 2, tokens, heads, dim]: the prompt's K and V as the pool holds them."""
    size = pool.layout.shape.block_size
    ids = torch.tensor(block_ids, dtype=torch.long)
    layers = []
    for layer in range(pool.layout.shape.num_layers):
        k, v = pool.k_cache(layer)[ids], pool.v_cache(layer)[ids]
        layers.append(torch.stack([k.flatten(0, 1)[:num_tokens], v.flatten(0, 1)[:num_tokens]]))
    assert num_tokens <= len(block_ids) * size
    return torch.stack(layers).clone()


def test_layerwise_and_batched_pushes_land_the_same_kv(decode, prefill, prompts,  # noqa: ANN001
                                                       one_at_a_time) -> None:
    """The same three prompts, batched the same way, pushed over Mooncake layer by layer and
    in one batch: byte-identical KV in the decode pool, each block of each layer sent once
    (the 140-token prompt's two chunks: 6 blocks with the first, 3 with the second), and the
    greedy text of a prompt prefilled alone."""
    executor, _ = prefill
    num_layers = executor.pool.layout.shape.num_layers
    kv, calls = {}, {}
    with over_mooncake(decode, executor) as (ref, putter):
        layout = executor.layout_for(ref.num_blocks)
        for mode in ("layerwise", "batched"):
            tasks = [reserve(decode, f"{mode}-{i}", ids, ref, mode) for i, ids in enumerate(prompts)]
            sessions = [putter.session(ref.mooncake_handle, layout, layerwise=mode == "layerwise")
                        for _ in tasks]
            with compute_held(executor):
                futures = [executor.submit_local(t, p) for t, p in zip(tasks, sessions, strict=True)]
            results = [future.result(timeout=120) for future in futures]
            for task, result in zip(tasks, results, strict=True):
                assert result.handoff_bytes == len(task.block_ids) * layout.bytes_per_block
            kv[mode] = [prompt_kv(decode.runner.pool, t.block_ids, len(t.token_ids)) for t in tasks]
            calls[mode] = [p.num_calls for p in sessions]
            texts = admit_and_decode(decode, {r.request_id: r.first_token_id for r in results})
            assert {rid.split("-")[1]: text for rid, text in texts.items()} == one_at_a_time
            assert_no_blocks_held(decode, executor)
        assert calls == {"layerwise": [num_layers, 2 * num_layers, num_layers],
                         "batched": [1, 1, 1]}
        for a, b in zip(kv["layerwise"], kv["batched"], strict=True):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit


def own_shm_entries() -> set[str]:
    """This process's /dev/shm entries (shm transfer segments are named <prefix>-<pid>-...):
    other processes' may come and go meanwhile (another test worker)."""
    return {name for name in os.listdir("/dev/shm") if f"-{os.getpid()}-" in name}


def test_a_push_failing_at_layer_k_fails_its_request_alone(decode, prefill, prompts,  # noqa: ANN001
                                                          one_at_a_time) -> None:
    """The middle request pushes over shm into a segment whose owner goes away when layer
    ``k`` is pushed: the put of layer k fails (the segment is gone), nothing more of it is sent,
    its request fails once its earlier puts have settled, and its prefill blocks come back;
    its batch-mates (Mooncake, layer-wise) land and decode as if alone."""
    executor, _ = prefill
    with over_mooncake(decode, executor) as (ref, putter):
        owner, pusher = shm_engine(30.0), shm_engine(30.0)
        shm_before = own_shm_entries()
        k = 7
        try:
            layout = executor.layout_for(ref.num_blocks)
            segment_pool, segment = shm_segment_pool(owner, layout)
            local = pusher.register(executor.pool.buffer)
            tasks = [reserve(decode, f"layer-{i}", ids, ref, "layer") for i, ids in enumerate(prompts)]
            failing = PushSession(pusher, local, executor.pool.layout, segment, layout, 30.0,
                                  layerwise=True)
            real_push = failing.push_layer

            def push_layer(layer, src, dst) -> None:  # noqa: ANN001
                if layer == k:
                    segment_pool.close()
                    owner.close()  # the decode side's process is gone: its segment with it
                real_push(layer, src, dst)

            failing.push_layer = push_layer
            sessions = [putter.session(ref.mooncake_handle, layout, layerwise=True), failing,
                        putter.session(ref.mooncake_handle, layout, layerwise=True)]
            with compute_held(executor):
                futures = [executor.submit_local(t, p) for t, p in zip(tasks, sessions, strict=True)]
            with pytest.raises(TransferError, match="unregistered segment"):
                futures[1].result(timeout=120)
            num_layers = executor.pool.layout.shape.num_layers
            # layers 0..k-1 went out; layer k's put is either refused as it is submitted (the
            # transfer engine already saw the segment go: no call counted) or submitted and fails
            # when it runs; later layers may be submitted before that failure is seen, no more
            assert k <= failing.num_calls <= num_layers
            assert decode.release("layer-1")  # the decode worker's failure policy releases it
            results = [futures[0].result(timeout=120), futures[2].result(timeout=120)]
            texts = admit_and_decode(decode, {r.request_id: r.first_token_id for r in results})
            assert texts == {"layer-0": one_at_a_time["0"], "layer-2": one_at_a_time["2"]}
            assert_no_blocks_held(decode, executor)
        finally:
            pusher.close()
            owner.close()
    assert own_shm_entries() <= shm_before  # the segment went with its owner
