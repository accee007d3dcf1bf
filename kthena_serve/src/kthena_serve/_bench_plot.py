"""The PNG of ``kthena bench serve``: one panel per case, kthena vs transformers vs vLLM."""

from __future__ import annotations

__all__ = ["plot"]

_COLORS = {"kthena": "#2f6db5", "kthena, no reuse": "#9bb9e0", "transformers": "#e08a2f",
           "vLLM (issue)": "#8a8a8a"}


def _bars(ax, title: str, unit: str, values: dict[str, float | None]) -> None:
    shown = {k: v for k, v in values.items() if v is not None}
    bars = ax.bar(list(shown), list(shown.values()), color=[_COLORS[k] for k in shown])
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(axis="x", labelsize=7, rotation=15)


def plot(result: dict, path: str) -> None:
    """Write the figure for a ``run_bench`` result to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ours, hf = result.get("kthena", {}), result.get("transformers", {})
    vllm = result["vllm_reference_from_issue"]
    panels = []
    if "a_batch1" in ours:
        panels.append(("(a) batch-1 decode", "tokens/s", {
            "kthena": ours["a_batch1"]["decode_tok_s"],
            "transformers": hf.get("a_batch1", {}).get("decode_tok_s"),
            "vLLM (issue)": vllm["a_decode_tok_s"]}))
        panels.append(("(a) TTFT, 128-token prompt", "seconds", {
            "kthena": ours["a_batch1"]["ttft_s"],
            "transformers": hf.get("a_batch1", {}).get("ttft_s")}))
    if "b_offline" in ours:
        panels.append(("(b) 32 x (128 in, 64 out)", "output tokens/s", {
            "kthena": ours["b_offline"]["output_tok_s"],
            "transformers": hf.get("b_offline", {}).get("output_tok_s"),
            "vLLM (issue)": vllm["b_output_tok_s"]}))
    if "c_shared_prefix_reuse" in ours:
        panels.append(("(c) 32 x (512 shared + 32, 16 out)", "total seconds (lower is better)", {
            "kthena": ours["c_shared_prefix_reuse"]["total_s"],
            "kthena, no reuse": ours["c_shared_prefix_no_reuse"]["total_s"],
            "transformers": hf.get("c_shared_prefix", {}).get("total_s"),
            "vLLM (issue)": vllm["c_total_s_reuse"]}))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 3.4), squeeze=False)
    for ax, (title, unit, values) in zip(axes[0], panels, strict=True):
        _bars(ax, title, unit, values)
    machine = result["machine"]
    fig.suptitle(f"kthena bench serve — {result['model']} {result['dtype']}, "
                 f"{machine['cores']} cores ({machine['cpu']}), load "
                 f"{machine['load_avg_1m_before']}→{machine['load_avg_1m_after']}, "
                 f"median of {result['runs']}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
