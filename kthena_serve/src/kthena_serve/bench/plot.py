"""The report of ``kthena bench serve``: a text table and a PNG of the same-run ratios.

Both read only the result dict `kthena_serve.bench.serve.run_bench` builds: the per-system medians,
``limits``, ``fraction_of_limit`` and ``speedup_vs``. Nothing is quoted from elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kthena_serve.bench.limits import COMPARED

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot", "table"]

_SYSTEMS = ("kthena", "vllm", "llama.cpp", "transformers")
_SHORT = {"a_batch1/decode_tok_s": "(a) decode", "a_batch1/ttft_s": "(a) TTFT",
          "b_offline/output_tok_s": "(b) 32x128->64", "c_shared_prefix_reuse/total_s": "(c) reuse",
          "c_shared_prefix_no_reuse/total_s": "(c) no reuse"}
_COLORS = {"kthena": "#2f6db5", "vllm": "#8a8a8a", "llama.cpp": "#5a9e4b",
           "transformers": "#e08a2f"}


def save_figure(fig: Figure, path: str, title: str, fontsize: int = 8) -> None:
    """Title ``fig`` (the run's model, machine and load), lay it out, write it to ``path`` and
    close it: every benchmark's plot ends so."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _get(result: dict, *keys: str) -> float | None:
    value: object = result
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value  # type: ignore[return-value]


def _fmt(value: float | None, suffix: str = "") -> str:
    return "–" if value is None else f"{value:.3g}{suffix}"


def table(result: dict) -> str:
    """A Markdown table: each figure per system, its limit, shares of it, and our speed-ups."""
    systems = [s for s in _SYSTEMS if s in result]
    peers = [s for s in systems if s != "kthena"]
    head = (["workload", *systems, "limit", *(f"{s} / limit" for s in systems),
             *(f"kthena vs {p}" for p in peers)])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, case, metric in COMPARED:
        if _get(result, "kthena", case, metric) is None:
            continue
        cells = [label, *(_fmt(_get(result, s, case, metric)) for s in systems),
                 _fmt(_get(result, "limits", case, metric)),
                 *(_fmt(_get(result, "fraction_of_limit", s, case, metric)) for s in systems),
                 *(_fmt(_get(result, "speedup_vs", p, case, metric), "×") for p in peers)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _grouped(ax, title: str, groups: dict[str, dict[str, float | None]]) -> None:
    names = [n for n in _SYSTEMS if any(g.get(n) is not None for g in groups.values())]
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(groups))]
        values = [g.get(name) or 0.0 for g in groups.values()]
        bars = ax.bar(xs, values, width, label=name, color=_COLORS[name])
        ax.bar_label(bars, labels=[_fmt(g.get(name)) if g.get(name) else "" for g in
                                   groups.values()], fontsize=6)
    ax.set_xticks([j + width * (len(names) - 1) / 2 for j in range(len(groups))], list(groups),
                  fontsize=7, rotation=15)
    ax.set_title(title, fontsize=9)
    if names:
        ax.legend(fontsize=7)
    else:  # e.g. the speed-ups of a run without peers (--no-hf, no --peer)
        ax.text(0.5, 0.5, "no figures in this run", ha="center", va="center",
                transform=ax.transAxes, fontsize=8)


def plot(result: dict, path: str) -> None:
    """Write the figure for a ``run_bench`` result to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(case, metric) for _, case, metric in COMPARED
            if _get(result, "kthena", case, metric) is not None]
    speedups = {_SHORT[f"{c}/{m}"]: {p: _get(result, "speedup_vs", p, c, m)
                                     for p in result.get("speedup_vs", {})} for c, m in keys}
    shares = {_SHORT[f"{c}/{m}"]: {s: _get(result, "fraction_of_limit", s, c, m)
                                   for s in _SYSTEMS} for c, m in keys}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    _grouped(left, "kthena speed-up over each peer (same run; > 1: kthena faster)", speedups)
    left.axhline(1.0, color="black", linewidth=0.8)
    _grouped(right, "share of the machine's limit reached (1 = limit)", shares)
    right.axhline(1.0, color="black", linewidth=0.8)
    machine, limits = result["machine"], result["limits"]["machine"]
    save_figure(fig, path, f"kthena bench serve — {result['model']} {result['dtype']}, "
                f"{machine['cores']} cores ({machine['cpu']}"
                f"{'; ' + machine['cpu_isa'] if machine.get('cpu_isa') else ''}), load "
                f"{machine['load_avg_1m_before']}→{machine['load_avg_1m_after']}, median of "
                f"{result['runs']}; limits: {limits['bandwidth_gb_s']} GB/s, "
                f"{limits['matmul_peak_gflop_s']} GFLOP/s")
