"""The PD benchmark's figure: handoff time vs KV bytes, the layer-wise push's overlap, and
TPOT / inter-token gaps per deployment."""

from __future__ import annotations

__all__ = ["plot"]


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    rows = result["handoff"]
    mib = [r["kv_bytes"] / 2**20 for r in rows]
    ax = axes[0]
    for key, label in (("zero_copy_s", "zero copy (control message only)"),
                       ("host_copy_s", "copy through host memory"),
                       ("mooncake_sync_s", "Mooncake put, batched, sync"),
                       ("mooncake_async_s", "Mooncake put, batched, async+wait")):
        ax.plot(mib, [r[key] * 1e3 for r in rows], marker="o", label=label)
    per_token = [(m, r["mooncake_per_token_s"] * 1e3) for m, r in zip(mib, rows, strict=True)
                 if "mooncake_per_token_s" in r]
    if per_token:
        ax.plot(*zip(*per_token, strict=True), marker="x", linestyle="--",
                label="Mooncake put, one call per token")
    ax.set(xscale="log", yscale="log", xlabel="KV bytes of the request (MiB; 64-2048 tokens)",
           ylabel="handoff time (ms)", title="Handoff cost vs KV size (SmolLM2-135M, bf16)")
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    overlap = result.get("overlap")
    ax = axes[1]
    if overlap:
        sizes = sorted({r["tokens"] for r in overlap})
        for offset, mode in ((-0.2, "layerwise"), (0.2, "batched")):
            by_size = {r["tokens"]: r for r in overlap if r["kv_push"] == mode}
            ax.bar([i + offset for i in range(len(sizes))],
                   [by_size[t]["after_compute_s"] * 1e3 for t in sizes], width=0.4,
                   label=f"{mode} push")
        ax.set_xticks(range(len(sizes)), [f"{t} tokens" for t in sizes])
        ax.set(yscale="log", ylabel="end of prefill compute → KV in decode pool (ms, log)",
               title="Layer-wise vs batched push (Mooncake, workers)")
        ax.legend(fontsize=8)
    serving = result.get("serving")
    ax = axes[2]
    if serving:
        names = [n for n in ("colocated", "pd", "decode_only_baseline") if n in serving]
        x = range(len(names))
        for offset, key, label in ((-0.2, "tpot_p50", "TPOT p50"), (0.0, "tpot_p99", "TPOT p99"),
                                   (0.2, "itl_p99", "inter-token p99")):
            ax.bar([i + offset for i in x], [(serving[n][key] or 0) * 1e3 for n in names],
                   width=0.2, label=label)
        ax.set_xticks(list(x), names)
        ax.set(yscale="log", ylabel="ms (log)", title="Decode streams while long prompts arrive")
        ax.legend(fontsize=8)
    fig.suptitle(f"kthena PD bench — {result['machine']['cores']} cores, "
                 f"load {result['machine']['load_1min']:.1f}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
