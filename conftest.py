"""Shared pytest set-up: Hypothesis profiles `dev` (default) and `ci` (`HYPOTHESIS_PROFILE=ci`)."""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", max_examples=50, deadline=None)
settings.register_profile(
    "ci",
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# Import the five layers before collection: pytest's importlib mode names a test module after its
# path (``kthena_core/tests/test_x.py`` -> ``kthena_core.tests.test_x``) and would otherwise create
# an empty ``kthena_core`` placeholder (the distribution folder) that shadows the real package.
import importlib  # noqa: E402

for _layer in ("kthena_core", "mooncake_kv", "kthena_comm", "mooncake_ops", "kthena_serve"):
    importlib.import_module(_layer)
