"""Config loading: the article's YAML format, and a specific error for each kind of bad file."""

import textwrap

import pytest

from kthena_core.config import ConfigError, KthenaConfig, ParallelismConfig, load_config
from kthena_core.known_models import load_model_spec

ARTICLE = """
cluster:
  master_addr: 127.0.0.1
  master_port: 29500
  world_size: 8
  local_rank: 0
parallelism:
  strategy: tp_pp
  tensor_parallel_size: 4
  pipeline_parallel_size: 2
model:
  checkpoint_path: default
  dtype: float16
service:
  api_type: http
  host: 127.0.0.1
  port: 8000
  max_batch_size: 32
  kv_cache_reuse: true
kv_cache:
  compression: {method: none, group_size: 128}
"""


def write(tmp_path, text, name="kthena_config.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_article_config_loads(tmp_path):
    cfg = load_config(write(tmp_path, ARTICLE))
    assert isinstance(cfg, KthenaConfig)
    assert (cfg.parallelism.tensor_parallel_size, cfg.parallelism.pipeline_parallel_size) == (4, 2)
    assert cfg.model.dtype == "fp16"  # normalised
    assert cfg.service.kv_cache_reuse is True
    assert cfg.kv_cache.compression.method == "none"  # int8: kthena_serve's test_int8_kv.py
    cfg.validate_against(load_model_spec("llama-2-70b"))  # 64 heads / 4, 80 layers / 2: fine


def test_relative_checkpoint_path_resolves_next_to_file(tmp_path):
    (tmp_path / "ckpt").mkdir()
    text = ARTICLE.replace("checkpoint_path: default", "checkpoint_path: ckpt")
    assert load_config(write(tmp_path, text)).model.checkpoint_path == "ckpt"


@pytest.mark.parametrize(
    ("old", "new", "pattern"),
    [
        ("  world_size: 8", "  world_size: 6", r"cluster.world_size: got 6.*4 x 2 x 1 = 8"),
        ("  tensor_parallel_size: 4", "  tensor_paralel_size: 4", r"unknown key \(did you mean 'tensor_parallel_size'"),
        ("  max_batch_size: 32", "  max_batch_size: -3", r"service.max_batch_size: got -3; allowed: a number > 0"),
        ("  port: 8000", "  port: 70000", r"service.port: got 70000; allowed: a TCP port"),
        ("  port: 8000", "  port: eighty", r"service.port: got 'eighty'; allowed: an integer"),
        ("  api_type: http", "  api_type: soap", r"service.api_type: got 'soap'; allowed: http, grpc"),
        ("  dtype: float16", "  dtype: float13", r"model.dtype: unknown dtype 'float13'"),
        ("  checkpoint_path: default", "  checkpoint_path: /no/such/model", r"model.checkpoint_path: got '/no/such/model'"),
        ("  kv_cache_reuse: true", "  kv_cache_reuse: yes please", r"service.kv_cache_reuse: got 'yes please'; allowed: true or false"),
        ("  local_rank: 0", "  local_rank: 9", r"cluster.local_rank: got 9; allowed: 0..7"),
        ("cluster:", "clustre:", r"clustre: unknown key \(did you mean 'cluster'"),
    ],
)
def test_bad_values_name_key_value_and_allowed(tmp_path, old, new, pattern):
    assert old in ARTICLE
    with pytest.raises(ConfigError, match=pattern):
        load_config(write(tmp_path, ARTICLE.replace(old, new)))


def _with_tp(tmp_path, tp: int):
    text = ARTICLE.replace("tensor_parallel_size: 4", f"tensor_parallel_size: {tp}")
    return load_config(write(tmp_path, text.replace("pipeline_parallel_size: 2", "pipeline_parallel_size: 1")))


def test_tp_the_engine_cannot_split_is_reported_against_the_model(tmp_path):
    with pytest.raises(ConfigError, match=r"tensor_parallel_size: got 8; allowed: one of 1, 2, 3, 6, 9 "
                                          r"\(.* has 9 attention heads, 3 KV heads\)"):
        _with_tp(tmp_path, 8).validate_against(load_model_spec("default"))


def test_uneven_tp_the_engine_runs_is_accepted():
    cfg = KthenaConfig(parallelism=ParallelismConfig(tensor_parallel_size=2))
    cfg.validate_against(load_model_spec("default"))  # 9 heads / 3 KV heads as 6 + 3 / 2 + 1


def test_unreadable_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "cluster: [unclosed"))
    with pytest.raises(ConfigError, match="<top level>"):
        load_config(write(tmp_path, "- just\n- a list\n"))
    with pytest.raises(ConfigError, match="cluster: got 3; allowed: a mapping"):
        load_config({"cluster": 3})
