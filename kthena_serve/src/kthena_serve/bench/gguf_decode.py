"""Decode steps of the model alone (batch 1, or ``--batch N`` sequences), by weight format and
decode-step form, against the memory-bandwidth floor: ``python -m kthena_serve.bench.gguf_decode``.

Candidates (``--candidates``): ``bf16`` (dense bf16, packed as the engine packs it, decode
steps through the layers as the kernel choice runs them: the fused native step where it
applies, `mooncake_ops.decode_step`), ``bf16-ops`` (the same model, one call per op), ``gguf``
(``--quantization gguf``: the GGUF file's Q4_1 / Q8_0 blocks, bf16 activations, fused where
it applies), ``gguf-ops`` (the same, one call per op), ``gguf-fp32``
(the same blocks, fp32 activations), ``int8`` (weight-only int8, bf16 activations, fused where
it applies), ``int8-ops`` and ``fp32``
(the dequantised model in float32). All are loaded first, then timed in interleaved rounds
(each round runs ``--steps`` decode steps of every candidate in turn), so a neighbour's load
lands on all of them alike. One JSON line per candidate, then one summary line:

* ``median_ms`` / ``p10_ms`` / ``p90_ms``: wall time per decode step over all rounds;
  ``cpu_median_ms``: the process's CPU time per step (what a step costs on cores of its own);
* ``weight_mb``: the matmul weight bytes one decode step reads (every layer's and the LM
  head's; the embedding reads one row);
* ``floor_ms`` = ``weight_mb`` / ``bandwidth_gb_s`` (a ``sum`` over a 256 MB tensor on the same
  threads, the best of 5: `kthena_core.discovery.host_probe.measure_bandwidth`), and
  ``floor_fraction`` = ``floor_ms`` / ``median_ms`` (1.0: the step reads its weights at the
  machine's memory bandwidth and does nothing else).

The summary carries the CPU (model name, family / model, ISA), threads, the load averages before
and after, and the speed-up of each candidate over ``bf16``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Sequence

import torch

from kthena_core.discovery.host_probe import measure_bandwidth
from kthena_serve.bench.machine import host_info
from kthena_serve.model.llama import DecodeStepChoice
from kthena_serve.model.loader import load_model
from mooncake_kv.paged import paged_batch

# name -> (dtype, quantization); ``-ops``: decode steps one call per op
CANDIDATES = {"bf16": (torch.bfloat16, None), "bf16-ops": (torch.bfloat16, None),
              "gguf": (torch.bfloat16, "gguf"), "gguf-ops": (torch.bfloat16, "gguf"),
              "gguf-fp32": (torch.float32, "gguf"), "int8": (torch.bfloat16, "int8"),
              "int8-ops": (torch.bfloat16, "int8"),
              "fp32": (torch.float32, None)}
_MATMUL_NAMES = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "lm_head_weight")
_BANDWIDTH_BYTES = 256 * 2**20


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the matmul weights (packed or dense) one decode step reads."""
    tensors = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers()):
        if name.rsplit(".", 1)[-1] in _MATMUL_NAMES:
            tensors[name] = tensor.numel() * tensor.element_size()
    return sum(tensors.values())


class Decoder:
    """One candidate model with a KV cache, ``batch`` sequences advanced a step at a time."""

    def __init__(self, model: str, dtype: torch.dtype, quantization: str | None, context: int,
                 kernels: str, block_size: int = 16, max_steps: int = 4096,
                 batch: int = 1) -> None:
        self.llm, _ = load_model(model, dtype=dtype, quantization=quantization, kernels=kernels)
        self.block_size = block_size
        per_seq = -(-(context + max_steps) // block_size)
        shape = (per_seq * batch, block_size, self.llm.num_kv_heads_per_rank, self.llm.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                       for _ in self.llm.layers]
        self.tables = [range(i * per_seq, (i + 1) * per_seq) for i in range(batch)]
        tokens = []
        with torch.inference_mode():
            for i, table in enumerate(self.tables):  # each sequence its own random prompt
                prompt = torch.randint(0, self.llm.config.shape.vocab_size, (context,),
                                       generator=torch.Generator().manual_seed(i))
                one = paged_batch([(table, 0, context)], block_size)
                tokens.append(self.llm(prompt, one.positions, one, self.caches).argmax(-1))
        self.tokens = torch.cat(tokens)
        self.position = context

    def steps(self, n: int) -> tuple[list[float], list[float]]:
        """Run ``n`` decode steps; (wall seconds, CPU seconds) of each."""
        walls, cpus = [], []
        with torch.inference_mode():
            for _ in range(n):
                batch = paged_batch([(t, self.position, 1) for t in self.tables], self.block_size)
                start, cpu = time.perf_counter(), time.process_time()
                self.tokens = self.llm(self.tokens, batch.positions, batch,
                                       self.caches).argmax(-1)
                walls.append(time.perf_counter() - start)
                cpus.append(time.process_time() - cpu)
                self.position += 1
        return walls, cpus


def run(names: Sequence[str], *, model: str = "default", context: int = 128, steps: int = 16,
        rounds: int = 8, kernels: str = "native", batch: int = 1) -> list[dict]:
    """Load every candidate, time them in interleaved rounds; the rows `main` prints."""
    host = host_info()
    decoders = {name: Decoder(model, *CANDIDATES[name], context, kernels,
                              max_steps=(rounds + 1) * steps, batch=batch) for name in names}
    for name, decoder in decoders.items():
        if name.endswith("-ops"):
            decoder.llm.decode_step = DecodeStepChoice("ops", f"--candidates {name}")
    bandwidth = max(measure_bandwidth(_BANDWIDTH_BYTES, 5).values())
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for name in names:  # warm-up
        decoders[name].steps(steps)
    for _ in range(rounds):
        for name in names:
            walls, cpus = decoders[name].steps(steps)
            times[name][0].extend(walls)
            times[name][1].extend(cpus)
    rows = [_row(name, decoders[name], *times[name], bandwidth) for name in names]
    base = next((r["median_ms"] for r in rows if r["candidate"] == "bf16"), None)
    summary = {"bench": "gguf_decode_summary", "model": model, "context": context, "batch": batch,
               "threads": torch.get_num_threads(), "kernels": kernels, **host,
               "loadavg_after": [round(x, 2) for x in os.getloadavg()],
               "bandwidth_gb_s": round(bandwidth / 1e9, 2), "torch": torch.__version__}
    if base is not None:
        summary["speedup_vs_bf16"] = {r["candidate"]: round(base / r["median_ms"], 2)
                                      for r in rows}
    return [*rows, summary]


def _row(name: str, decoder: Decoder, walls: list[float], cpus: list[float],
         bandwidth: float) -> dict:
    median = statistics.median(walls)
    deciles = statistics.quantiles(walls, n=10)
    nbytes = weight_bytes(decoder.llm)
    floor = nbytes / bandwidth
    return {"bench": "gguf_decode", "candidate": name, "steps": len(walls),
            "kernel": decoder.llm.kernel_choice.linear_decode or "F.linear",
            "decode_step": decoder.llm.decode_step.name,
            "median_ms": round(median * 1e3, 2), "p10_ms": round(deciles[0] * 1e3, 2),
            "p90_ms": round(deciles[-1] * 1e3, 2),
            "cpu_median_ms": round(statistics.median(cpus) * 1e3, 2),
            "tokens_per_s": round(1 / median, 1), "weight_mb": round(nbytes / 1e6, 1),
            "floor_ms": round(floor * 1e3, 2), "floor_fraction": round(floor / median, 3)}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default", help="'default' or a .gguf file")
    parser.add_argument("--candidates", default="bf16,bf16-ops,gguf,gguf-ops,int8,int8-ops",
                        help=f"comma-separated, of {', '.join(CANDIDATES)}")
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded per step")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kernels", default="native", choices=("auto", "native", "torch"))
    args = parser.parse_args(argv)
    names = args.candidates.split(",")
    unknown = sorted(set(names) - set(CANDIDATES))
    if unknown:
        parser.error(f"--candidates: unknown {unknown}; allowed: {', '.join(CANDIDATES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    for row in run(names, model=args.model, context=args.context, steps=args.steps,
                   rounds=args.rounds, kernels=args.kernels, batch=args.batch):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
