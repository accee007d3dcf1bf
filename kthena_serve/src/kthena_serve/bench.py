"""``kthena bench serve``: the engine on three workloads, against Hugging Face ``generate``.

    (a) batch 1: TTFT of a 128-token prompt, then decode tokens/s over 64 tokens
    (b) offline throughput: 32 requests x (128 prompt, 64 output) tokens
    (c) shared prefix: 32 requests = one 512-token system prompt + a 32-token question each,
        16 output tokens; prefix reuse on and off (total time, mean TTFT, computed prompt tokens)
    (d) the same through transformers ``generate`` (batch-padded, no prefix reuse)

Prompts are fixed-seed random token ids; outputs ignore EOS so every run does the same work.
Each case runs once to warm up, then ``runs`` times; the JSON reports medians, the machine and
its load average, and the PNG plots them with vLLM's figures from the issue for reference.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import attrs

from kthena_serve.config import EngineConfig
from kthena_serve.engine import LLMEngine
from kthena_serve.sampling_params import SamplingParams

__all__ = ["BenchOptions", "run_bench"]

# vLLM CPU 0.32.0 (eager) on the same model and cores of a quiet machine, as quoted in the issue.
VLLM_REFERENCE = {"a_decode_tok_s": 21.4, "b_output_tok_s": 350.0, "c_total_s_reuse": 2.05,
                  "c_total_s_no_reuse": 7.5}


@attrs.frozen
class BenchOptions:
    runs: int = 3
    cases: tuple[str, ...] = ("a", "b", "c")
    hf_baseline: bool = True
    plot: str | None = "bench_serve.png"
    num_threads: int | None = None
    seed: int = 0


def _prompts(count: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def _median(name: str, fn: Callable[[], dict], runs: int) -> dict:
    fn()  # warm-up
    results = [fn() for _ in range(runs)]
    median = {k: round(statistics.median(r[k] for r in results), 4) for k in results[0]}
    print(f"kthena bench serve: {name}: {median}", file=sys.stderr, flush=True)
    return median


# ---- the engine --------------------------------------------------------------------------------
def _engine_run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run ``prompts`` to completion on a cold prefix cache; latency and token figures."""
    assert engine.kv.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    computed = engine.stats().num_computed_prompt_tokens
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    total = time.perf_counter() - start
    ttfts = [o.first_token_time - start for o in finals]
    return {"total_s": total, "mean_ttft_s": statistics.mean(ttfts),
            "output_tok_s": sum(len(o.token_ids) for o in finals) / total,
            "computed_prompt_tokens": engine.stats().num_computed_prompt_tokens - computed,
            "finals": finals}


def _engine_cases(config: EngineConfig, options: BenchOptions) -> dict:
    rng = random.Random(options.seed)
    out: dict = {}
    label = "kthena"
    engines = {True: LLMEngine.from_config(config)}
    if "a" in options.cases:
        prompt = _prompts(1, 128, rng)

        def case_a() -> dict:
            run = _engine_run(engines[True], prompt, 64)
            final = run["finals"][0]
            decode = (final.finish_time - final.first_token_time) / (len(final.token_ids) - 1)
            return {"ttft_s": run["mean_ttft_s"], "decode_tok_s": 1.0 / decode}

        out["a_batch1"] = _median(f"{label} a", case_a, options.runs)
    if "b" in options.cases:
        prompts = _prompts(32, 128, rng)

        def case_b() -> dict:
            run = _engine_run(engines[True], prompts, 64)
            return {"total_s": run["total_s"], "output_tok_s": run["output_tok_s"]}

        out["b_offline"] = _median(f"{label} b", case_b, options.runs)
    if "c" in options.cases:
        system = _prompts(1, 512, rng)[0]
        prompts = [system + q for q in _prompts(32, 32, rng)]
        engines[False] = LLMEngine.from_config(  # the same weights, reuse off
            attrs.evolve(config, enable_prefix_caching=False), model=engines[True].runner.model,
            tokenizer=engines[True].tokenizer)
        for reuse in (True, False):

            def case_c(reuse: bool = reuse) -> dict:
                run = _engine_run(engines[reuse], prompts, 16)
                return {k: run[k] for k in ("total_s", "mean_ttft_s", "computed_prompt_tokens")}

            name = f"c_shared_prefix_{'reuse' if reuse else 'no_reuse'}"
            out[name] = _median(f"kthena {name}", case_c, options.runs)
        on, off = out["c_shared_prefix_reuse"], out["c_shared_prefix_no_reuse"]
        out["c_speedup"] = round(off["total_s"] / on["total_s"], 2)
    return out


# ---- transformers baseline ---------------------------------------------------------------------
def _hf_generate(model, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
    """(total seconds, seconds to the first token) for one padded batch."""
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, min_new_tokens=1,
                       do_sample=False)
        first = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens,
                       min_new_tokens=max_tokens, do_sample=False)
        return time.perf_counter() - start, first


def _hf_cases(config: EngineConfig, options: BenchOptions) -> dict:
    from transformers import AutoModelForCausalLM, logging

    from kthena_serve.model import resolve_checkpoint

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(resolve_checkpoint(config.model)),
                                                 dtype=config.torch_dtype).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    rng = random.Random(options.seed)
    out: dict = {}
    label = "transformers"
    if "a" in options.cases:
        prompt = _prompts(1, 128, rng)

        def case_a() -> dict:
            total, first = _hf_generate(model, prompt, 64)
            return {"ttft_s": first, "decode_tok_s": 63 / max(total - first, 1e-9)}

        out["a_batch1"] = _median(f"{label} a", case_a, options.runs)
    if "b" in options.cases:
        prompts = _prompts(32, 128, rng)

        def case_b() -> dict:
            total, _ = _hf_generate(model, prompts, 64)
            return {"total_s": total, "output_tok_s": 32 * 64 / total}

        out["b_offline"] = _median(f"{label} b", case_b, options.runs)
    if "c" in options.cases:
        system = _prompts(1, 512, rng)[0]
        prompts = [system + q for q in _prompts(32, 32, rng)]

        def case_c() -> dict:
            total, first = _hf_generate(model, prompts, 16)
            return {"total_s": total, "mean_ttft_s": first}

        out["c_shared_prefix"] = _median("transformers c", case_c, max(1, options.runs - 1))
    return out


# ---- report ------------------------------------------------------------------------------------
def _machine(num_threads: int) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "torch_threads": num_threads,
            "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "load_avg_1m_before": round(os.getloadavg()[0], 2)}


def run_bench(config: EngineConfig, options: BenchOptions) -> dict:
    """Run the cases; returns the JSON-ready result (and writes the plot if asked)."""
    from kthena_serve.threads import configure_threads

    config = attrs.evolve(config, num_threads=options.num_threads)
    result = {"bench": "kthena serve", "model": config.model, "dtype": config.dtype,
              "runs": options.runs, "machine": _machine(configure_threads(options.num_threads))}
    result["kthena"] = _engine_cases(config, options)
    if options.hf_baseline:
        result["transformers"] = _hf_cases(config, options)
    result["vllm_reference_from_issue"] = VLLM_REFERENCE
    result["machine"]["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    if options.plot:
        from kthena_serve._bench_plot import plot

        plot(result, options.plot)
        result["plot"] = options.plot
    return result
