"""The architectures the serving engine loads: one list, read by the engine's loader, the planner
and ``kthena deploy k8s`` (a plan or a manifest for a model the engine refuses is refused first).

Each name is a Hugging Face ``architectures`` entry of ``config.json``. kthena_serve's loader
implements them; kthena_core holds the list because it sits below every layer that asks. A
config without ``architectures`` is read as `DEFAULT_ARCHITECTURE` (``config_architectures``),
as the loader reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["DEFAULT_ARCHITECTURE", "SERVED_ARCHITECTURES", "config_architectures",
           "unserved_architecture"]

SERVED_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
})

DEFAULT_ARCHITECTURE = "LlamaForCausalLM"
"""What a ``config.json`` without ``architectures`` is taken to be."""


def config_architectures(config: Mapping[str, Any]) -> list[str]:
    """The architectures a config declares, or `DEFAULT_ARCHITECTURE` when it declares none."""
    return [str(a) for a in config.get("architectures") or [DEFAULT_ARCHITECTURE]]


def unserved_architecture(architectures: Iterable[str]) -> str | None:
    """Why the engine cannot serve a config whose ``architectures`` are these, or None."""
    archs = list(architectures)
    if SERVED_ARCHITECTURES.intersection(archs):
        return None
    return (f"architecture {archs} is not supported by the engine; allowed: "
            f"{', '.join(sorted(SERVED_ARCHITECTURES))}")
