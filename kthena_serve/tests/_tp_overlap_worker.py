"""One gloo rank of test_tp_overlap.py: TP overlap (MC2 ops) against plain TP.

    python _tp_overlap_worker.py RANK PORT TINY_CHECKPOINT OUT_JSON [real]

Two parts, each rank writing its own JSON:

* ``ops``: on fresh random inputs, `TensorParallel`'s three matmul + collective ops with the
  MC2 ops fused in (several tile counts) against the same ops without them (the matmul, then the
  collective: the pure-PyTorch reference): the largest absolute difference and its float32
  rounding bound;
* greedy tokens of test_sp's scenarios (`_sp_worker`) on TP=2 plain (``tp``), TP=2 with MC2
  (``mc2``, 3 row tiles), TP=2 with SP (``sp``) and with SP and MC2 (``sp_mc2``), with how many
  times each fused op ran; with ``real``, SmolLM2 on one batched scenario (``tp``, ``mc2``).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist
from _sp_worker import MIN_TOKENS, _run, _scenarios

TILES = 3


@attrs.define
class _Counting:
    """Delegates to the real MC2 ops and counts the calls of each (which path a forward took)."""

    inner: object
    counts: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(
        ("matmul_all_reduce", "all_gather_matmul", "matmul_reduce_scatter"), 0))

    def matmul_all_reduce(self, x, weight):  # noqa: ANN001, ANN201
        self.counts["matmul_all_reduce"] += 1
        return self.inner.matmul_all_reduce(x, weight)

    def all_gather_matmul(self, x, weight, bias):  # noqa: ANN001, ANN201
        self.counts["all_gather_matmul"] += 1
        return self.inner.all_gather_matmul(x, weight, bias)

    def matmul_reduce_scatter(self, x, weight):  # noqa: ANN001, ANN201
        self.counts["matmul_reduce_scatter"] += 1
        return self.inner.matmul_reduce_scatter(x, weight)


def _bound(x: torch.Tensor, w: torch.Tensor, world: int) -> float:
    """A float32 rounding bound for a sum over ranks of x @ w.T: each output is K products
    summed on a rank and ``world`` partial sums added, so two summation orders differ by at most
    ~(K + world) eps times the sum of the terms' magnitudes (the largest over every rank)."""
    scale = (x.abs() @ w.abs().t()).max().reshape(1)
    dist.all_reduce(scale, op=dist.ReduceOp.MAX)
    return float((x.shape[1] + world) * torch.finfo(torch.float32).eps * world * scale)


def _ops(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> dict:
    """Each op of a `TensorParallel` on these inputs (the scatter form on 2x the rows)."""
    return {"linear_all_reduce": lambda t: t.linear_all_reduce(x, w),
            "all_gather_linear": lambda t: t.all_gather_linear(x, w, bias),
            "linear_reduce_scatter": lambda t: t.linear_reduce_scatter(
                torch.cat([x, x.flip(0)]), w)}


def _op_errors(group, rank: int) -> dict[str, list[float]]:  # noqa: ANN001
    """[largest |fused - reference|, its rounding bound] of each op over fresh random inputs
    (seeded per rank)."""
    from kthena_serve.model import MC2Overlap, TensorParallel

    plain = TensorParallel.from_comm_group(group)
    g = torch.Generator().manual_seed(100 + rank)
    errors: dict[str, float] = {}
    for tiles in (None, 1, 2, 5):
        fused = attrs.evolve(plain, fused=MC2Overlap(group, tiles))
        for rows, k, n in ((1, 24, 40), (7, 24, 40), (64, 48, 72)):
            x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
            bias = torch.randn(n, generator=g)
            pairs = _ops(x, w, bias)
            for name, op in pairs.items():
                got, want = op(fused), op(plain)
                assert got.shape == want.shape, (name, got.shape, want.shape)
                key = f"{name}/tiles={tiles}/{rows}x{k}x{n}"
                errors[key] = [float((got - want).abs().max()), _bound(x, w, 2)]
    return errors


def _models(checkpoint: str, group, names: tuple[str, ...]) -> dict:  # noqa: ANN001
    from kthena_serve.model import MC2Overlap, SequenceParallel, TensorParallel, load_model

    models = {}
    for name in names:
        counting = _Counting(MC2Overlap(group, TILES)) if "mc2" in name else None
        tp = TensorParallel.from_comm_group(group, counting)
        sp = SequenceParallel(MIN_TOKENS) if name.startswith("sp") else None
        model, _ = load_model(checkpoint, dtype=torch.float32, tp=tp, sp=sp)
        models[name] = (model, counting)
    return models


def _run_counted(models: dict, scenario) -> dict:  # noqa: ANN001
    """`_sp_worker._run` (tokens, prompt tokens computed) plus the fused-op counts."""
    before = {name: dict(c.counts) for name, (_, c) in models.items() if c is not None}
    out = _run({name: (model, None) for name, (model, _) in models.items()}, scenario)
    for name, (_, counting) in models.items():
        if counting is not None:
            out[name]["fused"] = {op: n - before[name][op] for op, n in counting.counts.items()}
    return out


def main() -> None:
    rank, port, tiny, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    real = sys.argv[5:] == ["real"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    try:
        from kthena_comm.groups import CommGroup

        group = CommGroup("tp", (0, 1), rank, dist.group.WORLD)
        results: dict = {"ops": _op_errors(group, rank)}
        models = _models(tiny, group, ("tp", "mc2", "sp", "sp_mc2"))
        vocab = models["tp"][0].config.shape.vocab_size
        results["layers"] = len(models["tp"][0].layers)
        for name in _scenarios(vocab):
            results[name] = _run_counted(models, lambda r, n=name: _scenarios(vocab)[n](r))
        if real:
            from kthena_serve.model import ensure_default_checkpoint

            models = _models(str(ensure_default_checkpoint(progress=False)), group,
                             ("tp", "mc2"))
            vocab = models["tp"][0].config.shape.vocab_size
            results["real_batched_uneven"] = _run_counted(
                models, lambda r: _scenarios(vocab, seed=1)["batched_uneven"](r))
        with open(out, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
