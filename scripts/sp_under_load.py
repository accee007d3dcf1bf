"""Served TP2 + SP2 runs under load, each server's log kept: the search for the one 500 an
operator saw from SP at TP = 2 on a machine other jobs loaded (issue 53).

    python scripts/sp_under_load.py [--runs 20] [--load 2] [--logs DIR]

Each run starts ``kthena serve --tp 2 --sp 2 --sp-min-tokens 16`` on a tiny fp32 checkpoint
with the uneven head split (9 heads, 3 KV heads), sends three long prompts at once (83, 400 and
900 tokens), compares every answer with a one-rank engine's greedy text, stops the server and
keeps its whole output in ``DIR/server_N.log``. ``--load N`` starts N busy processes for the
duration (the "other jobs"); they are stopped at the end, whatever happens. Prints one JSON
line per run (statuses, whether all answers matched, the 1-minute load) and a summary; exits
1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "kthena_serve" / "tests"), str(ROOT / "tests")]

PROMPT_LENGTHS = (83, 400, 900)
UNEVEN_HEADS = {"num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 8,
                "hidden_size": 72, "intermediate_size": 144}  # test_sp.py's checkpoint


def _busy() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _one_run(checkpoint: Path, prompts: list[list[int]], expected: list[str], log: Path) -> dict:
    import httpx
    from _serve_process import start_serve

    proc, url, text = start_serve("--model", str(checkpoint), "--port", "0", "--dtype",
                                  "float32", "--kv-cache-memory", "32MiB", "--tp", "2",
                                  "--sp", "2", "--sp-min-tokens", "16", timeout=300)
    try:
        def ask(prompt: list[int]) -> tuple[int, str]:
            reply = httpx.post(f"{url}/v1/completions", timeout=300,
                               json={"model": "default", "prompt": prompt, "max_tokens": 8,
                                     "temperature": 0})
            ok = reply.status_code == 200
            return reply.status_code, reply.json()["choices"][0]["text"] if ok else reply.text

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, prompts))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        log.write_text(text + (rest or ""))
    return {"status": [s for s, _ in answers],
            "ok": all(s == 200 and t == e for (s, t), e in zip(answers, expected, strict=True)),
            "load_1min": os.getloadavg()[0], "log": str(log)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--load", type=int, default=2, help="busy processes beside the runs")
    parser.add_argument("--logs", default=None, help="folder for the server logs (default: a "
                                                     "new temporary folder, printed)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from _tiny import tiny_checkpoint

    from kthena_serve.engine.sampling_params import SamplingParams
    from kthena_serve.llm import LLM

    logs = Path(args.logs or tempfile.mkdtemp(prefix="sp-under-load-"))
    logs.mkdir(parents=True, exist_ok=True)
    checkpoint = tiny_checkpoint(logs / "checkpoint", **UNEVEN_HEADS)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    llm = LLM(str(checkpoint), dtype="float32", num_kv_blocks=256, num_threads=1)
    try:
        expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=8,
                                                                         temperature=0))]
    finally:
        llm.close()
    load = [_busy() for _ in range(args.load)]
    passed = 0
    try:
        for run in range(1, args.runs + 1):
            result = {"run": run, **_one_run(checkpoint, prompts, expected,
                                             logs / f"server_{run}.log")}
            passed += result["ok"]
            print(json.dumps(result), flush=True)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()
    print(json.dumps({"passed": passed, "runs": args.runs, "logs": str(logs)}), flush=True)
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
