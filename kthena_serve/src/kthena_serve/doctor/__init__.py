"""``kthena doctor``: one checklist, a verdict and a fix per line, for a server and its host.

    kthena doctor [--url URL [--api-key KEY]] [--config FILE.yaml] [--calibration BENCH.json]
                  [--json]

Server checks (``server``) read what a live server exports; host checks (``host``) judge
this machine against the plan a config asks for; the kernel-cache lines (``kernel_cache``)
list the kernel choices timed on this host, how close each was, its age and the load it was
timed under. Lines are ``Check`` values (``check``); the command exits 1 when any check fails,
2 on bad input (``DoctorError``).
"""

from kthena_serve.doctor.check import Check, DoctorError, checks_json, exit_status, format_checks
from kthena_serve.doctor.host import HostFacts, calibration_check, host_checks, load_host_facts
from kthena_serve.doctor.kernel_cache import kernel_cache_checks
from kthena_serve.doctor.server import ServerFacts, fetch_server, server_checks

__all__ = ["Check", "DoctorError", "HostFacts", "ServerFacts", "calibration_check",
           "checks_json", "exit_status", "fetch_server", "format_checks", "host_checks",
           "kernel_cache_checks", "load_host_facts", "server_checks"]
