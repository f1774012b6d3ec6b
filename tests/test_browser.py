"""The lessons in a real browser: JupyterLab on 127.0.0.1, headless Chromium driven by Playwright, every cell run.

    make test-browser       # installs Debian's chromium (as root) and the `browser` extra, then runs this file

For each notebook (lesson 00, the playground 15 when it exists, else lesson 08): open it, Run All Cells, wait until
every code cell has run, and check what a reader sees: no error output, every image output the kernel produced
decoded in the page (naturalWidth > 0), the widgets (progress bars, panels) rendered as widgets, not as text; in a
notebook with a Run button, a click on it reaches the kernel and changes what is shown. A small notebook made here
(a Button whose click launches two ranks) checks that round trip where no lesson has a button (no playground). Screenshots
go to site/browser/<notebook>.png. Skipped unless Chromium and Playwright are installed (`make install` does not
install them; `make test-browser` does, and fails if they are missing).

Chromium runs with the flags this sandboxed machine needs (no GPU, no background networking, no sandbox as root, a
fresh profile: Playwright makes one per launch); each notebook is bounded by a timeout.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "site" / "browser"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
try:
    from playwright.sync_api import sync_playwright
except ImportError:  # the `browser` extra is not installed
    sync_playwright = None

MISSING = [what for what, there in (("Debian's chromium", CHROMIUM), ("Playwright", sync_playwright)) if not there]
# Under `make test` (no browser extra) these tests are skipped; under `make test-browser` (LABKIT_BROWSER=1) a missing
# browser is a failure, not a skip that would let the target pass without running anything.
pytestmark = pytest.mark.skipif(bool(MISSING) and os.environ.get("LABKIT_BROWSER") != "1",
                                reason=f"needs {' and '.join(MISSING)}: make test-browser installs them")

FLAGS = ["--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--no-first-run", "--disable-quic", "--disable-dev-shm-usage"]
RUN_ALL_TIMEOUT_S = 420
SETTINGS = {  # JupyterLab settings for the run: no news pop-up over the page; every cell kept in the page, so that
    # the outputs of cells scrolled out of view can be counted and drawn in the screenshot
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false"},
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none"}}
PROBE = "browser_widget_probe.ipynb"
PROBE_CELLS = [
    "import ipywidgets as widgets\nimport labkit\n"
    "clicks = widgets.IntText(value=0, description='clicks')\n"
    "done = widgets.Label('not run yet')\n"
    "run = widgets.Button(description='Run')\n\n"
    "def on_run(_):\n"
    "    clicks.value += 1\n"
    "    result = labkit.launch(labkit.RunConfig(world_size=2, steps=3, tensorboard=False), echo=False,"
    " progress=False)\n"
    "    done.value = f'ran {len(result.steps())} steps on {result.world_size} ranks'\n\n"
    "run.on_click(on_run)\n"
    "widgets.VBox([run, clicks, done])",
]


def notebooks() -> list[str]:
    """Lesson 00, and the playground when it exists; else another lesson with figures and the probe, whose button
    checks the click-to-kernel round trip that the playground's Run button checks when it is there (CI's 30 minutes
    have no room for the same check twice)."""
    if (ROOT / "notebooks" / "15_playground.ipynb").exists():
        return ["00_first_ddp_run.ipynb", "15_playground.ipynb"]
    return ["00_first_ddp_run.ipynb", "08_seeds_and_reproducibility.ipynb", PROBE]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """JupyterLab on 127.0.0.1 at a free port, over a copy of notebooks/ (the browser saves what it runs)."""
    assert not MISSING, f"make test-browser needs {' and '.join(MISSING)}"
    work = tmp_path_factory.mktemp("browser")
    shutil.copytree(ROOT / "notebooks", work / "notebooks")
    kernel = {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}}
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in PROBE_CELLS],
                                            metadata=kernel), work / "notebooks" / PROBE)
    for plugin, values in SETTINGS.items():  # a fresh settings folder: the user's own stays untouched
        path = work / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    token = secrets.token_hex(16)
    # Figures inline, as a reader sees them; the claims it prints are not make test's count of the lesson's (a second
    # run of lesson 00 would count twice).
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "LABKIT_CLAIMS_LOG")}
    env.update(LABKIT_QUICK="1", LABKIT_RUNS=str(work / "runs"), TMPDIR=str(work),
               JUPYTERLAB_SETTINGS_DIR=str(work / "settings"), JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"),
               JUPYTER_RUNTIME_DIR=str(work / "runtime"))
    cmd = [str(Path(sys.executable).parent / "jupyter"), "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--IdentityProvider.token={token}", f"--notebook-dir={work / 'notebooks'}",
           "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")  # as the Makefile's `lab` target: containers and CI run as root
    log = open(work / "jupyterlab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                pytest.fail(f"JupyterLab did not start:\n{(work / 'jupyterlab.log').read_text()[-3000:]}")
            time.sleep(0.2)
    try:
        yield {"url": url, "token": token, "dir": work / "notebooks"}
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server shuts its kernels down, and with them their ranks
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS, chromium_sandbox=False)
        yield chromium
        chromium.close()


def prompts(page) -> list[str]:
    """The execution prompt of every code cell: '[3]:' once run, '[*]:' while running, '[ ]:' never run."""
    return [t.strip() for t in page.locator(".jp-Notebook .jp-CodeCell .jp-InputArea-prompt").all_inner_texts()]


def run_all(page, name: str) -> float:
    """Run > Run All Cells; wait until every code cell shows an execution count. Returns the seconds it took."""
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
    started, deadline = time.monotonic(), time.monotonic() + RUN_ALL_TIMEOUT_S
    while True:
        page.wait_for_timeout(1000)
        marks = prompts(page)
        if marks and all(m[1:-2].strip().isdigit() for m in marks):
            return time.monotonic() - started
        if not any("*" in m for m in marks) and time.monotonic() - started > 10:
            pytest.fail(f"{name}: Run All stopped before the end (an error?): prompts {marks}\n{errors(page)}")
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: cells still running after {RUN_ALL_TIMEOUT_S} s: prompts {marks}")


def errors(page) -> list[str]:
    return page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']") \
        .filter(has_text="Traceback").all_inner_texts()


def decoded_images(page) -> list[int]:
    """naturalWidth of every image in the notebook's outputs (0: the browser could not decode it)."""
    return page.eval_on_selector_all(".jp-Notebook .jp-OutputArea-output img", "els => els.map(e => e.naturalWidth)")


def saved_image_outputs(path: Path) -> int:
    notebook = nbformat.read(path, as_version=4)
    return sum("image/png" in o.get("data", {}) for c in notebook.cells if c.cell_type == "code" for o in c.outputs)


def click_run(page, name: str) -> str:
    """Click the first widget button labelled Run; return the widget area's text once it has changed."""
    button = page.locator(".jupyter-widgets button", has_text="Run").first
    area = page.locator(".jp-OutputArea-output", has=button).first
    before = area.inner_text()
    button.click()
    deadline = time.monotonic() + 180
    while area.inner_text() == before:
        if time.monotonic() > deadline:
            pytest.fail(f"{name}: the Run click changed nothing in 180 s:\n{before}")
        page.wait_for_timeout(500)
    page.wait_for_timeout(5000)  # let a launch the click started finish drawing
    return area.inner_text()


def screenshot_whole_notebook(page, path: Path) -> None:
    """The notebook scrolls inside the page: make the window as tall as the notebook, then take the picture."""
    scroller = ".jp-NotebookPanel .jp-WindowedPanel-outer"
    height = page.eval_on_selector(scroller, "e => e.scrollHeight")
    page.set_viewport_size({"width": 1400, "height": min(int(height) + 250, 16000)})
    page.eval_on_selector(scroller, "e => { e.scrollTop = 0; }")
    page.wait_for_timeout(1500)
    page.screenshot(path=str(path))


@pytest.mark.parametrize("name", notebooks())
def test_a_notebook_runs_in_the_browser_and_shows_its_figures_and_widgets(lab, browser, name):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    try:
        # A workspace of its own, reset: otherwise JupyterLab reopens the notebooks an earlier page had open
        page.goto(f"{lab['url']}/lab/workspaces/{Path(name).stem}/tree/{name}?reset&token={lab['token']}")
        page.wait_for_selector(".jp-NotebookPanel .jp-CodeCell", timeout=90_000)
        page.locator(".jp-StatusBar-Widget", has_text="Idle").first.wait_for(timeout=90_000)  # the kernel is up
        seconds = run_all(page, name)
        assert not errors(page), f"{name}: {errors(page)}"
        widgets = page.locator(".jp-OutputArea-output .jupyter-widgets").count()
        assert not page.locator(".jp-OutputArea-output", has_text="Widget(").count() \
            and not page.locator(".jp-OutputArea-output", has_text="IntProgress(").count(), \
            f"{name}: a widget was shown as text (the widget manager did not render it)"
        if page.locator(".jupyter-widgets button", has_text="Run").count():
            after = click_run(page, name)
            if name == PROBE:
                assert "ran 3 steps on 2 ranks" in after, after
        page.keyboard.press("Control+s")
        page.wait_for_timeout(2000)
        widths = decoded_images(page)
        expected = saved_image_outputs(lab["dir"] / name)
        assert all(w > 0 for w in widths), f"{name}: images not decoded: {widths}"
        assert len(widths) >= expected, f"{name}: {expected} image outputs saved, {len(widths)} shown"
        # A figure is an image output (matplotlib's PNG) or an image inside a widget (the panel draws its
        # side-by-side figure into an Image widget, not into an output); every one of them was decoded (above).
        in_widgets = len(page.eval_on_selector_all(".jp-OutputArea-output .jupyter-widgets img", "els => els"))
        if name != PROBE:
            assert expected + in_widgets >= 1 and widgets >= 1, \
                f"{name}: {expected} figure outputs, {in_widgets} figures in widgets, {widgets} widgets"
        screenshot_whole_notebook(page, SHOTS / f"{Path(name).stem}.png")
        print(f"{name}: ran in {seconds:.0f} s; {len(widths)} images decoded ({in_widgets} in widgets), "
              f"{widgets} widget views")
    except BaseException:
        page.screenshot(path=str(SHOTS / f"{Path(name).stem}.failed.png"))  # what the page showed then
        raise
    finally:
        page.close()
