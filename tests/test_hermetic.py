"""The suite reads nothing of the machine it runs on and leaves nothing for the next test: its
own cache folder, a recorded host probe, and process-wide settings put back after every test
(the root conftest.py). The test files run in a random order, so each test here both checks
the state it starts from and changes it: whichever runs second catches a leak."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from kthena_core.cpu_defaults import load_records
from mooncake_ops.dispatch import (
    choose_impl,
    dispatch_state,
    implementation_name,
    op_candidates,
    use_native,
)

# what every test of this file must start from: the state when the file was collected
START = (dispatch_state(), torch.get_num_threads(), os.environ.get("KTHENA_LEAK_CHECK"))


def _change_everything() -> None:
    use_native(not START[0][0])
    other = [name for name in op_candidates("paged_decode_attention", "cpu")
             if name != implementation_name("paged_decode_attention", "cpu")]
    if other:
        choose_impl("paged_decode_attention", "cpu", other[0])
    torch.set_num_threads(1 if START[1] != 1 else 2)
    os.environ["KTHENA_LEAK_CHECK"] = "left by a test"


def _assert_start() -> None:
    assert (dispatch_state(), torch.get_num_threads(),
            os.environ.get("KTHENA_LEAK_CHECK")) == START


def test_one_test_changes_the_process_wide_settings():
    _assert_start()
    _change_everything()
    assert dispatch_state() != START[0] and torch.get_num_threads() != START[1]


def test_another_sees_them_as_they_were():
    _assert_start()
    _change_everything()


def test_the_suite_has_its_own_cache_and_a_recorded_probe():
    cache = Path(os.environ["KTHENA_CACHE_DIR"])
    assert cache.name.startswith("kthena-suite-cache-") and cache.is_dir()
    assert cache != Path.home() / ".cache" / "kthena"
    probe = json.loads(Path(os.environ["KTHENA_HOST_PROBE"]).read_text())
    record = next(r for r in load_records() if r.name == "zen4")
    assert probe["memory_bw"] == record.bench["host_probe"]["memory_bw"]
    assert probe["cpu"]["isa_class"] == record.isa_class
