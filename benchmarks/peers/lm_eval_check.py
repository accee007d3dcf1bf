"""lm-eval as the judge: the same two small tasks scored against ``kthena serve`` (lm-eval's
``local-completions`` and ``local-chat-completions``) and against lm-eval's own ``hf`` model on
the same checkpoint, both in fp32; the scores must be equal.

    python3 benchmarks/peers/lm_eval_check.py [--build] [--json OUT.json]

* ``kthena_mc``: multiple choice (lm-eval's loglikelihood requests: ``echo`` + ``logprobs`` on
  context + continuation, its ``acc`` and ``acc_norm``), 24 arithmetic questions of 4 choices;
* ``kthena_gen``: ``generate_until`` (greedy, stop at a newline), 16 questions, scored by
  exact match of the first line (a task-local ``process_results``: lm-eval's own exact_match
  loads a metric from the Hugging Face hub, which is unreachable here).

The tasks are written by this script into a temporary folder (no hub download). lm-eval runs
from its own venv (``--build`` makes it: ``benchmarks/peers/.venv-lmeval`` with
``torch==2.13.0`` first, then ``lm-eval[api,hf]==0.4.*``); ``kthena serve`` from this repository's
``.venv`` on a free loopback port, with ``--dtype float32``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
VENV = HERE / ".venv-lmeval"
SERVED = "SmolLM2-135M-Instruct"

_MC_YAML = """task: kthena_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""

_GEN_YAML = """task: kthena_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
process_results: !function utils.process_results
metric_list:
  - metric: exact
    aggregation: mean
    higher_is_better: true
"""

_UTILS = '''def process_results(doc, results):
    return {"exact": float(results[0].strip() == doc["answer"].strip())}
'''


def write_tasks(folder: Path, seed: int = 7) -> None:
    """The two tasks' YAML, data and utils into ``folder`` (deterministic)."""
    rng = random.Random(seed)
    mc, gen = [], []
    for _ in range(24):
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        wrong = rng.sample([a + b + d for d in (-3, -2, -1, 1, 2, 3, 10)], 3)
        choices = [f" {a + b}"] + [f" {w}" for w in wrong]
        rng.shuffle(choices)
        mc.append({"question": f"What is {a} plus {b}?", "choices": choices,
                   "answer": choices.index(f" {a + b}")})
    for _ in range(16):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        gen.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    for name, rows in (("mc.jsonl", mc), ("gen.jsonl", gen)):
        (folder / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "kthena_mc.yaml").write_text(_MC_YAML.format(data=folder / "mc.jsonl"))
    (folder / "kthena_gen.yaml").write_text(_GEN_YAML.format(data=folder / "gen.jsonl"))
    (folder / "utils.py").write_text(_UTILS)


def build(venv: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)  # first: no CUDA build is pulled
    subprocess.run([*pip, "lm-eval[api,hf]==0.4.*"], check=True)  # [api]: local-completions; [hf]: the reference


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kthena serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"kthena serve was not ready within {timeout} s")


def _lm_eval(venv: Path, tasks: Path, out: Path, model: str, model_args: str,
             extra: list[str], names: str = "kthena_mc,kthena_gen") -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OPENAI_API_KEY": "unused"}
    command = [str(venv / "bin" / "lm_eval"), "--model", model, "--model_args", model_args,
               "--tasks", names, "--include_path", str(tasks),
               "--output_path", str(out), "--seed", "0", "--log_samples", *extra]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval {model} failed ({done.returncode}):\n"
                           + "\n".join((done.stdout + done.stderr).splitlines()[-30:]))
    found = sorted(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    results = json.loads(found[-1].read_text())["results"]
    scores = {task: {k.split(",")[0]: v for k, v in metrics.items()
                     if not k.startswith("alias") and "stderr" not in k}
              for task, metrics in results.items()}
    return {"scores": scores, "samples": _samples(out)}


def _samples(out: Path) -> dict:
    """Per task, per doc: the generated text, or each choice's loglikelihood."""
    found: dict[str, dict[int, object]] = {}
    for path in out.rglob("samples_*.jsonl"):
        task = path.name.removeprefix("samples_").rsplit("_", 1)[0]
        for line in path.read_text().splitlines():
            row = json.loads(line)
            resps = row["filtered_resps"]
            found.setdefault(task, {})[row["doc_id"]] = (
                resps[0] if isinstance(resps[0], str) else [float(r[0]) for r in resps])
    return found


def compare(served: dict, reference: dict) -> dict:
    """Equal scores, equal generated texts, equal picks, and the largest loglikelihood gap."""
    texts_equal, picks_equal, gap = True, True, 0.0
    for task, docs in reference["samples"].items():
        for doc, expected in docs.items():
            got = served["samples"].get(task, {}).get(doc)
            if isinstance(expected, str):
                texts_equal &= got == expected
            elif got is None:
                picks_equal = False
            else:
                picks_equal &= got.index(max(got)) == expected.index(max(expected))
                gap = max(gap, *(abs(a - b) for a, b in zip(got, expected, strict=True)))
    return {"scores_equal": served["scores"] == reference["scores"],
            "generated_texts_equal": texts_equal, "choices_picked_equal": picks_equal,
            "max_loglikelihood_gap": gap}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=VENV)
    parser.add_argument("--build", action="store_true", help="make the lm-eval venv first")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    if args.build and not (args.venv / "bin" / "lm_eval").exists():
        build(args.venv)
    if not (args.venv / "bin" / "lm_eval").exists():
        print(f"lm_eval_check: no lm-eval in {args.venv}; run with --build", file=sys.stderr)
        return 2
    checkpoint = Path(subprocess.run(
        [str(ROOT / ".venv" / "bin" / "python"), "-c",
         "from kthena_serve.model import resolve_checkpoint; print(resolve_checkpoint('default'))"],
        capture_output=True, text=True, check=True).stdout.strip())
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="kthena-lmeval-") as tmp:
        tasks, work = Path(tmp) / "tasks", Path(tmp)
        tasks.mkdir()
        write_tasks(tasks)
        server = subprocess.Popen(
            [str(ROOT / ".venv" / "bin" / "kthena"), "serve", "--model", str(checkpoint),
             "--served-model-name", SERVED, "--dtype", "float32", "--port", str(port),
             "--disable-log-stats"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            _wait_ready(url, server)
            common = f"model={SERVED},tokenizer_backend=huggingface,tokenizer={checkpoint}," \
                     "num_concurrent=1,max_retries=1"
            served = _lm_eval(args.venv, tasks, work / "served", "local-completions",
                              f"{common},base_url={url}/v1/completions", [])
            chat = _lm_eval(args.venv, tasks, work / "chat", "local-chat-completions",
                            f"{common},base_url={url}/v1/chat/completions",
                            ["--apply_chat_template"], "kthena_gen")
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        hf = f"pretrained={checkpoint},dtype=float32"
        reference = _lm_eval(args.venv, tasks, work / "hf", "hf", hf,
                             ["--device", "cpu", "--batch_size", "1"])
        chat_reference = _lm_eval(args.venv, tasks, work / "hf-chat", "hf", hf,
                                  ["--device", "cpu", "--batch_size", "1",
                                   "--apply_chat_template"], "kthena_gen")
    completions, chats = compare(served, reference), compare(chat, chat_reference)
    same = all(v for k, v in {**completions, **chats}.items() if k != "max_loglikelihood_gap")
    result = {"check": "lm-eval: kthena serve vs hf (fp32)",
              "served": served["scores"], "hf": reference["scores"],
              "served_chat": chat["scores"], "hf_chat": chat_reference["scores"],
              "completions": completions, "chat": chats,
              "generated": {k: list(v.values())[:4] for k, v in served["samples"].items()
                            if k == "kthena_gen"}, "equal": same}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
