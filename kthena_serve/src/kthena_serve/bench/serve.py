"""``kthena bench serve``: the engine on three workloads, against peers on the same cores.

    (a) batch 1: TTFT of a 128-token prompt, then decode tokens/s over 64 tokens
    (b) offline throughput: 32 requests x (128 prompt, 64 output) tokens
    (c) shared prefix: 32 requests = one 512-token system prompt + a 32-token question each,
        16 output tokens; prefix reuse on and off (total time, mean TTFT, computed prompt tokens)

The peers run the very same prompt token ids on the same threads: transformers ``generate``
(batch-padded, no prefix reuse) in this process, and with ``--peer vllm`` vLLM's CPU build from
its own venv (`kthena_serve.bench.peer`), or with ``--peer llama.cpp`` ``llama-server`` on the
model's GGUF (`kthena_serve.bench.llama_cpp`). Their runs alternate with ours case by case
(`interleave`), so the machine's drift over minutes does not land on one system. Each workload
is also set against the machine's physical limit, measured first on the same threads
(`kthena_serve.bench.limits`). Prompts are fixed-seed random token ids; outputs ignore EOS so
every run does the same work. Each case runs once per system to warm up, then ``runs`` rounds;
the JSON reports medians, speed-ups of ours over each peer, the share of the limit each system
reaches, the machine and its load average; the PNG plots the ratios. Only same-run figures are
reported. Where there are two cores, the TP collectives are timed over two ranks too
(``collectives``: what ``kthena plan --calibrate`` turns into ``sp_collective_factor``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from kthena_core.model_spec import ModelSpec
from kthena_serve.bench.limits import (
    COMPARED,
    achieved_fractions,
    measure_limits,
    peer_speedups,
    workload_limits,
)
from kthena_serve.bench.machine import cpu_isa, cpu_model, wait_until_idle
from kthena_serve.bench.optional import draw, note_missing
from kthena_serve.bench.peer import PEER_CASES, Peer
from kthena_serve.engine import LLMEngine
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

__all__ = ["CASE_KEYS", "BenchOptions", "interleave", "run_bench", "wait_policy_note",
           "workload_prompts"]

CASES = ("a", "b", "c")
PEER_NAMES = ("vllm", "llama.cpp")  # as they key the result
COLLECTIVE_ROWS = (2048, 8192)  # prompt-sized activations: the SP range the planner weighs


def _check_cases(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value or set(value) - set(CASES):
        raise ValueError(f"cases {','.join(value)!r}: choose a non-empty subset of "
                         f"{','.join(CASES)}")


@attrs.frozen
class BenchOptions:
    """What ``kthena bench serve`` runs; ``peer`` None leaves transformers the only peer
    (else `kthena_serve.bench.peer.PeerSpec` or `kthena_serve.bench.llama_cpp.LlamaCppPeer`)."""

    runs: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    cases: tuple[str, ...] = attrs.field(default=CASES, validator=_check_cases)
    hf_baseline: bool = True
    plot: str | None = "bench_serve.png"
    num_threads: int | None = None
    seed: int = 0
    peer: Peer | None = None
    collectives: bool = True


def _prompts(count: int, length: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def workload_prompts(cases: tuple[str, ...], seed: int = 0) -> dict[str, dict]:
    """The prompt token ids and output length of each workload; every system runs these."""
    rng = random.Random(seed)
    out: dict[str, dict] = {}
    if "a" in cases:
        out["a_batch1"] = {"prompts": _prompts(1, 128, rng), "max_tokens": 64}
    if "b" in cases:
        out["b_offline"] = {"prompts": _prompts(32, 128, rng), "max_tokens": 64}
    if "c" in cases:
        system = _prompts(1, 512, rng)[0]
        out["c_shared_prefix"] = {"prompts": [system + q for q in _prompts(32, 32, rng)],
                                  "max_tokens": 16}
    return out


Runner = Callable[[], dict]  # one timed run of a case: its figures
CASE_KEYS = tuple(PEER_CASES)  # result keys, in the order the cases run


def _case_keys(workloads: dict) -> list[tuple[str, str]]:
    """(result key, workload) of the cases whose workload is in ``workloads``, in run order."""
    return [(key, workload) for key, (workload, _, _) in PEER_CASES.items()
            if workload in workloads]


def interleave(systems: dict[str, dict[str, Runner]], runs: int,
               fewer: dict[tuple[str, str], int] | None = None,
               settle: Callable[[], object] = wait_until_idle) -> dict[str, dict[str, dict]]:
    """Each case in turn (`CASE_KEYS` order): every system that has it runs once to warm up,
    then ``runs`` rounds of one run per system, the order reversed every other round (ours,
    transformers, vLLM; then vLLM, transformers, ours; ...), so that the machine's drift over a
    case weighs on every system alike. ``fewer[(system, case)]`` caps that system's rounds;
    ``settle()`` runs before every run (by default: until the CPUs are idle, so that no
    system's leftover work lands on the next one's run).
    Returns the medians, ``{system: {case: {figure: median}}}``."""
    fewer = {key: max(1, n) for key, n in (fewer or {}).items()}
    out: dict[str, dict[str, dict]] = {name: {} for name in systems}
    for case in CASE_KEYS:
        names = [name for name in systems if case in systems[name]]
        for name in names:
            settle()
            systems[name][case]()  # warm-up (a peer process starts here)
        results: dict[str, list[dict]] = {name: [] for name in names}
        for round_ in range(runs):
            for name in names if round_ % 2 == 0 else names[::-1]:
                if round_ < fewer.get((name, case), runs):
                    settle()
                    results[name].append(systems[name][case]())
                    print(f"kthena bench serve: round {round_ + 1}: {name} {case}: "
                          f"{ {k: round(v, 4) for k, v in results[name][-1].items()} }",
                          file=sys.stderr, flush=True)
        for name in names:
            median = {k: round(statistics.median(r[k] for r in results[name]), 4)
                      for k in results[name][0]}
            print(f"kthena bench serve: {name} {case}: {median}", file=sys.stderr, flush=True)
            out[name][case] = median
    return out


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


def _engine_case(engine_of: Callable[[bool], LLMEngine], key: str, spec: dict) -> dict:
    """One timed run of case ``key`` on workload ``spec``; its figures."""
    reuse = key != "c_shared_prefix_no_reuse"
    run = _engine_run(engine_of(reuse), spec["prompts"], spec["max_tokens"])
    if key == "a_batch1":
        final = run["finals"][0]
        decode = (final.finish_time - final.first_token_time) / (len(final.token_ids) - 1)
        return {"ttft_s": run["mean_ttft_s"], "decode_tok_s": 1.0 / decode}
    if key == "b_offline":
        return {"total_s": run["total_s"], "output_tok_s": run["output_tok_s"]}
    return {k: run[k] for k in ("total_s", "mean_ttft_s", "computed_prompt_tokens")}


def _engine_runners(config: EngineConfig, workloads: dict,
                    engine: LLMEngine | None = None) -> dict[str, Runner]:
    """A runner per case whose workload is in ``workloads``, on ``engine`` (default: one from
    ``config``) and, for reuse off, a second engine over the same weights made when first run.
    Each runner holds its own workload (`functools.partial`, not a closure over a loop
    variable)."""
    engines = {True: engine or LLMEngine.from_config(config)}

    def engine_of(reuse: bool) -> LLMEngine:
        if reuse not in engines:  # the same weights, reuse off
            first = engines[True]
            engines[reuse] = LLMEngine.from_config(
                attrs.evolve(first.config, enable_prefix_caching=False),
                model=first.runner.model, tokenizer=first.tokenizer)
        return engines[reuse]

    return {key: functools.partial(_engine_case, engine_of, key, workloads[workload])
            for key, workload in _case_keys(workloads)}


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


def _hf_case(model: PreTrainedModel, key: str, spec: dict) -> dict:
    """One timed run of case ``key`` with transformers ``generate``; its figures."""
    total, first = _hf_generate(model, spec["prompts"], spec["max_tokens"])
    if key == "a_batch1":
        decode_s = max(total - first, 1e-9)
        return {"ttft_s": first, "decode_tok_s": (spec["max_tokens"] - 1) / decode_s}
    if key == "b_offline":
        return {"total_s": total, "output_tok_s": len(spec["prompts"]) * spec["max_tokens"] / total}
    return {"total_s": total, "mean_ttft_s": first}


def _hf_runners(checkpoint: Path, dtype: torch.dtype, workloads: dict
                ) -> dict[str, Runner] | None:
    """transformers' runners; None (after one line) if transformers fails to import."""
    try:
        from transformers import AutoModelForCausalLM, logging
    except ImportError as error:  # installed (the CLI checked) but broken
        note_missing("kthena bench serve", "transformers",
                     f"running without the transformers baseline ({error})")
        return None

    logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    # generate has no prefix reuse: every prompt token of every request is computed, so (c)
    # is reported as reuse off
    return {key: functools.partial(_hf_case, model, key, workloads[workload])
            for key, workload in _case_keys(workloads) if key != "c_shared_prefix_reuse"}


# ---- report ------------------------------------------------------------------------------------


def wait_policy_note(threads: int, environ: Mapping[str, str]) -> str | None:
    """A warning when this process's figures are taken with OpenMP's threads asleep between
    parallel regions (``OMP_WAIT_POLICY=PASSIVE`` and no ``GOMP_SPINCOUNT`` of its own), which
    the JSON's ``machine.omp_wait_policy`` records too; None otherwise."""
    passive = environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"
    if threads < 2 or not passive or environ.get("GOMP_SPINCOUNT", "").strip():
        return None
    return ("OMP_WAIT_POLICY=PASSIVE is set, so OpenMP wakes its threads through the kernel "
            "at every parallel region (a batch-32 decode step of the default model: 24 ms "
            "against 19 ms with OpenMP's default on a 2-core Zen 5); unset it to measure a "
            "process that has its cores alone (docs/kthena_serve.md, \"Threads vs cores\")")


def _machine(num_threads: int) -> dict:
    import torch

    from mooncake_ops.backends import native

    return {"cpu": cpu_model(), "cpu_isa": cpu_isa(), "cores": len(os.sched_getaffinity(0)),
            "native_kernels": native.isa() or "none", "torch_threads": num_threads,
            "torch": torch.__version__, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
            "load_avg_1m_before": round(os.getloadavg()[0], 2)}


def _limits(checkpoint: Path) -> dict:
    """Measure the machine's limits on this process's threads; the per-workload ideals."""
    config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    shape = ModelSpec.from_hf_config(config).shape
    limits, details = measure_limits(shape)
    print(f"kthena bench serve: limits: {details}", file=sys.stderr, flush=True)
    ideal = workload_limits(shape, limits)
    return {"machine": details,
            **{case: {k: round(v, 4) for k, v in figures.items()}
               for case, figures in ideal.items()}}


def _host_probe() -> dict | None:
    """This run's own host probe (measured now, on this process's threads, not read from the
    cache): the peaks a calibration fitted to this JSON is relative to, wherever it is fitted."""
    from kthena_core.discovery.host_probe import measure_host

    probe = measure_host(None)
    if probe is not None:
        print(f"kthena bench serve: {probe.describe()}", file=sys.stderr, flush=True)
    return None if probe is None else probe.to_dict()


def _compare(result: dict) -> None:
    """Add ``fraction_of_limit`` per system and ``speedup_vs`` per peer (ours over theirs)."""
    metrics: dict[str, tuple[str, ...]] = {}
    for _, case, metric in COMPARED:
        metrics[case] = (*metrics.get(case, ()), metric)
    systems = [name for name in ("kthena", *PEER_NAMES, "transformers") if name in result]
    limits = {case: v for case, v in result["limits"].items() if case != "machine"}
    result["fraction_of_limit"] = {name: achieved_fractions(result[name], limits)
                                   for name in systems}
    result["speedup_vs"] = {name: peer_speedups(result["kthena"], result[name], metrics)
                            for name in systems if name != "kthena"}


def _collectives(checkpoint: Path) -> dict:
    """The TP collectives timed over two gloo ranks on prompt-sized activations of the model
    (``bench.sp_prompts.measure_collectives``): what ``kthena plan --calibrate`` turns into the
    calibration's ``sp_collective_factor``; skipped, with the reason, on one core."""
    from kthena_serve.bench.sp_prompts import measure_collectives
    from kthena_serve.model import ModelConfig

    if (os.cpu_count() or 1) < 2:
        return {"skipped": "one core: two ranks would share it"}
    hidden = ModelConfig.from_pretrained(checkpoint).shape.hidden_size
    measured = measure_collectives(COLLECTIVE_ROWS, hidden, repeat=5)
    print("kthena bench serve: collectives (reduce-scatter + all-gather over all-reduce): "
          + ", ".join(f"{n} rows {v['sp_collective_factor']:.2f}"
                      for n, v in measured["sizes"].items()), file=sys.stderr, flush=True)
    return measured


def run_bench(config: EngineConfig, options: BenchOptions) -> dict:
    """Run the cases, ours and the peers' alternating (`interleave`); returns the JSON-ready
    result (and writes the plot)."""
    from kthena_serve.bench.plot import table
    from kthena_serve.engine.threads import configure_threads, owned_cores
    from kthena_serve.model import resolve_checkpoint

    config = attrs.evolve(config, num_threads=options.num_threads)
    threads = configure_threads(options.num_threads)
    note = wait_policy_note(threads, os.environ)
    if note:
        print(f"kthena bench serve: {note}", file=sys.stderr, flush=True)
    probe = _host_probe()  # first: the 1-minute load average it records is not our own work
    checkpoint = resolve_checkpoint(config.model)  # converted once, cached
    result = {"bench": "kthena serve", "model": config.model, "dtype": config.dtype,
              "quantization": config.quantization, "runs": options.runs,
              "machine": _machine(threads)}
    result["limits"] = _limits(checkpoint)
    result["host_probe"] = probe
    if options.collectives:
        result["collectives"] = _collectives(checkpoint)
    workloads = workload_prompts(options.cases, options.seed)
    engine = LLMEngine.from_config(config)
    result["kernels"] = dict(engine.processor.limits.kernels)  # what ran, and how it was chosen
    systems = {"kthena": _engine_runners(config, workloads, engine)}
    fewer: dict[tuple[str, str], int] = {}
    hf = _hf_runners(checkpoint, config.torch_dtype, workloads) if options.hf_baseline else None
    if hf is not None:
        systems["transformers"] = hf
        # its (c) takes ~2x ours without reuse: one round fewer
        fewer[("transformers", "c_shared_prefix_no_reuse")] = max(1, options.runs - 1)
    with contextlib.ExitStack() as stack:
        if options.peer is not None:
            session = stack.enter_context(options.peer.session(checkpoint, workloads,
                                                               owned_cores()[:threads]))
            systems[options.peer.name] = {key: functools.partial(session.run, key)
                                          for key, _ in _case_keys(workloads)}
        waits: list[float] = []
        result.update(interleave(systems, options.runs, fewer,
                                 settle=lambda: waits.append(wait_until_idle())))
        if options.peer is not None:
            result["machine"][f"{options.peer.name}_run"] = session.info
    result["schedule"] = ("per case: each system once to warm up, then runs rounds of one run "
                          "each, the order reversed every other round; every run starts once "
                          "this process's cores are idle")
    result["machine"]["idle_wait_s"] = {"total": round(sum(waits), 1),
                                        "max": round(max(waits, default=0.0), 1)}
    ours = result["kthena"]
    if "c_shared_prefix_reuse" in ours:
        on, off = ours["c_shared_prefix_reuse"], ours["c_shared_prefix_no_reuse"]
        ours["c_speedup"] = round(off["total_s"] / on["total_s"], 2)
    _compare(result)
    result["machine"]["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    print(table(result), file=sys.stderr, flush=True)
    if options.plot:
        from kthena_serve.bench.plot import plot

        if draw("kthena bench serve", lambda: plot(result, options.plot)):
            result["plot"] = options.plot
    return result
