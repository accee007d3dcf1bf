"""One rank of the EP check or benchmark over gloo; `launch` runs a world of them.

    python -m mooncake_ops._ep_worker {run|bench} RANK WORLD_SIZE PORT SPEC_JSON

``run`` computes each case of the spec on this rank (the fused and unfused EP paths and the
replicated-token path) and saves the outputs and `Traffic` to ``<out>/<case>-<rank>.pt`` for
the test to judge; ``bench`` times them and prints one JSON line per case from rank 0. Every
rank makes every rank's inputs from the case's seed (`case_inputs`), so the test can too.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # a rank process (not an importer: it keeps its environment)
    # Ranks share the cores: one intra-op thread each, no OpenMP spinning (before torch loads).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402

import attrs  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mooncake_ops as mo  # noqa: E402
from mooncake_ops.moe_selection import choose_moe_kernels  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def case_experts(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's (gate_up [E, 2I, H], down [E, H, I]) of ``case``, the same on each rank."""
    gen = torch.Generator().manual_seed(case["seed"])
    e, h, i = case["num_experts"], case["hidden"], case["inter"]
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    down = torch.randn(e, h, i, generator=gen) / i ** 0.5
    return gate_up.to(DTYPES[case["dtype"]]), down.to(DTYPES[case["dtype"]])


def case_inputs(case: dict, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (x, weights, ids): its own ``case["tokens"][rank]`` tokens routed by
    softmax top-k over random logits; with ``case["home"]`` rank 0's tokens prefer rank 0's
    experts (so it sends nothing away)."""
    gen = torch.Generator().manual_seed(case["seed"] * 1000 + rank + 1)
    tokens, e = case["tokens"][rank], case["num_experts"]
    x = torch.randn(tokens, case["hidden"], generator=gen).to(DTYPES[case["dtype"]])
    logits = torch.randn(tokens, e, generator=gen)
    if case.get("home") and rank == 0:
        logits[:, : e // len(case["tokens"])] += 100.0
    rule = mo.RoutingRule(top_k=case["top_k"], renormalize=True)
    weights, ids = mo.route_experts(logits, rule)
    return x, weights, ids


def _local_experts(case: dict, rank: int, world: int, kernels: str = "torch"
                   ) -> mo.ExpertWeights:
    """This rank's experts, packed for the ``kernels`` mode's fixed choice (no timing)."""
    gate_up, down = case_experts(case)
    held = mo.expert_range(case["num_experts"], world, rank)
    mine = gate_up[held.start:held.stop], down[held.start:held.stop]
    choice = choose_moe_kernels(kernels, *mine, case["top_k"])
    return mo.pack_experts(*mine, **choice.pack_args(), expert_start=held.start)


def run_case(case: dict, rank: int, world: int) -> dict:
    """This rank's outputs of every path, and what each all-to-all moved."""
    experts = _local_experts(case, rank, world)
    x, weights, ids = case_inputs(case, rank)
    e = case["num_experts"]
    d = mo.moe_distribute_dispatch(x, weights, ids, None, e)
    fused = mo.moe_distribute_combine(experts.run_sorted(d.rows[:d.num_rows], d.expert_counts),
                                      d, None)
    sent = mo.ep_dispatch(x, weights, ids, None, e)
    unfused = mo.ep_combine(mo.run_dispatched(sent, experts), sent, None)
    x0, w0, ids0 = case_inputs(case, 0)  # the replicated path: every rank holds rank 0's tokens
    return {"fused": fused, "unfused": unfused,
            "one_call": mo.ep_experts(x, weights, ids, experts, None, e),
            "replicated": mo.replicated_ep_experts(x0, w0, ids0, experts, None),
            "expert_counts": d.expert_counts, "sorted_rows": d.rows[:d.num_rows],
            "traffic_fused": attrs.asdict(d.traffic), "traffic_unfused": attrs.asdict(sent.traffic)}


def _median_s(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def bench_case(case: dict, rank: int, world: int, repeats: int) -> dict:
    """Median seconds per MoE layer call: fused EP, unfused EP, and one rank alone with every
    expert (its own tokens), with the fused path's off-rank bytes; experts packed for the
    ``native`` choice (the packed bf16 kernel on an AVX512_BF16 build)."""
    experts = _local_experts(case, rank, world, "native")
    alone = _local_experts(case, 0, 1, "native")
    x, weights, ids = case_inputs(case, rank)
    e = case["num_experts"]
    row = {"bench": "moe_ep", **case, "world": world, "repeats": repeats}
    row["fused_ms"] = _median_s(lambda: mo.ep_experts(x, weights, ids, experts, None, e),
                                repeats) * 1e3
    row["unfused_ms"] = _median_s(lambda: mo.ep_experts(x, weights, ids, experts, None, e,
                                                        fused=False), repeats) * 1e3
    row["one_rank_all_experts_ms"] = _median_s(lambda: mo.run_experts(x, weights, ids, alone),
                                               repeats) * 1e3
    row["off_rank_bytes"] = mo.moe_distribute_dispatch(x, weights, ids, None,
                                                       e).traffic.off_rank()
    return row


def main() -> None:
    mode, rank, world, port = sys.argv[1], *map(int, sys.argv[2:5])
    spec = json.loads(sys.argv[5])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        for case in spec["cases"]:
            if mode == "run":
                torch.save(run_case(case, rank, world),
                           Path(spec["out"]) / f"{case['name']}-{rank}.pt")
            else:
                row = bench_case(case, rank, world, spec.get("repeats", 10))
                if rank == 0:
                    print(json.dumps(row), flush=True)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, spec: dict, world: int = 2, timeout_s: float = 120.0) -> list[str]:
    """Run ``world`` ranks of this module on 127.0.0.1; returns each rank's stdout. Every
    rank is stopped before this returns or raises; one that fails stops the others at once.

    Raises:
        TimeoutError: a rank ran past ``timeout_s``.
        RuntimeError: a rank exited non-zero (its output is in the message).
    """
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE",
               GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory(prefix="ep-ranks-") as logs:
        files = [open(Path(logs) / f"rank{r}.log", "w+") for r in range(world)]  # noqa: SIM115
        procs = [subprocess.Popen([sys.executable, "-m", "mooncake_ops._ep_worker", mode,
                                   str(r), str(world), str(port), json.dumps(spec)],
                                  stdout=f, stderr=subprocess.STDOUT, text=True, env=env)
                 for r, f in enumerate(files)]
        try:
            _wait_all(procs, timeout_s, mode)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            outputs = []
            for f in files:
                f.seek(0)
                outputs.append(f.read())
                f.close()
    failed = [(p.returncode == -9, rank) for rank, p in enumerate(procs) if p.returncode]
    if failed:  # the rank that failed first, before those stopped for it
        rank = min(failed)[1]
        raise RuntimeError(f"EP {mode} rank {rank} exited {procs[rank].returncode}: "
                           f"{outputs[rank][-3000:]}")
    return outputs


def _wait_all(procs: list[subprocess.Popen], timeout_s: float, mode: str) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        if any(p.returncode for p in procs if p.poll() is not None):
            return  # one failed: the caller stops the rest and reports it
        if time.monotonic() > deadline:
            raise TimeoutError(f"EP {mode} ranks ran past {timeout_s}s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()
