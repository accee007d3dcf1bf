"""The planner gives no rank to devices discovery marks unhealthy, and says which it left out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kthena_core.cli import main
from kthena_core.discovery import build_ascend_topology, parse_npu_smi_info, parse_npu_topo
from kthena_core.hardware import get_device
from kthena_core.known_models import load_model_spec
from kthena_core.planner import NoFeasiblePlanError, Planner
from kthena_core.report import format_plan
from kthena_core.topology import Device, Link, Topology
from kthena_core.workload import Workload

DATA = Path(__file__).parent / "data"
INFO = "npu-smi-info.atlas800t-a2.910b3x8.ms-swift.txt"
TOPO = "npu-smi-info-t-topo.atlas800t-a2.910b3x8.ms-swift.txt"


def probe(name: str) -> str:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return "\n".join(line for line in lines if not line.startswith("# ")) + "\n"


def a2_with_alarms(bad: set[int]) -> Topology:
    """The recorded 8 x 910B3 npu-smi output with the Health cell of NPUs `bad` set to Alarm."""
    def alarm(m: re.Match) -> str:
        return m.group(0).replace("| OK ", "| Alarm", 1) if int(m.group(1)) in bad else m.group(0)

    info = re.sub(r"^\| (\d+)\s+910B3\s+\| OK ", alarm, probe(INFO), flags=re.M)
    return build_ascend_topology(parse_npu_smi_info(info), parse_npu_topo(probe(TOPO)))


def two_domain_box(health: list[str]) -> Topology:
    """8 devices, two 4-device fast domains joined by slow links (like two HCCS meshes on PCIe)."""
    spec = get_device("ascend-910b3")
    devs = tuple(Device(i, 0, i, spec, health=h) for i, h in enumerate(health))
    links = tuple(Link(a, b, "hccs" if a // 4 == b // 4 else "pcie", 196e9 if a // 4 == b // 4 else 16e9, 2e-6)
                  for a in range(8) for b in range(a + 1, 8))
    return Topology(devices=devs, links=links, name="2x4 box", source="test")


def test_discovery_marks_alarmed_npus_unhealthy():
    topo = a2_with_alarms({1, 3, 5, 7})
    assert [d.health for d in topo.devices] == ["ok", "unhealthy"] * 4


def test_plan_uses_only_the_four_healthy_npus_and_lists_the_others():
    topo = a2_with_alarms({1, 3, 5, 7})
    plan = Planner().plan(load_model_spec("llama-2-70b"), topo, Workload(concurrency=8))
    assert set(plan.device_ids) <= {0, 2, 4, 6} and plan.world_size == 4
    assert [x.device_id for x in plan.excluded] == [1, 3, 5, 7]
    assert all("unhealthy" in x.reason for x in plan.excluded)
    d = plan.to_dict()
    assert [x["id"] for x in d["excluded_devices"]] == [1, 3, 5, 7]
    assert "excluded  4 device(s) given no rank: 1 (unhealthy" in format_plan(plan)


def test_tp_groups_stay_inside_a_link_domain_after_exclusion():
    # Healthy: 0, 2 (domain A) and 4, 6 (domain B): TP2 groups must not straddle A and B.
    topo = two_domain_box(["ok", "unhealthy"] * 4)
    plan = Planner().plan(load_model_spec("llama-2-7b"), topo, Workload(concurrency=8))
    assert set(plan.device_ids) <= {0, 2, 4, 6}
    for group in plan.tp_groups():
        assert len({plan.device_ids[r] // 4 for r in group}) == 1, plan.tp_groups()


def test_a_straddling_tp_group_is_scored_at_the_slow_link():
    # Healthy: 0, 1, 2 in A and 4 in B. TP2 x DP2 would pair 2 with 4 over PCIe.
    topo = two_domain_box(["ok", "ok", "ok", "unhealthy", "ok", "unhealthy", "unhealthy", "unhealthy"])
    planner, model, wl = Planner(), load_model_spec("llama-2-7b"), Workload(concurrency=8)
    from kthena_core.layout import Layout
    straddle = planner.evaluate(model, topo, wl, Layout(2, 1, 2))
    inside = planner.evaluate(model, topo, wl, Layout(2, 1, 1))
    assert straddle.estimate.tpot_s > inside.estimate.tpot_s / 2  # not twice as good per replica


def test_too_few_healthy_devices_says_how_many_and_which():
    topo = a2_with_alarms({0, 1, 2, 3, 4, 5, 6})
    with pytest.raises(NoFeasiblePlanError) as info:
        Planner().plan(load_model_spec("llama-2-70b"), topo, Workload())
    msg = str(info.value)
    assert "1 of 8 devices healthy" in msg and "device 6 unhealthy" in msg


def test_no_healthy_device_at_all():
    topo = a2_with_alarms(set(range(8)))
    with pytest.raises(NoFeasiblePlanError, match="0 of 8 devices are healthy; excluded: device 0 unhealthy"):
        Planner().plan(load_model_spec("default"), topo, Workload())


def test_cli_json_lists_excluded_devices(tmp_path, capsys):
    path = tmp_path / "topo.yaml"
    path.write_text("nodes:\n  - device: ascend-910b3\n    devices: 4\n    health: [ok, unhealthy, ok, ok]\n")
    assert main(["plan", "--topology", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [x["id"] for x in out["excluded_devices"]] == [1] and 1 not in out["device_ids"]
    assert out["calibration"] is None
