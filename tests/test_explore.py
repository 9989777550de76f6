"""helpers.explore: one output holding the live widget and a picture of the default setting.

How a browser renders that output is tested in tests/test_browser.py; here: what explore() puts in
it, that the default figure is drawn once, that moving a control redraws, that no figure is left
open, and that bad input gets a clear message.
"""

from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from ipywidgets import Dropdown, IntSlider, fixed  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from helpers import explore as ex  # noqa: E402
from helpers.tools import notebooks as nbtools  # noqa: E402

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


@pytest.fixture
def shown(monkeypatch):
    """What explore() passes to IPython's display(), in order."""
    import IPython.display

    out: list = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, **kw: out.append(obj))
    return out


def wave(calls):
    def draw_wave(n=3, kind="sin", scale=1.0):
        calls.append({"n": n, "kind": kind, "scale": scale})
        fig, ax = plt.subplots(figsize=(3, 2))
        x = np.linspace(0, 6.3, 100)
        ax.plot(x, scale * (np.sin if kind == "sin" else np.cos)(n * x))
        return fig
    return draw_wave


def pixels(png: bytes):
    return plt.imread(io.BytesIO(png), format="png")


def test_one_output_holds_widget_picture_and_text(shown):
    calls = []
    draw = wave(calls)
    ex.explore(draw, n=IntSlider(value=4, min=1, max=8), kind=Dropdown(options=["sin", "cos"], value="cos"),
               scale=fixed(2.0))
    assert calls == [{"n": 4, "kind": "cos", "scale": 2.0}], "the default figure is drawn exactly once"
    first_picture, explorer = shown
    bundle = explorer._repr_mimebundle_()
    assert set(bundle) == {WIDGET_VIEW, "image/png", "text/plain"}
    assert bundle[WIDGET_VIEW]["model_id"] == explorer.widget.model_id
    assert bundle["text/plain"] == "[explorer: draw wave; run the notebook to move its controls]"
    png = base64.b64decode(bundle["image/png"])
    assert first_picture.data == png, "the widget's first picture is the saved one"
    fresh = ex._png(draw(n=4, kind="cos", scale=2.0))
    assert np.array_equal(pixels(png), pixels(fresh)), "the saved picture is the default setting's figure"
    assert not np.array_equal(pixels(png), pixels(ex._png(draw(n=5, kind="cos", scale=2.0))))
    plt.close("all")


def test_moving_a_control_redraws_and_leaves_no_figure_open(shown):
    calls = []
    before = plt.get_fignums()
    ex.explore(wave(calls), n=IntSlider(value=3, min=1, max=8), kind=["sin", "cos"])
    explorer = shown[-1]
    assert plt.get_fignums() == before
    slider, dropdown = explorer.widget.kwargs_widgets
    slider.value = 5
    dropdown.value = "cos"
    assert calls[1:] == [{"n": 5, "kind": "sin", "scale": 1.0}, {"n": 5, "kind": "cos", "scale": 1.0}]
    redrawn = [obj for obj in shown if isinstance(obj, Figure)]
    assert len(redrawn) == 2 and plt.get_fignums() == before


def test_abbreviations_give_their_widgets_default(shown):
    calls = []
    ex.explore(wave(calls), n=(1, 9), kind=["cos", "sin"])  # as interact() reads them: middle, first
    assert calls == [{"n": 5, "kind": "cos", "scale": 1.0}]
    plt.close("all")


def test_figures_draw_opens_besides_its_own_are_closed(shown):
    def draw(n=1):
        plt.figure()  # a stray figure
        fig, _ = plt.subplots()
        return fig

    before = plt.get_fignums()
    ex.explore(draw, n=IntSlider(value=1, min=0, max=2))
    shown[-1].widget.kwargs_widgets[0].value = 2
    assert plt.get_fignums() == before


def test_draw_returning_none_uses_the_current_figure(shown):
    def draw(n=1):
        plt.plot([0, n])

    ex.explore(draw, n=IntSlider(value=1, min=0, max=2))
    assert "image/png" in shown[-1]._repr_mimebundle_()
    assert plt.get_fignums() == []


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("not a function",), {"n": IntSlider()}, "draw must be a function"),
        ((lambda n: plt.figure(),), {}, "needs at least one control"),
        ((lambda n: plt.figure(),), {"n": object()}, "control n=<object"),
        ((lambda n: plt.subplots()[1],), {"n": IntSlider()}, "must return a matplotlib Figure, got Axes"),
    ],
)
def test_bad_input_gets_a_clear_message(shown, args, kwargs, message):
    before = plt.get_fignums()
    with pytest.raises(TypeError, match=message):
        ex.explore(*args, **kwargs)
    assert plt.get_fignums() == before, "no figure is left open"
    assert not shown


def test_an_error_at_the_default_setting_is_raised_in_the_cell(shown):
    def draw(n=1):
        plt.figure()
        return 1 / 0

    with pytest.raises(ZeroDivisionError):
        ex.explore(draw, n=IntSlider(value=1))
    assert plt.get_fignums() == [] and not shown


def test_saved_explorers_in_teaching_notebooks_hold_a_picture():
    """Issue 12: opened without running (or on GitHub), every explorer shows its default picture."""
    missing = []
    for path in nbtools.notebook_paths("notebooks"):
        for i, cell in enumerate(nbtools.read(path).cells):
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if WIDGET_VIEW in data and str(data.get("text/plain", "")).startswith(("[explorer", "interactive(")):
                    if "image/png" not in data:
                        missing.append(f"{path.name} cell {i}")
    assert not missing, f"explorers saved without a picture (use helpers.explore.explore): {missing}"
