"""The model package's exceptions: each names what was wrong and what is allowed."""

from __future__ import annotations


class ModelError(Exception):
    """Base class of every error raised by `kthena_serve.model`."""


class CheckpointError(ModelError, ValueError):
    """A checkpoint folder is missing a file, or a file does not describe a supported model."""


class UnsupportedModelError(ModelError, ValueError):
    """The checkpoint is readable but its architecture or an option is not supported."""


class ConversionError(ModelError, RuntimeError):
    """Converting the default GGUF file into a checkpoint folder failed."""


class TensorParallelError(ModelError, ValueError):
    """A tensor- or pipeline-parallel plan does not fit the model (heads tp cannot split,
    layers pp cannot split, bad rank)."""


class BatchError(ModelError, ValueError):
    """A forward's inputs disagree with each other or with the model (token counts, KV caches,
    pipeline stage); a malformed `PagedBatch` itself is mooncake_kv's `PagedBatchError`."""


class ChatTemplateError(ModelError, ValueError):
    """The tokenizer has no chat template, or the messages do not fit it."""
