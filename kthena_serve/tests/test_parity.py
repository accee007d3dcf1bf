"""Greedy parity with Hugging Face transformers on the default model (SmolLM2-135M-Instruct).

transformers loads the same GGUF file itself (``from_pretrained(folder, gguf_file=...)``); both
sides run in **float32**, where the dequantised weights are exact, so greedy tokens must be
identical: batch 1, batched, chunked prefill with a prefix already in the cache, and TP=2 over two
gloo processes. bf16 (the serving dtype) is checked for closeness, not identity.
"""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from _model_testing import GreedyRunner
from _ranks import run_two_ranks

from kthena_serve.model import ensure_default_checkpoint, load_model

transformers = pytest.importorskip("transformers")
kthena_known = pytest.importorskip("kthena_core.known_models")

pytestmark = pytest.mark.slow

NEW_TOKENS = 20
LONG_EN = ("Summarise the following in one sentence. The printing press, invented by Johannes Gutenberg "
           "around 1440, used movable metal type and an oil-based ink. It made books far cheaper to "
           "produce, which spread literacy across Europe, helped the Reformation and the Scientific "
           "Revolution travel quickly, and standardised spelling in many languages. Within fifty years "
           "presses were running in more than two hundred cities, and millions of volumes had been printed.")
LONG_ZH = ("请用一句话总结下面这段话。长城是中国古代的军事防御工程，修筑历史可上溯到西周时期。"
           "秦始皇统一六国后，把各国的长城连接起来，形成了万里长城。明朝又对长城进行了大规模的修建，"
           "今天我们看到的长城大多是明长城。长城不仅是世界上最伟大的建筑之一，也是中华民族的象征。")
QUESTIONS = ["What is the capital of France?", LONG_EN, "请用中文介绍一下你自己。", LONG_ZH,
             "List three prime numbers greater than 100."]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine OpenMP spin-waits collapse throughput."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_default_checkpoint(progress=False)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(ours):
    tokenizer = ours[1]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]


@pytest.fixture(scope="module")
def expected(prompts, hf_gguf_model):
    """transformers' greedy tokens (stopping at EOS) and first-step logits, float32."""
    hf = hf_gguf_model
    tokens, logits = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, pad_token_id=2)
            tokens.append(out.sequences[0, len(prompt):].tolist())
            logits.append(out.logits[0][0].float())
    return tokens, torch.stack(logits)


def _generate(model, prompts, eos, **kwargs):
    return GreedyRunner(model, num_blocks=96).generate(prompts, NEW_TOKENS, eos_token_ids=eos, **kwargs)


def test_prompts_cover_languages_and_lengths(ours, prompts):
    assert min(map(len, prompts)) < 40 < 100 < max(map(len, prompts))
    assert LONG_ZH in ours[1].decode(prompts[3])


def test_batch1_greedy_is_token_identical(ours, prompts, expected):
    model, tokenizer = ours
    got = [_generate(model, [p], tokenizer.eos_token_ids)[0] for p in prompts]
    assert got == expected[0]
    assert "Paris" in tokenizer.decode(got[0])


def test_batched_greedy_is_token_identical(ours, prompts, expected):
    model, tokenizer = ours
    assert _generate(model, prompts, tokenizer.eos_token_ids) == expected[0]


def test_cached_prefix_and_chunked_prefill_are_token_identical(ours, prompts, expected):
    """Each prompt's system-prompt blocks are already cached; the rest is prefilled in chunks."""
    model, tokenizer = ours
    runner = GreedyRunner(model, num_blocks=128)
    runner.generate([prompts[0]], 1)  # caches the shared system-prompt blocks
    before = runner.num_computed_prompt_tokens
    got = runner.generate(prompts, NEW_TOKENS, reuse_prefix=True, prefill_chunk=24,
                          eos_token_ids=tokenizer.eos_token_ids)
    assert got == expected[0]
    assert runner.num_computed_prompt_tokens - before < sum(map(len, prompts)) - 16 * len(prompts)


def test_bf16_logits_are_close(checkpoint, prompts, expected):
    model, _ = load_model(checkpoint, dtype=torch.bfloat16)
    runner = GreedyRunner(model, num_blocks=96)
    logits = runner.step([(p, 0, runner._allocate(-(-len(p) // 16))) for p in prompts])
    ref = expected[1]
    cosine = torch.nn.functional.cosine_similarity(logits, ref, dim=-1)
    assert cosine.min() > 0.995, cosine
    assert ((logits - ref).abs().max(-1).values / ref.abs().max(-1).values).max() < 0.1
    # bf16 may swap near-tied candidates: the float32 choice stays among bf16's top 3.
    top3 = logits.topk(3, dim=-1).indices
    assert all(int(r) in t.tolist() for r, t in zip(ref.argmax(-1), top3, strict=True))


_WORKER = textwrap.dedent("""
    import json, sys
    from datetime import timedelta
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    rank, port, checkpoint, prompts_file, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        from kthena_comm.groups import CommGroup
        from kthena_serve.model import TensorParallel, load_model
        from _model_testing import GreedyRunner
        tp = TensorParallel.from_comm_group(CommGroup("tp", (0, 1), rank, dist.group.WORLD))
        model, tokenizer = load_model(checkpoint, dtype=torch.float32, tp=tp)
        prompts = json.load(open(prompts_file))
        tokens = GreedyRunner(model, num_blocks=64).generate(prompts, 16, eos_token_ids=tokenizer.eos_token_ids)
        json.dump({"tokens": tokens, "kv_heads": model.num_kv_heads_per_rank}, open(out, "w"))
    finally:
        dist.destroy_process_group()
""")


def test_tp2_over_gloo_matches_tp1(checkpoint, ours, prompts, tmp_path):
    chosen = [prompts[0], prompts[2], prompts[4]]
    expected = _generate(ours[0], chosen, ours[1].eos_token_ids)
    expected = [t[:16] for t in expected]
    (tmp_path / "worker.py").write_text(_WORKER)
    (tmp_path / "prompts.json").write_text(json.dumps(chosen))
    run_two_ranks(lambda rank, port: [str(tmp_path / "worker.py"), str(rank), port,
                                      str(checkpoint), str(tmp_path / "prompts.json"),
                                      str(tmp_path / f"out{rank}.json")], timeout=240)
    results = [json.loads((tmp_path / f"out{rank}.json").read_text()) for rank in range(2)]
    assert [r["kv_heads"] for r in results] == [2, 1]  # 3 KV heads over 2 ranks
    assert [r["tokens"] for r in results] == [expected, expected]


def _engine_tokens(prompts, eos, **engine):
    """Greedy tokens from the serving engine (scheduler, micro-batches, spawned ranks), cut at
    EOS as transformers' are."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    cores = os.sched_getaffinity(0)
    llm = LLM(dtype="float32", num_kv_blocks=128, **engine)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0))
    finally:
        llm.close()
    # rank 0 pinned this process to one core; closing gives every core back, so the next
    # engine's ranks are spread over the cores again instead of all landing on that one
    assert os.sched_getaffinity(0) == cores
    return [list(o.token_ids) for o in outs]


def _cut(tokens, eos):
    return [t[:next((i + 1 for i, x in enumerate(t) if x in eos), len(t))] for t in tokens]


@pytest.mark.parametrize("layout", [{"pp": 2}, {"tp": 2, "pp": 2}],
                         ids=["pp2", "tp2xpp2"])
def test_pipeline_parallel_engine_matches_transformers(ours, prompts, expected, layout):
    """PP=2 (two stages of 15 layers, micro-batched) and TP=2 x PP=2 (four ranks) through the
    engine: token-identical to transformers and to PP=1 in float32."""
    chosen = [0, 2, 4] if layout.get("tp", 1) > 1 else range(len(prompts))
    batch = [prompts[i] for i in chosen]
    eos = set(ours[1].eos_token_ids)
    hf = _cut([expected[0][i] for i in chosen], eos)
    assert _cut(_engine_tokens(batch, eos, **layout), eos) == hf
    if layout == {"pp": 2}:
        assert _cut(_engine_tokens(batch, eos), eos) == hf  # and PP=1, same engine path


def test_repetition_penalty_is_token_identical_to_transformers(ours, prompts, hf_gguf_model):
    """vLLM's repetition_penalty (every token of the prompt and the output so far: logit / p
    when positive, x p otherwise), greedy in float32 through the engine: the tokens
    transformers' generate(repetition_penalty=1.3) gives, which penalises the same way."""
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    chosen = [prompts[0], prompts[2]]
    eos = set(ours[1].eos_token_ids)
    with torch.inference_mode():
        hf = [hf_gguf_model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                                     do_sample=False, repetition_penalty=1.3,
                                     pad_token_id=2)[0, len(p):].tolist() for p in chosen]
    llm = LLM(dtype="float32", num_kv_blocks=128)
    try:
        outs = llm.generate(chosen, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                   repetition_penalty=1.3))
    finally:
        llm.close()
    penalised = _cut([list(o.token_ids) for o in outs], eos)
    assert penalised == _cut(hf, eos)
    plain = _cut(_engine_tokens(chosen, eos), eos)
    assert penalised != plain  # the penalty changed what greedy picks on these prompts


def test_an_uneven_pipeline_split_engine_matches_one_process(ours, prompts):
    """PP=2 cut at layer 10 (10 + 20 layers, each stage's pool sized for its own layers) through
    the engine: token-identical to the single-process engine in float32."""
    batch = [prompts[0], prompts[2], prompts[4]]
    eos = set(ours[1].eos_token_ids)
    uneven = _engine_tokens(batch, eos, pp=2, pipeline_split_points=(10,))
    assert _cut(uneven, eos) == _cut(_engine_tokens(batch, eos), eos)
