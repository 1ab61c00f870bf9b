"""A run at a glance as a PNG: latency distributions and throughput over time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from benchmarks.client import RequestResult
from benchmarks.stats import Timeline, output_tokens, percentile, tpot


def _histogram(ax, values_ms: Sequence[float], title: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("ms")
    if not values_ms:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(values_ms, bins=min(60, max(5, len(values_ms) // 4)), color="#4c72b0")
    for p, style in ((50, "-"), (99, "--")):
        x = percentile(values_ms, p)
        ax.axvline(x, color="#c44e52", linestyle=style, linewidth=1, label=f"p{p} {x:.1f}")
    ax.legend(fontsize=8)


def _series(ax, tl: Timeline, values: Sequence[float], title: str, ylabel: str) -> None:
    times = [(i + 0.5) * tl.bucket_s for i in range(len(values))]
    ax.plot(times, values, color="#55a868", marker=".", markersize=3)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)


def save_plot(path: str | Path, results: Sequence[RequestResult], tl: Timeline, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    _histogram(axes[0][0], [r.ttft * 1e3 for r in done], "TTFT")
    _histogram(axes[0][1], [tpot(r) * 1e3 for r in done if output_tokens(r) > 1], "TPOT")
    _histogram(axes[0][2], [g * 1e3 for r in done for g in r.itl], "ITL")
    _histogram(axes[1][0], [r.latency * 1e3 for r in done], "End-to-end latency")
    _series(axes[1][1], tl, tl.tokens_per_s, "Output throughput", "tokens/s")
    _series(axes[1][2], tl, tl.in_flight, "Requests in flight", "requests")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
