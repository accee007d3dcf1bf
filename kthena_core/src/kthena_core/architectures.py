"""The architectures the serving engine loads: one list, read by the engine's loader, the planner
and ``kthena deploy k8s`` (a plan or a manifest for a model the engine refuses is refused first).

Each name is a Hugging Face ``architectures`` entry of ``config.json``. kthena_serve's loader
implements them; kthena_core holds the list because it sits below every layer that asks.
"""

from __future__ import annotations

from collections.abc import Iterable

SERVED_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
})


def unserved_architecture(architectures: Iterable[str]) -> str | None:
    """Why the engine cannot serve a config whose ``architectures`` are these, or None."""
    archs = list(architectures)
    if SERVED_ARCHITECTURES.intersection(archs):
        return None
    return (f"architecture {archs} is not supported by the engine; allowed: "
            f"{', '.join(sorted(SERVED_ARCHITECTURES))}")
