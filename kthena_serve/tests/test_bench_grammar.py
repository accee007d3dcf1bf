"""``python -m kthena_serve.bench.grammar``'s rounds on a tiny engine: every mode yields a row
of the full-batch decode steps, grammar modes with their bitmask timings, the others without."""

from __future__ import annotations

import types

import pytest
from _tiny import tiny_engine

pytest.importorskip("xgrammar")


def test_every_mode_measures_its_full_batch_steps():
    from kthena_serve.bench.grammar import MODES, measure

    llm = types.SimpleNamespace(engine=tiny_engine(max_num_seqs=4, num_kv_blocks=512))
    rows = {mode: measure(llm, mode, batch=4, steps=12) for mode in MODES}
    for mode, row in rows.items():
        assert row["mode"] == mode and row["batch"] == 4
        assert row["steps"] >= 5, row  # full-batch steps after the first three
        assert 0 < row["p10_ms"] <= row["median_ms"] <= row["p90_ms"], row
        assert ("fill_bitmask" in row) is (mode in ("json_schema", "mixed")), row
    assert not llm.engine.has_unfinished_requests()
