"""``kthena doctor``'s command line (entry point group ``kthena.commands``)."""

from __future__ import annotations

import argparse
import os

from kthena_core.cache_dir import default_cache_dir
from kthena_serve.doctor.check import Check, checks_json, exit_status, format_checks
from kthena_serve.doctor.host import calibration_check, host_checks, load_host_facts
from kthena_serve.doctor.kernel_cache import kernel_cache_checks
from kthena_serve.doctor.server import fetch_server, server_checks
from kthena_serve.serve_args import add_api_key_args

__all__ = ["register_doctor", "run_doctor"]


def register_doctor(subparsers: argparse._SubParsersAction) -> None:
    """Add ``kthena doctor``."""
    parser = subparsers.add_parser(
        "doctor", help="check a live server and this host: a verdict and a fix per line")
    parser.add_argument("--url", help="a running server (kthena serve, or a PD / DP router), "
                                      "e.g. http://127.0.0.1:8000")
    add_api_key_args(parser, "the server's API key")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="the kthena_config.yaml this host serves: plan it and check the "
                             "devices, collective variables and memory it needs")
    parser.add_argument("--calibration", metavar="BENCH.json",
                        help="the `kthena bench serve` JSON the plan is calibrated from "
                             "(`kthena plan --calibrate`): its age and machine")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for each answer of --url (default 10)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=_cmd_doctor)


def run_doctor(url: str | None, api_key: str | None, config: str | None,
               calibration: str | None, *, environ: dict[str, str] | None = None,
               timeout_s: float = 10.0) -> list[Check]:
    """Every check: the server's (with ``url``), then the host's, then the kernel choices
    cached on this host (``$KTHENA_CACHE_DIR/kernels``).

    Raises:
        DoctorError: bad input (an unreachable server, a refused key, a config that does not
            load, an unreadable calibration file).
    """
    checks: list[Check] = []
    plan_report = None
    if url:
        server = fetch_server(url, api_key, timeout_s)
        plan_report = server.plan
        checks += server_checks(server)
    facts = load_host_facts(config, dict(os.environ) if environ is None else environ)
    checks += host_checks(facts)
    checks.append(calibration_check(calibration, plan_report))
    checks += kernel_cache_checks(default_cache_dir())
    return checks


def _cmd_doctor(args: argparse.Namespace) -> int:
    from kthena_serve.deployment import api_key

    key = api_key({"api_key": args.api_key, "api_key_file": args.api_key_file})
    checks = run_doctor(args.url, key, args.config, args.calibration, timeout_s=args.timeout)
    if args.json:
        print(checks_json(checks, url=args.url, config=args.config))
    else:
        print(format_checks(checks))
    return exit_status(checks)
