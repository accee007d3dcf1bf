"""``kthena bench kv``: multi-turn chat over a KV pool smaller than its working set, with tiered
offload off, on host memory, on host memory + Mooncake Store, with bf16 and int8 KV, and two
engine instances sharing the store or not.

::

    sessions x turns, interleaved (turn t of every session, then turn t+1): each turn's prompt
    is the session's whole history (earlier prompts and answers) plus a new user message of
    random token ids (fixed seed), answered greedily with --max-tokens (ignore_eos)
    pool: the bytes of working set / --pool-ratio blocks of the compute dtype (an int8 pool
    gets the same bytes, so ~1.9x bf16's blocks); each case: fresh engines, a warm-up conversation, the run
    -> per case: TTFT p50 / p99, total seconds, computed prompt tokens, tier counters, and per
       turn: TTFT p50, prompt tokens computed, KV bytes held in the pool and the host tier, and
       bytes put to the store

Cases (``--cases``): ``off``, ``host`` (a host tier that holds everything), ``host+store``
(a host tier of a quarter of the working set, the rest spills to Mooncake Store), each with
``/int8`` for an int8 pool; ``2x-host`` and ``2x-shared``: two engine processes, turn t of
session s served by instance (s + t) mod 2 (no session affinity), each with its own host tier;
``2x-shared`` also points both at one Mooncake Store (``write=through``), so a history one
instance computed is fetched by the other.

Requests run one at a time, so TTFT is that of a lone request (promotion has nothing to overlap
with). Store cases use ``--master HOST:PORT``, or start ``mooncake_master`` from this
interpreter's bin folder on 127.0.0.1 and stop it after. ``--plot`` writes TTFT, computed
tokens and KV memory per turn as a PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from random import Random
from typing import TYPE_CHECKING, Any

import attrs

from kthena_serve.bench.machine import host_info
from kthena_serve.bench.optional import draw, plot_or_note
from kthena_serve.bench.plot import save_figure

if TYPE_CHECKING:
    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.model import LlamaForCausalLM, Tokenizer

__all__ = ["CASES", "BenchShape", "add_parser", "main", "plot", "run_case"]

CASES = ("off", "host", "host+store", "off/int8", "host/int8", "host+store/int8", "2x-host",
         "2x-shared")
_STORE_CASES = ("host+store", "2x-shared")


@attrs.frozen
class BenchShape:
    sessions: int = 64
    turns: int = 6
    user_tokens: int = 32
    max_tokens: int = 8
    block_size: int = 16
    pool_ratio: float = 4.0
    seed: int = 0

    @property
    def working_set_blocks(self) -> int:
        per_session = self.turns * (self.user_tokens + self.max_tokens)
        return self.sessions * -(-per_session // self.block_size)

    @property
    def pool_blocks(self) -> int:
        """Blocks of the pool (of the compute dtype): a quarter (``pool_ratio``) of the working set, and at least
        one session's history."""
        longest = self.turns * (self.user_tokens + self.max_tokens)
        return max(-(-longest // self.block_size) + 1,
                   int(self.working_set_blocks / self.pool_ratio))


def _messages(shape: BenchShape) -> list[list[list[int]]]:
    rng = Random(shape.seed)
    return [[[rng.randrange(100, 40000) for _ in range(shape.user_tokens)]
             for _ in range(shape.turns)] for _ in range(shape.sessions)]


# ---- an engine instance: in this process, or a worker process ------------------------------------
class _Local:
    def __init__(self, config: EngineConfig, model: LlamaForCausalLM, tokenizer: Tokenizer,
                 ) -> None:
        from kthena_serve.engine import LLMEngine

        self.engine = LLMEngine.from_config(config, model=model, tokenizer=tokenizer)

    def serve(self, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        return _serve(self.engine, request_id, prompt, max_tokens)

    def stats(self) -> dict:
        return self.engine.stats().to_json()

    def num_blocks(self) -> int:
        return self.engine.runner.num_blocks

    def close(self) -> None:
        self.engine.close()


def _serve(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int,
           ) -> tuple[float, list[int]]:
    from kthena_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error is not None:
                    raise RuntimeError(f"request {request_id} failed: {out.error}")
                return out.first_token_time - out.arrival_time, list(out.token_ids)
    raise RuntimeError(f"request {request_id} did not finish")


class _Worker:
    """An engine in a child process (``--worker``): JSON lines on its stdin and stdout."""

    def __init__(self, config: EngineConfig, model_name: str, dtype: str) -> None:
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "GLOG_minloglevel": "2"}
        spec = json.dumps({"config": attrs.asdict(config), "model": model_name, "dtype": dtype})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kthena_serve.bench.kv", "--worker", spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        try:
            self._blocks = self._call({"op": "num_blocks"})["num_blocks"]
        except BaseException:
            self.close()  # a worker that failed to start is not left running
            raise

    def _call(self, message: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench kv worker exited with {self.proc.wait()}")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"bench kv worker: {answer['error']}")
        return answer

    def serve(self, request_id: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        answer = self._call({"op": "serve", "id": request_id, "prompt": prompt,
                             "max_tokens": max_tokens})
        return answer["ttft_s"], answer["token_ids"]

    def stats(self) -> dict:
        return self._call({"op": "stats"})["stats"]

    def num_blocks(self) -> int:
        return self._blocks

    def close(self) -> None:
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the worker closes its engine at EOF
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def _worker_main(spec_json: str) -> int:
    from kthena_core.dtypes import torch_dtype
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.model import load_model

    spec = json.loads(spec_json)
    config = EngineConfig(**spec["config"])
    model, tokenizer = load_model(spec["model"], dtype=torch_dtype(spec["dtype"]))
    local = _Local(config, model, tokenizer)
    try:
        for line in sys.stdin:
            message = json.loads(line)
            try:
                if message["op"] == "serve":
                    ttft, tokens = local.serve(message["id"], message["prompt"],
                                               message["max_tokens"])
                    answer: dict[str, Any] = {"ttft_s": ttft, "token_ids": tokens}
                elif message["op"] == "stats":
                    answer = {"stats": local.stats()}
                else:
                    answer = {"num_blocks": local.num_blocks()}
            except Exception as error:  # noqa: BLE001 - reported to the parent, which raises
                answer = {"error": f"{type(error).__name__}: {error}"}
            print(json.dumps(answer), flush=True)
    finally:
        local.close()
    return 0


# ---- one case ------------------------------------------------------------------------------------
def _held(stats: Sequence[dict], block_bytes: int) -> dict:
    """KV bytes the instances hold now: pool blocks referenced or cached, and host tiers."""
    pool = sum((s["kv"]["num_used_blocks"] + s["kv"]["num_cached_blocks"]) for s in stats)
    host = sum(t["used_bytes"] or 0 for s in stats for t in s["kv_tiers"] if t["tier"] == "host")
    store_in = sum(t["num_bytes_in"] for s in stats for t in s["kv_tiers"]
                   if t["tier"] == "mooncake_store")
    return {"pool_bytes": pool * block_bytes, "host_bytes": host, "store_bytes_put": store_in}


def _computed(stats: Sequence[dict]) -> int:
    return sum(s["num_computed_prompt_tokens"] for s in stats)


def _conversation(instances: Sequence[_Local | _Worker], shape: BenchShape,
                  messages: Sequence[Sequence[list[int]]], tag: str,
                  block_bytes: int, per_turn: list | None = None) -> list[float]:
    histories: list[list[int]] = [[] for _ in messages]
    ttfts = []
    before = _computed([i.stats() for i in instances])
    for turn in range(shape.turns):
        turn_ttfts = []
        for session, history in enumerate(histories):
            prompt = history + messages[session][turn]
            instance = instances[(session + turn) % len(instances)]
            ttft, tokens = instance.serve(f"{tag}-{session}-{turn}", prompt, shape.max_tokens)
            turn_ttfts.append(ttft)
            history[:] = prompt + tokens
        ttfts += turn_ttfts
        if per_turn is not None:
            stats = [i.stats() for i in instances]
            computed = _computed(stats)
            per_turn.append({"turn": turn + 1,
                             "ttft_p50_s": round(statistics.median(turn_ttfts), 4),
                             "computed_prompt_tokens": computed - before,
                             **_held(stats, block_bytes)})
            before = computed
    return ttfts


def _block_bytes(model: LlamaForCausalLM, block_size: int, dtype: str) -> int:
    """Bytes of one block of a pool of the compute dtype (the int8 cases get the same memory)."""
    item = 4 if dtype == "float32" else 2
    return 2 * model.config.shape.num_layers * model.num_kv_heads_per_rank * model.head_dim \
        * block_size * item


def case_config(case: str, shape: BenchShape, model: LlamaForCausalLM, master: str | None,
                dtype: str = "bfloat16") -> tuple[EngineConfig, int]:
    """The EngineConfig of each instance of ``case``, and how many instances it runs."""
    from kthena_serve.engine.config import EngineConfig

    mode, _, kv = case.partition("/")
    block = _block_bytes(model, shape.block_size, dtype)
    working_set = shape.working_set_blocks * block
    # every client lends the store a working set (the store takes 16 MiB at least)
    segment = f"segment={max(64 << 20, working_set * 5 // 4)}"
    offload = {"off": None, "host": "host=4GiB", "2x-host": "host=4GiB",
               "host+store": f"host={working_set // 4},store=mooncake@{master},{segment}",
               "2x-shared": f"host=4GiB,store=mooncake@{master},write=through,{segment}",
               }[mode]
    config = EngineConfig(kv_cache_memory=shape.pool_blocks * block,
                          block_size=shape.block_size, dtype=dtype,
                          kv_cache_dtype=kv or "auto", max_num_seqs=4, kv_offload=offload)
    return config, 2 if mode.startswith("2x") else 1


def run_case(case: str, shape: BenchShape, model: LlamaForCausalLM, tokenizer: Tokenizer,
             master: str | None = None, model_name: str = "default",
             dtype: str = "bfloat16") -> dict:
    """One case's figures: fresh instances, a warm-up conversation (other tokens), the run."""
    config, count = case_config(case, shape, model, master, dtype)
    instances: list[Any] = []
    try:
        for _ in range(count):
            instances.append(_Worker(config, model_name, dtype) if count > 1
                             else _Local(config, model, tokenizer))
        warm = BenchShape(sessions=count, turns=2, user_tokens=shape.user_tokens,
                          max_tokens=shape.max_tokens, seed=shape.seed + 1)
        _conversation(instances, warm, _messages(warm), "warm", 0)
        block_bytes = round(config.kv_cache_memory / instances[0].num_blocks())
        per_turn: list[dict] = []
        before = _computed([i.stats() for i in instances])
        start = time.perf_counter()
        ttfts = _conversation(instances, shape, _messages(shape), "run", block_bytes, per_turn)
        total = time.perf_counter() - start
        stats = [i.stats() for i in instances]
        num_blocks = instances[0].num_blocks()
    finally:
        for instance in instances:
            instance.close()
    quantiles = statistics.quantiles(ttfts, n=100, method="inclusive")
    tiers = [t for s in stats for t in s["kv_tiers"]]
    return {"case": case, "instances": count, "kv_cache_dtype": config.kv_cache_dtype,
            "kv_offload": str(config.kv_offload) if config.kv_offload else None,
            "pool_blocks": num_blocks, "requests": len(ttfts),
            "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p99_s": round(quantiles[98], 4), "total_s": round(total, 3),
            "computed_prompt_tokens": _computed(stats) - before,
            "tiers": tiers, "per_turn": per_turn}


# ---- the plot ------------------------------------------------------------------------------------
def plot(report: dict, path: str) -> None:
    """TTFT p50, prompt tokens computed, and KV bytes (pool + host tier + put to the store) per
    turn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (("ttft_p50_s", "TTFT p50 per turn (s)", 1.0),
              ("computed_prompt_tokens", "prompt tokens computed per turn", 1.0),
              (None, "KV after the turn: pool + host tier + put to the store (MiB)", 1 / 2**20))
    for ax, (key, title, scale) in zip(axes, panels, strict=True):
        for run in report["runs"]:
            turns = [t["turn"] for t in run["per_turn"]]
            values = [(t[key] if key else t["pool_bytes"] + t["host_bytes"]
                       + t["store_bytes_put"]) * scale
                      for t in run["per_turn"]]
            ax.plot(turns, values, marker="o", markersize=3, label=run["case"],
                    linestyle="--" if "int8" in run["case"] else "-")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("turn", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0].legend(fontsize=7)
    machine, shape = report["machine"], report["shape"]
    save_figure(fig, path, f"kthena bench kv — {report['model']} {report['dtype']}, "
                f"{shape['sessions']} conversations x {shape['turns']} turns, working set "
                f"{report['working_set_mib']} MiB = {shape['pool_ratio']}x the pool; "
                f"{machine['cores']} cores ({machine['cpu']}), load "
                f"{machine['loadavg_before'][0]}→{machine['loadavg_after'][0]}")


def table(report: dict) -> str:
    """The Markdown table of the runs."""
    rows = ["| case | pool blocks | TTFT p50 (s) | TTFT p99 (s) | total (s) | prompt tokens "
            "computed | promoted blocks (host / store) |", "|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        promoted = {}
        for tier in run["tiers"]:
            promoted[tier["tier"]] = promoted.get(tier["tier"], 0) + tier["num_promoted_blocks"]
        moved = " / ".join(str(promoted[t]) for t in ("host", "mooncake_store") if t in promoted)
        rows.append(f"| {run['case']} | {run['pool_blocks']} | {run['ttft_p50_s']} | "
                    f"{run['ttft_p99_s']} | {run['total_s']} | {run['computed_prompt_tokens']} | "
                    f"{moved or '–'} |")
    return "\n".join(rows)


# ---- the command ---------------------------------------------------------------------------------
def add_parser(children: argparse._SubParsersAction) -> None:
    """Add ``kthena bench kv`` to the ``kthena bench`` subcommands."""
    parser = children.add_parser("kv", help="multi-turn chat over a pool 4x smaller than its "
                                 "working set: KV tiers off / host / host+store, bf16 and int8, "
                                 "two instances sharing the store or not",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    parser.set_defaults(func=_run)


def _arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of {', '.join(CASES)}")
    for field in attrs.fields(BenchShape):
        parser.add_argument(f"--{field.name.replace('_', '-')}", type=type(field.default),
                            default=field.default)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--model", default="default")
    parser.add_argument("--master", default=None, metavar="HOST:PORT",
                        help="mooncake_master of the store cases (default: start one on "
                             "127.0.0.1)")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the per-turn plot")


def _run(args: argparse.Namespace) -> int:
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        print(f"kthena bench kv: --cases takes {', '.join(CASES)}; got {args.cases!r}",
              file=sys.stderr)
        return 2
    shape = BenchShape(**{f.name: getattr(args, f.name) for f in attrs.fields(BenchShape)})
    plot_path = plot_or_note("kthena bench kv", args.plot)  # before minutes of runs
    from kthena_core.dtypes import torch_dtype
    from kthena_serve.model import load_model

    model, tokenizer = load_model(args.model, dtype=torch_dtype(args.dtype))
    master_proc, master = None, args.master
    if master is None and any(c.split("/")[0] in _STORE_CASES for c in cases):
        from mooncake_kv.tiers.master import MasterUnavailableError, start_local_master

        try:
            master_proc, master = start_local_master()
        except MasterUnavailableError as error:
            print(f"kthena bench kv: the store cases need --master HOST:PORT or a local "
                  f"master: {error}", file=sys.stderr)
            return 2
    block = _block_bytes(model, shape.block_size, args.dtype)
    report = {"bench": "kv", "model": args.model, "dtype": args.dtype,
              "shape": attrs.asdict(shape), "pool_blocks": shape.pool_blocks,
              "working_set_blocks": shape.working_set_blocks,
              "working_set_mib": round(shape.working_set_blocks * block / 2**20, 1),
              "machine": host_info(), "runs": []}
    try:
        for case in cases:
            result = run_case(case, shape, model, tokenizer, master, args.model, args.dtype)
            report["runs"].append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "per_turn"}),
                  file=sys.stderr, flush=True)
    finally:
        if master_proc is not None:
            from mooncake_kv.tiers.master import stop_master

            stop_master(master_proc)
    report["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report), flush=True)
    print(table(report), file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    if plot_path:
        draw("kthena bench kv", lambda: plot(report, plot_path))
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"] and len(argv) == 2:
        return _worker_main(argv[1])
    parser = argparse.ArgumentParser(prog="kthena bench kv", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
