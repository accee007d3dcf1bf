"""``kthena bench trace``: the window and its scaling on small traces written here, the
command's argument errors, the report (figures, ratios, table, CDFs) on a vLLM-style result
built the way vLLM's client builds it, and one replay of 4 requests against ``kthena serve``
with vLLM's client (skipped where the peer venv, which holds that client, is not built).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kthena_core.cli import main as kthena_main
from kthena_serve.bench import trace_report
from kthena_serve.bench.trace import DEFAULT_PEER_VENV, TraceOptions, client_command
from kthena_serve.bench.trace_report import (
    markdown_table,
    ours_vs_peer,
    per_request,
    percentile,
    percentile_check,
    plot_cdfs,
    side_figures,
)
from kthena_serve.bench.trace_window import (
    TraceError,
    TraceScaling,
    read_window,
    scale_window,
    window_stats,
    write_trace,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


ROWS = [  # a prefix [1, 2] shared by the 2nd and 3rd requests, as in Mooncake's traces
    {"timestamp": 272000, "input_length": 700, "output_length": 10, "hash_ids": [7, 8]},
    {"timestamp": 272868, "input_length": 1100, "output_length": 0, "hash_ids": [1, 2, 3]},
    {"timestamp": 273000, "input_length": 1536, "output_length": 1000, "hash_ids": [1, 2, 4]},
    {"timestamp": 280000, "input_length": 10, "output_length": 12, "hash_ids": [5]},
    {"timestamp": 280001, "input_length": 3, "output_length": 4, "hash_ids": [9]},
]
SCALING = TraceScaling(start=1, count=3, block_tokens=16, output_scale=0.125, output_cap=64,
                       time_scale=0.002)


# ---- the window and its scaling ----------------------------------------------------------------
def test_window_is_scaled_block_by_block_and_shared_prefixes_stay_shared(tmp_path):
    window = read_window(_trace(tmp_path / "t.jsonl", ROWS), SCALING.start, SCALING.count)
    scaled = scale_window(window, SCALING)
    assert [row["hash_ids"] for row in scaled] == [[1, 2, 3], [1, 2, 4], [5]]
    # 2 full blocks of 16, then the partial last block's fraction: 76/512 * 16 = 2.4 -> 2;
    # 512/512 -> 16; a 10-token single block -> 0.3 -> at least 1
    assert [row["input_length"] for row in scaled] == [34, 48, 1]
    for row in scaled:  # vLLM's client expands every id but the last into full blocks
        blocks = len(row["hash_ids"])
        assert (blocks - 1) * 16 < row["input_length"] <= blocks * 16


def test_outputs_are_scaled_half_up_capped_and_at_least_one():
    rows = [{"timestamp": i, "input_length": 1, "output_length": n, "hash_ids": [i]}
            for i, n in enumerate([0, 4, 12, 1000, 11])]
    scaled = scale_window(rows, SCALING)
    # 0 -> 1 (at least one), 0.5 -> 1, 1.5 -> 2 (half up), 125 -> 64 (cap), 1.375 -> 1
    assert [row["output_length"] for row in scaled] == [1, 1, 2, 64, 1]


def test_timestamps_are_rebased_to_the_window_and_scaled_to_replay_ms(tmp_path):
    window = read_window(_trace(tmp_path / "t.jsonl", ROWS), 1, 3)
    scaled = scale_window(window, SCALING)
    # (t - 272868) ms x 0.002 s/ms = replay seconds, written back in ms
    assert [row["timestamp"] for row in scaled] == [0, 264.0, 14264.0]
    stats = window_stats(scaled)
    assert stats == {"num_requests": 3, "prompt_tokens": 83, "output_tokens": 1 + 64 + 2,
                     "arrival_span_s": 14.264, "num_blocks": 7, "num_distinct_blocks": 5}


def test_the_scaled_window_is_written_in_the_trace_format(tmp_path):
    scaled = scale_window(read_window(_trace(tmp_path / "t.jsonl", ROWS), 0, 5), SCALING)
    write_trace(scaled, tmp_path / "w.jsonl")
    assert read_window(tmp_path / "w.jsonl", 0, 5) == scaled


def test_bad_traces_and_windows_are_named(tmp_path):
    path = _trace(tmp_path / "t.jsonl", ROWS)
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_window(tmp_path / "missing.jsonl", 0, 1)
    with pytest.raises(TraceError, match=r"ends at request 5, but .* has 5 requests \(0..4\)"):
        read_window(path, 3, 3)
    bad = _trace(tmp_path / "bad.jsonl", [ROWS[0], {"timestamp": 1, "input_length": 5}])
    with pytest.raises(TraceError, match=r"bad.jsonl:2: not a Mooncake trace request"):
        read_window(bad, 0, 2)
    (tmp_path / "text.jsonl").write_text("{\nnot json\n", encoding="utf-8")
    with pytest.raises(TraceError, match=r"text.jsonl:1: not JSON"):
        read_window(tmp_path / "text.jsonl", 0, 1)
    with pytest.raises(TraceError, match="arrival order"):
        scale_window([ROWS[2], ROWS[1]], SCALING)


@pytest.mark.parametrize("field, value, message", [
    ("count", 0, "--count must be positive"),
    ("block_tokens", 0, "--block-tokens must be positive"),
    ("output_scale", -0.5, "--output-scale must be positive"),
    ("output_cap", 0, "--output-cap must be positive"),
    ("time_scale", 0.0, "--time-scale must be positive"),
    ("start", -1, "--start must be 0 or more"),
])
def test_scaling_refuses_non_positive_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        TraceScaling(**{field: value})


# ---- the command's errors (nothing is started) -------------------------------------------------
def _bench(capsys, *argv: str) -> tuple[int, str]:
    code = kthena_main(["bench", "trace", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--time-scale", "0"], "--time-scale must be positive"),
    (["--output-scale", "-1"], "--output-scale must be positive"),
    (["--count", "0"], "--count must be positive"),
    (["--start", "4", "--count", "2"], "the window ends at request 5"),
    (["--kthena-arg=--port=9"], "--port is set by the bench"),
    (["--kthena-arg=max-num-seqs"], "one flag per --kthena-arg"),
])
def test_bad_arguments_exit_2_with_the_reason(tmp_path, capsys, argv, message):
    path = _trace(tmp_path / "t.jsonl", ROWS)
    code, err = _bench(capsys, "--trace", str(path), "--start", "0", "--count", "3", *argv)
    assert code == 2 and message in err, err


def test_a_missing_trace_file_is_named(tmp_path, capsys):
    code, err = _bench(capsys, "--trace", str(tmp_path / "nope.jsonl"))
    assert code == 2 and "nope.jsonl: no such file" in err


def test_a_missing_peer_venv_names_its_build_command(tmp_path, capsys):
    path = _trace(tmp_path / "t.jsonl", ROWS)
    code, err = _bench(capsys, "--trace", str(path), "--start", "0", "--count", "2",
                       "--peer", "vllm", "--peer-venv", str(tmp_path / "no-venv"))
    assert code == 2, err
    assert "python3 benchmarks/peers/build_vllm_venv.py" in err and "no-venv" in err


def test_plot_without_matplotlib_is_refused_before_anything_starts(tmp_path, capsys,
                                                                  monkeypatch):
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").touch()  # found; never run on this path
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    code, err = _bench(capsys, "--trace", str(_trace(tmp_path / "t.jsonl", ROWS)), "--start",
                       "0", "--count", "2", "--peer-venv", str(tmp_path / "venv"),
                       "--plot", str(tmp_path / "cdf.png"))
    assert code == 2 and "--plot needs matplotlib" in err, err


def test_the_trace_flag_is_required(capsys):
    with pytest.raises(SystemExit) as exit_info:
        kthena_main(["bench", "trace"])
    assert exit_info.value.code == 2
    assert "--trace" in capsys.readouterr().err


def test_the_client_gets_vllms_timed_trace_flags(tmp_path):
    argv = client_command(Path("/venv/bin/python"), "http://127.0.0.1:5", "m", Path("/ckpt"),
                          tmp_path / "w.jsonl", SCALING, tmp_path / "r.json")
    text = " ".join(argv)
    for part in ("bench serve --backend openai --base-url http://127.0.0.1:5",
                 "--endpoint /v1/completions --model m --tokenizer /ckpt",
                 "--dataset-name timed_trace", "--timed-trace-chunk-hash-size 16",
                 "--timed-trace-sec-multiplier 0.001", "--num-prompts 3",
                 "--ignore-eos --temperature 0", "--percentile-metrics ttft,tpot,itl,e2el",
                 "--metric-percentiles 50,90,99", "--save-result --save-detailed"):
        assert part in text
    assert argv[1].endswith("benchmarks/peers/vllm_cli.py")


def test_options_keep_kthena_args_in_order():
    options = TraceOptions(trace=Path("t"), kthena_args=("--max-num-batched-tokens=512",
                                                          "--no-prefix-caching"))
    assert options.kthena_args == ("--max-num-batched-tokens=512", "--no-prefix-caching")


def test_servers_get_the_users_environment_without_the_policy_we_set(monkeypatch):
    """Both servers start as from a shell: a PASSIVE this process set for itself
    (`threads.in_process_wait_policy`) is left out (`kthena serve` then keeps OpenMP's default
    spin), a value the user exported is passed on, and our API key never reaches the servers."""
    from kthena_serve.bench.trace import _sides
    from kthena_serve.engine import threads

    options = TraceOptions(trace=Path("t"), peer="vllm")
    monkeypatch.setenv("KTHENA_API_KEY", "secret")
    for defaulted, expected in ((True, None), (False, "PASSIVE")):
        monkeypatch.setattr(threads, "_defaulted", defaulted)
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        sides = {side.name: side for side in _sides(options, Path("py"), Path("m"), "m")}
        assert set(sides) == {"vllm", "kthena"}
        for side in sides.values():
            assert side.env.get("OMP_WAIT_POLICY") == expected, (side.name, defaulted)
        assert "KTHENA_API_KEY" not in sides["kthena"].env
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"  # this process's own is untouched


# ---- the report --------------------------------------------------------------------------------
def vllm_style_result(ttfts: list[float], itls: list[list[float]], failed: int = 0) -> dict:
    """A result dict as ``vllm bench serve --save-result --save-detailed`` writes it, its summary
    computed as vLLM's ``calculate_metrics`` does (numpy), plus ``failed`` failed requests."""
    latencies = [t + sum(gaps) for t, gaps in zip(ttfts, itls, strict=True)]
    lens = [len(gaps) + 1 for gaps in itls]
    tpots = [(lat - t) / (n - 1) for t, lat, n in zip(ttfts, latencies, lens, strict=True)
             if n > 1]
    values = {"ttft": ttfts, "tpot": tpots, "itl": [g for gaps in itls for g in gaps],
              "e2el": latencies}
    duration = 10.0
    result = {"duration": duration, "completed": len(ttfts), "failed": failed,
              "total_input_tokens": 100 * len(ttfts), "total_output_tokens": sum(lens),
              "request_throughput": len(ttfts) / duration,
              "output_throughput": sum(lens) / duration,
              "ttfts": ttfts + [0.0] * failed, "itls": itls + [[]] * failed,
              "latencies": latencies + [0.0] * failed, "output_lens": lens + [0] * failed,
              "errors": [""] * len(ttfts) + ["HTTP 500"] * failed}
    for name, xs in values.items():
        result[f"mean_{name}_ms"] = float(np.mean(xs) * 1000)
        for p in (50, 90, 99):
            result[f"p{p}_{name}_ms"] = float(np.percentile(xs, p) * 1000)
    return result


OURS = vllm_style_result([0.2, 0.4, 0.1, 0.3], [[0.05, 0.05], [0.1], [0.02, 0.03, 0.04], []],
                         failed=1)
PEER = vllm_style_result([0.1, 0.2, 0.1, 0.1], [[0.1, 0.1], [0.05], [0.05, 0.05, 0.05], []])


def test_percentile_is_numpys_linear_interpolation():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 160):
        xs = list(rng.exponential(size=n))
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)
    assert percentile([], 50) == 0.0


def test_per_request_lists_reproduce_vllms_summary():
    lists = per_request(OURS)
    assert lists["ttft"] == [0.2, 0.4, 0.1, 0.3]  # the failed request is left out
    assert lists["tpot"] == pytest.approx([0.05, 0.1, 0.03])  # (latency - ttft) / (n - 1)
    check = percentile_check(OURS, lists)
    assert check["agrees"] and check["max_rel_diff"] < 1e-12  # float rounding only
    assert trace_report.error_counts(OURS) == {"HTTP 500": 1}
    assert trace_report.error_counts(PEER) == {}
    tampered = {**OURS, "p99_ttft_ms": OURS["p99_ttft_ms"] * 1.01}
    assert percentile_check(tampered, lists)["agrees"] is False


def test_figures_and_ratios_read_higher_is_better_for_ours():
    ours, peer = side_figures(OURS), side_figures(PEER)
    assert ours["completed"] == 4 and ours["failed"] == 1
    assert ours["ttft_ms"]["p50"] == pytest.approx(250.0)
    ratios = ours_vs_peer(ours, peer)
    # latencies: the peer's / ours (TTFT p50 100 / 250 ms); throughput: ours / the peer's
    assert ratios["ttft_ms"]["p50"] == pytest.approx(0.4)
    assert ratios["output_throughput_tok_s"] == pytest.approx(ours["output_throughput_tok_s"]
                                                             / peer["output_throughput_tok_s"])
    assert ratios["itl_ms"]["p99"] == pytest.approx(
        round(peer["itl_ms"]["p99"] / ours["itl_ms"]["p99"], 3))
    with pytest.raises(ValueError, match="--save-detailed"):
        per_request({k: v for k, v in OURS.items() if k != "itls"})
    with pytest.raises(ValueError, match="--metric-percentiles"):
        side_figures({k: v for k, v in OURS.items() if k != "p90_e2el_ms"})


def _report(peer: bool) -> dict:
    report = {"window": {"trace": "t.jsonl", **{k: getattr(SCALING, k) for k in
                                                ("start", "count", "block_tokens",
                                                 "output_scale", "output_cap", "time_scale")},
                         "prompt_tokens": 60653, "arrival_span_s": 89.842},
              "machine": {"cpu": "AMD EPYC", "cpu_isa": "family 26 model 2", "cores": 2,
                          "loadavg_before": [0.5, 0.4, 0.3], "loadavg_after": [2.1, 1, 1]},
              "git_commit": "abc1234", "kthena": side_figures(OURS)}
    if peer:
        report["vllm"] = side_figures(PEER)
        report["kthena_vs_vllm"] = ours_vs_peer(report["kthena"], report["vllm"])
    return report


def test_table_has_both_systems_and_the_ratios():
    table = markdown_table(_report(peer=True))
    assert "AMD EPYC" in table and "load 0.5 → 2.1" in table and "60,653 prompt tokens" in table
    assert "| metric | vLLM | kthena serve | kthena / vLLM (higher is better) |" in table
    assert "| TTFT p50 / p90 / p99 ms | 100 / 170 / 197 | 250 / 370 / 397 | 0.40 / 0.46 / 0.50 |" \
        in table
    assert "| completed | 4 | 4 |  |" in table and "| failed | 0 | 1 |  |" in table
    alone = markdown_table(_report(peer=False))
    assert "| metric | kthena serve |" in alone and "vLLM" not in alone


def test_cdf_plot_is_written_and_needs_matplotlib(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "cdf.png"
    plot_cdfs({"vllm": per_request(PEER), "kthena": per_request(OURS)}, str(path), "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(RuntimeError, match="--plot needs matplotlib"):
        trace_report.plot_cdfs({}, str(tmp_path / "x.png"), "title")


# ---- one replay --------------------------------------------------------------------------------
def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.slow
def test_replay_against_kthena_serve_with_vllms_client(tmp_path):
    if not (DEFAULT_PEER_VENV / "bin" / "python").is_file():
        pytest.skip(f"vLLM's client lives in the peer venv, not built here ({DEFAULT_PEER_VENV}"
                    "; python3 benchmarks/peers/build_vllm_venv.py builds it)")
    rows = [{"timestamp": 100 * i, "input_length": 40 + 600 * (i % 2), "output_length": 24,
             "hash_ids": [1, 2] if i % 2 else [1]} for i in range(4)]
    path = _trace(tmp_path / "t.jsonl", rows)
    proc = subprocess.run(
        [sys.executable, "-m", "kthena_core.cli", "bench", "trace", "--trace", str(path),
         "--start", "0", "--count", "4", "--block-tokens", "16", "--output-cap", "3",
         "--time-scale", "0.001", "--json", str(tmp_path / "out.json"),
         "--keep", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert json.loads((tmp_path / "out.json").read_text()) == report
    ours = report["kthena"]
    assert ours["completed"] == 4 and ours["failed"] == 0
    assert ours["total_output_tokens"] == 4 * 3  # 24 / 8 = 3 each, EOS ignored
    assert ours["percentile_check"]["agrees"] and ours["errors"] == {}
    admission = ours["admission"]  # from the server's /metrics: the bound is off here
    assert admission["refused"] == {} and admission["estimate_to_wait_samples"] >= 4
    assert 0 < admission["estimate_to_wait_p10"] <= admission["estimate_to_wait_p50"] \
        <= admission["estimate_to_wait_p90"]
    assert admission["engine_seconds"]["prefill"] > 0
    for name in ("window.jsonl", "kthena-server.log", "kthena-result.json"):
        assert (tmp_path / "work" / name).is_file()
    assert report["window"]["prompt_tokens"] == 2 * 1 + 2 * 20  # 40/512*16 -> 1; 16 + 4
    assert "| completed | 4 |" in proc.stderr
    port = int(ours["server_command"][ours["server_command"].index("--port") + 1])
    assert not _listening(port)  # the server is gone
