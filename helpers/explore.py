"""Explorers: a figure a learner can steer with sliders (ipywidgets + matplotlib).

Every teaching notebook's explorer is made with :func:`explore`, so that each one also leaves a
static picture of its default setting in the saved notebook (what GitHub and a notebook opened
before running show), instead of the bare text ``interactive(children=(...``.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _Explorer:
    """One output: the live widget where a widget manager runs, the static PNG elsewhere."""

    def __init__(self, widget, png: str, title: str):
        self.widget, self.png, self.title = widget, png, title

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["image/png"] = self.png
        bundle["text/plain"] = f"[explorer: {self.title}; run the notebook to move its controls]"
        return bundle


def explore(draw: Callable[..., Any], **controls: Any) -> None:
    """Display ``draw(**values)`` under one ipywidgets control per keyword.

    ``draw`` makes one matplotlib figure and returns it (``None`` means the current figure);
    ``controls`` are ipywidgets controls (``IntSlider(...)``, ``Dropdown(...)``, ``fixed(...)``),
    whose ``.value`` is the default setting. The figure for the defaults is stored as a picture
    in the same output, so the saved notebook shows it without a running kernel.
    """
    import matplotlib.pyplot as plt
    from IPython.display import display
    from ipywidgets import interactive

    defaults = {name: getattr(c, "value", c) for name, c in controls.items()}
    with plt.ioff():
        fig = draw(**defaults) or plt.gcf()
        png = _png(fig)
        plt.close(fig)

    def show(**values: Any) -> None:
        fig = draw(**values) or plt.gcf()
        plt.show()
        plt.close(fig)

    title = getattr(draw, "__name__", "explorer").replace("_", " ")
    display(_Explorer(interactive(show, **controls), png, title))
