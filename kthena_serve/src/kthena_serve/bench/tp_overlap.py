"""``kthena bench tp-overlap``: the engine's step time at TP=2 with and without TP overlap (MC2).

::

    for each variant (plain, overlap with each --tiles count, plain again):
        LLM(tp=2, tp_overlap=..., no prefix cache)  -> --warmup runs, then --runs timed runs of
            prefill:  one prompt of --prompt-len tokens, 1 output token    -> one forward
            decode:   --batch prompts of 16 tokens, 1 + --decode-steps outputs, minus the
                      same batch with 1 output: --decode-steps decode forwards
        -> median ms per step; the greedy tokens (they must equal plain's)
    -> one JSON line: machine (CPU model, ISA, cores, load average before and after), the rows

The baseline runs first and last so that drift of the machine during the run shows. Fixed
seed, greedy, float32 by default (bf16 on CPU would compare the packed bf16 kernel of plain TP
with F.linear on the dense weights the MC2 ops take).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs

from kthena_serve.bench.machine import host_info, wait_until_idle

__all__ = ["TPOverlapOptions", "add_parser", "format_table", "run_tp_overlap_bench"]


@attrs.frozen
class TPOverlapOptions:
    model: str = "default"
    dtype: str = "float32"
    tiles: tuple[int | None, ...] = (None, 2, 4)
    prompt_len: int = 256
    batch: int = 8
    decode_steps: int = 16
    runs: int = 5
    warmup: int = 1
    seed: int = 0


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 40000, (length,), generator=g).tolist() for _ in range(count)]


def _timed(llm, prompts: Sequence[Sequence[int]], max_tokens: int) -> tuple[float, list]:  # noqa: ANN001
    from kthena_serve.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([list(p) for p in prompts], params)
    return time.perf_counter() - start, [list(o.token_ids) for o in outs]


def measure_variant(options: TPOverlapOptions, overlap: bool,
                    tiles: int | None) -> dict[str, Any]:
    """One engine at TP=2 (with or without overlap): median prefill and decode step ms."""
    from kthena_serve.llm import LLM

    long = _prompts(1, options.prompt_len, options.seed)
    short = _prompts(options.batch, 16, options.seed + 1)
    llm = LLM(options.model, dtype=options.dtype, tp=2, tp_overlap=overlap,
              tp_overlap_tiles=tiles if overlap else None, enable_prefix_caching=False,
              max_num_batched_tokens=max(1024, options.prompt_len),
              max_num_seqs=max(64, options.batch), kv_cache_memory="256MiB")
    try:
        prefill, decode, tokens = [], [], []
        for run in range(options.warmup + options.runs):
            t_prefill, _ = _timed(llm, long, 1)
            t_one, _ = _timed(llm, short, 1)
            t_many, tokens = _timed(llm, short, 1 + options.decode_steps)
            if run >= options.warmup:
                prefill.append(t_prefill * 1e3)
                decode.append((t_many - t_one) * 1e3 / options.decode_steps)
    finally:
        llm.close()
    return {"variant": "plain" if not overlap else f"overlap tiles={tiles or 'auto'}",
            "tp_overlap": overlap, "tiles": tiles,
            "prefill_ms": round(statistics.median(prefill), 2),
            "decode_step_ms": round(statistics.median(decode), 2),
            "prefill_ms_all": [round(x, 2) for x in prefill],
            "decode_step_ms_all": [round(x, 2) for x in decode], "tokens": tokens}


def run_tp_overlap_bench(options: TPOverlapOptions) -> dict[str, Any]:
    """Every variant in turn (plain first and last); tokens checked against plain's."""
    machine = host_info()
    variants = [(False, None), *((True, t) for t in options.tiles), (False, None)]
    rows = []
    for overlap, tiles in variants:
        wait_until_idle()  # a previous engine's ranks may still be winding down
        rows.append(measure_variant(options, overlap, tiles))
    plain_tokens = rows[0]["tokens"]
    for row in rows:
        row["tokens_equal_plain"] = row.pop("tokens") == plain_tokens
    machine["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    return {"bench": "tp_overlap", "machine": machine, "options": attrs.asdict(options),
            "rows": rows}


def format_table(result: dict[str, Any]) -> str:
    """The rows as a markdown table (what docs/kthena_serve.md shows)."""
    base = result["rows"][0]
    lines = ["| variant | prefill ms | decode step ms | vs plain (prefill / decode) | tokens "
             "= plain |", "|---|---|---|---|---|"]
    for row in result["rows"]:
        ratio = (f"{row['prefill_ms'] / base['prefill_ms']:.2f} / "
                 f"{row['decode_step_ms'] / base['decode_step_ms']:.2f}")
        lines.append(f"| {row['variant']} | {row['prefill_ms']} | {row['decode_step_ms']} | "
                     f"{ratio} | {'yes' if row['tokens_equal_plain'] else 'NO'} |")
    return "\n".join(lines)


def _tiles(text: str) -> tuple[int | None, ...]:
    return tuple(None if t.strip() == "auto" else int(t) for t in text.split(","))


def add_parser(children: argparse._SubParsersAction) -> None:
    parser = children.add_parser("tp-overlap", help="step time at TP=2 with and without TP "
                                 "overlap (MC2), 2 ranks on this host")
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--tiles", type=_tiles, default=(None, 2, 4),
                        help="overlap variants' row tiles, 'auto' = the device's default "
                             "(default auto,2,4)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences of the decode phase")
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--runs", type=int, default=5, help="timed runs per variant (median)")
    parser.add_argument("--table", action="store_true",
                        help="also print the markdown table (on stderr)")
    parser.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    from kthena_serve.deployment import prepare_process

    prepare_process()
    try:
        options = TPOverlapOptions(model=args.model, dtype=args.dtype, tiles=args.tiles,
                                   prompt_len=args.prompt_len, batch=args.batch,
                                   decode_steps=args.decode_steps, runs=args.runs)
        result = run_tp_overlap_bench(options)
    except ValueError as error:
        print(f"kthena bench tp-overlap: {error}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    if args.table:
        print(format_table(result), file=sys.stderr)
    return 0
