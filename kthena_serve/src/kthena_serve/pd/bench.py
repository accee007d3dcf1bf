"""``python -m kthena_serve.pd.bench``: PD vs colocated serving, and handoff cost vs KV bytes.

Part 1 (handoff, in one process, SmolLM2-135M KV geometry, bf16, 16-token blocks):
  zero_copy      what the same-host handoff adds: the control message (request id, block ids,
                 sampling state; first token back) encoded and decoded; the KV is already
                 in the decode pool
  host_copy      the alternative: prefill into a private pool, then copy the request's
                 blocks into the decode pool through host memory (one memcpy per range)
  mooncake_*     kthena_comm mooncake (TCP loopback) put of the blocks into a registered
                 pool: one batched put (sync / async + wait), and one put per token
Part 2 (serving, real worker processes, same cores): streams decode while long prompts
  (``--long-tokens``) arrive; TTFT / TPOT p50 / p99 for colocated (one worker on all cores)
  vs PD (1 prefill + 1 decode), and the decode-only baseline (streams, no long prompts).

Prints one JSON line and writes a PNG (``--plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import attrs

__all__ = ["main"]


def _median_s(fn, repeats: int) -> float:  # noqa: ANN001
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# ---- part 1: handoff ---------------------------------------------------------------------------
def bench_handoff(token_counts: list[int], repeats: int) -> list[dict]:
    from kthena_comm.transfer import MooncakeConfig, TransferBatch, create_engine
    from kthena_serve.config import EngineConfig
    from kthena_serve.model import resolve_checkpoint
    from kthena_serve.model.config import ModelConfig
    from kthena_serve.model_runner import kv_layout_for
    from kthena_serve.pd.protocol import PoolRef, PrefillResult, params_to_json
    from kthena_serve.sampling_params import SamplingParams
    from mooncake_kv.pool import KVPool

    model = ModelConfig.from_pretrained(resolve_checkpoint("default"))
    size = 16
    num_blocks = 2 * (max(token_counts) // size + 1)
    layout = kv_layout_for(model.num_hidden_layers, model.num_key_value_heads, model.head_dim,
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
                   "zero_copy_s": _median_s(control, repeats),
                   "host_copy_s": _median_s(host_copy, repeats),
                   "mooncake_sync_s": _median_s(lambda b=batch: sender.batch_put(b), repeats),
                   "mooncake_async_s": _median_s(put_async, repeats)}
            if tokens <= 256:  # one put per token: K and V of every layer, as its own call
                per_token = _per_token_batches(layout, local, remote, src, dst, tokens)
                row["mooncake_per_token_s"] = _median_s(
                    lambda pts=per_token: [sender.batch_put(b) for b in pts], max(1, repeats // 2))
            rows.append(row)
    finally:
        sender.close()
        receiver.close()
        decode_pool.close()
        prefill_pool.close()
    return rows


def _per_token_batches(layout, local, remote, src: list[int], dst: list[int],  # noqa: ANN001
                       tokens: int) -> list:
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
async def _stream(client, url: str, ids: list[int], max_tokens: int) -> dict:  # noqa: ANN001
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
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    tpot = (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)
    return {"ttft": stamps[0] - start, "tpot": tpot, "gaps": gaps}


async def _workload(url: str, opts: argparse.Namespace, with_long: bool) -> dict:
    import random

    import httpx

    rng = random.Random(0)
    vocab = 49152

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    async with httpx.AsyncClient(timeout=600) as client:
        await _stream(client, url, ids(32), 4)  # warm-up
        streams = [asyncio.create_task(_stream(client, url, ids(32), opts.stream_tokens))
                   for _ in range(opts.num_streams)]
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


def bench_serving(opts: argparse.Namespace) -> dict:
    from kthena_serve.pd.cluster import PDCluster

    engine = {"num_kv_blocks": 1024, "max_num_seqs": 16, "max_num_batched_tokens": 2048}
    pd = {"pd_threshold_tokens": 64, "transfer_timeout_s": 120}
    out = {}
    with PDCluster(engine, pd, num_prefill=0, num_decode=1) as colocated:
        out["colocated"] = asyncio.run(_workload(colocated.url, opts, True))
    with PDCluster(engine, pd, num_prefill=1, num_decode=1) as disagg:
        out["pd"] = asyncio.run(_workload(disagg.url, opts, True))
        out["decode_only_baseline"] = asyncio.run(_workload(disagg.url, opts, False))
    return out


# ---- main --------------------------------------------------------------------------------------
def _machine() -> dict:
    import platform

    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": len(os.sched_getaffinity(0)),
            "load_1min": os.getloadavg()[0], "torch": torch.__version__,
            "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kthena_serve.pd.bench")
    parser.add_argument("--tokens", default="64,256,1024,2048", help="handoff sizes (tokens)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--long-tokens", type=int, default=1024)
    parser.add_argument("--num-long", type=int, default=5)
    parser.add_argument("--long-interval", type=float, default=2.0)
    parser.add_argument("--num-streams", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=96)
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--plot", default="bench_pd.png", help="PNG path ('' for none)")
    opts = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GLOG_minloglevel", "2")
    result = {"machine": _machine(), "options": vars(opts),
              "handoff": bench_handoff([int(t) for t in opts.tokens.split(",")], opts.repeats)}
    if not opts.skip_serving:
        result["serving"] = bench_serving(opts)
    result["machine"]["load_1min_end"] = os.getloadavg()[0]
    if opts.plot:
        from kthena_serve.pd._bench_plot import plot

        plot(result, opts.plot)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
