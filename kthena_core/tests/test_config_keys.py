"""Every config key the SDK cannot honour is refused at load time, by name, saying what is
supported (STYLE: no key validates and then does nothing)."""

import pytest

from kthena_core.config import ConfigError, load_config
from kthena_core.config_plan import plan_config
from kthena_core.topology import from_catalog


@pytest.mark.parametrize(
    ("data", "key", "supported"),
    [
        ({"service": {"api_type": "grpc"}}, "service.api_type", "only one served"),
        ({"parallelism": {"fused_communication": True}}, "parallelism.fused_communication",
         "false with tensor_parallel_size 1"),
        ({"parallelism": {"strategy": "auto", "fused_communication": True},
          "service": {"mode": "pd"}}, "parallelism.fused_communication",
         "false with service.mode pd"),
        ({"parallelism": {"bucket_size_mb": 25}}, "parallelism.bucket_size_mb",
         "no all-reduce buckets"),
        ({"model": {"attention_kernel": "memory_efficient"}}, "model.attention_kernel", "flash"),
        ({"model": {"attention_kernel": "high_throughput"}}, "model.attention_kernel", "flash"),
        ({"model": {"dtype": "fp8"}}, "model.dtype", "bfloat16, float16 or float32"),
        ({"model": {"dtype": "bf16", "compute_dtype": "fp32"}}, "model.compute_dtype",
         "weight dtype"),
        ({"model": {"parameter_dtype": "fp16"}}, "model.parameter_dtype", "weight dtype"),
        ({"kv_cache": {"max_tokens": 4096, "memory_pool_size": "1GiB"}}, "kv_cache.max_tokens",
         "keep one"),
        ({"parallelism": {"sequence_parallel_enabled": True}},
         "parallelism.sequence_parallel_group_size", "tensor_parallel_size (1), which must be > 1"),
        ({"parallelism": {"strategy": "tp", "tensor_parallel_size": 2,
                          "sequence_parallel_group_size": 2}, "cluster": {"world_size": 2}},
         "parallelism.sequence_parallel_group_size", "set sequence_parallel_enabled: true"),
        ({"parallelism": {"strategy": "tp_pp", "tensor_parallel_size": 2,
                          "pipeline_parallel_size": 2, "sequence_parallel_enabled": True,
                          "sequence_parallel_group_size": 2}, "cluster": {"world_size": 4}},
         "parallelism.sequence_parallel_enabled",
         "pipeline parallelism (pp=2) is not wired"),
        ({"parallelism": {"strategy": "auto", "sequence_parallel_enabled": True},
          "service": {"mode": "pd"}},
         "parallelism.sequence_parallel_enabled", "false with service.mode pd"),
        ({"parallelism": {"strategy": "tp", "pipeline_parallel_size": 2},
          "cluster": {"world_size": 2}}, "parallelism.pipeline_parallel_size", "strategy 'tp'"),
        ({"parallelism": {"strategy": "auto", "tensor_parallel_size": 2},
          "cluster": {"world_size": 2}}, "parallelism.tensor_parallel_size", "planner chooses"),
        ({"service": {"mode": "disaggregated"}}, "service.mode", "colocated, pd"),
    ],
)
def test_an_unsupported_key_is_refused_by_name(data, key, supported):
    with pytest.raises(ConfigError) as error:
        load_config(data)
    message = str(error.value)
    assert message.startswith(f"{key}:") and supported in message, message


def test_every_supported_value_of_the_refused_keys_still_loads():
    cfg = load_config({"service": {"api_type": "http", "mode": "pd"},
                       "parallelism": {"fused_communication": False, "strategy": "auto"},
                       "model": {"attention_kernel": "flash", "dtype": "float16",
                                 "compute_dtype": "fp16"},
                       "kv_cache": {"compression": {"method": "none"}, "max_tokens": 4096}})
    assert (cfg.service.mode, cfg.model.compute_dtype, cfg.kv_cache.max_tokens) == ("pd", "fp16", 4096)
    fused = load_config({"parallelism": {"strategy": "tp", "tensor_parallel_size": 2,
                                         "fused_communication": True},
                         "cluster": {"world_size": 2}})
    assert fused.parallelism.fused_communication  # TP overlap (kthena serve --tp-overlap)
    int8 = load_config({"kv_cache": {"compression": {"method": "int8", "group_size": 64}}})
    assert (int8.kv_cache.compression.method, int8.kv_cache.compression.group_size) == ("int8", 64)


def test_a_pinned_strategy_is_the_layout_planned():
    cfg = load_config({"cluster": {"world_size": 2}, "model": {"checkpoint_path": "default"},
                       "parallelism": {"strategy": "tp", "tensor_parallel_size": 2}})
    plan = plan_config(cfg, from_catalog("atlas-800t-a2", 1))
    assert (plan.layout.tp, plan.layout.pp, plan.layout.dp, plan.layout.sp) == (2, 1, 1, 1)


def test_auto_lets_the_planner_choose_without_sp():
    cfg = load_config({"parallelism": {"strategy": "auto"}})
    plan = plan_config(cfg, from_catalog("atlas-800t-a2", 1))
    assert plan.layout.sp == 1 and all(e.layout.sp == 1 for e in plan.evaluations)


def test_a_pinned_layout_larger_than_the_topology_is_refused():
    cfg = load_config({"cluster": {"world_size": 12},
                       "parallelism": {"strategy": "tp_pp", "tensor_parallel_size": 6,
                                       "pipeline_parallel_size": 2}})
    with pytest.raises(ConfigError, match=r"12 devices, but topology .* has 8"):
        plan_config(cfg, from_catalog("atlas-800t-a2", 1))
