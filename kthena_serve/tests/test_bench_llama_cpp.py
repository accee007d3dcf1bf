"""``--peer llama.cpp`` of ``kthena bench serve`` and ``kthena bench trace``.

Without a build (the suite never makes one: ~10+ minutes): the refusals, each naming what was
wrong and the build command; the server's command line; the case figures from recorded request
times; the GGUF cache. With the build of ``benchmarks/peers/build_llama_cpp.sh`` on this
machine (skipped, with the reason, otherwise): one tiny ``kthena bench serve --peer llama.cpp``
run against the real ``llama-server``, its JSON checked against itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kthena_core.cli import main as kthena_main
from kthena_serve.bench.llama_cpp import (
    BUILD_COMMAND,
    LLAMA_DIR,
    LlamaCppPeer,
    RequestTiming,
    case_figures,
    parse_llama_cpp,
    quantized_gguf,
    server_command,
    source_gguf,
)
from kthena_serve.bench.peer import PeerMissingError, PeerRunError

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "build_llama_cpp.sh"


def _serve(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kthena_core.cli", "bench", "serve", *argv],
                          capture_output=True, text=True, timeout=timeout)


# ---- refusals ----------------------------------------------------------------------------------
def test_a_missing_build_is_one_line_naming_the_build_command(tmp_path):
    done = _serve("--peer", f"llama.cpp={tmp_path / 'no-build'}", "--plot", "")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
    assert BUILD_COMMAND in done.stderr and str(tmp_path / "no-build" / "bin") in done.stderr
    assert "llama-server or llama-quantize" in done.stderr
    assert BUILD_SCRIPT.is_file()
    assert BUILD_COMMAND == "bash " + str(BUILD_SCRIPT.relative_to(BUILD_SCRIPT.parents[2]))


def test_a_folder_with_only_one_binary_names_the_other(tmp_path):
    (tmp_path / "bin").mkdir()
    os.symlink("/bin/true", tmp_path / "bin" / "llama-server")  # a real program, never run
    peer = LlamaCppPeer(gguf=Path("m.gguf"), folder=tmp_path)
    with pytest.raises(PeerMissingError, match=r"no llama-quantize in .*build them once with "
                       r"`bash benchmarks/peers/build_llama_cpp.sh`"):
        peer.check()


@pytest.mark.parametrize("argv, message", [
    (["--peer", "llama.cpp", "--peer-quant", "Q5_K"],
     "--peer-quant 'Q5_K': choose from shipped, Q8_0, F16"),
    (["--peer-quant", "F16"], "--peer-quant F16: only with --peer llama.cpp"),
    (["--peer", "llama.cpp="], "empty folder after '='"),
    (["--peer", "sglang"], "unknown peer 'sglang'; choose from vllm (optionally "
     "=/path/to/its/python) or llama.cpp"),
])
def test_bad_peer_flags_exit_2_with_the_reason(argv, message, capsys):
    assert kthena_main(["bench", "serve", *argv, "--plot", ""]) == 2
    assert message in capsys.readouterr().err


def test_a_model_that_is_not_a_gguf_is_refused(tmp_path):
    with pytest.raises(ValueError, match="llama.cpp reads GGUF files only; use --model default"):
        parse_llama_cpp("llama.cpp", "shipped", str(tmp_path))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert source_gguf(str(gguf)) == gguf
    assert source_gguf("default").name.endswith(".gguf")


def test_trace_refuses_a_missing_build_before_anything_starts(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 40,
                                         "output_length": 8, "hash_ids": [1]}) + "\n"
                             for i in range(2)))
    code = kthena_main(["bench", "trace", "--trace", str(trace), "--start", "0", "--count", "2",
                        "--peer", f"llama.cpp={tmp_path / 'no-build'}",
                        "--keep", str(tmp_path / "work")])
    err = capsys.readouterr().err
    assert code == 2 and BUILD_COMMAND in err and "no-build" in err, err
    assert not (tmp_path / "work").exists()  # refused before the work folder


@pytest.mark.parametrize("argv, message", [
    (["--peer", "sglang"], "--peer 'sglang': choose vllm or llama.cpp"),
    (["--peer", "vllm=/x"], "--peer 'vllm=/x': choose vllm or llama.cpp"),
    (["--peer", "vllm", "--peer-quant", "F16"], "--peer-quant F16: only with --peer llama.cpp"),
])
def test_trace_peer_flags_are_checked(tmp_path, capsys, argv, message):
    code = kthena_main(["bench", "trace", "--trace", str(tmp_path / "t.jsonl"), *argv])
    assert code == 2 and message in capsys.readouterr().err


# ---- the server and the figures ----------------------------------------------------------------
def test_server_listens_on_loopback_with_one_thread_per_core():
    argv = server_command(Path("/b/llama-server"), Path("/m.gguf"), 4321, 3, 32, "m")
    text = " ".join(argv)
    assert argv[0] == "/b/llama-server"
    for part in ("--model /m.gguf", "--host 127.0.0.1 --port 4321", "--threads 3",
                 "--threads-batch 3", "--parallel 32", "--ctx-size 65536",  # 32 x 2048
                 "--cache-ram 0", "--alias m"):
        assert part in text
    assert "--slot-save-path" not in text
    erasable = server_command(Path("s"), Path("m"), 1, 1, 4, "m", slot_tokens=100,
                              slot_folder=Path("/tmp/x"))
    assert "--ctx-size 400" in " ".join(erasable)
    assert "--slot-save-path /tmp/x" in " ".join(erasable)


def test_case_figures_are_computed_as_ours_from_request_times():
    # batch 1 from t=10: first token at 10.5, 9 tokens in all, the last at 12.5
    one = [RequestTiming(10.0, 10.5, 12.5, 9, 128)]
    assert case_figures("a_batch1", 10.0, one) == {"ttft_s": 0.5, "decode_tok_s": 4.0}
    two = [RequestTiming(0.0, 1.0, 3.0, 4, 100), RequestTiming(0.0, 2.0, 5.0, 4, 30)]
    assert case_figures("b_offline", 0.0, two) == {"total_s": 5.0, "output_tok_s": 1.6}
    assert case_figures("c_shared_prefix_reuse", 0.0, two) == {
        "total_s": 5.0, "mean_ttft_s": 1.5, "computed_prompt_tokens": 130}


def test_shipped_is_the_gguf_itself_and_a_made_quant_is_reused(tmp_path):
    source = tmp_path / "SmolLM2.Q4_1.gguf"
    source.write_bytes(b"GGUF")
    assert quantized_gguf(LlamaCppPeer(gguf=source, folder=tmp_path)) == source
    cached = tmp_path / "models" / "SmolLM2.Q8_0.gguf"
    cached.parent.mkdir()
    cached.write_bytes(b"GGUF")  # made before: llama-quantize (absent here) is not run again
    assert quantized_gguf(LlamaCppPeer(gguf=source, quant="Q8_0", folder=tmp_path)) == cached


def test_a_failing_quantize_is_one_error_and_leaves_no_file(tmp_path):
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    (tmp_path / "bin").mkdir()
    os.symlink("/bin/false", tmp_path / "bin" / "llama-quantize")  # a real program, exits 1
    with pytest.raises(PeerRunError, match="llama-quantize exited with 1"):
        quantized_gguf(LlamaCppPeer(gguf=source, quant="F16", folder=tmp_path))
    assert list((tmp_path / "models").iterdir()) == []


# ---- one run against the real llama-server ---------------------------------------------------
def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_bench_serve_against_the_real_llama_server(tmp_path):
    if not (LLAMA_DIR / "bin" / "llama-server").is_file():
        pytest.skip(f"no llama.cpp build in {LLAMA_DIR} (`{BUILD_COMMAND}` makes one in ~10+ "
                    "minutes; the suite never builds it)")
    done = _serve("--peer", "llama.cpp", "--cases", "a", "--runs", "1", "--no-hf",
                  "--no-collectives", "--plot", "", "--threads", "1", timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    ours, theirs = result["kthena"]["a_batch1"], result["llama.cpp"]["a_batch1"]
    assert theirs["ttft_s"] > 0 and theirs["decode_tok_s"] > 0
    # the ratios are the run's own figures over each other (rounded as the bench rounds)
    ratios = result["speedup_vs"]["llama.cpp"]["a_batch1"]
    assert ratios["decode_tok_s"] == pytest.approx(ours["decode_tok_s"] / theirs["decode_tok_s"],
                                                   rel=0.02)
    run = result["machine"]["llama.cpp_run"]
    assert run["file_type"] and "Q4_1" in run["file_type"]  # as the server's log says
    assert run["threads"] == 1 and "--threads" in run["command"]
    assert result["machine"]["cpu"]
    port = int(run["command"][run["command"].index("--port") + 1])
    assert not _listening(port)  # the server is gone


def test_trace_starts_llama_server_first_with_the_users_environment(monkeypatch, tmp_path):
    from kthena_serve.bench.trace import TRACE_SLOT_TOKENS, TRACE_SLOTS, TraceOptions, _sides
    from kthena_serve.engine import threads

    monkeypatch.setattr(threads, "_defaulted", True)  # as if this process set PASSIVE itself
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    options = TraceOptions(trace=Path("t"), peer="llama.cpp", llama_cpp_dir=tmp_path)
    peer = LlamaCppPeer(gguf=Path("/m.gguf"), folder=tmp_path)
    sides = _sides(options, Path("py"), Path("ckpt"), "ckpt", peer, Path("/m.Q8_0.gguf"))
    assert [side.name for side in sides] == ["llama.cpp", "kthena"]
    llama = sides[0]
    assert llama.server[0] == str(tmp_path / "bin" / "llama-server")
    text = " ".join(llama.server)
    assert "--model /m.Q8_0.gguf" in text and "--alias ckpt" in text
    assert f"--parallel {TRACE_SLOTS}" in text and "--host 127.0.0.1" in text
    assert f"--ctx-size {TRACE_SLOTS * TRACE_SLOT_TOKENS}" in text
    assert llama.base_url.startswith("http://127.0.0.1:")
    assert "OMP_WAIT_POLICY" not in llama.env


def test_trace_options_refuse_an_unknown_peer():
    from kthena_serve.bench.trace import TraceOptions

    with pytest.raises(ValueError, match="'peer' must be in"):
        TraceOptions(trace=Path("t"), peer="sglang")


def _serving_workloads():
    """benchmarks/peers/serving_workloads.py as a module (it is a script, not a package)."""
    import importlib.util

    path = BUILD_SCRIPT.parent / "serving_workloads.py"
    spec = importlib.util.spec_from_file_location("serving_workloads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serving_workloads_pairs_are_checked():
    sw = _serving_workloads()
    assert sw.parse_pairs("bf16:F16, gguf:shipped") == [("bf16", "F16"), ("gguf", "shipped")]
    for bad, named in (("bf16", "'bf16'"), ("fp8:F16", "'fp8:F16'"), ("int8:Q4_K", "'int8:Q4_K'")):
        with pytest.raises(ValueError, match=f"--pairs entry {named}: want OURS:THEIRS"):
            sw.parse_pairs(bad)
    with pytest.raises(ValueError, match="--pairs is empty"):
        sw.parse_pairs(" , ")
    done = subprocess.run([sys.executable, str(BUILD_SCRIPT.parent / "serving_workloads.py"),
                           "--compare", "--rounds", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--rounds must be at least 1, got 0" in done.stderr


def test_serving_workloads_variants_are_checked():
    sw = _serving_workloads()
    assert sw.parse_variants(["process=", "thread=--no-engine-process --kernels native"]) == {
        "process": [], "thread": ["--no-engine-process", "--kernels", "native"]}
    for bad, named in ((["a=", "b"], "'b'"), (["a=", "a=--x"], "'a=--x'"), (["=", "b="], "'='")):
        with pytest.raises(ValueError, match=f"--variant {named}: want NAME=FLAGS"):
            sw.parse_variants(bad)
    with pytest.raises(ValueError, match="at least two to compare, got 1"):
        sw.parse_variants(["only="])
    script = str(BUILD_SCRIPT.parent / "serving_workloads.py")
    for extra, message in ((["--workloads", "c9"], "--workloads takes batch1_128_128"),
                           (["--compare"], "--variant compares our server with itself")):
        done = subprocess.run([sys.executable, script, "--variant", "a=", "--variant", "b=",
                               *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_serving_workloads_summary_takes_medians_and_orients_ratios():
    """Ratios are of the medians over rounds, ours over theirs with higher better: a time
    (TPOT, TTFT) is divided the other way from a rate (tokens/s)."""
    sw = _serving_workloads()

    def run(system, quant, tpot, tok_s, ttft):
        return {"system": system, "quant": quant, "workloads": {
            "batch1_128_128": {"tpot_p50_ms": tpot}, "c32_64x128_64": {"output_tok_s": tok_s},
            "c4_16x1024_16": {"ttft_p50_ms": ttft}}}

    runs = [run("kthena", "bf16", 10.0, 300.0, 1000.0), run("kthena", "bf16", 9.0, 330.0, 900.0),
            run("kthena", "bf16", 50.0, 100.0, 5000.0),  # a round a neighbour spoiled
            run("llama.cpp", "F16", 12.0, 150.0, 5000.0), run("llama.cpp", "F16", 11.0, 160.0, 4000.0),
            run("llama.cpp", "F16", 13.0, 140.0, 6000.0), run("llama.cpp", "Q8_0", 8.0, 170.0, 3000.0)]
    summary = sw.summarize(runs, [("bf16", "F16"), ("int8", "Q8_0")])
    assert summary["medians"]["kthena:bf16"] == {
        "batch1_128_128": 10.0, "c32_64x128_64": 300.0, "c4_16x1024_16": 1000.0}
    assert summary["ratios"] == {"bf16:F16": {  # int8 never ran: no ratio for it
        "batch1_128_128": 1.2, "c32_64x128_64": 2.0, "c4_16x1024_16": 5.0}}
