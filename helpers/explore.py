"""Explorers: a figure a learner can steer with sliders (ipywidgets + matplotlib).

Every teaching notebook's explorer is made with :func:`explore`, so that each one also leaves a
static picture of its default setting in the saved notebook, instead of the bare text
``interactive(children=(...``. One output carries both (checked in a real browser by
``tests/test_browser.py``):

- JupyterLab with a running kernel renders the live widget;
- a notebook opened without running it shows the picture: JupyterLab on a fresh clone (outputs
  not trusted yet), GitHub, and nbviewer/nbconvert (which show the widget as saved instead where
  the notebook carries its widget state, as ``make execute`` writes it).

JupyterLab shows "Error displaying widget: model not found" instead only for a notebook it trusts
(one the learner saved) reopened without running and without widget state: ipywidgets' own
behaviour, which no output of ours can change (Settings > "Save Widget State Automatically"
stores the state, but its restore races the kernel's start).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable
from typing import Any

EXPLORER_TEXT = "[explorer: {title}; run the notebook to move its controls]"


def _figure(result: Any):
    """The matplotlib figure ``draw`` returned (``None``: the current figure)."""
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    if result is None:
        return plt.gcf()
    if not isinstance(result, Figure):
        raise TypeError(f"explore(): draw(...) must return a matplotlib Figure, got {type(result).__name__}; "
                        "end it with `return fig` (fig, ax = plt.subplots(...))")
    return result


def _draw(draw: Callable[..., Any], values: dict[str, Any]):
    """``draw(**values)``'s figure; any other figure it opened is closed (also when it raises)."""
    import matplotlib.pyplot as plt

    before, fig = set(plt.get_fignums()), None
    try:
        fig = _figure(draw(**values))
        return fig
    finally:
        for num in set(plt.get_fignums()) - before - {getattr(fig, "number", None)}:
            plt.close(num)


def _png(fig) -> bytes:
    """The figure as PNG bytes, as the inline backend draws it (tight bounding box)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


class _Explorer:
    """One output: the live widget where a widget manager runs, the static PNG elsewhere."""

    def __init__(self, widget, png: bytes, title: str):
        self.widget, self.png, self.title = widget, png, title

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["image/png"] = base64.b64encode(self.png).decode("ascii")
        bundle["text/plain"] = EXPLORER_TEXT.format(title=self.title)
        return bundle


def _show_only_if(widgets: dict, shown_if: dict[str, Callable[[dict], bool]]) -> None:
    """Hide each control named in ``shown_if`` while its predicate of the current values is false."""
    unknown = sorted(set(shown_if) - set(widgets))
    if unknown:
        raise TypeError(f"explore(): shown_if names {unknown}, which are not controls ({sorted(widgets)})")

    def update(_change=None) -> None:
        values = {name: w.get_interact_value() for name, w in widgets.items()}
        for name, predicate in shown_if.items():
            widgets[name].layout.display = None if predicate(values) else "none"

    for w in widgets.values():
        w.observe(update, names="value")
    update()


def explore(draw: Callable[..., Any], shown_if: dict[str, Callable[[dict], bool]] | None = None,
            **controls: Any) -> None:
    """Display ``draw(**values)`` under one ipywidgets control per keyword.

    ``draw`` makes one matplotlib figure and returns it; ``controls`` are ipywidgets controls
    (``IntSlider(...)``, ``Dropdown(...)``, ``Checkbox(...)``, ``fixed(...)``, or the abbreviations
    ``interact`` accepts), whose value is the default setting. The figure for the defaults is
    drawn once: it is the widget's first picture and is stored in the same output, so the saved
    notebook shows it without a running kernel. ``shown_if`` maps a control's name to a
    predicate of all current values (a dict): the control is shown only while it holds, e.g.
    ``shown_if={"layers": lambda v: v["model"] == "custom"}``. A setting that ``draw`` cannot
    draw shows one line naming the error instead of a traceback.
    """
    import matplotlib.pyplot as plt
    from IPython.display import Image, display
    from ipywidgets import interactive

    if not callable(draw):
        raise TypeError(f"explore(draw, **controls): draw must be a function, got {type(draw).__name__}")
    if not controls:
        raise TypeError("explore(draw, **controls) needs at least one control, e.g. n=IntSlider(3, 1, 8)")
    widgets = {}
    for name, control in controls.items():
        widget = interactive.widget_from_abbrev(control)
        if widget is None:
            raise TypeError(f"explore(): control {name}={control!r} is not an ipywidgets control")
        widgets[name] = widget

    defaults = {name: w.get_interact_value() for name, w in widgets.items()}
    with plt.ioff():
        fig = _draw(draw, defaults)
        png = _png(fig)
        plt.close(fig)

    first = [png]  # interactive() shows the defaults at once: that picture is already drawn

    def show(**values: Any) -> None:
        if first:
            display(Image(first.pop()))
            return
        try:
            fig = _draw(draw, values)
        except Exception as error:  # one line for the learner, not a traceback from matplotlib
            print(f"[{title}] cannot draw this setting: {type(error).__name__}: {error}")
            return
        display(fig)
        plt.close(fig)

    title = getattr(draw, "__name__", "explorer").replace("_", " ")
    if shown_if:
        _show_only_if(widgets, shown_if)
    display(_Explorer(interactive(show, **widgets), png, title))
