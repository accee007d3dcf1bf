"""MC2 over two gloo ranks (real processes on 127.0.0.1) against unfused matmul + collective."""

from __future__ import annotations

import json

import pytest
import torch

import mooncake_ops as mo
from mooncake_ops import _mc2_worker
from mooncake_ops.backends.mc2_tiled import tiles


def test_tiled_mc2_matches_unfused_over_two_gloo_ranks():
    outputs = _mc2_worker.launch("check", world=2, timeout_s=150)
    reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert [r["rank"] for r in reports] == [0, 1]
    assert [f for r in reports for f in r["failures"]] == []


def test_single_process_is_a_group_of_one():
    x, w = torch.randn(5, 8), torch.randn(8, 3)
    torch.testing.assert_close(mo.matmul_all_reduce(x, w, num_tiles=3), x @ w)
    torch.testing.assert_close(mo.all_gather_matmul(x, w), x @ w)
    torch.testing.assert_close(mo.matmul_reduce_scatter(x, w), x @ w)


@pytest.mark.parametrize("rows,num_tiles", [(0, 4), (1, 4), (7, 3), (8, 4), (3, 8)])
def test_tiles_cover_the_rows_once(rows, num_tiles):
    spans = tiles(rows, num_tiles)
    assert spans[0][0] == 0 and spans[-1][1] == rows
    assert all(a < b or rows == 0 for a, b in spans)
    assert all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    assert len(spans) <= max(1, min(num_tiles, rows))
