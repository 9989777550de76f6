"""Explorers: a figure a learner can steer with sliders (ipywidgets + matplotlib).

Every teaching notebook's explorer is made with :func:`explore`. Its cell has two outputs:

- the controls (an ipywidgets box), live where a kernel runs;
- the picture, an ordinary PNG output that each move of a control replaces in place (a display
  update by id), so what the cell saves is always the picture of the last setting drawn.

A notebook opened without a kernel therefore shows the picture wherever it was saved: the
committed notebooks, a fresh clone, GitHub, nbviewer, and a learner's own saved copy (where the
controls themselves need the kernel: JupyterLab draws them from saved widget state if the notebook
carries it, else one line, "Error displaying widget: model not found"). Checked in a real browser
by ``tests/test_browser.py``.
"""

from __future__ import annotations

import base64
import html
import io
import threading
from collections.abc import Callable
from typing import Any

EXPLORER_TEXT = "[explorer: {title}; run the notebook to move its controls]"
PICTURE_TEXT = "[explorer picture: {title}]"
# ipykernel 7 handles some widget messages on a subshell thread besides the main one, and
# matplotlib (its text parsers included) is not thread-safe: two redraws at once failed at random
# (a ParseException, a tight_layout ValueError). Every explorer draws under this lock.
_DRAWING = threading.RLock()


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


class _Controls:
    """The controls' output: the live widget where a widget manager runs, one line elsewhere."""

    def __init__(self, widget, title: str):
        self.widget, self.title = widget, title

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = EXPLORER_TEXT.format(title=self.title)
        return bundle


def _picture_bundle(png: bytes, title: str) -> dict:
    """A display bundle for the explorer's picture (PNG, with a line of text as its fallback)."""
    return {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": PICTURE_TEXT.format(title=title)}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two settings are equal (values that cannot say so count as different)."""
    try:
        return bool(a == b)
    except Exception:
        return False


def _values(widgets: dict) -> dict[str, Any]:
    """The current value of each control, by name (what ``draw`` is called with)."""
    return {name: w.get_interact_value() for name, w in widgets.items()}


def _show_only_if(widgets: dict, shown_if: dict[str, Callable[[dict], bool]]) -> None:
    """Hide each control named in ``shown_if`` while its predicate of the current values is false."""
    unknown = sorted(set(shown_if) - set(widgets))
    if unknown:
        raise TypeError(f"explore(): shown_if names {unknown}, which are not controls ({sorted(widgets)})")

    def update(_change=None) -> None:
        values = _values(widgets)
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
    ``interact`` accepts), whose value is the default setting. The picture is an output of its
    own under the controls, replaced in place at each move, so a saved notebook shows the last
    picture drawn without a running kernel. ``shown_if`` maps a control's name to a
    predicate of all current values (a dict): the control is shown only while it holds, e.g.
    ``shown_if={"layers": lambda v: v["model"] == "custom"}``. A setting that ``draw`` cannot
    draw shows one line naming the error instead of a traceback.
    """
    import matplotlib.pyplot as plt
    from IPython.display import display
    from ipywidgets import HTML, DOMWidget, VBox, interactive

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
        if isinstance(widget, DOMWidget) and hasattr(widget, "description"):
            widget.description = widget.description or name  # as interact() labels them
            if len(widget.description) > 10 and not widget.style.description_width:
                widget.style.description_width = "initial"  # a long label in full, not cut to "custom: l..."
    title = getattr(draw, "__name__", "explorer").replace("_", " ")
    if shown_if:
        _show_only_if(widgets, shown_if)

    def png_of(setting: dict[str, Any]) -> bytes:
        with plt.ioff():
            fig = _draw(draw, setting)
            try:
                return _png(fig)
            finally:
                plt.close(fig)

    message = HTML("", layout={"margin": "0 0 0 8px"})
    shown = [_values(widgets)]  # the setting whose picture is on screen

    def redraw(_change=None) -> None:
        with _DRAWING:
            setting = _values(widgets)  # the latest values: moves that came while waiting are drawn once
            if _same(setting, shown[0]):
                return
            try:
                png = png_of(setting)
            except Exception as error:  # one line for the learner, not a traceback from matplotlib
                message.value = (f"<code>cannot draw this setting: {type(error).__name__}: "
                                 f"{html.escape(str(error))}</code>")
                return
            message.value = ""
            shown[0] = setting
            picture.update(_picture_bundle(png, title), raw=True)

    with _DRAWING:
        first = png_of(shown[0])
    for w in widgets.values():
        w.observe(redraw, names="value")
    visible = [w for w in widgets.values() if isinstance(w, DOMWidget)]  # not fixed(...) values
    display(_Controls(VBox([*visible, message], _dom_classes=["course-explorer"]), title))
    picture = display(_picture_bundle(first, title), raw=True, display_id=True)
