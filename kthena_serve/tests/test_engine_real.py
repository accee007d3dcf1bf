"""The engine on the real default model (SmolLM2-135M-Instruct): greedy tokens do not depend on
batching, chunking or prefix caching; Chinese streams as whole characters; shared prefixes are
computed once. Short generations keep this quick.

The model runs in float32 here. In bf16, chunked prefill and prefix reuse change the order of
the attention reductions, and "What is the capital of France?" sits on a near-tie (" The" vs
"L" differ by 0.08 logits even in fp32), so bf16 greedy output may legitimately flip between
batchings; fp32 is exact enough that it must not.
"""

from __future__ import annotations

import pytest

from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
QUESTIONS = [
    "What is the capital of France?",
    "用一句话介绍长城。",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]


@pytest.fixture(scope="module")
def loaded():
    import torch

    from kthena_serve.model import load_model

    threads = torch.get_num_threads()
    yield load_model("default", dtype=torch.float32)
    torch.set_num_threads(threads)


def _engine(loaded, **options) -> LLMEngine:
    model, tokenizer = loaded
    # One thread: robust when other test processes share the cores (no OpenMP barrier waits).
    config = EngineConfig(**{"kv_cache_memory": "64MiB", "num_threads": 1, "dtype": "float32", **options})
    return LLMEngine.from_config(config, model=model, tokenizer=tokenizer)


def _chat_ids(loaded, question: str) -> list[int]:
    tokenizer = loaded[1]
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def _run(engine: LLMEngine, prompts, params=GREEDY):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"q{i}", prompt, params)
    finals, deltas = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.new_text)
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"q{i}"] for i in range(len(prompts))], [deltas[f"q{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def solo(loaded):
    prompts = [_chat_ids(loaded, q) for q in QUESTIONS]
    outs = []
    for prompt in prompts:
        engine = _engine(loaded, enable_prefix_caching=False)
        outs.append(_run(engine, [prompt])[0][0])
    return prompts, outs


@pytest.mark.parametrize("options", [
    {},
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 24, "block_size": 8},
])
def test_batched_greedy_matches_batch_one(loaded, solo, options):
    prompts, alone = solo
    engine = _engine(loaded, **options)
    outs, _ = _run(engine, prompts)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone]
    assert engine.kv.stats().num_used_blocks == 0


def test_chinese_streams_whole_characters(loaded):
    prompt = loaded[1].encode("长城是中国古代的军事防御工程，")
    outs, deltas = _run(_engine(loaded), [prompt], SamplingParams(temperature=0, max_tokens=12))
    assert "".join(deltas[0]) == outs[0].text
    assert all("\ufffd" not in d for d in deltas[0])


def test_shared_system_prompt_is_computed_once(loaded):
    engine = _engine(loaded)
    prompts = [_chat_ids(loaded, q) for q in QUESTIONS]
    first, _ = _run(engine, prompts[:1])
    before = engine.stats().num_computed_prompt_tokens
    outs, _ = _run(engine, prompts[1:])
    assert all(o.num_cached_tokens >= 16 for o in outs)
    computed = engine.stats().num_computed_prompt_tokens - before
    assert computed == sum(len(p) - o.num_cached_tokens for p, o in zip(prompts[1:], outs, strict=True))
