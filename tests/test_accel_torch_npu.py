"""The torch_npu adapter against a TEST DOUBLE of torch_npu (tests/doubles/fake_torch_npu.py).

The double accepts, per release line, only the keyword names the torch_npu API reference lists
and raises TypeError on any other, so these tests pin the exact calls the npu backend makes for
each torch_npu version: names, positional order, the HCCL communicator name given to the MC2
ops. They say nothing about an NPU or about torch_npu itself (docs/accelerators.md).
"""

from __future__ import annotations

import pytest
import torch
from doubles import fake_torch_npu

from kthena_comm.groups import CommGroup, ParallelGroups, with_hccl_names
from kthena_comm.hccl import hccl_comm_name
from kthena_comm.layout import Rank
from mooncake_ops.backends import npu, torch_npu_api
from mooncake_ops.backends.torch_npu_api import NpuVersionError, release_of

SIX = ["2.1.0.post10", "2.2.0.post2", "2.3.1.post4", "2.4.0.post2"]
SEVEN = ["2.1.0.post12", "2.3.1.post6", "2.4.0.post4", "2.5.1", "2.6.0.post5", "2.9.0"]


@pytest.fixture(autouse=True)
def reset_adapter():
    torch_npu_api.load.cache_clear()
    yield
    torch_npu_api.load.cache_clear()


def test_release_lines_follow_the_ascend_extension_table():
    assert [release_of(v).line for v in SIX] == ["6.0"] * 4
    assert [release_of(v).line for v in SEVEN] == ["7.0+"] * 6
    assert release_of("2.1.0.post10").fia_scale_keyword == "scale_value"
    assert release_of("2.5.1").fia_scale_keyword == "scale"
    assert release_of("2.4.0.post4+git1234").line == "7.0+"
    with pytest.raises(NpuVersionError, match="predates Ascend Extension 6.0"):
        release_of("1.11.0.post15")
    with pytest.raises(NpuVersionError, match="not MAJOR.MINOR.PATCH"):
        release_of("nightly")


def _decode_inputs():
    q = torch.randn(2, 4, 8, dtype=torch.float16)
    k = torch.randn(6, 16, 2, 8, dtype=torch.float16)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    return q, k, k.clone(), table, torch.tensor([20, 5])


@pytest.mark.parametrize("version", SIX + SEVEN)
def test_paged_decode_calls_fused_infer_attention_with_this_versions_keywords(monkeypatch,
                                                                              version):
    calls = fake_torch_npu.install(monkeypatch, version)
    q, k, v, table, lens = _decode_inputs()
    out = npu.paged_decode_attention(q, k, v, table, lens, 0.35)
    (query, key, value), kwargs = calls.last("npu_fused_infer_attention_score")
    scale_kw = "scale_value" if fake_torch_npu.line_of(version) == "6.0" else "scale"
    assert kwargs.keys() == {"block_table", "actual_seq_lengths_kv", "num_heads",
                             "num_key_value_heads", "input_layout", "block_size", scale_kw}
    assert kwargs[scale_kw] == 0.35 and kwargs["input_layout"] == "BSH"
    assert (kwargs["num_heads"], kwargs["num_key_value_heads"], kwargs["block_size"]) == (4, 2, 16)
    assert kwargs["actual_seq_lengths_kv"] == [20, 5]
    assert kwargs["block_table"].dtype == torch.int32
    assert (query.shape, key.shape, value.shape) == ((2, 1, 32), (6, 16, 16), (6, 16, 16))
    assert out.shape == q.shape


@pytest.mark.parametrize("version", ["2.1.0.post10", "2.5.1"])
def test_kv_write_norms_and_swiglu_calls(monkeypatch, version):
    calls = fake_torch_npu.install(monkeypatch, version)
    key = torch.randn(3, 2, 8, dtype=torch.float16)
    cache = torch.zeros(4, 16, 2, 8, dtype=torch.float16)
    npu.write_kv(key, key, cache, cache.clone(), torch.tensor([5, -1, 17]))
    args, kwargs = calls.last("npu_scatter_pa_kv_cache")
    assert len(args) == 5 and kwargs == {}
    assert args[4].tolist() == [5, 17] and args[4].dtype == torch.int32  # padding slot dropped
    assert args[0].shape == (2, 2, 8)
    x, w = torch.randn(3, 8, dtype=torch.float16), torch.ones(8, dtype=torch.float16)
    npu.rms_norm(x, w, 1e-5)
    assert calls.last("npu_rms_norm")[1] == {"epsilon": 1e-5}
    y, summed = npu.rms_norm(x, w, 1e-6, residual=x)
    args, kwargs = calls.last("npu_add_rms_norm")
    assert (args[0] is x, args[1] is x, args[2] is w, kwargs) == (True, True, True,
                                                                  {"epsilon": 1e-6})
    npu.silu_and_mul(torch.randn(3, 16, dtype=torch.float16))
    assert calls.last("npu_swiglu")[1] == {"dim": -1}


def test_an_op_missing_from_torch_npu_runs_the_portable_path(monkeypatch):
    calls = fake_torch_npu.install(monkeypatch, "2.5.1", missing=("npu_swiglu",))
    x = torch.randn(3, 16)
    torch.testing.assert_close(npu.silu_and_mul(x), torch.nn.functional.silu(x[:, :8]) * x[:, 8:])
    assert "npu_swiglu" not in calls.names()


def test_version_is_read_once(monkeypatch):
    fake_torch_npu.install(monkeypatch, "2.4.0.post2")
    first = torch_npu_api.load()
    assert torch_npu_api.load() is first and first.release.line == "6.0"


class FakeBackend:
    def __init__(self, name: str, seen: list[int]) -> None:
        self.name, self.seen = name, seen

    def get_hccl_comm_name(self, rank: int) -> str:
        self.seen.append(rank)
        return self.name


class FakeProcessGroup:
    """TEST DOUBLE of an hccl ProcessGroup: only the communicator-name lookup."""

    def __init__(self, name: str) -> None:
        self.name, self.devices, self.ranks = name, [], []

    def _get_backend(self, device):
        self.devices.append(device)
        return FakeBackend(self.name, self.ranks)


def _tp_group(name: str | None = "hcom_tp", size: int = 2) -> CommGroup:
    ranks = tuple(Rank(r) for r in range(4, 4 + size))
    return CommGroup("tp", ranks, Rank(5), FakeProcessGroup("from_pg"), hccl_comm_name=name)


@pytest.mark.parametrize("version", ["2.1.0.post10", "2.5.1"])
def test_mc2_ops_get_the_groups_hccl_communicator_name(monkeypatch, version):
    calls = fake_torch_npu.install(monkeypatch, version)
    x, w = torch.randn(4, 256, dtype=torch.float16), torch.randn(256, 8, dtype=torch.float16)
    group = _tp_group()
    npu.matmul_all_reduce(x, w, group, 1)
    args, kwargs = calls.last("npu_mm_all_reduce_base")
    assert (args[2], kwargs) == ("hcom_tp", {"reduce_op": "sum", "bias": None})
    out, gathered = npu.all_gather_matmul(x, w, group, 1, return_gathered=True)
    args, kwargs = calls.last("npu_all_gather_base_mm")
    assert (args[2:], kwargs) == (("hcom_tp", 2), {"gather_output": True})
    assert out.shape == (8, 8) and gathered.shape == (8, 256)
    npu.matmul_reduce_scatter(x, w, group, 1)
    args, kwargs = calls.last("npu_mm_reduce_scatter_base")
    assert (args[2:], kwargs) == (("hcom_tp", 2), {"reduce_op": "sum"})


def test_mc2_resolves_the_name_from_the_process_group_when_not_stored(monkeypatch):
    calls = fake_torch_npu.install(monkeypatch, "2.5.1")
    group = _tp_group(name=None)
    monkeypatch.setattr(npu, "hccl_comm_name",
                        lambda pg, rank: hccl_comm_name(pg, rank, device="npu"))
    npu.matmul_all_reduce(torch.randn(4, 256, dtype=torch.float16),
                          torch.randn(256, 8, dtype=torch.float16), group, 1)
    assert calls.last("npu_mm_all_reduce_base")[0][2] == "from_pg"
    assert group.process_group.ranks == [5]  # the global rank, as torch_npu documents


def test_init_fills_hccl_names_for_multi_rank_groups_only():
    world = CommGroup("world", (Rank(0), Rank(1)), Rank(1), FakeProcessGroup("hcom_world"))
    single = CommGroup("pp", (Rank(1),), Rank(1))
    groups = with_hccl_names(ParallelGroups("hccl", world, world, single, single, single),
                             device="npu")
    assert (groups.world.hccl_comm_name, groups.tp.hccl_comm_name) == ("hcom_world",
                                                                       "hcom_world")
    assert groups.pp.hccl_comm_name is None and world.process_group.devices == ["npu", "npu"]
    assert world.process_group.ranks == [1, 1]  # this process's global rank
    with pytest.raises(ValueError, match="no HCCL backend"):
        hccl_comm_name(object(), 0, device="npu")


def test_mc2_outside_documented_constraints_keeps_the_tiled_path(monkeypatch):
    calls = fake_torch_npu.install(monkeypatch, "2.5.1")
    x, w = torch.randn(4, 64), torch.randn(64, 8)  # float32 and K < 256: not MC2
    group = CommGroup("local", (Rank(0),), Rank(0))
    torch.testing.assert_close(npu.matmul_all_reduce(x, w, group, 1), x @ w)
    assert not calls.names()
