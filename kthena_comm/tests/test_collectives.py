"""Collectives on 2 and 4 gloo ranks against a single-process reference, and layout groups."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_match_reference(run_ranks, world_size):
    outputs = run_ranks("collectives", world_size)
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [r["rank"] for r in results] == list(range(world_size))
    assert {r["backend"] for r in results} == {"gloo"}


def test_tp2_dp2_groups_put_the_right_ranks_together(run_ranks):
    outputs = run_ranks("groups", 4)
    by_rank = {r["rank"]: r for r in (json.loads(o.strip().splitlines()[-1]) for o in outputs)}
    assert [by_rank[r]["tp"] for r in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [by_rank[r]["dp"] for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [by_rank[r]["pp"] for r in range(4)] == [[0], [1], [2], [3]]
    assert [by_rank[r]["sp"] for r in range(4)] == [by_rank[r]["tp"] for r in range(4)]
    assert [by_rank[r]["tp_sum"] for r in range(4)] == [1.0, 1.0, 5.0, 5.0]
    assert [by_rank[r]["dp_sum"] for r in range(4)] == [2.0, 4.0, 2.0, 4.0]
