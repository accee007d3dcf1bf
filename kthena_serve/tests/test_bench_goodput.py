"""``kthena bench soak --overload``'s goodput: the accepted streams' tokens per second under
overload against the calibration's sustainable tokens per second, from each stream's own usage
chunk (what the server says it computed), never a constant."""

from __future__ import annotations

import asyncio
import json

import httpx
from _tiny import tiny_server

from kthena_serve.bench.overload import GOODPUT_TARGET, OverloadOptions, _Answer, _report, _send


def test_goodput_is_the_accepted_tokens_over_the_calibrations() -> None:
    accepted = [_Answer(200, 0.01, 0.5, is_done=True, tokens=100 + i) for i in range(10)]
    refused = [_Answer(503, 0.01, code="overloaded", tokens=None) for _ in range(5)]
    broken = [_Answer(200, 0.01, 0.4, is_done=False, tokens=999)]  # no [DONE]: not accepted
    calibration = {"completed": 10, "sustainable_rps": 1.0, "sustainable_tokens_per_s": 80.0}
    report = _report(OverloadOptions(bound_s=1.0), calibration, 4.0,
                     accepted + refused + broken, 10.0)
    assert report["accepted_tokens"] == sum(100 + i for i in range(10)) == 1045
    assert report["accepted_tokens_per_s"] == 104.5
    assert report["goodput_ratio"] == round(104.5 / 80.0, 3)
    assert report["goodput_target"] == GOODPUT_TARGET and report["goodput_ok"] is True
    slow = _report(OverloadOptions(), {**calibration, "sustainable_tokens_per_s": 200.0}, 4.0,
                   accepted, 10.0)
    assert slow["goodput_ratio"] == round(104.5 / 200.0, 3) and slow["goodput_ok"] is False
    unknown = _report(OverloadOptions(), {"completed": 0, "sustainable_rps": 0.0}, 4.0,
                      accepted, 10.0)
    assert unknown["goodput_ratio"] is None and unknown["goodput_ok"] is None


def test_a_streams_tokens_are_its_usage() -> None:
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with tiny_server("tiny") as (_, client):
        whole = client.post("/v1/completions", json={**body, "stream": False,
                                                     "stream_options": None}).json()["usage"]

        async def streamed() -> _Answer:
            async with httpx.AsyncClient(base_url=str(client.base_url), timeout=60) as http:
                return await _send(http, "/v1/completions", json.dumps(body))

        answer = asyncio.run(streamed())
    assert answer.status == 200 and answer.is_done and answer.problem is None
    assert whole["completion_tokens"] == 5
    assert answer.tokens == whole["prompt_tokens"] + whole["completion_tokens"]
