"""The article's entry points: ``DistributedModel`` generates what ``LLM`` generates (tp 1 and 2),
maps a transformers model to its folder, refuses bad arguments by name; and
``launch_distributed_inference`` serves a config as ``kthena serve --config`` does, with the
model's explicit choices overriding it, until SIGTERM (exit 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest
from _support import free_port

from kthena_core.config import ConfigError as KthenaConfigError
from kthena_core.config import load_config
from kthena_serve import DistributedArgumentError, DistributedModel, launch_distributed_inference
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.llm import LLM
from kthena_serve.model import ensure_default_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=8)
PROMPTS = ["The capital of France is", "Three colours of the sea:"]
SMALL = {"num_kv_blocks": 64, "dtype": "float32", "num_threads": 1}
CONFIG = {  # one device, the default model, a tiny pool; the port is filled in per test
    "cluster": {"world_size": 1, "topology": "auto"},
    "parallelism": {"strategy": "tp_pp", "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
    "model": {"checkpoint_path": "default", "dtype": "float32"},
    "service": {"api_type": "http", "host": "127.0.0.1", "max_batch_size": 4,
                "kv_cache_reuse": True},
    "kv_cache": {"max_tokens": 1024, "reuse_bucket_size": 16},
}


@pytest.fixture(scope="module")
def checkpoint():
    return ensure_default_checkpoint(progress=False)


@pytest.fixture(scope="module")
def llm_tokens(checkpoint):
    llm = LLM("default", **SMALL)
    try:
        return [list(out.token_ids) for out in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


# ---- DistributedModel ---------------------------------------------------------------------------
def test_generate_is_llm_generate(llm_tokens):
    # tp/pp > 1 run the same ParallelModelRunner whose greedy parity test_parity.py checks
    with DistributedModel("default", tp_size=1, pp_size=1, **SMALL) as model:
        assert (model.engine_config.tp, model.engine_config.pp) == (1, 1)
        outs = model.generate(PROMPTS, GREEDY)
    assert [list(out.token_ids) for out in outs] == llm_tokens


def test_engine_config_carries_every_choice_and_only_given_ones_are_explicit():
    model = DistributedModel("default", pp_size=2, enable_kv_cache_reuse=False, max_num_seqs=4)
    config = model.engine_config
    assert (config.model, config.tp, config.pp, config.enable_prefix_caching,
            config.max_num_seqs) == ("default", 1, 2, False, 4)
    assert dict(model.explicit_choices) == {"model": "default", "pp": 2,
                                            "enable_prefix_caching": False, "max_num_seqs": 4}
    assert repr(model) == ("DistributedModel(model='default', max_num_seqs=4, pp_size=2, "
                           "enable_kv_cache_reuse=False)")
    model.close()  # nothing was built: a no-op


def test_a_transformers_model_maps_to_its_local_folder(checkpoint):
    transformers = pytest.importorskip("transformers")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    model = DistributedModel(hf_model, tp_size=2)
    assert model.engine_config.model == str(checkpoint)
    assert model.explicit_choices["model"] == str(checkpoint)


def test_a_transformers_model_without_a_folder_is_refused():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16,
                                      num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(DistributedArgumentError, match="no local folder behind it") as error:
        DistributedModel(transformers.LlamaForCausalLM(config))
    assert error.value.argument == "model"
    assert "save_pretrained(FOLDER)" in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "argument", "says"),
    [
        ({"tp_size": 0}, "tp_size", "EngineConfig.tp must be a positive int (got 0)"),
        ({"tp_size": "2"}, "tp_size", "a positive int (got '2')"),
        ({"tp_size": 1.5}, "tp_size", "a positive int (got 1.5)"),
        ({"pp_size": True}, "pp_size", "a positive int (got True)"),
        ({"enable_kv_cache_reuse": "yes"}, "enable_kv_cache_reuse", "True or False"),
        ({"max_num_seqs": 0}, "max_num_seqs", "a positive int"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size",
         "unknown keyword argument; allowed: tp_size, pp_size, enable_kv_cache_reuse"),
        ({"tp": 2}, "tp", "pass it as tp_size="),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, argument, says):
    with pytest.raises(DistributedArgumentError) as error:
        DistributedModel("default", **kwargs)
    assert error.value.argument == argument
    assert str(error.value).startswith(f"{argument}: ") and says in str(error.value)


@pytest.mark.parametrize(("model", "says"), [
    (42, "got a int; allowed: 'default', a checkpoint folder, or a transformers model"),
    ("/no/such/folder", "is not a Hugging Face checkpoint folder"),
])
def test_a_model_that_is_no_checkpoint_is_refused(model, says):
    with pytest.raises(DistributedArgumentError, match="^model: ") as error:
        DistributedModel(model)
    assert says in str(error.value)


# ---- launch_distributed_inference: refusals before anything starts -------------------------------
def test_grpc_is_refused_as_the_config_loader_refuses_it():
    with pytest.raises(KthenaConfigError) as loader:
        load_config({"service": {"api_type": "grpc"}})
    with pytest.raises(DistributedArgumentError) as error:
        launch_distributed_inference(lambda: "default", CONFIG, service_type="grpc")
    assert error.value.argument == "service_type"
    assert str(error.value).split("; allowed: ")[1] == str(loader.value).split("; allowed: ")[1]


def test_bad_launch_arguments_are_refused_by_name():
    config = {**CONFIG, "service": {**CONFIG["service"], "port": 8000}}
    cases = [
        (DistributedModel("default"), config, "model_init_fn", "a function returning"),
        (lambda: 42, config, "model_init_fn", "returned a int; allowed: a DistributedModel"),
        (lambda: "default", 42, "config", "a kthena_config.yaml path, a KthenaConfig"),
        (lambda: DistributedModel("default", num_kv_blocks=8), config, "num_kv_blocks",
         "kthena serve has no flag for it"),
    ]
    for init, cfg, argument, says in cases:
        with pytest.raises(DistributedArgumentError) as error:
            launch_distributed_inference(init, cfg)
        assert error.value.argument == argument and says in str(error.value)


def test_the_seeds_model_init_fn_is_called_with_rank_and_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = {**CONFIG, "service": {**CONFIG["service"], "port": 8000}}
    seen = []

    def model_init_fn(rank, world_size):
        seen.append((rank, world_size))
        return DistributedModel("default", num_kv_blocks=8)  # refused once made: no serving

    with pytest.raises(DistributedArgumentError, match="kthena serve has no flag"):
        launch_distributed_inference(model_init_fn, config)
    assert seen == [(0, 1)]  # one process, no launcher
    with pytest.raises(DistributedArgumentError) as error:
        launch_distributed_inference(lambda rank: "default", config)
    assert error.value.argument == "model_init_fn"
    assert "takes 1 positional arguments; allowed: none, or (rank, world_size)" in str(error.value)


def test_an_invalid_config_fails_before_the_model_is_made(tmp_path):
    made = []
    bad = {**CONFIG, "parallelism": {"strategy": "tp_pp", "tensor_parallel_size": 2}}
    with pytest.raises(KthenaConfigError, match="cluster.world_size"):
        launch_distributed_inference(lambda: made.append(1) or "default", bad)
    (tmp_path / "bad.yaml").write_text("service: {api_type: grpc}\n")
    with pytest.raises(KthenaConfigError, match="service.api_type"):
        launch_distributed_inference(lambda: made.append(1) or "default", tmp_path / "bad.yaml")
    assert not made


# ---- launch_distributed_inference: serving --------------------------------------------------------
_SERVE = textwrap.dedent("""
    import json, sys
    from kthena_serve import DistributedModel, launch_distributed_inference

    def model_init_fn():
        return DistributedModel("default", tp_size=1, enable_kv_cache_reuse=False)

    if __name__ == "__main__":
        sys.exit(launch_distributed_inference(model_init_fn, json.loads(sys.argv[1]), "http"))
""")


def _read_until(proc: subprocess.Popen, marker: str, timeout: float = 240.0) -> str:
    deadline, seen = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"no {marker!r} line:\n" + "".join(seen))


@pytest.mark.slow
def test_launch_serves_the_plan_with_the_models_choices_until_sigterm(tmp_path, checkpoint):
    port = free_port()
    config = {**CONFIG, "service": {**CONFIG["service"], "port": port}}
    script = tmp_path / "serve.py"
    script.write_text(_SERVE)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    env.pop("KTHENA_API_KEY", None)
    proc = subprocess.Popen([sys.executable, str(script), json.dumps(config)], env=env,
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        printed = _read_until(proc, f"on http://127.0.0.1:{port} (max_model_len=")
        assert "kthena serve: plan layout tp=1 pp=1 dp=1" in printed
        assert "override the config: --model, --tp, --no-prefix-caching" in printed
        assert "kv blocks=64" in printed  # kv_cache.max_tokens 1024 / 16: the config still counts
        body = {"model": "default", "max_tokens": 4, "temperature": 0,
                "prompt": "Kthena plans the layout and Mooncake keeps the KV cache; " * 3}
        replies = [httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                              timeout=120).json() for _ in range(2)]
        assert replies[0]["usage"]["completion_tokens"] == 4
        assert replies[0]["choices"][0]["text"] == replies[1]["choices"][0]["text"]
        # enable_kv_cache_reuse=False beat the config's kv_cache_reuse: true
        assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


@pytest.mark.parametrize(("reuse", "flag", "not_flag"), [
    (True, "--enable-prefix-caching", "--no-prefix-caching"),
    (False, "--no-prefix-caching", "--enable-prefix-caching")])
def test_the_override_line_names_the_flag_that_was_really_given(tmp_path, capsys, reuse, flag,
                                                                not_flag):
    """enable_kv_cache_reuse=True was logged as --no-prefix-caching (issue 53): the line names
    the flag that sets the value given, and the spec has that value."""
    from kthena_serve.deployment import resolve_spec
    from kthena_serve.distributed import _flags

    path = tmp_path / "kthena_config.yaml"
    path.write_text(json.dumps({**CONFIG, "service": {**CONFIG["service"],
                                                      "kv_cache_reuse": not reuse}}))
    choices = DistributedModel("default", enable_kv_cache_reuse=reuse).explicit_choices
    spec = resolve_spec(dict(choices), str(path))
    err = capsys.readouterr().err
    assert f"override the config: --model, {flag}\n" in err and not_flag not in err, err
    assert spec.engine.enable_prefix_caching is reuse
    assert _flags(choices) == f"--model default {flag}"
