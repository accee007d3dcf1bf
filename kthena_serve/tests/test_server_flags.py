"""``--structured-outputs-config`` and the connection timeouts as ``ServeSpec`` settings: what
each takes, and every bad value refused by the flag's name (test_mode_flags.py serves them)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from kthena_serve.dp.launcher import ReplicaLauncher
from kthena_serve.engine.config import EngineConfig
from kthena_serve.engine.structured_output import StructuredOutputsParams
from kthena_serve.spec import ServeSpec

FLAG = "--structured-outputs-config"


def test_the_whitespace_default_from_the_flag() -> None:
    assert ServeSpec.resolve({}).disable_any_whitespace is True
    for config, expected in (('{"disable_any_whitespace": false}', False),
                             ('{"disable_any_whitespace": true}', True), ("{}", True),
                             ({"disable_any_whitespace": False}, False)):  # a YAML / dict
        spec = ServeSpec.resolve({"structured_outputs_config": config})
        assert spec.disable_any_whitespace is expected, config
        assert ServeSpec.from_json(spec.to_json()) == spec
    for mode in ({"dp": 2}, {"mode": "pd"}):
        spec = ServeSpec.resolve({"structured_outputs_config": '{"disable_any_whitespace": false}',
                                  **mode})
        assert spec.disable_any_whitespace is False


@pytest.mark.parametrize(("config", "says"), [
    ("disable_any_whitespace=false", "not JSON"),
    ("[1]", "takes a JSON object of disable_any_whitespace, got [1]"),
    ('{"backend": "outlines"}', "unknown key(s) backend; allowed: disable_any_whitespace"),
    ('{"disable_any_whitespace": "no"}', "disable_any_whitespace takes true or false, got 'no'"),
    ('{"disable_any_whitespace": 0}', "takes true or false, got 0"),
])
def test_bad_structured_outputs_configs_are_refused_by_name(config: str, says: str) -> None:
    with pytest.raises(ValueError) as error:
        ServeSpec.resolve({"structured_outputs_config": config})
    assert str(error.value).startswith(f"{FLAG}: ") and says in str(error.value)


def test_connection_timeouts() -> None:
    assert ServeSpec.resolve({}).server_timeouts() == {}  # run_server's defaults
    spec = ServeSpec.resolve({"timeout_keep_alive": 5, "timeout_header_read": 2.5})
    assert spec.server_timeouts() == {"keep_alive_s": 5.0, "header_timeout_s": 2.5}
    assert ServeSpec.from_json(spec.to_json()) == spec
    assert ServeSpec.resolve({"timeout_header_read": 1}).server_timeouts() == {
        "header_timeout_s": 1.0}
    for setting, flag in (("timeout_keep_alive", "--timeout-keep-alive"),
                          ("timeout_header_read", "--timeout-header-read")):
        for bad in (0, -1.0, math.inf, math.nan, True, "5"):
            with pytest.raises(ValueError) as error:
                ServeSpec.resolve({setting: bad})
            assert str(error.value) == (f"{flag}: must be a positive number of seconds, got "
                                        f"{bad!r}")


def test_a_request_that_says_nothing_gets_the_servers_choice() -> None:
    from kthena_serve.server.request_parts import StructuredOutputs

    said = StructuredOutputs.model_validate({"json_object": True}).constraint()
    assert said.disable_any_whitespace is None  # filled in by the server (OpenAIRoutes)
    own = StructuredOutputs.model_validate({"json_object": True,
                                            "disable_any_whitespace": False}).constraint()
    assert own.disable_any_whitespace is False
    with pytest.raises(ValueError, match="disable_any_whitespace must be a bool"):
        StructuredOutputsParams(json_object=True, disable_any_whitespace="yes")


def test_the_replicas_get_the_whitespace_default(tmp_path) -> None:
    for loose in (False, True):
        launcher = ReplicaLauncher(EngineConfig(), 1, "m", cores=[0],
                                   disable_any_whitespace=not loose)
        try:
            command = launcher._command(launcher.workers["replica-0"], tmp_path / "ready")
            assert ("--any-whitespace" in command) is loose
        finally:
            launcher.stop()


def test_kthena_serve_refuses_bad_values_in_one_line() -> None:
    for args, line in (
            (["--timeout-header-read", "0"],
             "kthena serve: --timeout-header-read: must be a positive number of seconds, got 0.0"),
            ([FLAG, '{"disable_any_whitespace": 1, "backend": "x"}'],
             f"kthena serve: {FLAG}: unknown key(s) backend; allowed: disable_any_whitespace "
             "(this server's structured outputs run on xgrammar, with no other server-wide "
             "setting)")):
        done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve", *args],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.strip().splitlines() == [line]
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve",
                           "--timeout-keep-alive", "soon"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2
    assert "argument --timeout-keep-alive: invalid float value: 'soon'" in done.stderr
