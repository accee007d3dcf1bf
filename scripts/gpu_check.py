#!/usr/bin/env python3
"""The GPU check: everything CUDA-only this repository can verify, run once, one JSON report.

    python scripts/gpu_check.py --out gpu_check.json      # on a machine with an NVIDIA GPU
    python scripts/gpu_check.py --dry-run                 # anywhere: arguments, plan, schema

Steps (each becomes one entry of ``report["steps"]``):

    environment             torch, CUDA, the GPU, and the Mooncake wheel's transports
    pytest_cuda             the repository's CUDA-marked tests (pytest -k cuda): the engine's
                            greedy tokens on cuda equal those on cpu; one launcher rank of
                            the parallel runner on cuda:0 over nccl; with two GPUs, TP=2 with
                            every rank's tensors on cuda:RANK and tp=1's tokens
    ops_parity              mooncake_ops on cuda (float32) against their pure-PyTorch
                            references on CPU in float64
    engine_vs_transformers  greedy tokens of LLM(device="cuda", dtype="float32") against
                            transformers' generate on cuda, default model
    mooncake_cuda_memory    register a CUDA tensor with the installed Mooncake wheel: a handle
                            located at cuda:0 on a CUDA build, the named refusal otherwise
    pd_device_pools         the one-GPU PD hand-off through a device pool: this process (the
                            decode side) makes its KV pool on cuda:0 (create_pool shared=True)
                            and exports it (pd/pool_share.py: CUDA IPC); a prefill child
                            process opens it and runs PrefillExecutor.submit_shared into a
                            scattered block table, then prefills the same prompt into its own
                            pool; checked: the decode side's own view of those blocks is byte
                            for byte what the child read through IPC, equal to its own pool's
                            KV, first tokens equal, other blocks untouched; reported: bytes
                            written in place, bytes copied, open / prefill / hand-off times
    pd_mooncake_device_pools  the cross-host PD path on one GPU: the decode pool and the
                            prefill worker's own pool on cuda:0, each registered with Mooncake
                            on 127.0.0.1 (memory kind cuda:0), the prefill pushed layer by
                            layer (submit_local + PushSession); checked: the pushed blocks land
                            bit for bit, one put per layer; reported: bytes moved, puts,
                            hand-off time; a wheel without CUDA reports its refusal
                            (unsupported)
    mc2_parity              mooncake_ops MC2 ops (matmul_all_reduce, all_gather_matmul,
                            matmul_reduce_scatter) on cuda over NCCL, one rank per GPU (at most
                            2), tiled 1 and 4, against matmul + one collective in float64 on
                            the CPU; and which fused kernels the installed torch has
                            (mc2.require_fused: symmetric-memory async-TP)
    bench_serve             kthena bench serve --device cuda (engine only; JSON kept)

``--dry-run`` runs only what needs no GPU (argument parsing, the environment step, the plan)
and writes a report whose other steps are ``planned``, each listing the detail fields it
reports (``reports``); the test suite runs it, and runs the PD and MC2 steps' code on cpu
(shm pool, gloo), so the plan, the schema and the steps cannot rot. Statuses: planned,
passed, failed, skipped, unsupported. Exit status 0 when no step failed, 1 when one did, 2
when a real run finds no CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "kthena.gpu_check/2"
STATUSES = ("planned", "passed", "failed", "skipped", "unsupported")
STEP_KEYS = {"name", "description", "needs_gpu", "command", "status", "seconds", "detail",
             "reports"}
# the detail fields the PD and MC2 steps report (also on cpu: tests/test_gpu_check.py)
PD_REPORTS = ("device", "route", "prompt_tokens", "kv_bytes_written", "bytes_copied",
              "open_pool_s", "prefill_s", "handoff_s", "first_token", "kv_max_abs_diff",
              "checks")
PD_MOONCAKE_REPORTS = ("device", "route", "location", "prompt_tokens", "bytes_moved",
                       "num_puts", "prefill_s", "handoff_s", "first_token", "checks")
MC2_REPORTS = ("device", "world", "max_abs_error", "tolerance", "failures")
MC2_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Step:
    name: str
    description: str
    needs_gpu: bool
    command: tuple[str, ...] | None = None
    run: Callable[[argparse.Namespace], tuple[str, dict]] | None = field(default=None,
                                                                       compare=False)
    reports: tuple[str, ...] = ()  # the detail fields a run fills


# ---- steps ---------------------------------------------------------------------------------------
def environment(args: argparse.Namespace) -> tuple[str, dict]:
    import torch

    detail: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                              "cuda_available": torch.cuda.is_available(),
                              "cuda_runtime": torch.version.cuda}
    if torch.cuda.is_available():
        detail["gpu"] = torch.cuda.get_device_name(0)
        detail["num_gpus"] = torch.cuda.device_count()
    try:
        from kthena_comm.transfer.mooncake import installed_build

        detail["mooncake"] = str(installed_build())
    except ImportError as exc:
        detail["mooncake"] = f"not importable: {exc}"
    return "passed", detail


def pytest_cuda(args: argparse.Namespace) -> tuple[str, dict]:
    proc = _run(PYTEST_CUDA, args.timeout_s)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0:
        return "failed", {"summary": summary, "tail": proc.stdout[-3000:]}
    return ("skipped" if "skipped" in summary else "passed"), {"summary": summary}


def ops_parity(args: argparse.Namespace) -> tuple[str, dict]:
    import torch

    torch.manual_seed(0)
    errors = {name: _max_error(fn, "cuda") for name, fn in _parity_cases(torch).items()}
    bad = {k: v for k, v in errors.items() if v > 1e-4}
    return ("failed" if bad else "passed"), {"max_abs_error": errors, "tolerance": 1e-4}


def engine_vs_transformers(args: argparse.Namespace) -> tuple[str, dict]:
    import torch
    import transformers

    from kthena_core.known_models import default_gguf_path
    from kthena_serve import LLM, SamplingParams

    llm = LLM(device="cuda", dtype="float32")
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
               for q in ("What is the capital of France?", "List three prime numbers.")]
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0,
                                                                      max_tokens=16))]
    folder, name = os.path.split(default_gguf_path())
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                           dtype=torch.float32).cuda().eval()
    theirs = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p], device="cuda"), max_new_tokens=16,
                              do_sample=False, pad_token_id=2)
            theirs.append(out[0, len(p):].tolist())
    same = [list(a) == list(b) for a, b in zip(ours, theirs, strict=True)]
    return ("passed" if all(same) else "failed"), {"identical": same, "ours": ours,
                                                   "transformers": theirs}


def mooncake_cuda_memory(args: argparse.Namespace) -> tuple[str, dict]:
    import torch

    from kthena_comm.errors import TransportUnavailableError
    from kthena_comm.transfer import MooncakeConfig, create_engine

    engine = create_engine("mooncake", MooncakeConfig())
    try:
        memory = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
        try:
            handle = engine.register(memory)
        except TransportUnavailableError as exc:
            return "unsupported", {"refusal": str(exc), "build": str(engine.build)}
        return "passed", {"location": handle.location, "build": str(engine.build)}
    finally:
        engine.close()


def pd_device_pools(args: argparse.Namespace) -> tuple[str, dict]:
    return pd_handoff("cuda:0", args.timeout_s)


def pd_mooncake_device_pools(args: argparse.Namespace) -> tuple[str, dict]:
    return pd_mooncake("cuda:0", args.timeout_s)


def mc2_parity(args: argparse.Namespace) -> tuple[str, dict]:
    import torch

    from mooncake_ops import mc2
    from mooncake_ops.errors import UnsupportedDeviceError

    status, detail = mc2_check("cuda", min(2, torch.cuda.device_count()), args.timeout_s)
    try:
        detail["fused"] = dict(mc2.require_fused("cuda"))
    except UnsupportedDeviceError as exc:
        detail["fused"] = {"missing": str(exc)}
    return status, detail


def bench_serve(args: argparse.Namespace) -> tuple[str, dict]:
    proc = _run(BENCH, args.timeout_s)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return "failed", {"tail": (proc.stdout + proc.stderr)[-3000:]}
    return "passed", {"result": json.loads(lines[-1])}


PYTEST_CUDA = (sys.executable, "-m", "pytest", "-q", "-rs", "kthena_serve/tests/test_engine.py",
               "kthena_serve/tests/test_placement.py", "-k", "cuda")
BENCH = (str(Path(sys.executable).with_name("kthena")), "bench", "serve", "--device", "cuda",
         "--no-hf", "--runs", "1", "--plot", "")
STEPS = (
    Step("environment", "torch, CUDA, the GPU and the Mooncake wheel's transports", False,
         run=environment),
    Step("pytest_cuda", "CUDA-marked tests: engine greedy tokens on cuda == on cpu; ranks on "
         "cuda:LOCAL_RANK over nccl (TP=2 where 2 GPUs)", True,
         PYTEST_CUDA, pytest_cuda),
    Step("ops_parity", "mooncake_ops on cuda float32 vs CPU float64", True, run=ops_parity),
    Step("engine_vs_transformers", "greedy tokens: LLM(device='cuda', float32) vs transformers "
         "generate on cuda", True, run=engine_vs_transformers),
    Step("mooncake_cuda_memory", "register a CUDA tensor with the installed Mooncake wheel",
         True, run=mooncake_cuda_memory),
    Step("pd_device_pools", "one-GPU PD hand-off: a prefill process writes into the decode "
         "process's cuda pool through CUDA IPC", True, run=pd_device_pools,
         reports=PD_REPORTS),
    Step("pd_mooncake_device_pools", "PD across hosts' path on one GPU: both pools on cuda "
         "registered with Mooncake (127.0.0.1), the prefill pushed layer by layer", True,
         run=pd_mooncake_device_pools, reports=PD_MOONCAKE_REPORTS),
    Step("mc2_parity", "MC2 ops on cuda over NCCL (one rank per GPU, at most 2) vs matmul + "
         "collective in float64; fused kernels of the installed torch", True, run=mc2_parity,
         reports=MC2_REPORTS + ("fused",)),
    Step("bench_serve", "kthena bench serve on cuda (engine only)", True, BENCH, bench_serve),
)
KNOWN_WITHOUT_GPU = {"environment"}


# ---- helpers --------------------------------------------------------------------------------------
def _run(command: tuple[str, ...], timeout_s: float,
         stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s, input=stdin)


# ---- the PD hand-off through a device pool -------------------------------------------------------
PD_BLOCKS = (5, 2, 9, 0, 7, 3, 11)  # a scattered block table: the prefill must follow it
PD_PROMPT = ("A prefill worker writes each token's keys and values straight into the blocks "
             "the decode worker reserved, so nothing but the first token has to travel back. ")


def pd_handoff(device: str, timeout_s: float) -> tuple[str, dict]:
    """The decode side of the hand-off (see ``pd_device_pools`` in the module docs): a pool on
    ``device`` shared the way a PD decode worker shares it, a prefill child that fills it.
    On cpu the pool is a /dev/shm file, on cuda device memory opened through CUDA IPC; the
    hand-off code is the same (``PrefillExecutor.submit_shared``)."""
    import torch

    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.model_runner import create_pool, kv_layout_for
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.model import load_model
    from kthena_serve.pd.pool_share import export_pool
    from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json

    config = EngineConfig(device=device, dtype="float32", num_kv_blocks=16, max_num_seqs=2)
    net, tokenizer = load_model("default", dtype=torch.float32)  # the shapes and the prompt
    layout = kv_layout_for(net.config.shape.num_layers, net.num_kv_heads_per_rank,
                           net.head_dim, config)
    del net
    ids = tokenizer.encode(PD_PROMPT * 4)[: (len(PD_BLOCKS) - 1) * config.block_size + 3]
    pool = create_pool(layout, config, shared=True)
    try:
        shared = export_pool(pool)
        ref = PoolRef(layout.num_blocks, config.block_size, config.dtype,
                      kv_cache_dtype=config.kv_cache_dtype, **shared)
        task = PrefillTask("gpu-check-pd", tuple(ids), 0, PD_BLOCKS,
                           params_to_json(SamplingParams(temperature=0, max_tokens=1)), ref)
        proc = _run((sys.executable, str(Path(__file__).resolve()), "--pd-prefill-child"),
                    timeout_s, json.dumps({"config": config.to_json(), "task": task.to_json()}))
        if proc.returncode != 0:
            return "failed", {"tail": (proc.stdout + proc.stderr)[-3000:]}
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        seen = _prompt_kv(pool, PD_BLOCKS, len(ids))  # this process's own view of its pool
        others = [b for b in range(layout.num_blocks) if b not in PD_BLOCKS]
        checks = {"decode_sees_the_prefill_kv": _digest(seen) == got.pop("kv_digest"),
                  "kv_equals_own_pool": got["kv_max_abs_diff"] <= 1e-5,
                  "first_token_equals_own_pool": got["first_token"] == got.pop("own_first_token"),
                  "other_blocks_untouched": all(not any(pool.read_block(b)) for b in others)}
    finally:
        pool.close()
    detail = {"device": device, "route": "device_ipc" if "device_ipc" in shared else "shm",
              "prompt_tokens": len(ids), "kv_bytes_written": len(PD_BLOCKS) * layout.bytes_per_block,
              **got, "checks": checks}
    return ("passed" if all(checks.values()) else "failed"), detail


def pd_prefill_child(data: dict) -> dict:
    """The prefill side, in its own process: open the decode pool, prefill into it, then the
    same prompt into this process's own pool for comparison."""
    import torch

    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.model import load_model
    from kthena_serve.pd.pool_share import open_pool
    from kthena_serve.pd.prefill import PrefillExecutor
    from kthena_serve.pd.protocol import PrefillTask, params_from_json

    config, task = EngineConfig.from_json(data["config"]), PrefillTask.from_json(data["task"])
    net, _ = load_model("default", dtype=torch.float32, device=config.device)
    executor = PrefillExecutor(net, config, own_pool=True)
    ref, num_tokens = task.pool, len(task.token_ids)
    decode_pool = None
    try:
        began = time.perf_counter()
        decode_pool = open_pool(ref, executor.layout_for(ref.num_blocks, ref.block_size,
                                                         ref.dtype, ref.kv_cache_dtype))
        opened = time.perf_counter()
        result = executor.submit_shared(task).result(timeout=600)
        prefilled = time.perf_counter()
        own = executor.submit_owned("own", task.token_ids,
                                    params_from_json(task.params)).result(timeout=600)
        theirs = _prompt_kv(decode_pool, task.block_ids, num_tokens)
        mine = _prompt_kv(executor.pool, own.block_ids, num_tokens)
        return {"open_pool_s": round(opened - began, 6),
                "prefill_s": round(prefilled - opened, 6), "handoff_s": result.handoff_s,
                "bytes_copied": result.handoff_bytes, "first_token": result.first_token_id,
                "own_first_token": own.token_id,
                "kv_max_abs_diff": float((theirs - mine).abs().max()),
                "kv_digest": _digest(theirs)}
    finally:
        if decode_pool is not None:
            decode_pool.close()
        executor.close()


def pd_mooncake(device: str, timeout_s: float) -> tuple[str, dict]:
    """The cross-host path in one process: the decode pool and the prefill worker's own pool on
    ``device``, each registered with a Mooncake engine on 127.0.0.1 (memory kind ``cuda:N`` on
    cuda), the prefill pushed into the decode pool's scattered blocks layer by layer
    (``PrefillExecutor.submit_local`` + ``PushSession``, as the PD workers run it). A wheel
    that cannot register this memory is reported as ``unsupported`` with its refusal."""
    import torch

    from kthena_comm.errors import TransportUnavailableError
    from kthena_serve.engine.config import EngineConfig
    from kthena_serve.engine.model_runner import create_pool, kv_layout_for
    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.model import load_model
    from kthena_serve.pd.prefill import PrefillExecutor
    from kthena_serve.pd.protocol import PoolRef, PrefillTask, params_to_json
    from kthena_serve.pd.transfer import BlockPutter, register_pool

    config = EngineConfig(device=device, dtype="float32", num_kv_blocks=16, max_num_seqs=2)
    net, tokenizer = load_model("default", dtype=torch.float32, device=device)
    layout = kv_layout_for(net.config.shape.num_layers, net.num_kv_heads_per_rank,
                           net.head_dim, config)
    ids = tokenizer.encode(PD_PROMPT * 4)[: (len(PD_BLOCKS) - 1) * config.block_size + 3]
    params = SamplingParams(temperature=0, max_tokens=1)
    decode_pool = create_pool(layout, config, shared=True)  # as a mooncake decode worker's
    executor = PrefillExecutor(net, config, own_pool=True)
    engine = putter = None
    try:
        try:
            engine, handle = register_pool(decode_pool, "127.0.0.1", timeout_s)
            putter = BlockPutter(executor.pool, "127.0.0.1", timeout_s)
        except TransportUnavailableError as exc:
            return "unsupported", {"device": device, "refusal": str(exc)}
        ref = PoolRef(layout.num_blocks, config.block_size, config.dtype,
                      mooncake_handle=handle.to_json(), kv_cache_dtype=config.kv_cache_dtype)
        task = PrefillTask("gpu-check-push", tuple(ids), 0, PD_BLOCKS, params_to_json(params),
                           ref)
        session = putter.session(ref.mooncake_handle, executor.layout_for(ref.num_blocks),
                                 layerwise=True)
        began = time.perf_counter()
        result = executor.submit_local(task, session).result(timeout=timeout_s)
        prefill_s = time.perf_counter() - began
        # the prompt is in the own prefix cache now: these are the blocks that were pushed
        own = executor.submit_owned("own", ids, params).result(timeout=timeout_s)
        sent = _prompt_kv(executor.pool, own.block_ids, len(ids))
        landed = _prompt_kv(decode_pool, PD_BLOCKS, len(ids))
        others = [b for b in range(layout.num_blocks) if b not in PD_BLOCKS]
        full = (len(ids) // config.block_size) * config.block_size  # the cached full blocks
        checks = {"full_blocks_landed_bit_for_bit": _digest(landed[:, :, :full])
                  == _digest(sent[:, :, :full]),
                  # the partial last block was recomputed for the comparison (the prefix cache
                  # holds full blocks only), in another batch shape: float32 rounding through
                  # 30 layers, so a bound relative to the largest value, ~100 float32 epsilons
                  "tail_matches_recomputed": float((landed - sent).abs().max())
                  <= 1e-5 * float(sent.abs().max()),
                  "bytes_are_the_blocks": result.handoff_bytes
                  == len(PD_BLOCKS) * layout.bytes_per_block,
                  "one_put_per_layer": session.num_calls == layout.shape.num_layers,
                  "other_blocks_untouched": all(not any(decode_pool.read_block(b))
                                                for b in others)}
        detail = {"device": device, "route": "mooncake", "location": handle.location,
                  "prompt_tokens": len(ids), "bytes_moved": result.handoff_bytes,
                  "num_puts": session.num_calls, "prefill_s": round(prefill_s, 6),
                  "handoff_s": result.handoff_s, "first_token": result.first_token_id,
                  "checks": checks}
        return ("passed" if all(checks.values()) else "failed"), detail
    finally:
        for part in (putter, engine, executor, decode_pool):
            if part is not None:
                part.close()


def _prompt_kv(pool: Any, block_ids: tuple[int, ...], num_tokens: int) -> Any:
    """[layers, 2, tokens, heads, dim] on the CPU: the prompt's K and V as ``pool`` holds them."""
    import torch

    ids = torch.tensor(block_ids, dtype=torch.long, device=pool.buffer.device)
    return torch.stack([torch.stack([pool.k_cache(layer)[ids].flatten(0, 1)[:num_tokens],
                                     pool.v_cache(layer)[ids].flatten(0, 1)[:num_tokens]])
                        for layer in range(pool.layout.shape.num_layers)]).cpu()


def _digest(kv: Any) -> str:
    import hashlib

    return hashlib.sha256(kv.contiguous().numpy().tobytes()).hexdigest()


# ---- MC2 ops over a world of ranks ----------------------------------------------------------------


def mc2_check(device: str, world: int, timeout_s: float) -> tuple[str, dict]:
    """Run ``world`` ranks of ``mc2_rank`` (this script again) on ``device`` and gather them."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = str(Path(__file__).resolve())
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    procs = [subprocess.Popen([sys.executable, script, "--mc2-child", device, str(rank),
                               str(world), str(port)], cwd=ROOT, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for rank in range(world)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:  # a rank left waiting for a dead peer is stopped, not leaked
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if any(proc.returncode != 0 for proc in procs):
        return "failed", {"tail": [out[-2000:] for out in outputs]}
    ranks = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    errors = {op: max(r["max_abs_error"][op] for r in ranks) for op in ranks[0]["max_abs_error"]}
    failures = [f for r in ranks for f in r["failures"]]
    return ("failed" if failures else "passed"), {
        "device": device, "world": world, "max_abs_error": errors,
        "tolerance": MC2_TOLERANCE, "failures": failures}


def mc2_rank(device: str, rank: int, world: int, port: int) -> dict:
    """One rank: each MC2 op (tiles 1 and 4) on ``device`` against a float64 CPU reference
    (the whole x @ w computed from every rank's inputs, which each rank can regenerate)."""
    import torch
    import torch.distributed as dist

    from mooncake_ops import mc2

    backend = {"cpu": "gloo", "cuda": "nccl"}[device]
    where = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(where)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(10 + r),
                          dtype=torch.float64) for r in range(world)]
        w = torch.randn(16, 12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
        want = {"matmul_all_reduce": sum(x @ w for x in xs),
                "all_gather_matmul": torch.cat(xs) @ w,
                "matmul_reduce_scatter": sum(x @ w for x in xs).chunk(world)[rank]}
        x, wd = xs[rank].to(where, torch.float32), w.to(where, torch.float32)
        errors: dict[str, float] = {}
        for tiles in (1, 4):
            for op, expected in want.items():
                got = getattr(mc2, op)(x, wd, num_tiles=tiles)
                error = float((got.double().cpu() - expected).abs().max())
                errors[op] = max(errors.get(op, 0.0), error)
        failures = [f"rank {rank} {op}: {e:.2e}" for op, e in errors.items()
                    if e > MC2_TOLERANCE]
        return {"rank": rank, "max_abs_error": errors, "failures": failures}
    finally:
        dist.destroy_process_group()


def _max_error(case: Callable[[Any, str, Any], tuple], device: str) -> float:
    """Largest |public op on ``device`` in float32 - its pure-PyTorch reference in float64|."""
    import torch

    import mooncake_ops
    from mooncake_ops.backends import reference

    got = case(mooncake_ops, device, torch.float32)
    want = case(reference, "cpu", torch.float64)
    return max(float((g.double().cpu() - w).abs().max()) for g, w in zip(got, want, strict=True))


def _parity_cases(torch: Any) -> dict[str, Callable[[Any, str, Any], tuple]]:
    """Each case builds its inputs once on the CPU, then runs ``ops`` on (device, dtype); the
    public ops and mooncake_ops.backends.reference share names and positional arguments."""
    num_blocks, block, kv_heads, heads, dim = 8, 16, 2, 4, 32
    base = {"q": torch.randn(3, heads, dim), "k": torch.randn(num_blocks, block, kv_heads, dim),
            "v": torch.randn(num_blocks, block, kv_heads, dim), "x": torch.randn(5, 64),
            "w": torch.randn(64), "gate": torch.randn(5, 128)}
    table = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 33], dtype=torch.int32)

    def put(name: str, device: str, dtype: Any) -> Any:
        return base[name].to(device=device, dtype=dtype)

    def decode(ops: Any, device: str, dtype: Any) -> tuple:
        return (ops.paged_decode_attention(put("q", device, dtype), put("k", device, dtype),
                                           put("v", device, dtype), table.to(device),
                                           lens.to(device), dim ** -0.5),)

    def norm(ops: Any, device: str, dtype: Any) -> tuple:
        return (ops.rms_norm(put("x", device, dtype), put("w", device, dtype), 1e-6),)

    def swiglu(ops: Any, device: str, dtype: Any) -> tuple:
        return (ops.silu_and_mul(put("gate", device, dtype)),)

    return {"paged_decode_attention": decode, "rms_norm": norm, "silu_and_mul": swiglu}


def validate_report(report: dict) -> list[str]:
    """Problems with a report's shape (empty when it follows the schema)."""
    problems = [] if report.get("schema") == SCHEMA else [f"schema is not {SCHEMA}"]
    for key in ("dry_run", "started", "machine", "steps", "ok"):
        if key not in report:
            problems.append(f"missing {key}")
    for step in report.get("steps", []):
        if set(step) != STEP_KEYS:
            problems.append(f"step {step.get('name')}: keys {sorted(step)}")
        if step.get("status") not in STATUSES:
            problems.append(f"step {step.get('name')}: status {step.get('status')!r}")
    return problems


def run_plan(args: argparse.Namespace, has_gpu: bool) -> list[dict]:
    steps = []
    for step in STEPS:
        entry = {"name": step.name, "description": step.description, "needs_gpu": step.needs_gpu,
                 "command": list(step.command) if step.command else None, "status": "planned",
                 "seconds": 0.0, "detail": {}, "reports": list(step.reports)}
        if step.name in args.skip:
            entry["status"] = "skipped"
        elif args.dry_run and step.name not in KNOWN_WITHOUT_GPU:
            pass
        elif step.needs_gpu and not has_gpu and step.name not in KNOWN_WITHOUT_GPU:
            entry["status"], entry["detail"] = "skipped", {"reason": "no CUDA device"}
        else:
            entry.update(_timed(step, args))
        steps.append(entry)
    return steps


def _timed(step: Step, args: argparse.Namespace) -> dict:
    began = time.monotonic()
    try:
        status, detail = step.run(args)  # type: ignore[misc]
    except Exception:  # a step's failure is reported, the next step still runs
        status, detail = "failed", {"error": traceback.format_exc()[-3000:]}
    return {"status": status, "detail": detail, "seconds": round(time.monotonic() - began, 2)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU work: parse, plan, write the report schema")
    p.add_argument("--out", default="gpu_check.json", help="report path (JSON)")
    p.add_argument("--skip", action="append", default=[], choices=[s.name for s in STEPS],
                   help="leave a step out (repeatable)")
    p.add_argument("--timeout-s", type=float, default=1800.0,
                   help="deadline of each subprocess step")
    # the child processes the PD and MC2 steps start (this script again, one role each)
    p.add_argument("--pd-prefill-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mc2-child", nargs=4, metavar=("DEVICE", "RANK", "WORLD", "PORT"),
                   help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.pd_prefill_child:
        print(json.dumps(pd_prefill_child(json.loads(sys.stdin.read()))))
        return 0
    if args.mc2_child:
        device, rank, world, port = args.mc2_child
        print(json.dumps(mc2_rank(device, int(rank), int(world), int(port))))
        return 0
    import torch

    has_gpu = torch.cuda.is_available()
    report = {"schema": SCHEMA, "dry_run": args.dry_run,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                          "platform": platform.platform()},
              "steps": run_plan(args, has_gpu)}
    report["ok"] = not any(s["status"] == "failed" for s in report["steps"])
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"gpu_check: report in {args.out} ({'dry run' if args.dry_run else 'ran'}; "
          f"ok={report['ok']})", file=sys.stderr)
    if not args.dry_run and not has_gpu:
        return 2
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
