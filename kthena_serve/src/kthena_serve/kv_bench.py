"""``python -m kthena_serve.kv_bench``: multi-turn chat over a pool smaller than its working set,
with tiered KV offload off, on host memory, and on host memory + Mooncake Store.

::

    sessions x turns, interleaved (turn t of every session, then turn t+1): each turn's prompt
    is the session's whole history (earlier prompts and answers) plus a new user message of
    random token ids (fixed seed), answered greedily with --max-tokens (ignore_eos)
    pool: working set / --pool-ratio blocks, so a session's blocks are evicted before its turn
    per mode: a fresh engine, one warm-up conversation, then the measured run
    -> one JSON line per mode: TTFT p50 / p99, total seconds, computed prompt tokens, tier stats

Requests run one at a time, so TTFT is that of a lone request (promotion has nothing to
overlap with). ``host+store`` uses ``--master HOST:PORT``, or starts ``mooncake_master`` from
this interpreter's bin folder on 127.0.0.1 and stops it after; its host tier holds a quarter
of the working set, so most reuse comes from the store.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import attrs

from kthena_serve._machine import host_info

__all__ = ["main", "run_mode"]

MODES = ("off", "host", "host+store")


@attrs.frozen
class BenchShape:
    sessions: int = 8
    turns: int = 4
    user_tokens: int = 64
    max_tokens: int = 16
    block_size: int = 16
    pool_ratio: float = 4.0
    seed: int = 0

    @property
    def working_set_blocks(self) -> int:
        per_session = self.turns * (self.user_tokens + self.max_tokens)
        return self.sessions * -(-per_session // self.block_size)

    @property
    def pool_blocks(self) -> int:
        longest = self.turns * (self.user_tokens + self.max_tokens)
        return max(-(-longest // self.block_size) + 1,
                   int(self.working_set_blocks / self.pool_ratio))


def _messages(shape: BenchShape) -> list[list[list[int]]]:
    rng = random.Random(shape.seed)
    return [[[rng.randrange(100, 40000) for _ in range(shape.user_tokens)]
             for _ in range(shape.turns)] for _ in range(shape.sessions)]


def _serve(engine, request_id: str, prompt: list[int], params):  # noqa: ANN001, ANN202
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out
    raise RuntimeError(f"request {request_id} did not finish")


def _conversation(engine, shape: BenchShape, messages, params, tag: str) -> list[float]:  # noqa: ANN001
    histories: list[list[int]] = [[] for _ in messages]
    ttfts = []
    for turn in range(shape.turns):
        for session, history in enumerate(histories):
            prompt = history + messages[session][turn]
            out = _serve(engine, f"{tag}-{session}-{turn}", prompt, params)
            if out.error is not None:
                raise RuntimeError(f"request failed: {out.error}")
            ttfts.append(out.first_token_time - out.arrival_time)
            history[:] = prompt + list(out.token_ids)
    return ttfts


def run_mode(mode: str, shape: BenchShape, model, tokenizer, master: str | None = None,  # noqa: ANN001
             dtype: str = "bfloat16") -> dict:
    """One mode's figures (a fresh engine; warm-up conversation first, with other tokens)."""
    from kthena_serve.config import EngineConfig
    from kthena_serve.engine import LLMEngine
    from kthena_serve.sampling_params import SamplingParams

    offload = None
    if mode == "host":
        offload = "host=4GiB"
    elif mode == "host+store":
        quarter = shape.working_set_blocks // 4 * _block_bytes(model, shape, dtype)
        offload = f"host={max(1, quarter)},store=mooncake@{master}"
    config = EngineConfig(num_kv_blocks=shape.pool_blocks, block_size=shape.block_size,
                          dtype=dtype, max_num_seqs=4, kv_offload=offload)
    engine = LLMEngine.from_config(config, model=model, tokenizer=tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=shape.max_tokens, ignore_eos=True)
    try:
        warm = BenchShape(sessions=1, turns=2, user_tokens=shape.user_tokens,
                          max_tokens=shape.max_tokens, seed=shape.seed + 1)
        _conversation(engine, warm, _messages(warm), params, "warm")
        before = engine.stats().num_computed_prompt_tokens
        start = time.perf_counter()
        ttfts = _conversation(engine, shape, _messages(shape), params, "run")
        total = time.perf_counter() - start
        stats = engine.stats()
    finally:
        engine.close()
    quantiles = statistics.quantiles(ttfts, n=100, method="inclusive")
    return {"mode": mode, "kv_offload": offload, "requests": len(ttfts),
            "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p99_s": round(quantiles[98], 4), "total_s": round(total, 3),
            "computed_prompt_tokens": stats.num_computed_prompt_tokens - before,
            "tiers": [attrs.asdict(t) for t in stats.kv_tiers]}


def _block_bytes(model, shape: BenchShape, dtype: str) -> int:  # noqa: ANN001
    item = 4 if dtype == "float32" else 2
    return (2 * model.config.num_hidden_layers * model.num_kv_heads_per_rank * model.head_dim
            * shape.block_size * item)


def _start_master() -> tuple[subprocess.Popen, str]:
    from mooncake_kv.tiers.master import MasterUnavailableError, start_local_master

    try:
        return start_local_master()
    except MasterUnavailableError as error:
        raise SystemExit(f"kv_bench: host+store needs --master HOST:PORT or a local master: "
                         f"{error}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kthena_serve.kv_bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated, of {', '.join(MODES)}")
    for field in attrs.fields(BenchShape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="mooncake_master for host+store (default: start one on 127.0.0.1)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes takes {', '.join(MODES)}; got {args.modes!r}")
    shape = BenchShape(**{f.name: getattr(args, f.name) for f in attrs.fields(BenchShape)})
    import torch

    from kthena_serve.model import load_model

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    master_proc, master = None, args.master
    if "host+store" in modes and master is None:
        master_proc, master = _start_master()
    report = {"bench": "kv_offload", "shape": attrs.asdict(shape),
              "pool_blocks": shape.pool_blocks, "working_set_blocks": shape.working_set_blocks,
              "machine": host_info(), "runs": []}
    try:
        for mode in modes:
            result = run_mode(mode, shape, model, tokenizer, master, args.dtype)
            report["runs"].append(result)
            print(json.dumps(result), flush=True)
    finally:
        if master_proc is not None:
            from mooncake_kv.tiers.master import stop_master

            stop_master(master_proc)
    report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
