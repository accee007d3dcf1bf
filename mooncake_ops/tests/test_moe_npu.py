"""The npu path of the MoE dispatch / combine against a TEST DOUBLE of torch_npu (defined here):
the documented call is made, its outputs are handed on as documented, and calls outside the
documented shapes run the portable path. Documentation only: nothing here ran on an NPU."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kthena_comm.groups import CommGroup
from kthena_comm.layout import Rank
from mooncake_ops.backends import moe_a2a, npu, torch_npu_api

# Keyword-only names of the torch_npu 7.0.0 API reference (ptaoplist_002364 / _002363).
DISPATCH_KEYWORDS = {"scales", "x_active_mask", "expert_scales", "group_tp", "tp_world_size",
                     "tp_rank_id", "expert_shard_type", "shared_expert_num",
                     "shared_expert_rank_num", "quant_mode", "global_bs",
                     "expert_token_nums_type"}
COMBINE_KEYWORDS = {"tp_send_counts", "x_active_mask", "activation_scale", "weight_scale",
                    "group_list", "expand_scales", "group_tp", "tp_world_size", "tp_rank_id",
                    "expert_shard_type", "shared_expert_num", "shared_expert_rank_num",
                    "global_bs", "out_dtype", "comm_quant_mode", "group_list_type"}
A_ROWS = 12  # the double's expand_x buffer (A >= BS * world * min(local experts, K))


class FakeNpu(types.ModuleType):
    """TEST DOUBLE of torch_npu's two MoE ops: records calls, refuses undocumented keywords,
    returns tensors of the documented shapes (it computes nothing an NPU would)."""

    def __init__(self) -> None:
        super().__init__("torch_npu")
        self.__version__ = "2.5.1"
        self.calls: list[tuple[str, tuple, dict]] = []

    def _record(self, name, args, kwargs, allowed):
        unknown = set(kwargs) - allowed
        if unknown:
            raise TypeError(f"{name}() got unexpected keyword argument(s) {sorted(unknown)}")
        self.calls.append((name, args, kwargs))

    def npu_moe_distribute_dispatch(self, *args, **kwargs):
        self._record("npu_moe_distribute_dispatch", args, kwargs, DISPATCH_KEYWORDS)
        x, expert_ids = args[0], args[1]
        expand_x = torch.arange(A_ROWS * x.shape[1], dtype=x.dtype).view(A_ROWS, x.shape[1])
        return (expand_x, torch.zeros(A_ROWS), torch.arange(expert_ids.numel(),
                                                            dtype=torch.int32),
                torch.tensor([3, 2], dtype=torch.int64), torch.tensor([4, 1, 0, 0]),
                torch.tensor([0]), torch.zeros(A_ROWS))

    def npu_moe_distribute_combine(self, *args, **kwargs):
        self._record("npu_moe_distribute_combine", args, kwargs, COMBINE_KEYWORDS)
        return torch.zeros(args[1].shape[0], args[0].shape[1], dtype=args[0].dtype)


@pytest.fixture
def fake_npu(monkeypatch):
    module = FakeNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    torch_npu_api.load.cache_clear()
    yield module
    torch_npu_api.load.cache_clear()


def _ep_group(size: int = 2) -> CommGroup:
    ranks = tuple(Rank(r) for r in range(size))
    return CommGroup("ep", ranks, Rank(1 % size), None, hccl_comm_name="hcom_ep")


def _routing(tokens=5, hidden=64, dtype=torch.bfloat16):
    x = torch.randn(tokens, hidden).to(dtype)
    ids = torch.tensor([[0, 3], [1, 2], [3, 0], [2, 1], [0, 1]])[:tokens]
    return x, torch.rand(tokens, 2), ids


def test_dispatch_and_combine_make_the_documented_calls(fake_npu):
    x, weights, ids = _routing()
    group = _ep_group()
    d = npu.moe_distribute_dispatch(x, weights, ids, group, range(2, 4), 4)
    args, kwargs = fake_npu.calls[-1][1:]
    assert args[0] is x and args[1].dtype == torch.int32 and torch.equal(args[1], ids.int())
    assert args[2:] == ("hcom_ep", 2, 1, 4)  # group_ep, ep_world_size, ep_rank_id, E
    assert kwargs == {"quant_mode": 0, "shared_expert_rank_num": 0,
                      "expert_token_nums_type": 1}
    assert d.expert_counts == (3, 2) and d.num_rows == 5 and d.traffic is None
    assert d.rows.shape == (A_ROWS, 64) and d.experts == range(2, 4)
    out = npu.moe_distribute_combine(d.rows[:d.num_rows] * 2, d, group)
    name, args, kwargs = fake_npu.calls[-1]
    assert name == "npu_moe_distribute_combine" and out.shape == x.shape
    expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales = args[:5]
    assert expand_x.shape == (A_ROWS, 64)  # padded back to the dispatch's A rows
    assert torch.equal(expand_x[:5], d.rows[:5] * 2) and not expand_x[5:].any()
    assert torch.equal(expert_ids, ids.int()) and expert_scales.dtype == torch.float32
    assert torch.equal(expand_idx, torch.arange(10, dtype=torch.int32))
    assert torch.equal(ep_send_counts, torch.tensor([4, 1, 0, 0]))  # dispatch's ep_recv_counts
    assert args[5:] == ("hcom_ep", 2, 1, 4)
    assert set(kwargs) == {"tp_send_counts", "shared_expert_rank_num"}
    assert torch.equal(kwargs["tp_send_counts"], torch.tensor([0]))


@pytest.mark.parametrize("why", ["float32", "one rank", "hidden 48", "300 tokens", "top_k 9"])
def test_calls_outside_the_documented_shapes_run_the_portable_path(fake_npu, monkeypatch, why):
    x, weights, ids = _routing()
    size = 2
    if why == "float32":
        x = x.float()
    elif why == "one rank":
        size = 1
    elif why == "hidden 48":
        x = x[:, :48]
    elif why == "300 tokens":
        x, weights, ids = x.repeat(60, 1), weights.repeat(60, 1), ids.repeat(60, 1)
    else:
        ids, weights = ids.repeat(1, 5)[:, :9], weights.repeat(1, 5)[:, :9]
    seen = []
    monkeypatch.setattr(moe_a2a, "moe_distribute_dispatch",
                        lambda *a: seen.append(a) or "portable")
    assert npu.moe_distribute_dispatch(x, weights, ids, _ep_group(size), range(0, 4),
                                       4) == "portable"
    assert len(seen) == 1 and not fake_npu.calls


def test_an_installed_torch_npu_without_the_ops_runs_the_portable_path(fake_npu, monkeypatch):
    monkeypatch.delattr(FakeNpu, "npu_moe_distribute_combine")
    monkeypatch.setattr(moe_a2a, "moe_distribute_dispatch", lambda *a: "portable")
    x, weights, ids = _routing()
    assert npu.moe_distribute_dispatch(x, weights, ids, _ep_group(), range(0, 2), 4) == "portable"
