"""The report of ``kthena bench trace``: figures from vLLM's client, same-run ratios, table, CDFs.

Every figure comes from the result file of ``vllm bench serve --save-result --save-detailed``
(keys ``p50_ttft_ms``, ``output_throughput``, ..., and the per-request lists ``ttfts``,
``itls``, ``latencies``, ``output_lens``, ``errors``). The per-request lists are turned into
the same four latencies vLLM reports, its percentiles are recomputed from them (numpy's linear
interpolation) as a check that the lists are the ones the summary came from, and the CDF plot
draws them. Nothing is quoted from another run.
"""

from __future__ import annotations

import collections
import math

__all__ = ["LATENCIES", "PERCENTILES", "error_counts", "markdown_table", "ours_vs_peer",
           "per_request", "percentile", "percentile_check", "plot_cdfs", "side_figures"]

LATENCIES = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (50, 90, 99)
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2el": "end-to-end"}
_THROUGHPUTS = (("output_throughput_tok_s", "output_throughput", "output throughput tok/s"),
                ("request_throughput_req_s", "request_throughput", "request throughput req/s"))
_COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens")
_LABELS = {"vllm": "vLLM", "llama.cpp": "llama.cpp", "kthena": "kthena serve"}  # table order


def side_figures(result: dict) -> dict:
    """One system's figures from vLLM's result dict: each latency's mean and percentiles in
    ms, both throughputs, counts and duration.

    Raises:
        ValueError: a key is missing (the client ran without the flags `trace` passes).
    """
    try:
        out: dict = {f"{name}_ms": {"mean": round(result[f"mean_{name}_ms"], 1),
                                    **{f"p{p}": round(result[f"p{p}_{name}_ms"], 1)
                                       for p in PERCENTILES}}
                     for name in LATENCIES}
        out.update({key: round(result[source], 3) for key, source, _ in _THROUGHPUTS})
        out.update({key: result[key] for key in _COUNTS})
        out["duration_s"] = round(result["duration"], 2)
    except KeyError as error:
        raise ValueError(f"vLLM's result has no {error}: run `vllm bench serve` with "
                         "--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles "
                         "50,90,99 --save-result") from None
    return out


def per_request(result: dict) -> dict[str, list[float]]:
    """The successful requests' latencies in seconds, as vLLM's summary computes them: TTFT,
    TPOT ((latency - TTFT) / (output tokens - 1), requests of 2+ tokens), every ITL gap, and
    end-to-end latency. Needs ``--save-detailed``.

    Raises:
        ValueError: the per-request lists are missing.
    """
    try:
        rows = list(zip(result["ttfts"], result["itls"], result["latencies"],
                        result["output_lens"], result["errors"], strict=True))
    except KeyError as error:
        raise ValueError(f"vLLM's result has no per-request {error}: run `vllm bench serve` "
                         "with --save-detailed") from None
    ok = [row for row in rows if not row[4]]
    return {"ttft": [ttft for ttft, *_ in ok],
            "tpot": [(latency - ttft) / (n - 1) for ttft, _, latency, n, _ in ok if n > 1],
            "itl": [gap for _, itls, *_ in ok for gap in itls],
            "e2el": [latency for _, _, latency, *_ in ok]}


def error_counts(result: dict, limit: int = 5) -> dict[str, int]:
    """The failed requests' errors by their last line (a traceback's exception), the
    ``limit`` most common; {} when every request succeeded."""
    lines = [error.strip().splitlines()[-1][:200] for error in result.get("errors", []) if error]
    return dict(collections.Counter(lines).most_common(limit))


def percentile(values: list[float], q: float) -> float:
    """``numpy.percentile(values, q)`` (linear interpolation between closest ranks); 0 for
    no values, as vLLM reports an empty metric."""
    if not values:
        return 0.0
    ranked = sorted(values)
    at = (len(ranked) - 1) * q / 100
    low, high = math.floor(at), math.ceil(at)
    return ranked[low] + (ranked[high] - ranked[low]) * (at - low)


def percentile_check(result: dict, lists: dict[str, list[float]]) -> dict:
    """Our percentiles of the per-request lists against vLLM's summary: the largest relative
    difference, and whether every one agrees to 1e-6."""
    worst = 0.0
    for name in LATENCIES:
        for p in PERCENTILES:
            reported = result[f"p{p}_{name}_ms"]
            ours = percentile(lists[name], p) * 1000
            worst = max(worst, abs(ours - reported) / max(abs(reported), 1e-9))
    return {"max_rel_diff": float(f"{worst:.3g}"), "agrees": worst <= 1e-6}


def _ratio(numerator: float, denominator: float) -> float | None:
    return round(numerator / denominator, 3) if denominator > 0 and numerator > 0 else None


def ours_vs_peer(ours: dict, peer: dict) -> dict:
    """Ratios that read "higher is better for ours": the peer's latency ÷ ours, our throughput
    ÷ the peer's (None where a figure is 0)."""
    out: dict = {f"{name}_ms": {key: _ratio(peer[f"{name}_ms"][key], value)
                                for key, value in ours[f"{name}_ms"].items()}
                 for name in LATENCIES}
    out.update({key: _ratio(ours[key], peer[key]) for key, _, _ in _THROUGHPUTS})
    return out


def _cell(figures: dict, name: str, digits: int = 0) -> str:
    return " / ".join("–" if figures[f"{name}_ms"][f"p{p}"] is None
                      else f"{figures[f'{name}_ms'][f'p{p}']:,.{digits}f}" for p in PERCENTILES)


def _ratio_cell(values: list[float | None]) -> str:
    return " / ".join("–" if v is None else f"{v:.2f}" for v in values)


def markdown_table(report: dict) -> str:
    """A Markdown table of each system's figures (and ours ÷ the peer's where there is one),
    with the window, the CPU and the load above it."""
    systems = [name for name in _LABELS if name in report]
    peer = next((s for s in systems if s != "kthena"), None)
    ratios = report.get(f"kthena_vs_{peer}")
    head = ["metric", *(_LABELS[s] for s in systems)] + (
        [f"kthena / {_LABELS[peer]} (higher is better)"] if ratios else [])
    lines = [_caption(report), "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for key, _, label in _THROUGHPUTS:
        row = [label, *(f"{report[s][key]:.2f}" for s in systems)]
        lines.append("| " + " | ".join(row + ([_ratio_cell([ratios[key]])] if ratios else []))
                     + " |")
    for name in LATENCIES:
        row = [f"{_NAMES[name]} p50 / p90 / p99 ms", *(_cell(report[s], name) for s in systems)]
        if ratios:
            row.append(_ratio_cell([ratios[f"{name}_ms"][f"p{p}"] for p in PERCENTILES]))
        lines.append("| " + " | ".join(row) + " |")
    for key in ("completed", "failed"):
        lines.append("| " + " | ".join([key, *(str(report[s][key]) for s in systems)]
                                       + ([""] if ratios else [])) + " |")
    return "\n".join(lines) + "\n"


def _caption(report: dict) -> str:
    window, machine = report["window"], report["machine"]
    return (f"Requests {window['start']}–{window['start'] + window['count'] - 1} of "
            f"{window['trace']}: {window['block_tokens']} tokens per block, outputs × "
            f"{window['output_scale']} capped at {window['output_cap']}, timestamps × "
            f"{window['time_scale']} ({window['prompt_tokens']:,} prompt tokens, "
            f"{window['arrival_span_s']:.1f} s of arrivals); {machine['cpu']} "
            f"({machine['cpu_isa']}), {machine['cores']} cores, load "
            f"{machine['loadavg_before'][0]} → {machine['loadavg_after'][0]}; commit "
            f"{report['git_commit']}.")


def plot_cdfs(lists: dict[str, dict[str, list[float]]], path: str, title: str) -> None:
    """CDFs of TTFT, TPOT and ITL, one line per system (``lists[system][latency]``, seconds),
    to a PNG at ``path``.

    Raises:
        RuntimeError: matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import NullFormatter
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: `pip install matplotlib` in this venv, "
                           "or leave --plot out") from None
    from kthena_serve.bench.plot import save_figure

    colors = {"kthena": "#2f6db5", "vllm": "#8a8a8a", "llama.cpp": "#5a9e4b"}
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, name in zip(axes, ("ttft", "tpot", "itl"), strict=True):
        for system, values in lists.items():
            ranked = sorted(v * 1000 for v in values[name] if v > 0)
            if ranked:
                ax.step([ranked[0], *ranked], [i / len(ranked) for i in range(len(ranked) + 1)],
                        where="post", label=system, color=colors.get(system))
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_ylim(0, 1.02)
        ax.set_xlabel(f"{_NAMES[name]} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of gaps")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    save_figure(fig, path, title)
