"""One gloo rank of test_sp.py's parity run: greedy tokens with and without sequence parallelism.

    python _sp_worker.py RANK PORT TINY_CHECKPOINT OUT_JSON [real]

Every scenario runs three ways on the same prompts: one rank with the whole model (``tp1``),
TP=2 (``tp``) and TP=2 with SP (``sp``); the TP models count their all-gathers, so the test
can tell which forwards sequence parallelism split. Each rank writes its own JSON.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import attrs
import torch
import torch.distributed as dist

MIN_TOKENS = 16  # forwards of fewer tokens run as plain TP
NEW_TOKENS = 8


def _counting(tp, counts: dict[str, int]):  # noqa: ANN001, ANN202
    def gather(tensor: torch.Tensor) -> torch.Tensor:
        counts["all_gather"] += 1
        return tp.all_gather(tensor)

    return attrs.evolve(tp, all_gather=gather)


def _models(checkpoint: str, tp) -> dict:  # noqa: ANN001
    from kthena_serve.model import SequenceParallel, load_model

    models = {"tp1": (load_model(checkpoint, dtype=torch.float32)[0], None)}
    for name, sp in (("tp", None), ("sp", SequenceParallel(MIN_TOKENS))):
        counts = {"all_gather": 0}
        model, _ = load_model(checkpoint, dtype=torch.float32, tp=_counting(tp, counts), sp=sp)
        models[name] = (model, counts)
    return models


def _run(models: dict, scenario) -> dict:  # noqa: ANN001
    """``scenario(runner)`` -> tokens, for each model on a fresh runner; tokens, gathers, and
    prompt tokens computed (prefix hits skip some)."""
    from _model_testing import GreedyRunner

    out = {}
    for name, (model, counts) in models.items():
        runner = GreedyRunner(model, num_blocks=64)
        before = counts["all_gather"] if counts else 0
        tokens = scenario(runner)
        out[name] = {"tokens": tokens, "computed": runner.num_computed_prompt_tokens,
                     "all_gathers": (counts["all_gather"] - before) if counts else 0}
    return out


def _scenarios(vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)

    def prompt(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    batch = [prompt(37), prompt(51), prompt(9)]  # 97 tokens in one forward: shards of 49 + 48
    single, shared = prompt(101), prompt(40)  # 101: not a multiple of the 16-token block
    later = [shared + prompt(29), shared + prompt(7)]

    def prefix_hit(runner) -> list[list[int]]:  # noqa: ANN001
        runner.generate([shared + prompt(3)], 1, reuse_prefix=True)  # caches shared's 2 blocks
        return runner.generate(later, NEW_TOKENS, reuse_prefix=True, prefill_chunk=20)

    return {
        "batched_uneven": lambda r: r.generate(batch, NEW_TOKENS),
        "single_101": lambda r: r.generate([single], NEW_TOKENS),
        "chunked_101": lambda r: r.generate([single], NEW_TOKENS, prefill_chunk=24),
        "short": lambda r: r.generate([prompt(12)], NEW_TOKENS),  # 12 < MIN_TOKENS: plain TP
        "prefix_hit": prefix_hit,
    }


def main() -> None:
    rank, port, tiny, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    real = sys.argv[5:] == ["real"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    try:
        from kthena_comm.groups import CommGroup
        from kthena_serve.model import TensorParallel

        tp = TensorParallel.from_comm_group(CommGroup("tp", (0, 1), rank, dist.group.WORLD))
        models = _models(tiny, tp)
        vocab = models["tp1"][0].config.shape.vocab_size
        results = {"kv_heads": models["sp"][0].num_kv_heads_per_rank,
                   "q_heads": len(models["sp"][0].plan.q_heads),
                   "layers": len(models["sp"][0].layers)}
        # Each scenario draws its prompts afresh (same seed): every model sees the same ones.
        for name in _scenarios(vocab):
            results[name] = _run(models, lambda r, n=name: _scenarios(vocab)[n](r))
        if real:
            from kthena_serve.model import ensure_default_checkpoint

            models = _models(str(ensure_default_checkpoint(progress=False)), tp)
            vocab = models["tp1"][0].config.shape.vocab_size
            results["real_batched_uneven"] = _run(
                models, lambda r: _scenarios(vocab, seed=1)["batched_uneven"](r))
        with open(out, "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
