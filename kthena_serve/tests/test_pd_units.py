"""PD pieces without processes: core split, control messages (the router's scoring and decider,
which PD and DP share, are tested in test_cluster.py)."""

from __future__ import annotations

import pytest

from kthena_serve.engine.request import FinishReason, RequestOutput
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.pd.launcher import split_cores
from kthena_serve.pd.protocol import (
    PoolRef,
    PrefillTask,
    output_from_json,
    output_to_json,
    params_from_json,
    params_to_json,
)


def test_split_cores_disjoint_then_shared() -> None:
    specs = split_cores([0, 1, 2, 3, 4], 1, 2)
    assert [s.cores for s in specs] == [(0, 1), (2, 3), (4,)]
    assert [s.role for s in specs] == ["prefill", "decode", "decode"]
    shared = split_cores([0], 1, 1)
    assert [s.cores for s in shared] == [(0,), (0,)]
    with pytest.raises(ValueError):
        split_cores([0], 0, 0)


def test_messages_round_trip() -> None:
    params = SamplingParams(temperature=0.5, seed=3, stop=["x"], max_tokens=7)
    assert params_from_json(params_to_json(params)) == params
    task = PrefillTask("r", (1, 2, 3), 0, (5,), params_to_json(params), PoolRef(8, 16, "bfloat16",
                       "mooncake_kv.1.ab"))
    assert PrefillTask.from_json(task.to_json()) == task
    out = RequestOutput("r", (1,), "a", (1,), "a", FinishReason.STOP, 3, 0, 1.0, 2.0, 3.0)
    assert output_from_json(output_to_json(out)) == out
