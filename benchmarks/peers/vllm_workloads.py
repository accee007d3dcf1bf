"""``kthena bench serve``'s workloads through vLLM's offline ``LLM`` API (the peer side).

Run with the peer venv's python (built by ``build_vllm_venv.py``), never with the project's::

    benchmarks/peers/.venv-vllm/bin/python benchmarks/peers/vllm_workloads.py \
        --model ~/.cache/kthena/SmolLM2-135M-Instruct --workloads workloads.json \
        --cores 0-1 --repeats 3

``--workloads`` is the JSON file ``kthena bench serve --peer vllm`` writes: per workload the
prompt token ids and output length (``{"a_batch1": {"prompts": [[...]], "max_tokens": 64},
"b_offline": ..., "c_shared_prefix": ...}``), so both sides run the very same prompts. To run
this script alone, write the file with the project's python::

    .venv/bin/python -c "import json; from kthena_serve.bench import workload_prompts; \
        print(json.dumps(workload_prompts(('a', 'b', 'c'))))" > workloads.json

vLLM runs eager (``enforce_eager=True``), bf16, greedy with ``ignore_eos``, its OpenMP threads
bound to ``--cores`` (``VLLM_CPU_OMP_THREADS_BIND``) and a ``--kv-cache-gib`` KV cache
(``VLLM_CPU_KVCACHE_SPACE``). Requests go through ``LLM.llm_engine``'s ``add_request`` /
``step`` loop, timed as kthena's engine is: TTFT is the first step that returns a token for a
request, decode tokens/s is (tokens - 1) ÷ (finish - first token). Each workload runs once to
warm up, then ``--repeats`` times on a reset prefix cache; medians are printed as one JSON line
on stdout with the keys ``kthena bench serve`` uses. Prefix reuse off needs a second ``LLM``
(``enable_prefix_caching=False``), so that workload runs in a child process of this script.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = ("a", "b", "c_reuse", "c_no_reuse")
WORKLOAD_KEYS = ("a_batch1", "b_offline", "c_shared_prefix", "c_shared_prefix")


def _log(message: str) -> None:
    print(f"vllm_workloads: {message}", file=sys.stderr, flush=True)


def _cores(text: str) -> list[int]:
    """'0-1' or '0,2,3' -> core ids; raises ValueError naming the accepted forms."""
    cores: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cores += range(int(low), int(high or low) + 1)
    except ValueError:
        raise ValueError(f"--cores {text!r}: expected core ids like '0-1' or '0,2,3'") from None
    if not cores:
        raise ValueError(f"--cores {text!r} names no core")
    return cores


def _environment(cores: str, kv_cache_gib: int) -> None:
    """vLLM's CPU knobs; read by vLLM when the engine starts, so set before it is imported."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _make_llm(model: str, prefix_caching: bool):
    from vllm import LLM

    return LLM(model=model, dtype="bfloat16", enforce_eager=True, seed=0,
               enable_prefix_caching=prefix_caching, disable_log_stats=True)


def _run(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """All ``prompts`` to completion on a cold prefix cache; kthena's figures for the run."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running?)")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first: dict[str, float] = {}
    done: dict[str, tuple[float, int]] = {}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.outputs and out.outputs[0].token_ids:
                first.setdefault(out.request_id, now)
            if out.finished:
                done[out.request_id] = (now, len(out.outputs[0].token_ids))
    total = time.perf_counter() - start
    if len(done) != len(prompts) or any(n != max_tokens for _, n in done.values()):
        raise RuntimeError(f"vLLM finished {len(done)} of {len(prompts)} requests or returned "
                           f"a length other than {max_tokens}")
    return {"total_s": total, "first": first, "done": done, "start": start,
            "output_tokens": sum(n for _, n in done.values())}


def _median(name: str, fn, repeats: int) -> dict:
    fn()  # warm-up
    results = [fn() for _ in range(repeats)]
    median = {k: round(statistics.median(r[k] for r in results), 4) for k in results[0]}
    _log(f"{name}: {median}")
    return median


def _case_a(llm, spec: dict) -> dict:
    run = _run(llm, spec["prompts"], spec["max_tokens"])
    (rid, (finish, tokens)), = run["done"].items()
    return {"ttft_s": run["first"][rid] - run["start"],
            "decode_tok_s": (tokens - 1) / (finish - run["first"][rid])}


def _case_b(llm, spec: dict) -> dict:
    run = _run(llm, spec["prompts"], spec["max_tokens"])
    return {"total_s": run["total_s"], "output_tok_s": run["output_tokens"] / run["total_s"]}


def _case_c(llm, spec: dict) -> dict:
    run = _run(llm, spec["prompts"], spec["max_tokens"])
    ttfts = [t - run["start"] for t in run["first"].values()]
    return {"total_s": run["total_s"], "mean_ttft_s": statistics.mean(ttfts)}


def run_cases(args: argparse.Namespace, workloads: dict, cases: list[str]) -> dict:
    """Run ``cases`` in this process (one ``LLM``); results keyed like kthena's JSON."""
    reuse = "c_no_reuse" not in cases
    llm = _make_llm(args.model, prefix_caching=reuse)
    out = {}
    try:
        if "a" in cases:
            out["a_batch1"] = _median("a", lambda: _case_a(llm, workloads["a_batch1"]),
                                      args.repeats)
        if "b" in cases:
            out["b_offline"] = _median("b", lambda: _case_b(llm, workloads["b_offline"]),
                                       args.repeats)
        if "c_reuse" in cases or "c_no_reuse" in cases:
            name = "c_shared_prefix_reuse" if reuse else "c_shared_prefix_no_reuse"
            out[name] = _median(name, lambda: _case_c(llm, workloads["c_shared_prefix"]),
                                args.repeats)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return out


def _child_no_reuse(args: argparse.Namespace) -> dict:
    """Reuse off needs its own ``LLM``: run it in a fresh process of this script."""
    command = [sys.executable, __file__, "--model", args.model, "--workloads",
               str(args.workloads), "--cores", args.cores, "--repeats", str(args.repeats),
               "--kv-cache-gib", str(args.kv_cache_gib), "--cases", "c_no_reuse"]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    result = None
    for line in done.stdout.splitlines():  # vLLM logs to stdout: pass them on, keep the JSON
        if line.startswith('{"vllm"'):
            result = json.loads(line)["vllm"]
        else:
            print(line, file=sys.stderr)
    if done.returncode != 0 or result is None:
        raise RuntimeError(f"the reuse-off child exited with {done.returncode} and no JSON "
                           f"line: {' '.join(command)}")
    return result


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--workloads", type=Path, required=True, help="workloads JSON file")
    parser.add_argument("--cores", required=True, help="cores to bind, e.g. 0-1")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (median)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--cases", default=None, help=f"subset of {','.join(CASES)} (default: "
                        "every workload in the file)")
    args = parser.parse_args(argv)
    if not args.workloads.is_file():
        parser.error(f"--workloads {args.workloads}: no such file")
    args.workload_specs = json.loads(args.workloads.read_text(encoding="utf-8"))
    present = [case for case, key in zip(CASES, WORKLOAD_KEYS, strict=True)
               if key in args.workload_specs]
    cases = ([c.strip() for c in args.cases.split(",") if c.strip()] if args.cases is not None
             else present)
    unknown = sorted(set(cases) - set(CASES))
    if unknown or not cases:
        parser.error(f"--cases {args.cases!r}: unknown {unknown}; choose from {', '.join(CASES)}")
    if set(cases) - set(present):
        parser.error(f"--cases {','.join(cases)}: {args.workloads} holds workloads for "
                     f"{','.join(present) or 'none'} only")
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a converted Hugging "
                     "Face checkpoint folder")
    try:
        _cores(args.cores)
    except ValueError as error:
        parser.error(str(error))
    args.case_list = cases
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    workloads = args.workload_specs
    _environment(args.cores, args.kv_cache_gib)
    cases = args.case_list
    here = [c for c in cases if c != "c_no_reuse"] if len(cases) > 1 else cases
    result = run_cases(args, workloads, here) if here else {}
    if "c_no_reuse" in cases and here != cases:
        result.update(_child_no_reuse(args))
    import vllm

    print(json.dumps({"vllm": result, "version": vllm.__version__, "cores": args.cores,
                      "kv_cache_gib": args.kv_cache_gib, "enforce_eager": True,
                      "dtype": "bfloat16"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
