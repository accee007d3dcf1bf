"""Packaging: imports without torch; curated exports; the bench prints one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

import mooncake_kv
from mooncake_kv import bench


def test_imports_without_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import mooncake_kv; mooncake_kv.KVCacheManager(4, 2)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_all_names_exist() -> None:
    missing = [name for name in mooncake_kv.__all__ if not hasattr(mooncake_kv, name)]
    assert missing == []


def test_bench_prints_one_json_line(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["--requests", "60", "--warmup", "5", "--num-prompts", "5", "--capacity", "2000"]
    for index in ("hash", "radix"):
        assert bench.main([*args, "--index", index]) == 0
        lines = capsys.readouterr().out.strip().splitlines()
        assert len(lines) == 1
        result = json.loads(lines[0])
        assert result["config"]["index"] == index
        assert 0.0 < result["hit_rate"] < 1.0
        assert result["evicted_tokens"] > 0
        for key in ("requests_per_s", "requests_per_s_from_median", "us_per_match", "us_per_free"):
            assert result[key] > 0
        assert "load_avg" in result["machine"] and "cpu_model" in result["machine"]
