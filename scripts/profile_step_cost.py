#!/usr/bin/env python3
"""Profile the engine's step time by composition and fit the scheduler's step cost model.

    python scripts/profile_step_cost.py [--repeats 5] [--model default]

Builds the default engine (``EngineConfig()``), then times ``runner.execute`` on synthetic
steps of ``decode_rows`` decodes (each over ``decode_context`` cached tokens) plus one prefill
chunk of ``prefill_tokens`` tokens starting at ``prefill_start`` (the tokens before it are in
the cache), the fastest of ``--repeats`` after a warm-up (the least disturbed by other processes on shared cores). It then fits, by least squares,

    t = a + b * prefill_tokens + c * decode_rows + d * prefill_attention

(``prefill_attention`` = the chunk's query x key pairs, ``StepShape.prefill_attention``) and
prints the grid and the fit as one JSON line, with the CPU model and load. No KV manager is
involved: the block tables are plain ranges of the pool.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="default")
    args = parser.parse_args()

    import torch

    from kthena_serve.engine import LLMEngine
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.scheduled import ScheduledBatch, ScheduledSeq
    from kthena_serve.engine.step_cost import StepShape, fit_least_squares

    engine = LLMEngine.from_config(EngineConfig(model=args.model))
    runner, size = engine.runner, engine.config.block_size

    def seq(rid: str, start: int, count: int, first: int) -> ScheduledSeq:
        num_blocks = -(-(start + count) // size)
        return ScheduledSeq(rid, tuple([100] * count), start,
                            tuple(range(first, first + num_blocks)), True)

    def time_step(decode_rows: int, decode_context: int, prefill_tokens: int,
                  prefill_start: int) -> float:
        # the decodes share one block table (each writes one slot; timing is what counts)
        seqs = [seq(f"d{i}", decode_context, 1, 0) for i in range(decode_rows)]
        if prefill_tokens:
            seqs.append(seq("p", prefill_start, prefill_tokens, decode_context // size + 1))
        batch = ScheduledBatch(tuple(seqs))
        runner.execute(batch)  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            runner.execute(batch)
            times.append(time.perf_counter() - start)
        return min(times)  # the least disturbed by other processes on shared cores

    rows = []
    grid = [(d, 256, p, s) for d in (1, 8, 32) for p in (0, 16, 64, 128, 256, 512, 1024)
            for s in (0,)] + [(d, 256, p, s) for d in (1, 8) for p in (64, 256, 512)
                              for s in (1024, 2048)] + [(d, c, 0, 0) for d in (1, 8, 32)
                                                        for c in (1024, 2048)]
    for decode_rows, decode_context, prefill_tokens, prefill_start in grid:
        seconds = time_step(decode_rows, decode_context, prefill_tokens, prefill_start)
        shape = StepShape(prefill_tokens=prefill_tokens, decode_rows=decode_rows,
                          prefill_attention=StepShape.chunk_attention(prefill_start,
                                                                      prefill_tokens))
        rows.append({"decode_rows": decode_rows, "decode_context": decode_context,
                     "prefill_tokens": prefill_tokens, "prefill_start": prefill_start,
                     "ms": round(seconds * 1e3, 2), "shape": shape})
        print(f"decodes {decode_rows:3d} @ctx {decode_context:5d}  prefill {prefill_tokens:5d}"
              f" @start {prefill_start:5d}: {seconds * 1e3:8.2f} ms", flush=True)
    full = fit_least_squares([(r["shape"], r["ms"] / 1e3) for r in rows])
    linear = fit_least_squares([(r["shape"], r["ms"] / 1e3) for r in rows], attention=False)
    for r in rows:
        r["fit_ms"] = round(full.predict(r.pop("shape")) * 1e3, 2)
    print(json.dumps({
        "cpu": _cpu_model(), "cores": os.cpu_count(), "load_1m": os.getloadavg()[0],
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model": args.model, "dtype": engine.config.dtype,
        "fit": full.coefficients(), "fit_without_attention": linear.coefficients(),
        "rows": rows}))
    engine.close()


if __name__ == "__main__":
    main()
