"""Engine behaviour on a tiny random-weight Llama (fp32): same greedy tokens whatever the
batching, chunking, prefix caching or preemption; aborts free blocks; shared prefixes are reused.
"""

from __future__ import annotations

import random
import re

import pytest
from _tiny import finish_all, tiny_engine

from kthena_serve.engine.request import FinishReason
from kthena_serve.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(count: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 40000) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 40000) for _ in range(rng.randrange(1, 40))]
            for _ in range(count)]


def _run(engine, prompts, params=GREEDY):
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    for i, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    finals = finish_all(engine)
    return [finals[f"r{i}"] for i in range(len(prompts))]


def _tokens(outs):
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference():
    """Each prompt alone, one at a time, no prefix cache, no chunking."""
    prompts = _prompts(6, shared=9) + _prompts(4, seed=1)
    solo = []
    for prompt in prompts:
        engine = tiny_engine(enable_prefix_caching=False, max_num_batched_tokens=512)
        solo += _tokens(_run(engine, [prompt]))
    return prompts, solo


@pytest.mark.parametrize("options", [
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 7},  # chunked prefill mixed with decodes
    {"max_num_seqs": 2},
    {"block_size": 16, "max_num_batched_tokens": 33},
    {"prefix_index": "radix"},  # the KV layer's parts, chosen from EngineConfig
    {"hash_algorithm": "sha256", "max_num_batched_tokens": 7},
    {"target_step_ms": 0},  # decode protection off: every step fills its token budget
])
def test_batched_greedy_equals_batch_one(reference, options):
    prompts, solo = reference
    engine = tiny_engine(**options)
    assert _tokens(_run(engine, prompts)) == solo
    assert engine.kv.stats().num_used_blocks == 0


def test_preemption_recomputes_identical_tokens(reference):
    prompts, solo = reference
    engine = tiny_engine(num_kv_blocks=24, max_num_seqs=8)  # 96 slots for ~10 x 40 tokens
    outs = _run(engine, prompts)
    assert engine.stats().num_preemptions > 0
    assert _tokens(outs) == solo
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    assert engine.kv.stats().num_used_blocks == 0


def test_shared_prefix_is_cached_and_not_recomputed():
    prompts = _prompts(5, seed=3, shared=32)
    engine = tiny_engine()
    _run(engine, prompts[:1])
    computed_before = engine.stats().num_computed_prompt_tokens
    outs = _run(engine, prompts[1:])
    assert all(o.num_cached_tokens >= 32 for o in outs)
    computed = engine.stats().num_computed_prompt_tokens - computed_before
    assert computed == sum(len(p) - o.num_cached_tokens for p, o in zip(prompts[1:], outs, strict=True))
    assert computed < sum(len(p) for p in prompts[1:]) - 4 * 32 + 4 * 4  # at most a block short


def test_concurrent_shared_prefix_waits_for_one_prefill():
    """Arriving together, the followers wait a step and reuse the leader's prefix."""
    prompts = _prompts(4, seed=4, shared=64)
    engine = tiny_engine(max_num_batched_tokens=512)
    outs = _run(engine, prompts)
    assert sorted(o.num_cached_tokens for o in outs)[1:] == [64, 64, 64]


def test_cache_salt_isolates_tenants():
    prompt = _prompts(1, seed=5, shared=32)[0]
    engine = tiny_engine()
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished_requests():
        engine.step()
    for rid, salt, hit in (("b", "tenant-b", False), ("c", "tenant-a", True), ("d", None, False)):
        request = engine.add_request(rid, prompt, GREEDY, cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        assert (request.num_cached_tokens > 0) is hit, rid


def test_abort_frees_blocks_and_reports_abort():
    engine = tiny_engine()
    engine.add_request("x", _prompts(1)[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", _prompts(1, seed=9)[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert engine.kv.stats().num_used_blocks > 0
    out = engine.abort_request("x")
    assert out.finish_reason is FinishReason.ABORT
    assert engine.abort_request("x") is None
    engine.abort_request("y")
    assert not engine.has_unfinished_requests()
    assert engine.kv.stats().num_used_blocks == 0


def test_seeded_sampling_does_not_depend_on_the_batch():
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=10,
                            ignore_eos=True)
    prompt = _prompts(1, seed=6)[0]
    alone = _run(tiny_engine(), [prompt], params)[0].token_ids
    others = _prompts(3, seed=7)
    mixed = _run(tiny_engine(), [*others, prompt],
                 [SamplingParams(temperature=0.8, max_tokens=10)] * 3 + [params])
    assert mixed[-1].token_ids == alone


def test_stop_token_ids_and_max_tokens():
    prompt = _prompts(1, seed=8)[0]
    tokens = _run(tiny_engine(), [prompt])[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tokens[3]],
                            ignore_eos=True)
    out = _run(tiny_engine(), [prompt], params)[0]
    assert out.finish_reason is FinishReason.STOP
    assert out.token_ids == tokens[: tokens.index(tokens[3]) + 1]


def test_too_long_requests_are_refused():
    from kthena_serve.engine.errors import InvalidRequestError

    engine = tiny_engine(num_kv_blocks=8)  # 32 slots
    with pytest.raises(InvalidRequestError, match="context"):
        engine.add_request("a", list(range(3, 40)), GREEDY)
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        engine.add_request("b", list(range(3, 25)), GREEDY)
    with pytest.raises(InvalidRequestError):
        engine.add_request("c", [], GREEDY)


def test_engine_config_reaches_the_kv_layer_parts():
    engine = tiny_engine(prefix_index="radix", hash_algorithm="sha256")
    assert engine.kv.index_name == "radix"
    assert engine.kv.hasher.algo == "sha256"
    outs = _run(engine, _prompts(2, shared=9))
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    assert engine.kv.stats().num_cached_blocks > 0  # the radix tree cached the prompts


@pytest.mark.parametrize(("field", "value", "message"), [
    ("prefix_index", "trie", "EngineConfig.prefix_index must be a registered prefix index: "
     "one of 'hash', 'radix' (got 'trie')"),
    ("hash_algorithm", "md5", "EngineConfig.hash_algorithm must be a registered hash "
     "algorithm: one of 'sha256', 'xxh3_128' (got 'md5')"),
    ("kv_cache_dtype", "float16", "EngineConfig.kv_cache_dtype must be 'auto', the compute "
     "dtype ('bfloat16') or 'int8' (got 'float16'); the attention kernels read the cache in "
     "the compute dtype"),
    ("dtype", "fp16", "EngineConfig.dtype must be one of 'bfloat16', 'float16', 'float32' "
     "(got 'fp16')"),
    ("device", "gpu", "EngineConfig.device must be one of 'cpu', 'cuda', 'cuda:N', 'npu', "
     "'npu:N' (got 'gpu')"),
    ("max_num_seqs", 0, "EngineConfig.max_num_seqs must be a positive int (got 0)"),
    ("tp", True, "EngineConfig.tp must be a positive int (got True)"),
    ("max_model_len", -1, "EngineConfig.max_model_len must be a positive int or None (got -1)"),
    ("kv_cache_memory", "1XB", "EngineConfig.kv_cache_memory must be a positive size: bytes, "
     "or e.g. '1GiB', '512MiB', '2G' (got '1XB')"),
    ("model", 3, "EngineConfig.model must be 'default' or a checkpoint folder (str or "
     "os.PathLike) (got 3)"),
    ("enable_prefix_caching", "yes", "EngineConfig.enable_prefix_caching must be True or False "
     "(got 'yes')"),
    ("chat_special_tokens", "raw", "EngineConfig.chat_special_tokens must be one of 'text', "
     "'control' (got 'raw')"),
    ("target_step_ms", -1, "EngineConfig.target_step_ms must be None or 0 (off), or "
     "milliseconds up to 60000 (got -1)"),
    ("target_step_ms", float("nan"), "EngineConfig.target_step_ms must be None or 0 (off)"),
    ("target_step_ms", "fast", "EngineConfig.target_step_ms must be None or 0 (off)"),
    ("target_step_ms", True, "EngineConfig.target_step_ms must be None or 0 (off)"),
])
def test_engine_config_refuses_what_it_cannot_honour(field, value, message):
    from kthena_serve.engine.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError) as caught:
        EngineConfig(**{field: value})
    assert str(caught.value).startswith(message)
    assert caught.value.field == field and isinstance(caught.value, ValueError)
    assert "Attribute(" not in str(caught.value)  # no attrs internals in the message


def test_engine_config_errors_name_the_cli_flag():
    import argparse

    from kthena_serve.serve_args import add_engine_args
    from kthena_serve.spec import engine_config

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    add_engine_args(parser)
    for argv, message in [
        (["--max-num-seqs", "0"], "--max-num-seqs: EngineConfig.max_num_seqs must be a "
         "positive int (got 0)"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype: EngineConfig.kv_cache_dtype must be"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory: EngineConfig.kv_cache_memory must"),
        (["--target-step-ms", "-5"], "--target-step-ms: EngineConfig.target_step_ms must be "
         "None or 0 (off), or milliseconds up to 60000 (got -5.0)"),
    ]:
        with pytest.raises(ValueError) as caught:
            engine_config(vars(parser.parse_args(argv)))
        assert str(caught.value).startswith(message)
    assert engine_config(vars(parser.parse_args([]))).model == "default"


def test_engine_config_takes_a_path_for_model(tmp_path):
    from kthena_serve.engine.config import EngineConfig

    assert EngineConfig(model=tmp_path).model == str(tmp_path)


def test_scheduled_batch_is_plain_data():
    """What crosses from the scheduler to the runner is ids and ints, never a live Request."""
    engine = tiny_engine(max_num_batched_tokens=5)
    engine.add_request("a", list(range(3, 12)), GREEDY)
    batch = engine.scheduler.schedule()
    (seq,) = batch.seqs
    assert (seq.request_id, seq.token_ids, seq.start) == ("a", tuple(range(3, 8)), 0)
    assert not seq.is_sampled and batch.sampled_rows == []
    assert all(isinstance(b, int) for b in seq.block_ids)
    engine.scheduler.update(batch)
    (seq,) = engine.scheduler.schedule().seqs
    assert (seq.token_ids, seq.start, seq.is_sampled) == (tuple(range(8, 12)), 5, True)


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not __import__("torch").cuda.is_available(), reason="no CUDA device here"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_greedy_tokens_are_the_same_on_every_device(device, reference):
    """The runner, pool and sampler follow ``config.device``; CPU is the reference."""
    prompts, solo = reference
    engine = tiny_engine(device=device)
    assert engine.runner.device.type == device
    assert engine.runner.pool.buffer.device.type == device
    assert _tokens(_run(engine, prompts)) == solo


@pytest.mark.parametrize("where", ["stream", "sampler"])
def test_a_failing_request_fails_alone(reference, where):
    """A failure injected into one request of a running batch ends that request only: its
    blocks go back, and every other request's greedy tokens are unchanged."""
    prompts, solo = reference
    engine = tiny_engine()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    bad = engine.add_request("bad", prompts[0], GREEDY)
    _poison(engine, bad, where)
    finals = finish_all(engine)
    bad = finals.pop("bad")
    assert bad.finish_reason is FinishReason.ABORT and "retry it" in bad.error
    assert [finals[f"r{i}"].token_ids for i in range(len(prompts))] == solo
    assert all(o.error is None for o in finals.values())
    assert engine.kv.stats().num_used_blocks == 0


def _poison(engine, request, where):
    request_id = request.request_id
    if where == "stream":  # e.g. a detokenizer that cannot take the token
        stream = request.stream

        class BrokenStream:
            def append(self, token_id):
                raise TypeError("injected failure")

            def __getattr__(self, name):
                return getattr(stream, name)

        request.stream = BrokenStream()
        return
    sample = engine.sampler.__class__.__call__

    def picky(self, logits, requests, token_bitmask=None):
        if any(r.request_id == request_id for r in requests):
            raise OverflowError("injected failure")
        return sample(self, logits, requests, token_bitmask)

    engine.sampler.__class__ = type("PickySampler", (engine.sampler.__class__,),
                                    {"__call__": picky})


def test_sampling_fields_are_bounded_at_the_edge():
    from kthena_serve.engine.sampling_params import SamplingParams

    for fields, message in [({"seed": 2**64}, "seed must be an int in [-2**63, 2**64 - 1]"),
                            ({"top_k": 2**64 - 1}, "top_k must be -1 (off) or an int in [1,"),
                            ({"temperature": float("inf")}, "temperature must be a finite"),
                            ({"top_p": float("nan")}, "top_p must be a finite"),
                            ({"stop_token_ids": [2**63]}, "stop_token_ids must be ints in")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            SamplingParams(**fields)
    engine = tiny_engine()  # the largest accepted values sample fine
    outs = _run(engine, _prompts(2), SamplingParams(seed=2**64 - 1, top_k=2**31 - 1,
                                                   temperature=100.0, max_tokens=3))
    assert all(len(o.token_ids) == 3 for o in outs)


def _protected_engine(target_step_ms: float):
    """A tiny engine whose step cost model is held at 0.5 ms a prefill token (no clock in the
    budget it answers); ``target_step_ms`` 0: decode protection off."""
    from _tiny import default_tokenizer, tiny_llama

    from kthena_serve.engine import LLMEngine, build_runner
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.step_cost import StepCoefficients, StepCostModel

    config = EngineConfig(dtype="float32", num_kv_blocks=256, block_size=4,
                          max_num_batched_tokens=64, max_num_seqs=8, check_invariants=True,
                          num_threads=1, target_step_ms=target_step_ms)
    runner, tokenizer = build_runner(config, tiny_llama(), default_tokenizer())
    cost = StepCostModel(StepCoefficients(0.0, 0.5e-3, 0.0), prior_weight=1e12)
    return LLMEngine(config, runner, tokenizer, step_cost=cost)


def _decode_then_long_prompt(engine):
    """'a' decodes while the 150-token 'b' arrives; each step's (batch, budget answers)."""
    steps = []
    budget, schedule = engine.scheduler.prefill_budget, engine.scheduler.schedule
    answers: list[int] = []

    def recording_budget(rows: int, burst: int) -> int:
        answers.append(budget(rows, burst))
        return answers[-1]

    def recording_schedule():
        answers.clear()
        batch = schedule()
        steps.append((batch, list(answers)))
        return batch

    engine.scheduler.schedule = recording_schedule
    if budget is not None:
        engine.scheduler.prefill_budget = recording_budget
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("a", _prompts(1, seed=5)[0], params)
    engine.step()
    engine.step()  # 'a' decodes from here on
    engine.add_request("b", [7] * 150, params)
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o.token_ids) for o in engine.step() if o.finished)
    return finals, steps


def test_a_long_prompt_arriving_while_one_decodes_is_split_within_the_budget():
    # 20 ms / 0.5 ms: 40 prefill tokens a step
    engine = _protected_engine(target_step_ms=20.0)
    finals, steps = _decode_then_long_prompt(engine)
    chunks = []
    for batch, answers in steps:
        seqs = {s.request_id: s for s in batch.seqs}
        if "b" in seqs and seqs["b"].start < 150:  # a chunk of b's prompt, beside a's decode
            (answer,) = answers
            assert len(seqs["a"].token_ids) == 1 and 4 <= answer <= 40
            assert len(seqs["b"].token_ids) <= answer
            chunks.append(len(seqs["b"].token_ids))
    assert sum(chunks) == 150 and len(chunks) >= -(-150 // 40)
    assert engine.step_cost.num_observed == len(steps)  # every step fed the model

    plain = _protected_engine(target_step_ms=0)
    assert plain.scheduler.prefill_budget is None
    unprotected, plain_steps = _decode_then_long_prompt(plain)
    assert unprotected == finals  # the same greedy tokens
    assert len(plain_steps) < len(steps)  # b's prompt in 64-token chunks


def test_a_cached_prompt_computed_again_for_prompt_logprobs_holds_one_block_per_position():
    """Prompt logprobs compute the whole prompt though it is cached; at commit its blocks are
    swapped for the cached twins, so it holds its block table and no more (it held twice the
    prompt's blocks before, and a lone request near the pool's size looked unfittable)."""
    engine = tiny_engine(num_kv_blocks=64)
    prompt = [random.Random(3).randrange(100, 1000) for _ in range(28)]  # 7 blocks of 4
    engine.add_request("first", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.kv.num_free_blocks == 64
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1, ignore_eos=True)
    engine.add_request("again", prompt, params)
    engine.step()  # the whole prompt in one step, committed after it
    (request,) = engine.scheduler.running
    table = engine.kv.block_ids("again")
    assert request.block_ids == table and len(table) == 7  # the cached prompt's blocks
    assert engine.kv.num_free_blocks == 64 - 7
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert len(outputs["again"].token_ids) == 4 and len(outputs["again"].prompt_logprobs) == 28
    assert engine.kv.num_free_blocks == 64
