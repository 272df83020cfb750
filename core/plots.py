"""Figures people would rather look at than read: learning curves of candidates."""

from __future__ import annotations

from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: figures go to files and MLflow, never to a window
import matplotlib.pyplot as plt

from core.records import CurvePoint


def learning_curve(curves: dict[str, list[CurvePoint]], title: str = "", ylabel: str = "fitness") -> Any:
    """Fitness against training frames, one line per named curve."""
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    for name, points in curves.items():
        if points:
            ax.plot([p.frames for p in points], [p.fitness for p in points], marker="o", ms=3, label=name)
    ax.set_xlabel("frames")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    plt.close(fig)  # the caller saves it; keep pyplot's registry empty
    return fig
