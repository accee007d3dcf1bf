"""``kthena serve --help`` and ``kthena bench serve --help`` show every option's default, and
the value shown is the one a run takes.

``kthena serve``'s flags have no argparse defaults (a flag not given is absent, and
``ServeSpec.resolve`` takes the config's value or the typed default), so each option is checked
against the default the spec resolves to: ``EngineConfig``'s field, or the spec's own table.
``kthena bench serve``'s own options are checked against their parser defaults. Options that
default to nothing (an API key, a Redis URL, a config file) need not show one.
"""

from __future__ import annotations

import argparse
import re

import attrs
import pytest

from kthena_core.cli import build_parser
from kthena_serve.async_engine import STALL_TIMEOUT_S
from kthena_serve.engine.config import EngineConfig
from kthena_serve.spec import _SERVE_DEFAULTS

# How a default whose value is not printed as is appears in the help.
SHOWN_AS = {"kv_cache_memory": "1GiB", "stream_stall_timeout": f"{STALL_TIMEOUT_S:g}",
            "max_queued_tokens": "off", "model": "default"}
# The window around the word "default" in which the value must appear.
WINDOW = 48


def _subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS
            and not isinstance(a, argparse._HelpAction)]


@pytest.fixture(autouse=True)
def _no_environment_defaults(monkeypatch):
    """The help shows the defaults of a run with no KTHENA_KERNELS set."""
    monkeypatch.delenv("KTHENA_KERNELS", raising=False)


def _serve_default(dest: str) -> object:
    if dest in SHOWN_AS:
        return SHOWN_AS[dest]
    fields = attrs.fields_dict(EngineConfig)
    if dest not in fields:
        return _SERVE_DEFAULTS.get(dest)
    default = fields[dest].default
    return default.factory() if isinstance(default, attrs.Factory) else default


def _shown(value: object) -> set[str]:
    """The spellings of ``value`` a help text may use."""
    if isinstance(value, bool):
        return {"on"} if value else {"off"}
    if isinstance(value, float):
        return {f"{value:g}", str(value)}
    return {str(value)}


def _check(option: str, help_text: str, default: object) -> str | None:
    """Why ``help_text`` does not show ``default`` (None: it does)."""
    if default is None:
        return None
    text = " ".join(help_text.split())
    starts = [m.start() for m in re.finditer(r"\bdefault\b", text)]
    if not starts:
        return f"{option}: no default shown in {text!r} (the default is {default!r})"
    words = {w for s in starts
             for w in re.findall(r"[\w.,:/-]+", text[max(0, s - WINDOW):s + WINDOW])}
    words |= {w.strip(".,:") for w in words} | {p for w in words for p in w.split("/")}
    if not _shown(default) & words:
        return f"{option}: the help shows no {sorted(_shown(default))} near 'default': {text!r}"
    return None


def test_every_kthena_serve_option_shows_its_default():
    parser = _subparser("serve")
    problems = [_check(a.option_strings[0], a.help or "", _serve_default(a.dest))
                for a in _options(parser)]
    assert [p for p in problems if p] == []


def test_every_kthena_bench_serve_option_shows_its_default():
    parser = _subparser("bench", "serve")
    problems = []
    for action in _options(parser):
        own = action.default is not argparse.SUPPRESS
        default = action.default if own else _serve_default(action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            default = False
        problems.append(_check(action.option_strings[0], action.help or "", default))
    assert [p for p in problems if p] == []


@pytest.mark.parametrize(("help_text", "default", "ok"), [
    ("tokens per KV block (default 16)", 16, True),
    ("tokens per KV block (default 32)", 16, False),
    ("tokens per KV block", 16, False),
    ("the API key", None, True),
    ("turn prefix reuse off (default on)", True, True),
    ("seconds (default 30)", 30.0, True),
])
def test_the_check_itself(help_text, default, ok):
    assert (_check("--x", help_text, default) is None) is ok


def test_the_printed_help_carries_the_defaults(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for shown in ("requests running at once (default 64)", "port to bind (default 8000)",
                  "Hub repo id ORG/NAME"):
        assert shown in out
