"""helpers.explore: an output for the controls, then the picture, replaced in place at each move.

How a browser renders that output is tested in tests/test_browser.py; here: what explore() puts in
it, that the default figure is drawn once, that moving a control replaces the picture, that no figure is left
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

from helpers import explore as ex  # noqa: E402
from helpers.tools import notebooks as nbtools  # noqa: E402

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


class Handle:
    """A stand-in for IPython's DisplayHandle: records each update."""

    def __init__(self):
        self.updates: list = []

    def update(self, obj, **kwargs):
        self.updates.append(obj)


@pytest.fixture
def shown(monkeypatch):
    """What explore() passes to IPython's display(), in order; a display by id gets a Handle."""
    import IPython.display

    out: list = []

    def display(obj, **kwargs):
        out.append(obj)
        if kwargs.get("display_id"):
            out.append(Handle())
            return out[-1]

    monkeypatch.setattr(IPython.display, "display", display)
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


def png_of(bundle: dict) -> bytes:
    return base64.b64decode(bundle["image/png"])


def parts(shown):
    """(controls output, the controls in order, picture bundle, picture handle) of the last explorer."""
    controls, picture, handle = shown[-3:]
    return controls, list(controls.widget.children[:-1]), picture, handle


def test_controls_then_picture(shown):
    calls = []
    draw = wave(calls)
    ex.explore(draw, n=IntSlider(value=4, min=1, max=8), kind=Dropdown(options=["sin", "cos"], value="cos"),
               scale=fixed(2.0))
    assert calls == [{"n": 4, "kind": "cos", "scale": 2.0}], "the default figure is drawn exactly once"
    controls, widgets, picture, handle = parts(shown)
    bundle = controls._repr_mimebundle_()
    assert set(bundle) == {WIDGET_VIEW, "text/plain"}, "the picture is an output of its own"
    assert bundle[WIDGET_VIEW]["model_id"] == controls.widget.model_id
    assert bundle["text/plain"] == "[explorer: draw wave; run the notebook to move its controls]"
    assert [type(w).__name__ for w in widgets] == ["IntSlider", "Dropdown"], "fixed values are not shown"
    assert set(picture) == {"image/png", "text/plain"} and picture["text/plain"] == "[explorer picture: draw wave]"
    fresh = ex._png(draw(n=4, kind="cos", scale=2.0))
    assert np.array_equal(pixels(png_of(picture)), pixels(fresh)), "the picture is the default setting's figure"
    assert not np.array_equal(pixels(png_of(picture)), pixels(ex._png(draw(n=5, kind="cos", scale=2.0))))
    assert handle.updates == []
    plt.close("all")


def test_moving_a_control_replaces_the_picture_and_leaves_no_figure_open(shown):
    calls = []
    before = plt.get_fignums()
    ex.explore(wave(calls), n=IntSlider(value=3, min=1, max=8), kind=["sin", "cos"])
    _, (slider, dropdown), picture, handle = parts(shown)
    assert plt.get_fignums() == before
    slider.value = 5
    dropdown.value = "cos"
    assert calls[1:] == [{"n": 5, "kind": "sin", "scale": 1.0}, {"n": 5, "kind": "cos", "scale": 1.0}]
    assert len(handle.updates) == 2 and plt.get_fignums() == before
    first, second = (pixels(png_of(u)) for u in handle.updates)
    assert not np.array_equal(first, second) and not np.array_equal(first, pixels(png_of(picture)))


def test_a_setting_that_cannot_be_drawn_shows_one_line_and_keeps_the_picture(shown):
    def draw_ratio(n=1):
        fig, ax = plt.subplots()
        ax.plot([0, 1 / (n - 2)])
        return fig

    before = plt.get_fignums()
    ex.explore(draw_ratio, n=IntSlider(value=1, min=0, max=3))
    controls, (slider,), _, handle = parts(shown)
    message = controls.widget.children[-1]
    slider.value = 2
    assert "ZeroDivisionError: division by zero" in message.value and "Traceback" not in message.value
    assert handle.updates == [] and plt.get_fignums() == before
    slider.value = 3
    assert message.value == "" and len(handle.updates) == 1


def test_redraws_hold_the_drawing_lock(shown):
    """Widget messages may arrive on two threads (ipykernel 7's subshells): draws never overlap."""
    import threading

    free_while_drawing = []

    def try_lock():
        got = ex._DRAWING.acquire(blocking=False)
        if got:
            ex._DRAWING.release()
        free_while_drawing.append(got)

    def draw_probe(n=1):
        probe = threading.Thread(target=try_lock)
        probe.start()
        probe.join()
        fig, ax = plt.subplots()
        ax.plot([0, n])
        return fig

    ex.explore(draw_probe, n=IntSlider(value=1, min=0, max=3))
    parts(shown)[1][0].value = 2
    assert free_while_drawing == [False, False], "another thread could draw at the same time"


def test_long_labels_are_shown_in_full_and_unnamed_controls_get_their_name(shown):
    ex.explore(wave([]), n=IntSlider(value=3, min=1, max=8, description="custom: layers"), kind=Dropdown(options=["sin", "cos"]))
    _, (n, kind), _, _ = parts(shown)
    assert n.style.description_width == "initial" and kind.description == "kind"
    plt.close("all")


def test_shown_if_hides_a_control_until_its_predicate_holds(shown):
    ex.explore(wave([]), shown_if={"scale": lambda v: v["kind"] == "cos"}, n=IntSlider(value=3, min=1, max=8),
               kind=["sin", "cos"], scale=IntSlider(value=1, min=1, max=3))
    _, (_, kind, scale), _, _ = parts(shown)
    assert scale.layout.display == "none"
    kind.value = "cos"
    assert scale.layout.display is None
    with pytest.raises(TypeError, match="not controls"):
        ex.explore(wave([]), shown_if={"missing": lambda v: True}, n=IntSlider())
    plt.close("all")


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
    parts(shown)[1][0].value = 2
    assert plt.get_fignums() == before


def test_draw_returning_none_uses_the_current_figure(shown):
    def draw(n=1):
        plt.plot([0, n])

    ex.explore(draw, n=IntSlider(value=1, min=0, max=2))
    assert "image/png" in parts(shown)[2]
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
    """Opened without running (GitHub, a fresh clone, a learner's saved copy), every explorer
    shows a picture: the output after its controls is a PNG."""
    missing, found = [], 0
    for path in nbtools.notebook_paths("notebooks"):
        for i, cell in enumerate(nbtools.read(path).cells):
            outputs = [out.get("data", {}) for out in cell.get("outputs", [])]
            for k, data in enumerate(outputs):
                if WIDGET_VIEW in data and str(data.get("text/plain", "")).startswith(("[explorer", "interactive(")):
                    found += 1
                    after = outputs[k + 1] if k + 1 < len(outputs) else {}
                    if "image/png" not in after or not str(after.get("text/plain", "")).startswith("[explorer picture"):
                        missing.append(f"{path.name} cell {i}")
    assert found >= 8, f"only {found} explorers found in notebooks/"
    assert not missing, f"explorers saved without a picture after them (use helpers.explore.explore): {missing}"


def _covered_by_legends(fig) -> list[str]:
    """What a legend of ``fig`` hides: each bar (a patch of non-zero size) or text of the same axes
    whose drawn box overlaps the legend's."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    hidden = []
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        for artist in [*ax.patches, *ax.texts]:
            extent = artist.get_window_extent(renderer)
            if extent.width > 0 and extent.height > 0 and box.overlaps(extent):
                hidden.append(f"{ax.get_title()}: {type(artist).__name__} at {extent.bounds}")
    return hidden


@pytest.mark.slow  # make test-all: a few seconds
def test_notebook_12_waste_explorer_legends_hide_nothing_at_the_settings_it_suggests():
    """Its legends once sat on the paged bar at documents = 1, a setting the notebook suggests."""
    import torch

    from helpers import nb12_serving

    cell = next(c.source for c in nbtools.read("notebooks/12_serving.ipynb").cells
                if c.source.startswith("def waste_explorer"))
    scope = {"plt": plt, "N_REQ": 2000, "gen": lambda seed: torch.Generator().manual_seed(seed),
             **{name: getattr(nb12_serving, name)
                for name in ("request_mix", "contiguous_slots", "paged_slots")}}
    exec(cell[:cell.index("\nexplore(")], scope)  # the draw function, as the notebook defines it
    settings = [{}, {"doc_share": 1.0}, {"max_len": 131072}, {"block_size": 512, "chat_median": 50},
                {"block_size": 1}, {"doc_share": 1.0, "max_len": 2048}]
    for setting in settings:
        fig = scope["waste_explorer"](**setting)
        try:
            assert not _covered_by_legends(fig), (setting, _covered_by_legends(fig))
        finally:
            plt.close(fig)
