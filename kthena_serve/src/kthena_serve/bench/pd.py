"""``python -m kthena_serve.bench.pd``: PD vs colocated serving, and handoff cost vs KV bytes.

Part 1 (handoff, in one process, SmolLM2-135M KV geometry, bf16, 16-token blocks):
  zero_copy      what the same-host handoff adds: the control message (request id, block ids,
                 sampling state; first token back) encoded and decoded; the KV is already
                 in the decode pool
  host_copy      the alternative: prefill into a private pool, then copy the request's
                 blocks into the decode pool through host memory (one memcpy per range)
  mooncake_*     kthena_comm mooncake (TCP loopback) put of the blocks into a registered
                 pool: one batched put (sync / async + wait), and one put per token
Part 2 (article B's table, ``bench/kv_move.py``): a LLaMA-2-70B-shaped KV moved from a
  prefill pool to a decode pool by host copy, per-token puts, a batched put, a batched async
  put, layer-wise async puts and zero-copy sharing, over shm, Mooncake loopback and (with
  ``--kv-move-netns``) Mooncake across two network namespaces.
Part 3 (overlap, real worker processes over Mooncake): the time from the end of a prompt's
  prefill compute to its KV in the decode pool, layer-wise push vs one put after the prefill.
Part 5 (batched prefill, in one process): several prompts submitted at once to the prefill
  worker's executor, one per forward vs batched per forward.
Part 4 (serving, real worker processes): streams decode while long prompts
  (``--long-tokens``) arrive; TTFT / TPOT / inter-token p50 / p99 for colocated (one worker on
  all cores) vs PD (1 prefill + 1 decode), and the decode-only baseline (the same decode worker,
  no long prompts); the benchmark's client and router run on the prefill worker's cores.

Prints one JSON line and writes PNGs (``--plot``, and ``<plot>_kv_move.png``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from kthena_comm.bench import median_s
from kthena_serve.bench.machine import cpu_model
from kthena_serve.bench.optional import draw, plot_or_note
from kthena_serve.engine.config import EngineConfig
from kthena_serve.pd.config import PDConfig

if TYPE_CHECKING:
    import httpx

    from kthena_comm.transfer import MemoryHandle, TransferBatch
    from mooncake_kv.layout import KVLayout

__all__ = ["main"]


# ---- part 1: handoff ---------------------------------------------------------------------------
def bench_handoff(token_counts: list[int], repeats: int) -> list[dict]:
    from kthena_comm.transfer import MooncakeConfig, TransferBatch, create_engine
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.model_runner import kv_layout_for
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.model import resolve_checkpoint
    from kthena_serve.model.config import ModelConfig
    from kthena_serve.pd.protocol import PoolRef, PrefillResult, params_to_json
    from mooncake_kv.pool import KVPool

    model = ModelConfig.from_pretrained(resolve_checkpoint("default"))
    size = 16
    num_blocks = 2 * (max(token_counts) // size + 1)
    layout = kv_layout_for(model.shape.num_layers, model.shape.num_kv_heads, model.shape.head_dim,
                           EngineConfig(num_kv_blocks=num_blocks, block_size=size))
    decode_pool = KVPool.create(layout, shared=True)
    prefill_pool = KVPool.create(layout)
    prefill_pool.buffer.random_(0, 255)
    sender = create_engine("mooncake", MooncakeConfig())
    receiver = create_engine("mooncake", MooncakeConfig())
    local, remote = sender.register(prefill_pool.buffer), receiver.register(decode_pool.buffer)
    src_buf, dst_buf = prefill_pool.buffer, decode_pool.buffer
    rows = []
    try:
        for tokens in token_counts:
            n = -(-tokens // size)
            src, dst = list(range(n)), list(range(n, 2 * n))
            pairs = layout.pair_ranges(src, dst)
            batch = TransferBatch(local, remote, [p.src_offset for p in pairs],
                                  [p.dst_offset for p in pairs], [p.length for p in pairs])
            ref = PoolRef(num_blocks, size, "bfloat16", decode_pool.name)

            result = PrefillResult("req-1", 42, tokens, 0.0, 0.0, 0)
            params = params_to_json(SamplingParams(temperature=0.7, seed=1))

            def control(dst=dst, result=result, params=params, ref=ref) -> None:
                # what the handoff adds to a request: block ids + sampling state out, the
                # first token back (the prompt itself travels in any deployment)
                message = {"request_id": "req-1", "block_ids": dst, "params": params,
                           "num_cached_tokens": 0, "pool": ref.shm_name}
                json.loads(json.dumps(message))
                PrefillResult(**json.loads(json.dumps(attrs.asdict(result))))

            def host_copy(pairs=pairs) -> None:
                for p in pairs:
                    dst_buf[p.dst_offset:p.dst_offset + p.length].copy_(
                        src_buf[p.src_offset:p.src_offset + p.length])

            def put_async(batch=batch) -> None:
                sender.wait([sender.batch_put_async(batch)])

            row = {"tokens": tokens, "kv_bytes": n * layout.bytes_per_block,
                   "ranges": len(pairs),
                   "zero_copy_s": median_s(control, repeats),
                   "host_copy_s": median_s(host_copy, repeats),
                   "mooncake_sync_s": median_s(lambda b=batch: sender.batch_put(b), repeats),
                   "mooncake_async_s": median_s(put_async, repeats)}
            if tokens <= 256:  # one put per token: K and V of every layer, as its own call
                per_token = _per_token_batches(layout, local, remote, src, dst, tokens)
                row["mooncake_per_token_s"] = median_s(
                    lambda pts=per_token: [sender.batch_put(b) for b in pts], max(1, repeats // 2))
            rows.append(row)
    finally:
        sender.close()
        receiver.close()
        decode_pool.close()
        prefill_pool.close()
    return rows


def _per_token_batches(layout: KVLayout, local: MemoryHandle, remote: MemoryHandle,
                       src: list[int], dst: list[int], tokens: int) -> list[TransferBatch]:
    """One batch per token: its K and V row in every layer (what a per-token put sends)."""
    from kthena_comm.transfer import TransferBatch
    from mooncake_kv import KVPart

    shape = layout.shape
    row = shape.num_kv_heads * shape.head_dim * shape.dtype.element_bytes
    size = shape.block_size
    batches = []
    for t in range(tokens):
        s_off, d_off = [], []
        for layer in range(shape.num_layers):
            for part in KVPart:
                s_off.append(layout.segment(src[t // size], layer, part).offset + t % size * row)
                d_off.append(layout.segment(dst[t // size], layer, part).offset + t % size * row)
        batches.append(TransferBatch(local, remote, s_off, d_off, [row] * len(s_off)))
    return batches


# ---- part 2: serving --------------------------------------------------------------------------
async def _stream(client: httpx.AsyncClient, url: str, ids: list[int], max_tokens: int,
                  window_start: float = 0.0) -> dict:
    body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    stamps = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"text"' in line:
                stamps.append(time.perf_counter())
    if not stamps:
        return {"ttft": None, "tpot": None, "gaps": []}
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if a >= window_start]
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return {"ttft": stamps[0] - start, "tpot": tpot, "gaps": gaps}


async def _workload(url: str, opts: argparse.Namespace, with_long: bool) -> dict:
    import random

    import httpx

    rng = random.Random(0)
    vocab = 49152

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
        await _stream(client, url, ids(32), 4)  # warm-up
        # inter-token gaps count from when the long prompts start arriving (the streams'
        # own admission is over by then), in the decode-only run from the same moment
        window = time.perf_counter() + 0.5
        streams = [asyncio.create_task(_stream(client, url, ids(32), opts.stream_tokens,
                                               window)) for _ in range(opts.num_streams)]
        longs = []
        if with_long:
            await asyncio.sleep(0.5)
            for _ in range(opts.num_long):
                longs.append(asyncio.create_task(_stream(client, url, ids(opts.long_tokens), 4)))
                await asyncio.sleep(opts.long_interval)
        streams_out = await asyncio.gather(*streams)
        longs_out = await asyncio.gather(*longs)
    tpots = [s["tpot"] for s in streams_out if s["tpot"]]
    gaps = [g for s in streams_out for g in s["gaps"]]
    ttfts = [s["ttft"] for s in longs_out if s["ttft"]]
    return {"tpot_p50": _pct(tpots, 50), "tpot_p99": _pct(tpots, 99),
            "itl_p50": _pct(gaps, 50), "itl_p99": _pct(gaps, 99),
            "long_ttft_p50": _pct(ttfts, 50), "long_ttft_p99": _pct(ttfts, 99),
            "num_long": len(ttfts), "num_streams": len(tpots)}


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def _pin_process(cores: tuple[int, ...]) -> None:
    """Move every thread of this process (client, router, OpenAI app) onto ``cores``."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # the thread ended meanwhile
            pass


def bench_serving(opts: argparse.Namespace) -> dict:
    """Streams decoding while long prompts arrive: colocated, PD, and PD's decode worker with
    no long prompts (the decode-only baseline: the same process on the same cores).

    The benchmark's own process (client, router, OpenAI app) runs on the prefill worker's
    cores, so the decode worker's core serves only the decode worker in both PD runs.
    """
    from kthena_serve.pd.embedded import PDCluster

    engine = {"num_kv_blocks": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 2048}
    pd = {"pd_threshold_tokens": 64, "transfer_timeout_s": 120}
    out = {}
    everywhere = tuple(sorted(os.sched_getaffinity(0)))
    try:
        with PDCluster(EngineConfig(**engine), PDConfig(**pd), num_prefill=0, num_decode=1) as colocated:
            out["colocated"] = asyncio.run(_workload(colocated.url, opts, True))
        with PDCluster(EngineConfig(**engine), PDConfig(**pd), num_prefill=1, num_decode=1) as disagg:
            specs = {s.name: s.cores for s in disagg.launcher.specs}
            _pin_process(specs["prefill-0"])
            out["cores"] = {"prefill": specs["prefill-0"], "decode": specs["decode-0"],
                            "client_and_router": specs["prefill-0"]}
            out["pd"] = asyncio.run(_workload(disagg.url, opts, True))
            out["decode_only_baseline"] = asyncio.run(_workload(disagg.url, opts, False))
    finally:
        _pin_process(everywhere)
    base = out["decode_only_baseline"]
    out["pd_vs_decode_only"] = {key: out["pd"][key] / base[key]
                                for key in ("tpot_p50", "tpot_p99", "itl_p50", "itl_p99")
                                if out["pd"][key] and base[key]}
    return out


# ---- part 4b: TP workers -------------------------------------------------------------------------
def _requests(url: str, num: int, prompt_tokens: int, output_tokens: int,
              metrics: Callable[[], str] | None = None) -> dict:
    """``num`` streamed requests one after another, each a fresh random prompt, after one
    warm-up request: TTFT and TPOT medians (one at a time: what one user sees; no prefix is
    shared). With ``metrics`` (a decode worker's /metrics), also the KV bytes each
    disaggregated request of the measured ones moved (``kv_bytes_per_request``)."""
    import random

    import httpx

    rng = random.Random(1)
    pages = []

    async def run() -> list[dict]:
        out = []
        async with httpx.AsyncClient(timeout=600, trust_env=False) as client:
            await _stream(client, url, [rng.randrange(100, 49000) for _ in range(32)], 4)
            if metrics is not None:
                pages.append(await asyncio.to_thread(metrics))
            for _ in range(num):
                ids = [rng.randrange(100, 49000) for _ in range(prompt_tokens)]
                out.append(await _stream(client, url, ids, output_tokens))
            if metrics is not None:
                pages.append(await asyncio.to_thread(metrics))
        return out

    runs = asyncio.run(run())
    result = {"ttft_p50": _pct([r["ttft"] for r in runs if r["ttft"]], 50),
              "tpot_p50": _pct([r["tpot"] for r in runs if r["tpot"]], 50),
              "num_requests": sum(r["ttft"] is not None for r in runs)}
    if pages:
        def diff(name: str, label: str = "") -> float:
            return _sample(pages[1], name, label) - _sample(pages[0], name, label)

        done = diff("kthena_pd_requests_total", 'path="disaggregated"')
        result["num_disaggregated"] = int(done)
        result["kv_bytes_per_request"] = (diff("kthena_pd_transferred_bytes_total") / done
                                          if done else None)
    return result


def _sample(page: str, name: str, label: str = "") -> float:
    """The sum of the ``name`` samples of a /metrics page whose labels hold ``label``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
               if line.startswith(name + "{") and label in line)


def bench_tp(opts: argparse.Namespace) -> list[dict]:
    """Each ``--tp-pairs`` entry ``A:B``: a PD deployment of one TP-A prefill and one TP-B
    decode worker against a colocated TP-B engine (a decode worker with no prefill worker: the
    same process kind on the same cores), sequential streamed requests; TTFT, TPOT and the KV
    bytes each disaggregated request moved (decode side's ``kthena_pd_transferred_bytes``)."""
    from kthena_serve.pd.embedded import PDCluster

    engine = EngineConfig(num_kv_blocks=1024, max_num_seqs=8, kernels="native")
    rows = []
    for pair in opts.tp_pairs.split(","):
        prefill_tp, decode_tp = (int(x) for x in pair.split(":"))
        pd = {"pd_threshold_tokens": 16, "transfer_timeout_s": 300, "prefill_tp": prefill_tp,
              "decode_tp": decode_tp}
        args = (opts.tp_requests, opts.tp_prompt_tokens, opts.tp_output_tokens)
        with PDCluster(engine, PDConfig(**pd), num_prefill=0, num_decode=1) as colocated:
            alone = _requests(colocated.url, *args)
        with PDCluster(engine, PDConfig(**pd), num_prefill=1, num_decode=1) as disagg:
            split = _requests(disagg.url, *args,
                              metrics=lambda c=disagg: c.worker_metrics("decode-0"))
        rows.append({"prefill_tp": prefill_tp, "decode_tp": decode_tp,
                     "colocated": alone, "pd": split,
                     "pd_vs_colocated": {k: split[k] / alone[k] for k in ("ttft_p50", "tpot_p50")
                                         if split[k] and alone[k]}})
    return rows


# ---- part 5: batched prefill -------------------------------------------------------------------
def bench_batched_prefill(lengths: list[int], num_prompts: int, repeats: int) -> list[dict]:
    """``num_prompts`` prompts of each length submitted at once to one prefill executor (the
    prefill worker's, in this process, shm zero-copy into a decode pool), one prompt per forward
    (``max_num_seqs=1``) vs batched (up to 16 per forward under a 2048-token budget): the time
    until every first token is back. Medians of ``repeats``; same weights, same threads."""
    import random

    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.model_runner import create_pool, kv_layout_for
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.model import load_model
    from kthena_serve.pd.prefill import PrefillExecutor
    from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json

    model, _ = load_model("default")
    size = 16
    num_blocks = num_prompts * (max(lengths) // size + 1)
    layout = kv_layout_for(model.config.shape.num_layers, model.num_kv_heads_per_rank,
                           model.head_dim, EngineConfig(num_kv_blocks=num_blocks))
    pool = create_pool(layout, EngineConfig(), shared=True)
    ref = PoolRef(num_blocks, size, "bfloat16", pool.name)
    params = params_to_json(SamplingParams(temperature=0, max_tokens=1))
    rng = random.Random(3)
    rows = []
    try:
        for seats, label in ((1, "one_at_a_time"), (16, "batched")):
            executor = PrefillExecutor(model, EngineConfig(max_num_seqs=seats,
                                                           max_num_batched_tokens=2048))
            try:
                for tokens in lengths:
                    per = -(-tokens // size)
                    times = []
                    steps_before = executor.num_steps
                    for rep in range(repeats + 1):
                        tasks = [PrefillTask(f"{label}-{tokens}-{rep}-{i}",
                                             tuple(rng.randrange(100, 49000)
                                                   for _ in range(tokens)),
                                             0, tuple(range(i * per, (i + 1) * per)), params, ref)
                                 for i in range(num_prompts)]
                        start = time.perf_counter()
                        futures = [executor.submit_shared(task) for task in tasks]
                        for future in futures:
                            future.result(timeout=600)
                        if rep:  # the first round warms the kernels up
                            times.append(time.perf_counter() - start)
                    rows.append({"mode": label, "tokens": tokens, "num_prompts": num_prompts,
                                 "total_s": statistics.median(times),
                                 "forwards_per_round": (executor.num_steps - steps_before)
                                 / (repeats + 1)})
            finally:
                executor.close()
    finally:
        pool.close()
    return rows


# ---- part 3: layer-wise push overlap ----------------------------------------------------------
def _metric_sums(text: str) -> dict[str, float]:
    """``name_sum`` / ``name_count`` samples of the prefill role from a /metrics page."""
    out = {}
    for line in text.splitlines():
        if line.startswith("kthena_pd_") and 'role="prefill"' in line:
            name = line.split("{", 1)[0]
            if name.endswith(("_sum", "_count")):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


def bench_overlap(token_counts: list[int], repeats: int) -> list[dict]:
    """Prompts of each length through PD over Mooncake (1 prefill + 1 decode worker, TCP on
    127.0.0.1, one core each), the KV pushed layer by layer vs in one batch after the prefill.

    Per request, from the prefill worker's metrics: ``compute_s`` (its forwards) and
    ``after_compute_s`` (from its last forward's end to the last put landed in the decode
    pool: what the decode worker waits for beyond the prefill). Medians over ``repeats``.
    """
    import random

    from kthena_serve.pd.embedded import PDCluster

    rng = random.Random(7)
    engine = {"num_kv_blocks": 2 * max(token_counts) // 16 + 64, "max_num_seqs": 4,
              "max_num_batched_tokens": 2048}
    rows = []
    for mode in ("layerwise", "batched"):
        pd = {"pd_threshold_tokens": 0, "transfer_timeout_s": 300, "transport": "mooncake",
              "kv_push": mode}
        with PDCluster(EngineConfig(**engine), PDConfig(**pd), num_prefill=1, num_decode=1) as cluster:
            cluster.complete([rng.randrange(100, 49000) for _ in range(64)], max_tokens=1)
            for tokens in token_counts:
                compute, after = [], []
                for _ in range(repeats):
                    before = _metric_sums(cluster.worker_metrics("prefill-0"))
                    reply = cluster.complete([rng.randrange(100, 49000) for _ in range(tokens)],
                                             max_tokens=1, timeout=600)
                    reply.raise_for_status()
                    now = _metric_sums(cluster.worker_metrics("prefill-0"))
                    diff = {k: now[k] - before.get(k, 0.0) for k in now}
                    if diff.get("kthena_pd_handoff_seconds_count") != 1:
                        raise RuntimeError(f"the {tokens}-token prompt was not disaggregated: "
                                           f"{diff}")
                    compute.append(diff["kthena_pd_prefill_seconds_sum"])
                    after.append(diff["kthena_pd_handoff_seconds_sum"])
                rows.append({"kv_push": mode, "tokens": tokens,
                             "compute_s": statistics.median(compute),
                             "after_compute_s": statistics.median(after),
                             "after_compute_all_s": after})
    return rows


# ---- main --------------------------------------------------------------------------------------
def _machine() -> dict:
    import platform

    import torch

    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)),
            "load_1min": os.getloadavg()[0], "torch": torch.__version__,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kthena_serve.bench.pd")
    parser.add_argument("--tokens", default="64,256,1024,2048", help="handoff sizes (tokens)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--long-tokens", type=int, default=1024)
    parser.add_argument("--num-long", type=int, default=5)
    parser.add_argument("--long-interval", type=float, default=2.0)
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--overlap-tokens", default="1024,4096",
                        help="prompt lengths of the layer-wise vs batched push comparison "
                             "('' to skip)")
    parser.add_argument("--overlap-repeats", type=int, default=3)
    parser.add_argument("--kv-move-tokens", type=int, default=128,
                        help="article B's table: a LLaMA-2-70B-shaped KV of this many tokens "
                             "moved by each method (0 to skip; see bench/kv_move.py)")
    parser.add_argument("--kv-move-netns", action="store_true",
                        help="article B's table also across two network namespaces (root)")
    parser.add_argument("--batched-prefill-tokens", default="64,256",
                        help="prompt lengths of the batched vs one-at-a-time prefill comparison "
                             "('' to skip)")
    parser.add_argument("--batched-prefill-prompts", type=int, default=8)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--tp-pairs", default="",
                        help="TP workers: prefill_tp:decode_tp pairs, e.g. 2:2,1:2,2:1, each "
                             "against a colocated engine of the decode size ('' to skip)")
    parser.add_argument("--tp-requests", type=int, default=8)
    parser.add_argument("--tp-prompt-tokens", type=int, default=512)
    parser.add_argument("--tp-output-tokens", type=int, default=32)
    parser.add_argument("--plot", default="bench_pd.png", help="PNG path ('' for none)")
    opts = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GLOG_minloglevel", "2")
    plot_path = plot_or_note("bench pd", opts.plot)  # before the runs
    result = {"machine": _machine(), "options": vars(opts),
              "handoff": bench_handoff([int(t) for t in opts.tokens.split(",")], opts.repeats)}
    if opts.kv_move_tokens:
        from kthena_serve.bench.kv_move import bench_kv_move

        result["kv_move"] = bench_kv_move(opts.kv_move_tokens, opts.repeats, opts.kv_move_netns)
    if opts.batched_prefill_tokens:
        result["batched_prefill"] = bench_batched_prefill(
            [int(t) for t in opts.batched_prefill_tokens.split(",")],
            opts.batched_prefill_prompts, opts.repeats)
    if opts.overlap_tokens:
        result["overlap"] = bench_overlap([int(t) for t in opts.overlap_tokens.split(",")],
                                          opts.overlap_repeats)
    if not opts.skip_serving:
        result["serving"] = bench_serving(opts)
    if opts.tp_pairs:
        result["tp"] = bench_tp(opts)
    result["machine"]["load_1min_end"] = os.getloadavg()[0]
    print(json.dumps(result), flush=True)
    if plot_path:
        draw("bench pd", lambda: _plot(result, plot_path))
    return 0


def _plot(result: dict, path: str) -> None:
    from kthena_serve.bench.pd_plot import plot

    plot(result, path)
    if "kv_move" in result:
        from kthena_serve.bench.kv_move import plot_kv_move

        root, ext = os.path.splitext(path)
        plot_kv_move(result["kv_move"], f"{root}_kv_move{ext or '.png'}")


if __name__ == "__main__":
    sys.exit(main())
