"""Per-run TTFT, TPOT and output throughput of both sides of a `bench compare`, as one PNG (matplotlib, Agg)."""

from __future__ import annotations

PANELS = (
    ("median TTFT (ms)", "median_ttft_ms"),
    ("median TPOT (ms)", "median_tpot_ms"),
    ("output throughput (tok/s)", "output_throughput"),
)


def plot_runs(base: list[tuple[str, dict]], cand: list[tuple[str, dict]], path: str) -> None:
    import statistics

    import matplotlib

    matplotlib.use("Agg")  # no display; safe to call before or after other matplotlib users pick theirs
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.6))
    for ax, (title, key) in zip(axes, PANELS):
        for side, runs, color, marker in (("baseline", base, "tab:blue", "o"), ("candidate", cand, "tab:orange", "s")):
            xs = [i + 1 for i, (_, d) in enumerate(runs) if d.get(key) is not None]
            ys = [d[key] for _, d in runs if d.get(key) is not None]
            ax.plot(xs, ys, marker=marker, linestyle="none", color=color, label=f"{side} (n={len(runs)})")
            if ys:
                ax.axhline(statistics.median(ys), color=color, linestyle="--", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("run")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("bench compare: per-run figures (dashed: median over runs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
