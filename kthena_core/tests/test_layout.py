"""Layout: the one parallel layout value validates its sizes and the SP rule, and prints itself."""

from __future__ import annotations

import attrs
import pytest

from kthena_core.layout import ExpertLayout, Layout, LayoutError, with_ep


def test_layout_defaults_and_figures():
    layout = Layout(2, dp=2)
    assert (layout.tp, layout.pp, layout.dp, layout.sp) == (2, 1, 2, 1)
    assert layout.num_devices == 4 and layout.device_mapping == (2, 1, 2)
    assert Layout(2, sp=2).device_mapping == Layout(2).device_mapping
    assert str(Layout(2, 1, 1, 2)) == "tp=2 pp=1 dp=1 sp=2"


def test_layout_validates():
    with pytest.raises(LayoutError, match="tp must be a positive int, got 0"):
        Layout(0)
    with pytest.raises(LayoutError, match="pp must be a positive int, got True"):
        Layout(1, pp=True)
    with pytest.raises(LayoutError, match="sp=4 must be 1 or equal tp=2"):
        Layout(2, sp=4)
    assert issubclass(LayoutError, ValueError)


def test_an_expert_layout_overlays_ep_on_the_instances():
    layout = with_ep(Layout(8, 1, 4), 4)
    assert isinstance(layout, ExpertLayout) and (layout.ep, layout.num_devices) == (4, 32)
    assert layout.label == "TP8 x PP1 x DP4 (EP4)" and str(layout).endswith(" ep=4")
    assert with_ep(Layout(8, 1, 4, 8), 2).label == "TP8 x PP1 x DP4 (EP2, SP8)"
    plain = with_ep(Layout(8, 1, 4), 1)
    assert type(plain) is Layout and plain.ep == 1 and plain.label == "TP8 x PP1 x DP4"
    assert attrs.asdict(plain) == {"tp": 8, "pp": 1, "dp": 4, "sp": 1}  # the engine's form
    with pytest.raises(LayoutError, match="ep=3 must divide dp=4"):
        ExpertLayout(8, 1, 4, ep=3)
