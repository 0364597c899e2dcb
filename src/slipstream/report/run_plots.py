"""Small helpers the run report's plots share: one colour per run, labels safe for matplotlib,
and the size and look of a panel."""

from __future__ import annotations

from typing import Any

MiB = 2**20


def pyplot():
    """matplotlib.pyplot on the file-only backend (a report never opens a window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def color(index: int) -> str:
    """The colour of run `index` on every plot of the page (matplotlib's default cycle)."""
    return f"C{index % 10}"


def label(text: Any, limit: int = 60) -> str:
    """A run name or layer name as matplotlib text: shortened, and with `$` escaped so that a
    name is never parsed as mathtext (an odd number of `$` would be an error)."""
    text = str(text)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("$", r"\$")


def panels(count: int, width: float = 6.0, height: float = 3.6):
    """A figure of `count` panels side by side; returns (fig, list of axes)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, count, figsize=(width * count, height), squeeze=False)
    # Fixed spacing rather than tight_layout, which costs a third of a report's time; page.figure
    # saves with bbox_inches="tight", which trims the outer margins anyway.
    fig.subplots_adjust(wspace=0.3)
    return fig, list(axes[0])


def style(ax, xlabel: str, ylabel: str, title: str = "", legend: bool = True) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def mib(n: float | None) -> float:
    return (n or 0.0) / MiB


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"
