"""``kthena bench serve``'s workloads through vLLM's offline ``LLM`` API (the peer side).

Run with the peer venv's python (built by ``build_vllm_venv.py``), never with the project's.
``kthena bench serve --peer vllm`` starts it and asks for one run at a time, so that its runs
and kthena's alternate on the same cores (see docs/bench_serve.md). It builds one ``LLM`` and
then serves requests, one JSON object per line: on stdin ``{"case": "a" | "b" | "c"}``, on
stdout ``{"peer": "vllm", "case": ..., "result": {...}}`` with the figures of that one run,
keyed as kthena's. Its first such line is ``{"peer": "vllm", "ready": {...}}`` (version,
cores, settings). It exits when stdin closes. vLLM logs to stdout too, so only lines that are
JSON objects with a ``"peer"`` key are answers. By hand::

    .venv/bin/python -c "import json; from kthena_serve.bench.serve import workload_prompts; \
        print(json.dumps(workload_prompts(('a', 'b', 'c'))))" > workloads.json
    printf '{"case": "b"}\n{"case": "b"}\n' | benchmarks/peers/.venv-vllm/bin/python \
        benchmarks/peers/vllm_workloads.py --model ~/.cache/kthena/SmolLM2-135M-Instruct \
        --workloads workloads.json --cores 0-1 --prefix-caching on

``--workloads`` is the JSON file ``kthena bench serve --peer vllm`` writes: per workload the
prompt token ids and output length (``{"a_batch1": {"prompts": [[...]], "max_tokens": 64},
"b_offline": ..., "c_shared_prefix": ...}``), so both sides run the very same prompts.

vLLM runs eager (``enforce_eager=True``), bf16, greedy with ``ignore_eos``, its OpenMP threads
bound to ``--cores`` (``VLLM_CPU_OMP_THREADS_BIND``) and a ``--kv-cache-gib`` KV cache
(``VLLM_CPU_KVCACHE_SPACE``). Requests go through ``LLM.llm_engine``'s ``add_request`` /
``step`` loop, timed as kthena's engine is: TTFT is the first step that returns a token for a
request, decode tokens/s is (tokens - 1) ÷ (finish - first token). Every run starts on a
reset prefix cache. Prefix reuse off needs another ``LLM`` (``--prefix-caching off``), so the
bench runs a second process of this script for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# case -> the workload it runs (kthena_serve.bench.peer.PEER_CASES holds the same pairs: this
# script runs in the peer venv, which does not have the project installed)
WORKLOADS = {"a": "a_batch1", "b": "b_offline", "c": "c_shared_prefix"}


def _log(message: str) -> None:
    print(f"vllm_workloads: {message}", file=sys.stderr, flush=True)


def _answer(**fields: object) -> None:
    print(json.dumps({"peer": "vllm", **fields}), flush=True)


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


def run_case(llm, case: str, spec: dict) -> dict:
    """One timed run of ``case`` ("a", "b" or "c") on ``spec``; kthena's keys for it."""
    run = _run(llm, spec["prompts"], spec["max_tokens"])
    if case == "a":
        (rid, (finish, tokens)), = run["done"].items()
        return {"ttft_s": run["first"][rid] - run["start"],
                "decode_tok_s": (tokens - 1) / (finish - run["first"][rid])}
    if case == "b":
        return {"total_s": run["total_s"], "output_tok_s": run["output_tokens"] / run["total_s"]}
    ttfts = [t - run["start"] for t in run["first"].values()]
    return {"total_s": run["total_s"], "mean_ttft_s": statistics.mean(ttfts)}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--workloads", type=Path, required=True, help="workloads JSON file")
    parser.add_argument("--cores", required=True, help="cores to bind, e.g. 0-1")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--prefix-caching", choices=("on", "off"), required=True,
                        help="the LLM's enable_prefix_caching")
    args = parser.parse_args(argv)
    if not args.workloads.is_file():
        parser.error(f"--workloads {args.workloads}: no such file")
    args.workload_specs = json.loads(args.workloads.read_text(encoding="utf-8"))
    if not (Path(args.model) / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a converted Hugging "
                     "Face checkpoint folder")
    try:
        _cores(args.cores)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    _environment(args.cores, args.kv_cache_gib)
    import vllm

    llm = _make_llm(args.model, prefix_caching=args.prefix_caching == "on")
    try:
        _answer(ready={"version": vllm.__version__, "cores": args.cores,
                       "kv_cache_gib": args.kv_cache_gib, "enforce_eager": True,
                       "dtype": "bfloat16"})
        for line in sys.stdin:
            if not line.strip():
                continue
            case = json.loads(line).get("case")
            served = sorted(c for c, w in WORKLOADS.items() if w in args.workload_specs)
            if case not in served:
                raise ValueError(f"request {line.strip()!r}: case must be one of {served}")
            result = run_case(llm, case, args.workload_specs[WORKLOADS[case]])
            _log(f"{case} (prefix caching {args.prefix_caching}): {result}")
            _answer(case=case, result=result)
    finally:
        llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
