"""The explorers in a real browser: JupyterLab driven by headless Chromium through Playwright.

For every teaching notebook in ``notebooks/`` (found at collection time, so new ones are picked up):

1. open it as a learner who has just cloned the course (nothing trusted, no kernel run yet): every
   saved explorer must show its picture, not ``interactive(children=...`` nor "Error displaying
   widget";
2. run all cells in a fresh kernel: no cell may end in an error;
3. find every live explorer (the controls output of ``helpers.explore.explore`` and the picture
   output after it), move every control a learner can see, one at a time (sliders of every kind,
   dropdowns, checkboxes, toggles, number fields; controls that a move reveals included), and
   require each move to redraw the picture (decoded pixels compared before and after) with no
   complaint under the controls and no traceback.

A self-test also saves a notebook after moving its explorer, as a learner's Ctrl-S does (trusted,
no widget state), reopens it and requires the last picture drawn to be shown.

Screenshots (the saved picture, each explorer before and after the move, the page on a failure),
a failing explorer's whole traceback and the phase timings go to ``build/screenshots/<notebook>/``,
which CI keeps. Small notebooks in ``build/browser-test/`` show that the check fails when it should. One JupyterLab server and one browser page
serve all notebooks; each notebook gets its own kernel, shut down when its test ends. Nothing is
saved: autosave is off and the notebooks are closed unsaved.

Needs Chromium (Debian: ``apt-get install chromium``; or set ``CHROMIUM=/path/to/chrome``) and
Playwright for Python (a dev dependency; its own browser download is not used). Without Chromium the
module is skipped with one line saying so. Select it with ``pytest -m browser``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from helpers.tools import notebooks as nbtools

ROOT = nbtools.ROOT
SHOTS = ROOT / "build" / "screenshots"
NOTEBOOKS = [p.relative_to(ROOT).as_posix() for p in nbtools.notebook_paths("notebooks")]
RUN_TIMEOUT_S = 600  # one notebook's Run All (60 s on an idle 2-core machine; make test shares it)
EXPLORER_TEXT = ("[explorer", "interactive(")  # text/plain of explore() / bare interact() outputs

# Under `make test` (-n 2 --dist loadscope) this module is one scope: it runs on one worker (one
# server, one browser) while the other worker runs the rest; --no-loadscope-reorder starts it early.
# Under --dist loadgroup the mark below keeps it together the same way.
pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.xdist_group("browser")]


def _chromium() -> str | None:
    """The Chromium (or Chrome) executable: $CHROMIUM, else the first one on PATH."""
    if os.environ.get("CHROMIUM"):
        return os.environ["CHROMIUM"]
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    return next((p for p in map(shutil.which, names) if p), None)


CHROMIUM = _chromium()
try:
    from playwright import sync_api
except ImportError:
    sync_api = None
if CHROMIUM is None or sync_api is None:
    _why = ("no Chromium found (apt-get install chromium, or set CHROMIUM=/path)" if CHROMIUM is None
            else "Playwright is not installed (pip install -e .[dev])")
    if os.environ.get("REQUIRE_BROWSER_TEST"):  # set by .ci/run: CI must not skip it
        pytest.fail(f"browser test required but {_why}", pytrace=False)
    pytest.skip(f"browser test skipped: {_why}", allow_module_level=True)

# JupyterLab settings for the test server: every cell in the page (no windowing), never save,
# no news or update pop-ups over the screenshots.
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}

# ----------------------------------------------------------------------------- page scripts

OPEN_JS = """async (path) => {
  const app = window.jupyterapp;
  const panel = await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
  await panel.context.ready;
  await panel.sessionContext.ready;
  panel.__busy = 0;  // how many times the kernel went busy: each move of a control makes it busy
  panel.sessionContext.statusChanged.connect((_, status) => { if (status === 'busy') panel.__busy++; });
  (window.__panels = window.__panels || {})[path] = panel;
  return panel.id;
}"""

# Saved outputs that carry a widget view, with what the page rendered for each.
SAVED_WIDGETS_JS = """(path) => {
  const panel = window.__panels[path], WV = 'application/vnd.jupyter.widget-view+json', found = [];
  panel.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    const outputs = cell.model.outputs;
    for (let k = 0; k < outputs.length; k++) {
      const data = outputs.get(k).data;
      if (!data[WV]) continue;
      const child = cell.outputArea.widgets[k];
      const node = child ? child.node.querySelector('.jp-OutputArea-output') : null;
      if (node) node.setAttribute('data-browser-test', 'saved-' + i + '-' + k);
      // explore() saves the picture as the output after the controls
      const after = k + 1 < outputs.length ? outputs.get(k + 1).data : {};
      const next = cell.outputArea.widgets[k + 1];
      const pic = next && String(after['text/plain'] || '').startsWith('[explorer picture')
          ? next.node.querySelector('.jp-OutputArea-output') : null;
      if (pic) pic.setAttribute('data-browser-test', 'saved-' + i + '-' + k + '-picture');
      found.push({cell: i, tag: 'saved-' + i + '-' + k, plain: String(data['text/plain'] || ''),
                  mime: pic ? (pic.dataset.mimeType || '') : (node ? (node.dataset.mimeType || '') : null),
                  text: (pic || node) ? (pic || node).innerText.slice(0, 120) : ''});
    }
  });
  return found;
}"""

RENDERED_JS = """(path) => {
  const panel = window.__panels[path];
  return panel.content.widgets.every(cell => cell.model.type !== 'code'
      || cell.outputArea.widgets.length === cell.model.outputs.length);
}"""

RUN_ALL_JS = """async ([path, ms]) => {
  const panel = window.__panels[path];
  const run = window.jupyterapp.commands.execute('notebook:run-all-cells',
                                                 {widgetId: panel.id, activate: false});
  return await Promise.race([run, new Promise(r => setTimeout(() => r('timeout'), ms))]);
}"""

ERRORS_JS = """(path) => {
  const panel = window.__panels[path], errors = [];
  panel.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    for (let k = 0; k < cell.model.outputs.length; k++) {
      const o = cell.model.outputs.get(k).toJSON();
      if (o.output_type === 'error')
        errors.push({cell: i, source: cell.model.sharedModel.getSource().split('\\n')[0],
                     error: o.ename + ': ' + o.evalue});
    }
    if (cell.model.executionCount === null && cell.model.sharedModel.getSource().trim())
      errors.push({cell: i, source: cell.model.sharedModel.getSource().split('\\n')[0],
                   error: 'not executed'});
  });
  return errors;
}"""

# Live explorers: the controls output of explore() (a widget view whose text is "[explorer: ...")
# and the picture output after it. Each pair is tagged so Playwright can address it; returns
# [tag, controls are live, picture shown] triples.
LIVE_JS = """(path) => {
  const panel = window.__panels[path], WV = 'application/vnd.jupyter.widget-view+json', found = [];
  panel.content.widgets.forEach(cell => {
    if (cell.model.type !== 'code') return;
    const outputs = cell.model.outputs;
    for (let k = 0; k + 1 < outputs.length; k++) {
      const data = outputs.get(k).data;
      if (!data[WV] || !String(data['text/plain'] || '').startsWith('[explorer:')) continue;
      const controls = cell.outputArea.widgets[k], picture = cell.outputArea.widgets[k + 1];
      if (!controls || !picture) continue;
      const tag = 'explorer-' + (found.length + 1), box = controls.node.querySelector('.course-explorer');
      controls.node.setAttribute('data-browser-test', tag);
      picture.node.setAttribute('data-browser-test', tag + '-picture');
      found.push([tag, !!box && !box.closest('.jupyter-widgets-disconnected'), !!picture.node.querySelector('img')]);
    }
  });
  return found;
}"""

LIVE_READY_JS = (
    "([path, n]) => { const live = (" + LIVE_JS + ")(path); return live.length >= n && live.every(x => x[1] && x[2]); }"
)

SAVE_JS = """async (path) => { await window.__panels[path].context.save(); }"""

KERNEL_JS = """(path) => {
  const panel = window.__panels[path], s = panel.sessionContext.session;
  return [s && s.kernel ? s.kernel.status : 'none', panel.__busy];
}"""

CLOSE_JS = """(path) => {
  const panel = window.__panels[path];
  delete window.__panels[path];
  panel.context.model.dirty = false;  // closed unsaved
  panel.sessionContext.shutdown();  // the kernel stops in the background while the next one starts
  panel.dispose();
}"""

# ----------------------------------------------------------------------------- server and page


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_lab(tmp: Path, token: str) -> subprocess.Popen:
    """JupyterLab on the repository: a free local port, a token, and settings of its own."""
    for name, values in LAB_SETTINGS.items():
        file = tmp / "settings" / f"{name}.jupyterlab-settings"
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(values))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
               JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(tmp / "workspaces"))
    args = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--ServerApp.root_dir={ROOT}",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={_free_port()}", "--ServerApp.port_retries=20",
            f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
            "--NotebookNotary.db_file=:memory:",  # nothing trusted yet, as on a fresh clone
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate", "--LabApp.news_url="]
    if os.getuid() == 0:
        args.append("--allow-root")
    with open(tmp / "lab.log", "w") as log:
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _lab_url(proc: subprocess.Popen, tmp: Path, token: str, timeout: float = 180) -> str:
    """The server's address once it answers (its runtime file names the port it took)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        for info in (tmp / "runtime").glob("jpserver-*.json"):
            try:
                url = json.loads(info.read_text())["url"].rstrip("/")
                urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5)
                return url
            except (OSError, ValueError, KeyError):
                pass
        time.sleep(0.3)
    raise AssertionError(f"JupyterLab did not start:\n{(tmp / 'lab.log').read_text()[-3000:]}")


@pytest.fixture(scope="module")
def page():
    """One Chromium page with JupyterLab loaded (server and browser started side by side);
    notebooks are opened and closed in it."""
    tmp, token = Path(tempfile.mkdtemp(prefix="browser-test-")), secrets.token_hex(16)
    proc = _start_lab(tmp, token)
    try:
        with sync_api.sync_playwright() as pw:
            args = ["--disable-dev-shm-usage"] + (["--no-sandbox"] if os.getuid() == 0 else [])
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=args)
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{_lab_url(proc, tmp, token)}/lab/workspaces/browser-test?reset&token={token}")
            page.wait_for_function("() => window.jupyterapp && window.jupyterapp.started")
            page.evaluate("async () => { await window.jupyterapp.restored; }")
            yield page
            browser.close()
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


# ----------------------------------------------------------------------------- explorer controls


def _pixels(src: str | None):
    """Decoded RGBA pixels of a ``data:image/png;base64,...`` address (None if there is none)."""
    from matplotlib.image import imread

    if not src or "base64," not in src:
        return None
    return imread(io.BytesIO(base64.b64decode(src.split("base64,", 1)[1])), format="png")


def _same_picture(a: str | None, b: str | None) -> bool:
    import numpy as np

    pa, pb = _pixels(a), _pixels(b)
    return pa is not None and pb is not None and pa.shape == pb.shape and np.array_equal(pa, pb)


def _picture(page, tag: str) -> str | None:
    """The address (data URI) of the explorer's picture, None while it has none."""
    return page.evaluate("t => { const i = document.querySelector(`[data-browser-test='${t}-picture'] img`); "
                         "return i && i.src; }", tag)


def _move(control) -> str | None:
    """Change one ipywidgets control by a step, as a learner would; say what was done (None: cannot)."""
    cls = control.get_attribute("class") or ""
    label = control.locator(".widget-label")
    name = (label.first.inner_text().strip() if label.count() else "") or "control"
    if control.locator(".noUi-handle").count():  # IntSlider, FloatSlider, SelectionSlider, ...
        handle, readout = control.locator(".noUi-handle").first, control.locator(".widget-readout")

        def value() -> str | None:
            if readout.count():
                text = readout.first.evaluate("r => r.value !== undefined && r.tagName === 'INPUT' ? r.value : r.innerText")
                return text.strip()
            return handle.get_attribute("aria-valuenow")

        before = value()
        handle.focus()
        handle.press("ArrowRight")
        if value() == before:  # already at its maximum
            handle.press("ArrowLeft")
        return f"slider {name!r} from {before} to {value()}"
    if "widget-dropdown" in cls or "widget-select" in cls:
        select = control.locator("select").first
        options = select.locator("option").all_inner_texts()
        if len(options) < 2:
            return None
        index = (select.evaluate("s => s.selectedIndex") + 1) % len(options)
        select.select_option(index=index)
        return f"dropdown {name!r} to {options[index]!r}"
    if "widget-checkbox" in cls:
        control.locator("input[type=checkbox]").first.click()
        return f"checkbox {name!r}"
    if "widget-toggle-buttons" in cls or "widget-radio" in cls:
        choices = control.locator("button:not(.mod-active), input[type=radio]:not(:checked)")
        if not choices.count():
            return None
        choices.first.click()
        return f"choice {name!r}"
    if "widget-toggle-button" in cls:
        control.click()
        return f"toggle {name!r}"
    field = control.locator("input[type=number]")
    if field.count():
        field.first.press("ArrowUp")
        field.first.press("Enter")
        return f"number {name!r} up one step"
    return None


def _wait_for_picture(page, path: str, tag: str, busy_before: int, timeout: float = 300) -> str | None:
    """The explorer's picture once the kernel has answered a move (it went busy and is idle again;
    10 s without going busy: the move sent nothing) and the page has drawn its last output."""
    start = time.monotonic()
    while True:
        (status, busy), waited = page.evaluate(KERNEL_JS, path), time.monotonic() - start
        if (busy > busy_before and status == "idle") or (busy == busy_before and waited > 10) or waited > timeout:
            break
        time.sleep(0.1)
    src, settle = _picture(page, tag), time.monotonic() + 10
    while time.monotonic() < settle:  # outputs are drawn after the kernel's idle message: wait for
        time.sleep(0.5)               # the picture to stay the same for half a second
        src, last = _picture(page, tag), src
        if src == last:
            break
    return src


def _complaint(box) -> str:
    """What the explorer says under its controls (a setting it could not draw), or a traceback
    printed in its cell, or ''."""
    line = " ".join(box.locator(".course-explorer .widget-html").all_inner_texts()).strip()
    stderr = "\n".join(box.locator('xpath=..').locator('[data-mime-type="application/vnd.jupyter.stderr"]')
                       .all_inner_texts())
    return line or (stderr if "Traceback" in stderr else "")


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[Path(p).stem for p in NOTEBOOKS])
def test_explorers_in_the_browser(page, path):
    _open_check_close(page, path, SHOTS / Path(path).stem)


def _open_check_close(page, path: str, shots: Path) -> None:
    shutil.rmtree(shots, ignore_errors=True)
    shots.mkdir(parents=True)
    timings = {"open": time.monotonic()}
    page.evaluate(OPEN_JS, path)
    try:
        _check(page, path, shots, timings)
    except BaseException:
        page.screenshot(path=shots / "failure.png")
        raise
    finally:
        page.evaluate(CLOSE_JS, path)
        marks = list(timings.items()) + [("end", time.monotonic())]
        (shots / "timings.json").write_text(json.dumps(
            {a: round(tb - ta, 1) for (a, ta), (_, tb) in zip(marks, marks[1:])}) + "\n")


def _check(page, path: str, shots: Path, timings: dict[str, float]) -> None:
    """Raise AssertionError listing every problem found in the notebook at ``path``."""
    name, problems = Path(path).name, []
    # 1. As saved: each explorer shows a picture of its default setting.
    page.wait_for_function(RENDERED_JS, arg=path)
    saved = [w for w in page.evaluate(SAVED_WIDGETS_JS, path) if w["plain"].startswith(EXPLORER_TEXT)]
    for n, w in enumerate(saved, 1):
        tag = w["tag"] + ("-picture" if w["mime"] == "image/png" else "")
        page.locator(f'[data-browser-test="{tag}"]').screenshot(path=shots / f"explorer-{n}-saved.png")
        if w["mime"] != "image/png":
            problems.append(
                f"cell {w['cell']}: before running, the explorer shows {w['text'][:50]!r} ({w['mime']}), "
                "not a picture of its default setting: make it with helpers.explore.explore and re-execute")

    # 2. Opening it changes nothing but the Python version: once its kernel has started (and sent its
    # language_info), the notebook's metadata is the committed one plus language_info.version, which
    # no committed notebook records (it would tie the notebook to the Python that last ran it; the
    # version JupyterLab adds is what marks a notebook just opened as modified).
    page.wait_for_function(f"(p) => ({KERNEL_JS})(p)[0] === 'idle'", arg=path, timeout=120_000)
    time.sleep(1.0)
    opened = page.evaluate("(p) => window.__panels[p].context.model.toJSON().metadata", path)
    info = {k: v for k, v in opened.get("language_info", {}).items() if k != "version"}
    committed = json.loads(json.dumps(nbtools.read(ROOT / path).metadata))
    if {**opened, "language_info": info} != committed:
        changed = sorted(k for k in {*opened, *committed} if k != "language_info" and opened.get(k) != committed.get(k))
        problems.append("opening the notebook changed its metadata beyond the Python version: "
                        f"{changed or ['language_info']} differ from what the kernel and JupyterLab write")

    # 3. Run all cells in a fresh kernel.
    timings["run all"] = time.monotonic()
    result = page.evaluate(RUN_ALL_JS, [path, RUN_TIMEOUT_S * 1000])
    if result == "timeout":
        raise AssertionError(f"{name}: Run All did not finish in {RUN_TIMEOUT_S} s")
    errors = page.evaluate(ERRORS_JS, path)
    if errors or result is not True:
        raise AssertionError(f"{name}: cells failed when run in the browser: {errors or result}")

    # 4. Every explorer is live, shows a picture, and redraws when one of its controls moves.
    timings["explorers"] = time.monotonic()
    expected = sum(w["plain"].startswith(EXPLORER_TEXT) for w in page.evaluate(SAVED_WIDGETS_JS, path))
    if not expected:
        raise AssertionError(f"{name}: no explorer found (every teaching notebook has one)")
    try:
        page.wait_for_function(LIVE_READY_JS, arg=[path, expected], timeout=120_000)
    except sync_api.TimeoutError:
        pass  # reported below, explorer by explorer
    live = page.evaluate(LIVE_JS, path)
    if len(live) != expected:
        problems.append(f"{expected} explorer outputs but {len(live)} live explorers in the page")
    panel_id = page.evaluate("(p) => window.__panels[p].id", path)
    if "Error displaying widget" in page.locator(f"#{panel_id}").inner_text():
        problems.append("a widget shows 'Error displaying widget'")
    for tag, is_live, has_picture in live:
        if not is_live:
            problems.append(f"{tag}: its controls are not connected to the kernel")
            continue
        problems += [f"{tag}: {p}" for p in _move_explorer(page, path, tag, has_picture, shots)]
    timings["close"] = time.monotonic()
    assert not problems, f"{name}:\n  " + "\n  ".join(problems)


def _controls(box) -> list:
    """The explorer's controls that a learner can see now (shown_if hides some), in order."""
    # every child widget but the message line (a SelectionSlider's node lacks .jupyter-widgets)
    found = box.locator(".course-explorer > .lm-Widget:not(.widget-html)")
    return [found.nth(i) for i in range(found.count()) if found.nth(i).is_visible()]


def _move_explorer(page, path: str, tag: str, has_picture: bool, shots: Path) -> list[str]:
    """Move every control the learner can see, one at a time (controls that appear after a move
    included): each move must redraw the picture, with no complaint. The problems found."""
    box = page.locator(f'[data-browser-test="{tag}"]')
    box.scroll_into_view_if_needed()
    box.screenshot(path=shots / f"{tag}-before.png")
    if not has_picture:
        return ["shows no picture after running"]
    problems, moved, before = [], set(), _picture(page, tag)
    for _ in range(30):
        todo = [c for c in _controls(box) if c.get_attribute("data-moved") is None]
        if not todo:
            break
        control = todo[0]
        control.evaluate("c => c.setAttribute('data-moved', '1')")
        busy = page.evaluate(KERNEL_JS, path)[1]
        move = _move(control)
        if move is None:
            continue
        after = _wait_for_picture(page, path, tag, busy)
        moved.add(move)
        complaint = _complaint(box)
        if complaint:
            (shots / f"{tag}-complaint.txt").write_text(complaint)
            last = [line for line in complaint.splitlines() if line.strip()][-1][:300]
            return problems + [f"after moving {move}: {last} (whole text: {tag}-complaint.txt)"]
        if _same_picture(before, after):
            problems.append(f"moving {move} did not change the picture")
        before = after
    page.locator(f'[data-browser-test="{tag}-picture"]').screenshot(path=shots / f"{tag}-after.png")
    if not moved:
        problems.append("no control could be moved")
    return problems


# ----------------------------------------------------------------------------- the test's own tests
# Small notebooks written to build/browser-test/ (git-ignored) show that the check above fails
# when it should (and passes a working explorer).

SELFTEST = ROOT / "build" / "browser-test"
EXPLORER_CELL = """import matplotlib.pyplot as plt
from ipywidgets import IntSlider
from helpers.explore import explore


def draw_line(n=2):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, {y}])
    return fig


explore(draw_line, n=IntSlider(value=2, min=1, max=5))"""


def _selftest_notebook(name: str, cells: list[tuple[str, str | None]]) -> str:
    """Write a notebook of code cells, each with saved explorer outputs: "picture" (what explore()
    leaves: controls, then the picture), "text" (what a bare interact() leaves) or None (no
    output). Returns its path."""
    import nbformat
    from matplotlib.figure import Figure

    buf = io.BytesIO()
    Figure(figsize=(2, 1)).savefig(buf, format="png")
    picture = {"image/png": base64.b64encode(buf.getvalue()).decode(), "text/plain": "[explorer picture: x]"}
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    for i, (source, saved) in enumerate(cells):
        cell = nbformat.v4.new_code_cell(source)
        view = {"application/vnd.jupyter.widget-view+json": {"model_id": f"{i:032x}", "version_major": 2,
                                                             "version_minor": 0}}
        if saved == "picture":
            cell.outputs = [nbformat.v4.new_output("display_data", data={**view, "text/plain": "[explorer: x]"}),
                            nbformat.v4.new_output("display_data", data=picture)]
        elif saved == "text":
            text = "interactive(children=(IntSlider(value=2, description='n'),))"
            cell.outputs = [nbformat.v4.new_output("display_data", data={**view, "text/plain": text})]
        nb.cells.append(cell)
    SELFTEST.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, SELFTEST / f"{name}.ipynb")
    return f"build/browser-test/{name}.ipynb"


SELECTION_CELL = """import matplotlib.pyplot as plt
from ipywidgets import IntSlider, SelectionSlider
from helpers.explore import explore


def pick(n=2, k="a"):
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [0, n])
    return fig


explore(pick, n=IntSlider(value=2, min=1, max=5), k=SelectionSlider(options=["a", "b", "c"], value="a"))"""


def test_the_check_finds_each_faulty_explorer(page):
    path = _selftest_notebook("faulty_explorers", [
        (EXPLORER_CELL.format(y="n"), "text"),  # works, but was saved without its picture
        (EXPLORER_CELL.format(y="1").replace("draw_line", "frozen"), "picture"),  # ignores its control
        (EXPLORER_CELL.format(y="n if n == 2 else 1 / 0").replace("draw_line", "broken"), "picture"),
        (SELECTION_CELL, "picture"),  # its SelectionSlider changes nothing
    ])
    with pytest.raises(AssertionError) as failure:
        _open_check_close(page, path, SELFTEST / "faulty_explorers")
    message = str(failure.value)
    assert "cell 0: before running, the explorer shows 'interactive(children=" in message, message
    assert "explorer-1:" not in message, f"a working explorer was reported: {message}"
    assert "explorer-2: moving slider 'n' from 2 to 3 did not change the picture" in message, message
    assert "explorer-3: after moving slider 'n' from 2 to 3: cannot draw this setting: ZeroDivisionError" in message, message
    # a SelectionSlider is moved too (its move here changes nothing, so it is reported)
    assert "explorer-4: moving slider 'k' from a to b did not change the picture" in message, message
    assert "explorer-4: moving slider 'n'" not in message, message


def test_the_check_finds_a_failing_cell(page):
    path = _selftest_notebook("failing_cell", [(EXPLORER_CELL.format(y="n"), "picture"), ("1 / 0", None)])
    with pytest.raises(AssertionError, match=r"cells failed when run in the browser: .*ZeroDivisionError"):
        _open_check_close(page, path, SELFTEST / "failing_cell")


def test_a_saved_copy_reopened_shows_the_last_picture(page):
    """A learner moves a control, saves (trusted, no widget state) and reopens: the picture of
    the last setting is there, not "Error displaying widget: model not found"."""
    path = _selftest_notebook("saved_copy", [(EXPLORER_CELL.format(y="n"), None)])
    page.evaluate(OPEN_JS, path)
    try:
        assert page.evaluate(RUN_ALL_JS, [path, RUN_TIMEOUT_S * 1000]) is True
        page.wait_for_function(LIVE_READY_JS, arg=[path, 1], timeout=120_000)
        (tag, _, _), = page.evaluate(LIVE_JS, path)
        box = page.locator(f'[data-browser-test="{tag}"]')
        first = _picture(page, tag)
        busy = page.evaluate(KERNEL_JS, path)[1]
        _move(_controls(box)[0])
        moved = _wait_for_picture(page, path, tag, busy)
        assert not _same_picture(first, moved)
        page.evaluate(SAVE_JS, path)
    finally:
        page.evaluate(CLOSE_JS, path)
    page.evaluate(OPEN_JS, path)
    try:
        page.wait_for_function(RENDERED_JS, arg=path)
        reopened = page.evaluate("""(path) => {
          const cell = window.__panels[path].content.widgets[0], out = cell.outputArea.widgets[1];
          const img = out && out.node.querySelector('img');
          return img && img.src;
        }""", path)
        assert _same_picture(reopened, moved), "the reopened copy does not show the last picture drawn"
    finally:
        page.evaluate(CLOSE_JS, path)


# ----------------------------------------------------------------------------- the class mistake report

REPORT_DEMO = ROOT / "docs" / "class-report" / "report.html"


def test_the_class_report_reads_in_a_real_browser(page):
    """The committed demonstration report (README: For instructors), opened from disk as an
    instructor does: it loads nothing from the network, every chart is an image with an accessible
    name and a description that says its numbers, every table is named by its caption and has column
    headers, and the charts' bars are drawn."""
    requests: list[str] = []
    errors: list[str] = []
    lab_page = page  # the module's browser (one Playwright per process): a tab of its own
    page = lab_page.context.browser.new_page(viewport={"width": 1200, "height": 900})
    try:
        page.on("request", lambda r: requests.append(r.url))
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(REPORT_DEMO.as_uri())
        charts = page.get_by_role("img")
        assert charts.count() >= 2, "no charts in the report"
        for i in range(charts.count()):
            chart = charts.nth(i)
            described = chart.get_attribute("aria-labelledby").split()
            texts = [page.locator(f"[id='{x}']").text_content() for x in described]
            assert all(t and t.strip() for t in texts), f"chart {i} lacks its title or description: {texts}"
            assert chart.bounding_box()["height"] > 50 and chart.locator("rect").count() > 0
        first = page.locator("section h2").first.text_content()
        table = page.get_by_role("table", name=f"Exercises of {first}")
        assert table.count() == 1 and table.get_by_role("columnheader").count() == 8
        assert table.get_by_role("rowheader").count() >= 1
        assert page.get_by_role("table", name=re.compile("Most common mistakes")).count() >= 1
        assert page.get_by_role("heading", name="Marked for review").count() == 1
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "class-report.png"), full_page=False)
    finally:
        page.close()
    assert all(u.startswith("file://") for u in requests), [u for u in requests if not u.startswith("file://")]
    assert not errors, errors
