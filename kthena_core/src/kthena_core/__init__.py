"""kthena_core: model spec, hardware catalog, topology discovery, parallel planner, config, launcher.

Depends on attrs, numpy and pyyaml only; torch is imported lazily, by the launcher and by
`kthena_core.dtypes.torch_dtype` alone.
"""

from kthena_core.config import ConfigError, KthenaConfig, load_config
from kthena_core.cost_model import CostParams, Estimate, Memory
from kthena_core.hardware import (
    DeviceSpec,
    NodeSpec,
    get_device,
    get_node,
    list_devices,
    list_nodes,
)
from kthena_core.known_models import DefaultModelMissingError, default_gguf_path, load_model_spec
from kthena_core.layout import ExpertLayout, Layout, LayoutError, PDLayout
from kthena_core.model_spec import MissingKeyError, ModelSpec, ModelSpecError
from kthena_core.planner import Evaluation, NoFeasiblePlanError, Plan, Planner
from kthena_core.shape import (
    HeadMove,
    HeadSplitError,
    ModelShape,
    ModelShapeError,
    allowed_tp_sizes,
    attention_head_range,
    check_tp,
    check_tp_divides_heads,
    kv_head_moves,
    kv_head_range,
    kv_heads_per_rank,
    tp_sizes_dividing_heads,
)
from kthena_core.topology import Device, Link, Topology, TopologyError, from_catalog
from kthena_core.workload import Workload, WorkloadError

__all__ = [
    "ConfigError",
    "CostParams",
    "DefaultModelMissingError",
    "Device",
    "DeviceSpec",
    "Estimate",
    "Evaluation",
    "ExpertLayout",
    "HeadMove",
    "HeadSplitError",
    "KthenaConfig",
    "Layout",
    "LayoutError",
    "Link",
    "Memory",
    "MissingKeyError",
    "ModelShape",
    "ModelShapeError",
    "ModelSpec",
    "ModelSpecError",
    "NoFeasiblePlanError",
    "NodeSpec",
    "PDLayout",
    "Plan",
    "Planner",
    "Topology",
    "TopologyError",
    "Workload",
    "WorkloadError",
    "allowed_tp_sizes",
    "attention_head_range",
    "check_tp",
    "check_tp_divides_heads",
    "default_gguf_path",
    "from_catalog",
    "get_device",
    "get_node",
    "kv_head_moves",
    "kv_head_range",
    "kv_heads_per_rank",
    "list_devices",
    "list_nodes",
    "load_config",
    "load_model_spec",
    "tp_sizes_dividing_heads",
]
