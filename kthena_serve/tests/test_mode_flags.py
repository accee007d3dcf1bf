"""Server-wide flags in every mode (issue 53): ``--tool-call-parser``, the model's names,
``--structured-outputs-config``, ``--timeout-keep-alive`` / ``--timeout-header-read``.

One tiny checkpoint whose chat template takes tools and writes Llama 3.1's JSON calls is put in
a Hub cache this test builds, as the repo ``HuggingFaceTB/SmolLM2-135M-Instruct`` (the default
model's Hub id, so the catalog's names apply; no network: ``HF_HUB_OFFLINE=1``). Each mode
(colocated, ``--dp 2``, ``--mode pd``) is one real deployment started with
``--tool-call-parser llama3_json``, ``--structured-outputs-config '{"disable_any_whitespace":
false}'`` and a 2 s header-read bound:

* the parser: ``tool_choice: required`` holds the random model to llama3_json's format and the
  answer comes back as OpenAI ``tool_calls`` (whole and streamed alike). Under the default
  (hermes) the same request is a 400, since this template writes no ``<tool_call>`` blocks
  (test_tool_parsers.py shows it colocated): a replica or router that dropped the flag fails
  here.
* the names: a request's ``model`` may be the served name (the Hub id), the catalog name, the
  default model's served name or ``default``; anything else is a 404.
* JSON whitespace: with whitespace tokens pushed up, a JSON constraint (a list of booleans:
  no strings) that does not say lets the model write whitespace (the flag's default reached whoever reads the
  request: the server, a replica, the PD router); one that says ``true`` does not.
* the header bound: a connection to the public port that sends nothing is closed by the
  server (the test waits 10x the flag's bound, and less than the default's 30 s).
"""

from __future__ import annotations

import json
import os
import re
import socket

import httpx
import pytest
from _serve_process import start_serve, stop
from _tiny import default_tokenizer, tiny_checkpoint
from test_model_source import hub_cache
from test_tool_parsers import TIME, WEATHER, template

from kthena_serve.dp.launcher import ReplicaLauncher
from kthena_serve.engine.config import EngineConfig
from kthena_serve.server.tool_parsers import add_deltas
from kthena_serve.spec import ServeSpec, model_aliases

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
NAMES = (HUB_ID, "smollm2-135m-instruct", "SmolLM2-135M-Instruct", "default")
FLAGS = ("--model", HUB_ID, "--tool-call-parser", "llama3_json", "--dtype", "float32",
         "--kernels", "torch", "--kv-cache-memory", "16MiB", "--max-num-seqs", "4",
         "--port", "0", "--shutdown-timeout", "2", "--disable-log-stats",
         "--structured-outputs-config", '{"disable_any_whitespace": false}',
         "--timeout-header-read", "2", "--timeout-keep-alive", "30")
MODES = {"colocated": (), "dp": ("--dp", "2"),
         "pd": ("--mode", "pd", "--prefill", "1", "--decode", "1")}


# ---- without processes --------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [{"dp": 2}, {"mode": "pd"}, {"mode": "pd", "prefill": 0}])
def test_every_mode_takes_every_parser(mode: dict) -> None:
    for parser in ("llama3_json", "mistral", "pythonic"):
        spec = ServeSpec.resolve({"tool_call_parser": parser, **mode})
        assert spec.tool_call_parser == parser
        assert ServeSpec.from_json(spec.to_json()) == spec  # what a PD worker is started with
    with pytest.raises(ValueError, match="allowed: hermes, llama3_json, mistral, pythonic"):
        ServeSpec.resolve({"tool_call_parser": "llama3", **mode})


def test_the_replicas_are_started_with_the_parser(tmp_path) -> None:
    launcher = ReplicaLauncher(EngineConfig(), 1, "m", cores=[0], tool_call_parser="pythonic")
    try:
        command = launcher._command(launcher.workers["replica-0"], tmp_path / "ready")
        assert command[command.index("--tool-call-parser") + 1] == "pythonic"
    finally:
        launcher.stop()


def test_the_names_of_one_model() -> None:
    smollm2 = {"smollm2-135m-instruct", "SmolLM2-135M-Instruct", HUB_ID, "default"}
    for given in ("default", "smollm2-135m-instruct", "SmolLM2-135M-Instruct", HUB_ID,
                  "SMOLLM2-135M-INSTRUCT"):
        spec = ServeSpec.resolve({"model": given})
        assert spec.aliases | {spec.served_model_name} == smollm2, given
        assert spec.served_model_name not in spec.aliases
    assert model_aliases("llama-3-8b", "llama-3-8b") == {"meta-llama/Meta-Llama-3-8B", "default"}
    assert model_aliases("meta-llama/Meta-Llama-3-8B", "meta-llama/Meta-Llama-3-8B") == {
        "llama-3-8b", "default"}
    named = ServeSpec.resolve({"model": "llama-3-8b", "served_model_name": "mine"})
    assert named.aliases == {"llama-3-8b", "meta-llama/Meta-Llama-3-8B", "default"}
    assert model_aliases("kthena-test/tiny", "kthena-test/tiny") == {"default"}


def test_a_path_is_a_path_not_a_catalog_name(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "llama-3-8b").mkdir()
    assert model_aliases("llama-3-8b", "llama-3-8b") == {"default"}


# ---- one deployment per mode --------------------------------------------------------------------
@pytest.fixture(scope="module")
def environment(tmp_path_factory) -> dict[str, str]:
    folder = tiny_checkpoint(tmp_path_factory.mktemp("tools") / "tiny-tools")
    (folder / "chat_template.jinja").write_text(template("llama3_json"))
    cache = tmp_path_factory.mktemp("hf") / "hub"
    hub_cache(cache, HUB_ID, folder)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING_FACE_")) and k != "TRANSFORMERS_OFFLINE"}
    return {**env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
            "OMP_WAIT_POLICY": "PASSIVE",
            "KTHENA_CACHE_DIR": str(tmp_path_factory.mktemp("kthena_cache"))}


@pytest.fixture(scope="module", params=sorted(MODES))
def served(request, environment):
    proc, url, _ = start_serve(*FLAGS, *MODES[request.param], env=environment, timeout=300)
    try:
        with httpx.Client(base_url=url, timeout=300) as client:
            yield client
    finally:
        stop(proc)


def _whitespace_bias(bias: float) -> dict[str, float]:
    """``bias`` on every token that is whitespace only (-100: a random model left free among
    JSON's optional whitespace may pick it for ever)."""
    tokenizer = default_tokenizer()
    return {str(i): bias for i in range(tokenizer.vocab_size)
            if tokenizer.token_strs([i])[0] not in tokenizer.special_tokens
            and not tokenizer.token_bytes([i])[0].strip()}


def _tool_body(**fields) -> dict:
    return {"model": HUB_ID, "temperature": 0, "max_tokens": 200, "tools": [WEATHER, TIME],
            "tool_choice": "required", "parallel_tool_calls": False,
            "messages": [{"role": "user", "content": "The weather in Oslo?"}], **fields}


def test_required_tool_calls_are_parsed_in_the_flagged_format(served: httpx.Client) -> None:
    body = _tool_body(logit_bias=_whitespace_bias(-100.0))
    answer = served.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert len(calls) == 1 and choice["message"]["content"] is None
    assert calls[0]["function"]["name"] in ("get_weather", "get_time")
    arguments = json.loads(calls[0]["function"]["arguments"])
    if calls[0]["function"]["name"] == "get_weather":
        assert set(arguments) == {"city"} and isinstance(arguments["city"], str)
    with served.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: {")]
    streamed: list[dict] = []
    for chunk in chunks:
        add_deltas(streamed, chunk["choices"][0]["delta"].get("tool_calls") or [])
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]


def test_every_name_of_the_model_is_accepted_and_others_are_404(served: httpx.Client) -> None:
    (card,) = served.get("/v1/models").json()["data"]
    assert card["id"] == HUB_ID
    for name in NAMES:
        answer = served.post("/v1/completions",
                             json={"model": name, "prompt": "Hi", "max_tokens": 1})
        assert answer.status_code == 200, (name, answer.text)
        assert answer.json()["model"] == HUB_ID
    for name in ("smollm2", "llama-3-8b", "huggingfacetb/smollm2-135m-instruct"):
        answer = served.post("/v1/chat/completions", json={
            "model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
        assert answer.status_code == 404, (name, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "model_not_found" and HUB_ID in error["message"]


def test_the_json_whitespace_default_is_the_flags(served: httpx.Client) -> None:
    # no string in this language: any whitespace is JSON's optional whitespace
    schema = {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3}

    def text(**constraint) -> str:
        answer = served.post("/v1/completions", json={
            "model": HUB_ID, "prompt": "JSON:", "max_tokens": 8, "temperature": 0,
            "logit_bias": _whitespace_bias(100.0),
            "structured_outputs": {"json": schema, **constraint}})
        assert answer.status_code == 200, answer.text
        return answer.json()["choices"][0]["text"]

    loose = text()  # the flag's false: whitespace allowed, and the bias takes it
    assert re.search(r"\s", loose), loose
    compact = text(disable_any_whitespace=True)  # the request's own choice wins
    assert not re.search(r"\s", compact) and compact.startswith("["), compact


def test_a_connection_that_sends_no_header_is_closed(served: httpx.Client) -> None:
    host, port = served.base_url.host, served.base_url.port
    with socket.create_connection((host, port)) as sock:
        # 10 x the flag's 2 s, and under the 30 s default: a server that did not get the
        # flag keeps the connection past this wait
        sock.settimeout(20)
        try:
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass
