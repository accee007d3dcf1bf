"""Cache-operations benchmark: ``python -m mooncake_kv.bench [--index hash|radix] ...``.

Synthetic chat workload: ``--num-prompts`` system prompts of ``--sys-min..--sys-max``
tokens picked with Zipf(``--zipf``) popularity; each request is a system prompt plus
``--user-min..--user-max`` fresh user tokens plus ``--gen`` generated tokens. Per request,
one at a time: ``match_prefix`` the prompt, ``try_allocate`` + ``commit`` the full
sequence, ``free``, then ``evict`` down to ``--capacity`` cached tokens when over.

Only the cache operations are timed (workload generation is not); ``requests_per_s`` is
requests / total cache time, ``requests_per_s_from_median`` is 1 / median request time,
which a busy machine's preemptions barely move. A throwaway run of
``--warmup`` requests on a separate manager comes first. Prints one JSON line: requests/s,
hit rate (matched prompt tokens / prompt tokens), microseconds per verb, eviction cost,
``cpu_share`` (the fraction of the timed loop's wall time the process was on a CPU: below
1 the machine was busy and the figures are pessimistic), the config and the machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import random
import statistics
import sys
import time
from array import array
from collections.abc import Iterator, Sequence

from mooncake_kv.index import available_indexes
from mooncake_kv.manager import KVCacheManager

__all__ = ["main", "run"]

_VOCAB_BYTES = 2  # uint16 token ids: a 65,536-token vocabulary


def _tokens(rng: random.Random, count: int) -> list[int]:
    return array("H", rng.randbytes(_VOCAB_BYTES * count)).tolist()


def _workload(args: argparse.Namespace, seed: int) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``(prompt, full_sequence)`` per request, forever."""
    rng = random.Random(seed)
    prompts = [
        _tokens(rng, rng.randint(args.sys_min, args.sys_max)) for _ in range(args.num_prompts)
    ]
    weights = list(itertools.accumulate(1.0 / (k + 1) ** args.zipf for k in range(len(prompts))))
    choices = range(len(prompts))
    while True:
        system = prompts[rng.choices(choices, cum_weights=weights)[0]]
        prompt = system + _tokens(rng, rng.randint(args.user_min, args.user_max))
        yield prompt, prompt + _tokens(rng, args.gen)


def _make_manager(args: argparse.Namespace) -> KVCacheManager:
    longest = args.sys_max + args.user_max + args.gen
    headroom = -(-longest // args.block_size) + 1  # one request never needs to evict
    num_blocks = args.capacity // args.block_size + headroom
    return KVCacheManager(num_blocks, args.block_size, index=args.index, hash_algo=args.hash_algo)


def run(args: argparse.Namespace, num_requests: int, seed: int) -> dict[str, float]:
    """Run ``num_requests`` requests on a fresh manager; return timings and counters."""
    manager = _make_manager(args)
    capacity_blocks = args.capacity // args.block_size
    clock = time.perf_counter
    t_match = t_alloc = t_free = t_evict = 0.0
    evicted = 0
    per_request: list[float] = []
    workload = _workload(args, seed)
    wall0, cpu0 = clock(), time.thread_time()
    for i in range(num_requests):
        prompt, full = next(workload)
        request_id = f"r{i}"
        t0 = clock()
        match = manager.match_prefix(request_id, prompt)
        t1 = clock()
        prefill = manager.try_allocate(request_id, len(prompt) - match.num_cached_tokens)
        if prefill is None or manager.try_append(request_id, len(full) - len(prompt)) is None:
            raise RuntimeError("pool too small for one request; this is a bench bug")
        manager.commit(request_id, full)
        t2 = clock()
        manager.free(request_id)
        t3 = clock()
        over = manager.num_cached_blocks - capacity_blocks
        if over > 0:
            evicted += manager.evict(over)
        t4 = clock()
        t_match += t1 - t0
        t_alloc += t2 - t1
        t_free += t3 - t2
        t_evict += t4 - t3
        per_request.append(t4 - t0)
    # share of the loop's wall time this thread was on a CPU: < 1 means other load
    cpu_share = (time.thread_time() - cpu0) / (clock() - wall0)
    total = t_match + t_alloc + t_free + t_evict
    evicted_tokens = evicted * args.block_size
    return {
        "requests_per_s": round(num_requests / total, 1),
        # robust to preemption by other processes (a few slow requests), not to SMT sharing
        "requests_per_s_from_median": round(1.0 / statistics.median(per_request), 1),
        "hit_rate": round(manager.stats().hit_rate, 4),
        "us_per_match": round(1e6 * t_match / num_requests, 2),
        "us_per_allocate_commit": round(1e6 * t_alloc / num_requests, 2),
        "us_per_free": round(1e6 * t_free / num_requests, 2),
        "us_per_evict": round(1e6 * t_evict / num_requests, 2),
        "evicted_tokens": evicted_tokens,
        "evicted_tokens_per_request": round(evicted_tokens / num_requests, 1),
        "ns_per_evicted_token": round(1e9 * t_evict / evicted_tokens, 1) if evicted_tokens else 0.0,
        "cache_seconds": round(total, 4),
        "cpu_share": round(cpu_share, 3),
    }


def describe_machine() -> dict[str, object]:
    """CPU model, core counts, load average and Python: enough to compare runs."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m mooncake_kv.bench", description=__doc__.split("\n")[0]
    )
    add = parser.add_argument
    add("--num-prompts", type=int, default=200, help="distinct system prompts")
    add("--sys-min", type=int, default=256, help="shortest system prompt (tokens)")
    add("--sys-max", type=int, default=1024, help="longest system prompt (tokens)")
    add("--zipf", type=float, default=1.0, help="Zipf exponent of system prompt popularity")
    add("--user-min", type=int, default=16, help="fewest fresh user tokens per request")
    add("--user-max", type=int, default=256, help="most fresh user tokens per request")
    add("--gen", type=int, default=64, help="generated tokens per request")
    add("--capacity", type=int, default=500_000, help="cached tokens kept (evict above)")
    add("--block-size", type=int, default=16, help="tokens per block")
    add("--requests", type=int, default=20_000, help="timed requests")
    add("--warmup", type=int, default=1000, help="requests on a throwaway manager first")
    add("--seed", type=int, default=0, help="workload seed")
    add("--index", choices=available_indexes(), default="hash", help="prefix index (A/B)")
    add("--hash-algo", default="xxh3_128", help="block hash algorithm (xxh3_128, sha256)")
    args = parser.parse_args(argv)
    if not (0 < args.sys_min <= args.sys_max and 0 <= args.user_min <= args.user_max):
        parser.error("need 0 < --sys-min <= --sys-max and 0 <= --user-min <= --user-max")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = [round(x, 2) for x in os.getloadavg()]
    if args.warmup:
        run(args, args.warmup, args.seed + 1)
    result = run(args, args.requests, args.seed)
    machine = {**describe_machine(), "load_avg_before": load_before}
    line = {"bench": "mooncake_kv.cache_ops", **result, "config": vars(args), "machine": machine}
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
