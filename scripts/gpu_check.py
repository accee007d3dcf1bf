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
    pd_device_pools         unsupported: PD decode workers keep their KV pool in host shared
                            memory (create_pool refuses a shared pool off the CPU), so there is
                            no device-resident PD hand-off to run; reported, never faked
    bench_serve             kthena bench serve --device cuda (engine only; JSON kept)

``--dry-run`` runs only what needs no GPU (argument parsing, the environment step, the plan)
and writes a report whose other steps are ``planned``; the test suite runs it so the plan and
the schema cannot rot. Statuses: planned, passed, failed, skipped, unsupported. Exit status 0
when no step failed, 1 when one did, 2 when a real run finds no CUDA device.
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
SCHEMA = "kthena.gpu_check/1"
STATUSES = ("planned", "passed", "failed", "skipped", "unsupported")
STEP_KEYS = {"name", "description", "needs_gpu", "command", "status", "seconds", "detail"}
PD_DEVICE_POOLS = ("PD decode workers create their KV pool in POSIX shared memory on the host "
                   "(kthena_serve.model_runner.create_pool refuses shared=True with a device "
                   "other than cpu), and the mooncake transport registers that host pool; the "
                   "engine has no device-resident PD pool to hand off")


@dataclass(frozen=True)
class Step:
    name: str
    description: str
    needs_gpu: bool
    command: tuple[str, ...] | None = None
    run: Callable[[argparse.Namespace], tuple[str, dict]] | None = field(default=None,
                                                                       compare=False)


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
    return "unsupported", {"reason": PD_DEVICE_POOLS}


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
    Step("pd_device_pools", "PD hand-off with device-resident KV pools", True,
         run=pd_device_pools),
    Step("bench_serve", "kthena bench serve on cuda (engine only)", True, BENCH, bench_serve),
)
KNOWN_WITHOUT_GPU = {"environment", "pd_device_pools"}


# ---- helpers --------------------------------------------------------------------------------------
def _run(command: tuple[str, ...], timeout_s: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


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
                 "seconds": 0.0, "detail": {}}
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
