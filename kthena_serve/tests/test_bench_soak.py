"""``kthena bench soak``: a short real run is clean, and the soak's own judging catches failures.

The run asserts outcomes only (no errors, bad requests refused, no KV block held after), never
a latency: the figures belong to the 5-minute runs in docs/bench_serve.md.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import attrs
import pytest

from kthena_serve.bench.soak import SoakOptions, Target, _judge, _Outcome, _Plan, _plan

_TARGET = Target("http://127.0.0.1:1", "m", 2048, ("shared opening",))


@pytest.mark.slow
def test_short_soak_is_clean() -> None:
    # seed 0: client 0 starts with a disconnect and client 2 with a bad request, so both kinds
    # are sent however slow the machine is
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("KTHENA_API_KEY", None)
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "bench", "soak", "--minutes",
                           "0.1", "--clients", "4", "--seed", "0", "--kv-cache-memory", "64MiB"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["num_errors"] == 0 and result["errors"] == []
    num_bad = sum(n for kind, n in result["counts"].items() if kind.startswith("bad_"))
    assert num_bad >= 1 and result["num_bad_4xx"] == num_bad
    assert result["counts"]["disconnect"] >= 1
    assert result["idle_after"] is True and result["kv_after"]["kthena_kv_blocks_used"] == 0
    assert result["ttft_ms"]["n"] > 0 and result["rss_mib"]["max"] > 0
    assert result["server_exit_code"] == 0


def test_plans_are_seeded_and_cover_every_kind() -> None:
    first = [_plan(random.Random(7), _TARGET) for _ in range(3)]
    assert first == [_plan(random.Random(7), _TARGET) for _ in range(3)]
    rng = random.Random(0)
    kinds = {_plan(rng, _TARGET).kind for _ in range(500)}
    bad = {"bad_seed", "bad_top_k", "bad_temperature", "bad_model", "bad_empty_prompt",
           "bad_max_tokens"}
    assert kinds == {"completion", "chat", "disconnect"} | bad
    body = _first_plan("bad_temperature").body
    assert '"temperature": Infinity' in body  # the bare JSON text, not a string


def _first_plan(kind: str, seed: int = 0) -> _Plan:
    """The first plan of ``random.Random(seed)`` whose kind starts with ``kind``."""
    rng = random.Random(seed)
    while not (plan := _plan(rng, _TARGET)).kind.startswith(kind):
        pass
    return plan


@pytest.mark.parametrize(("kind", "outcome", "is_error"), [
    ("completion", _Outcome(200, stamps=[1.0], is_done=True), False),
    ("completion", _Outcome(200, stamps=[1.0]), True),  # no [DONE]
    ("completion", _Outcome(200, stamps=[1.0], problem="error event: {}"), True),
    ("completion", _Outcome(503, problem="draining"), True),
    ("completion", _Outcome(503, problem="past the bound", code="overloaded"), False),
    ("bad_", _Outcome(503, code="overloaded"), True),  # validation comes before admission
    ("completion", _Outcome(problem="ReadTimeout"), True),  # transport error
    ("disconnect", _Outcome(200, stamps=[1.0, 2.0]), False),  # closed after 2 events
    ("disconnect", _Outcome(200, stamps=[1.0]), True),  # ended early without [DONE]
    ("bad_", _Outcome(400), False),
    ("bad_", _Outcome(200, is_done=True), True),
    ("bad_", _Outcome(500), True),
])
def test_judge(kind: str, outcome: _Outcome, is_error: bool) -> None:
    plan = _first_plan(kind)
    if kind == "disconnect":
        plan = attrs.evolve(plan, close_after=2)
    assert (_judge(plan, outcome) is not None) == is_error


def test_only_loopback() -> None:
    with pytest.raises(ValueError, match="loopback"):
        SoakOptions(url="http://10.0.0.1:8000")
    assert SoakOptions(url="http://127.0.0.1:8000").url


def test_overload_report_splits_accepted_refused_and_errors() -> None:
    from kthena_serve.bench.overload import OverloadOptions, _Answer, _report

    answers = [_Answer(200, 0.01, 0.5 + i / 100, is_done=True) for i in range(50)]
    answers += [_Answer(503, 0.005 * (i + 1), retry_after=str(1 + i % 3), code="overloaded")
                for i in range(30)]
    answers += [_Answer(503, 4.0 + i, code="queue_timeout") for i in range(3)]  # at the deadline
    answers += [_Answer(503, 0.01, code=None, problem="draining"),  # not the bound's 503
                _Answer(200, 0.01, 0.4, is_done=False)]  # no [DONE]
    calibration = {"completed": 10, "sustainable_rps": 1.0}
    report = _report(OverloadOptions(bound_s=1.0), calibration, 4.0, answers, 20.0)
    assert (report["num_accepted"], report["num_rejected"], report["num_errors"]) == (50, 33, 2)
    assert report["accepted_ttft_ms"]["p99"] == 990.0 and report["ttft_p99_within_bound"]
    assert report["rejected_latency_ms"]["p99"] == 150.0  # the fast ones only
    assert report["num_rejected_late"] == 3
    assert report["rejected_late_latency_ms"]["p50"] == 5000.0
    assert report["retry_after_s"] == {"min": 1, "p50": 2, "max": 3}
    assert report["accepted_rps"] == 2.5 and report["offered_rps"] == 4.0
    assert not _report(OverloadOptions(bound_s=0.5), calibration, 4.0, answers,
                       20.0)["ttft_p99_within_bound"]
