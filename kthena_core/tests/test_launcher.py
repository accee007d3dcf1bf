"""kthena-run: config -> torchrun argv and per-rank environment, and a real 2-rank gloo launch."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from _support import free_port

from kthena_core.config import ConfigError
from kthena_core.launcher import main
from kthena_core.serving_group import ServingGroup

SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
dist.init_process_group(os.environ["KTHENA_DIST_BACKEND"])
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "KTHENA_TP_SIZE", "KTHENA_PP_SIZE", "OMP_NUM_THREADS", "OMP_WAIT_POLICY"]
out = {k: os.environ.get(k) for k in keys}
out["sum"] = t.item()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_dry_run_prints_env_and_argv(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {world_size: 2, master_port: 29555}\nparallelism: {tensor_parallel_size: 2}\n")
    assert main(["--config", str(cfg), "--backend", "gloo", "--dry-run", "serve.py", "--port", "1"]) == 0
    out = capsys.readouterr().out
    assert "KTHENA_DIST_BACKEND=gloo" in out and "OMP_WAIT_POLICY=PASSIVE" in out
    assert "KTHENA_TP_SIZE" not in out  # nothing read the layout variables: none are exported
    assert "--nproc_per_node=2" in out and "--master_port=29555" in out and "serve.py --port 1" in out


def test_bad_config_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {world_size: 3}\nparallelism: {tensor_parallel_size: 2}\n")
    assert main(["--config", str(cfg), "--dry-run", "x.py"]) == 2
    assert "cluster.world_size: got 3" in capsys.readouterr().err


def test_mismatched_nproc_is_a_clear_error(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("cluster: {world_size: 2}\nparallelism: {tensor_parallel_size: 2}\n")
    assert main(["--config", str(cfg), "--nproc_per_node", "4", "--dry-run", "x.py"]) == 2
    assert "world_size is 2" in capsys.readouterr().err


def test_real_two_rank_gloo_launch(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"cluster: {{world_size: 2, master_port: {free_port()}}}\nparallelism: {{tensor_parallel_size: 2}}\n")
    scratch = tmp_path / "tmp"  # the launch's temp folder: torchrun's log folders go here
    scratch.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "kthena_core.launcher", "--config", str(cfg), "--backend", "gloo",
         str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(scratch.iterdir()) == []  # torchrun's log folders are gone with the launch
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["RANK"] for r in ranks] == ["0", "1"]
    assert all(r["sum"] == 3.0 and r["KTHENA_TP_SIZE"] is None and r["WORLD_SIZE"] == "2" for r in ranks)
    assert all(r["OMP_WAIT_POLICY"] == "PASSIVE" and r["OMP_NUM_THREADS"] for r in ranks)


# ---- inside a Kthena serving group ------------------------------------------------------------
GROUP = {"ENTRY_ADDRESS": "127.0.0.1", "WORKER_INDEX": "1", "GROUP_SIZE": "2"}


def test_serving_group_variables_are_master_addr_node_rank_and_nnodes(monkeypatch, capsys):
    for name, value in GROUP.items():
        monkeypatch.setenv(name, value)
    assert main(["--serving-group", "--nnodes", "2", "--nproc_per_node", "2", "--tp", "2",
                 "--pp", "2", "--backend", "gloo", "--cpus", "6", "--dry-run", "serve"]) == 0
    out = capsys.readouterr().out
    assert ("--nnodes=2 --node_rank=1 --nproc_per_node=2 --master_addr=127.0.0.1" in out
            and "OMP_NUM_THREADS=3" in out)  # --cpus 6 shared by 2 ranks


def test_serving_group_takes_no_address_or_rank_flags(monkeypatch, capsys):
    for name, value in GROUP.items():
        monkeypatch.setenv(name, value)
    assert main(["--serving-group", "--node_rank", "0", "--nproc_per_node", "1", "--pp", "2",
                 "--dry-run", "serve"]) == 2
    assert "drop --master_addr / --node_rank" in capsys.readouterr().err
    assert main(["--cpus", "0", "--dry-run", "serve"]) == 2
    assert "--cpus 0: allowed: an integer >= 1" in capsys.readouterr().err


def test_serving_group_from_environ_names_the_variable_and_what_is_allowed():
    assert ServingGroup.from_environ(GROUP) == ServingGroup("127.0.0.1", 1, 2)
    assert ServingGroup.from_environ({**GROUP, "GROUP_SIZE": "4"}).group_size == 4  # any size
    for change, message in [
        ({"GROUP_SIZE": "0"}, "GROUP_SIZE=0: allowed: an integer >= 1"),
        ({"ENTRY_ADDRESS": " "}, "ENTRY_ADDRESS=' ': allowed: the entry pod's address"),
        ({"WORKER_INDEX": "1.0"}, "WORKER_INDEX='1.0': allowed: 0..1"),
        ({"GROUP_SIZE": "3"}, "GROUP_SIZE=3, but this engine spans --nnodes 2 pods"),
    ]:
        with pytest.raises(ConfigError) as error:
            ServingGroup.from_environ({**GROUP, **change}, expected_size=2)
        assert message in str(error.value)
