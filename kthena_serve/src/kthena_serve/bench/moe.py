"""An MoE model against the dense model of equal active parameters: ``python -m
kthena_serve.bench.moe`` (or ``kthena bench moe``).

No real MoE model is installable here, so both checkpoints are written by the bench (random
weights, safetensors) with the same attention, layers and vocabulary: a Mixtral-shaped model
of ``--experts`` experts of width ``--expert-width``, ``--top-k`` per token, and a Llama-shaped
dense model whose MLP width is ``top_k x expert_width`` (the same parameters per token). Each is
loaded as the engine loads it and timed alone (one thread): a prefill of ``--prompt`` tokens,
and decode steps at batch 1 and at ``--batch`` sequences. One JSON line per (model, case) with
the medians, then a summary line of MoE / dense ratios, the parameter counts and the machine.

What it shows: a decode step reads every expert some token of the batch is routed to, so at
batch 1 the MoE model reads about the dense model's bytes and at larger batches up to
``experts / top_k`` times them; prefill computes the same FLOPs per token in both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kthena_serve.bench.machine import host_info
from kthena_serve.deployment import prepare_process

BLOCK = 16  # torch and the model are imported on use: after prepare_process (OpenMP's policy)


def _config(args: argparse.Namespace, moe: bool) -> dict[str, object]:
    base = {"vocab_size": 4096, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
            "num_attention_heads": args.hidden // 64, "num_key_value_heads": args.hidden // 128,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "hidden_act": "silu"}
    if moe:
        return {**base, "architectures": ["MixtralForCausalLM"], "num_local_experts": args.experts,
                "num_experts_per_tok": args.top_k, "intermediate_size": args.expert_width}
    return {**base, "architectures": ["LlamaForCausalLM"],
            "intermediate_size": args.top_k * args.expert_width}


def _shape(name: str, config: Any) -> tuple[int, ...]:
    """The [out, in] (or [n]) shape of checkpoint tensor ``name``."""
    s, moe = config.shape, config.moe
    h, q, kv = s.hidden_size, s.num_attention_heads * s.head_dim, s.num_kv_heads * s.head_dim
    kind = name.rsplit(".", 2)[-2]
    width = moe.intermediate_size if moe is not None and ".experts." in name else \
        s.intermediate_size
    return {"embed_tokens": (s.vocab_size, h), "lm_head": (s.vocab_size, h), "q_proj": (q, h),
            "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (width, h), "up_proj": (width, h), "down_proj": (h, width),
            "w1": (width, h), "w3": (width, h), "w2": (h, width),
            "gate": (moe.num_experts if moe is not None else 0, h)}.get(kind, (h,))


def write_checkpoint(folder: Path, hf_config: dict[str, object], seed: int = 0) -> Path:
    """A random checkpoint of ``hf_config`` (norms 1, matmul weights scaled by fan-in^-1/2,
    routers N(0, 1)) with the default model's tokenizer files; returns ``folder``."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from kthena_serve.model import ModelConfig, resolve_checkpoint
    from kthena_serve.model.loader import expected_weight_names

    folder.mkdir(parents=True, exist_ok=True)
    default = resolve_checkpoint("default")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(default / name, folder / name)
    (folder / "config.json").write_text(json.dumps(hf_config))
    config = ModelConfig.from_dict(hf_config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name in sorted(expected_weight_names(config)):
        shape = _shape(name, config)
        if len(shape) == 1:
            tensors[name] = torch.ones(shape)
        else:
            scale = 1.0 if name.endswith(("embed_tokens.weight", "gate.weight")) else \
                shape[1] ** -0.5
            tensors[name] = (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    """Median wall seconds of ``fn()`` over ``repeats`` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """Median ms of a prefill of ``--prompt`` tokens and of decode steps at batch 1 and
    ``--batch``, the model loaded as the engine loads it (packed weights, kernels by timing)."""
    import torch

    from kthena_core.dtypes import torch_dtype
    from kthena_serve.model.loader import load_model
    from mooncake_kv.paged import paged_batch

    dtype = torch_dtype(args.dtype)
    model, _ = load_model(str(folder), dtype=dtype, kernels=args.kernels)
    context = args.prompt
    per_seq = -(-(context + 1) // BLOCK)
    blocks = per_seq * args.batch
    shape = (blocks, BLOCK, model.num_kv_heads_per_rank, model.head_dim)
    caches = [tuple(torch.zeros(shape, dtype=dtype) for _ in range(model.kv_parts))
              for _ in model.layers]
    tables = [range(i * per_seq, (i + 1) * per_seq) for i in range(args.batch)]
    prompt = torch.randint(0, model.config.shape.vocab_size, (context,))

    def step(seqs: int, cached: int, new: int) -> None:
        batch = paged_batch([(tables[i], cached, new) for i in range(seqs)], BLOCK)
        model(prompt[: seqs * new] if new > 1 else prompt[:seqs], batch.positions, batch, caches)

    with torch.inference_mode():
        for i in range(args.batch):  # every sequence's context in the cache
            batch = paged_batch([(tables[i], 0, context)], BLOCK)
            model(prompt, batch.positions, batch, caches)
        return {"prefill_ms": 1e3 * _time(lambda: step(1, 0, context), args.repeats),
                "decode_batch1_ms": 1e3 * _time(lambda: step(1, context, 1), args.repeats),
                f"decode_batch{args.batch}_ms":
                    1e3 * _time(lambda: step(args.batch, context, 1), args.repeats)}


def run(args: argparse.Namespace) -> list[dict[str, object]]:
    """Both models measured, alternating (moe, dense) ``--rounds`` times; the rows."""
    import torch

    from kthena_core.model_spec import ModelSpec

    rows = []
    with tempfile.TemporaryDirectory(prefix="kthena-bench-moe-") as tmp:
        folders = {kind: write_checkpoint(Path(tmp) / kind, _config(args, kind == "moe"))
                   for kind in ("moe", "dense")}
        results: dict[str, list[dict[str, float]]] = {"moe": [], "dense": []}
        for _ in range(args.rounds):
            for kind, folder in folders.items():
                results[kind].append(measure(folder, args))
        for kind, folder in folders.items():
            spec = ModelSpec.from_hf_config(json.loads((folder / "config.json").read_text()))
            medians = {key: round(statistics.median(r[key] for r in results[kind]), 3)
                       for key in results[kind][0]}
            rows.append({"bench": "moe_vs_dense", "model": kind, **medians,
                         "params": spec.num_params(), "active_params": spec.num_params(active=True)})
    moe, dense = rows
    ratios = {f"{key}_ratio": round(moe[key] / dense[key], 3) for key in moe if key.endswith("_ms")}
    rows.append({"bench": "moe_vs_dense", "summary": "moe / dense", **ratios,
                 "experts": args.experts, "top_k": args.top_k, "dtype": args.dtype,
                 "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2),
                 **host_info()})
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-width", type=int, default=704)
    parser.add_argument("--prompt", type=int, default=256, help="prefill tokens (and context)")
    parser.add_argument("--batch", type=int, default=8, help="sequences of the larger decode")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--kernels", default="auto", choices=("auto", "native", "torch"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3, help="alternations of the two models")
    parser.add_argument("--threads", type=int, default=1)


def _run(args: argparse.Namespace) -> int:
    if args.hidden % 128:
        print(f"kthena bench moe: --hidden {args.hidden} must be a multiple of 128 (64-wide "
              "heads, half as many KV heads)", file=sys.stderr)
        return 2
    if not 1 <= args.top_k <= args.experts:
        print(f"kthena bench moe: --top-k {args.top_k} must be in 1..--experts "
              f"({args.experts})", file=sys.stderr)
        return 2
    prepare_process()
    import torch

    torch.set_num_threads(args.threads)
    for row in run(args):
        print(json.dumps(row), flush=True)
    return 0


def add_parser(children: argparse._SubParsersAction) -> None:
    """Add ``kthena bench moe`` to the ``kthena bench`` subcommands."""
    parser = children.add_parser("moe", help="a tiny MoE model against the dense model of "
                                 "equal active parameters: prefill and decode step times",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=_run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return _run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
