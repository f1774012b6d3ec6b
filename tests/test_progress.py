"""The launch's progress: a real bar with the time left, steps done over steps total, per rank."""
import nbformat
import pytest
from nbclient import NotebookClient

from labkit.view.progress import eta_seconds


def test_eta_counts_from_the_first_recorded_step():
    assert eta_seconds(done=20, total=40, first_done=1, first_at=0.0, now=19.0) == pytest.approx(20.0)
    assert eta_seconds(done=1, total=40, first_done=1, first_at=5.0, now=5.0) is None   # no rate yet
    assert eta_seconds(done=40, total=40, first_done=1, first_at=0.0, now=9.0) == 0.0


CELLS = [
    "import labkit\nfrom labkit.view.progress import Progress\n"
    "bar = Progress('demo', total_steps=10, world_size=2)\nbar.update([-1, -1])\nbar.update([3, 4])",
    "assert bar.bar.value == 4 and bar.bar.max == 10, bar.bar.value\n"
    "assert 'step 4/10' in bar.text and '4 · 5 per rank' in bar.text, bar.text\n"
    "bar.close(ok=False); assert bar.bar.bar_style == 'danger'",
    "run = labkit.launch(labkit.RunConfig(world_size=2, steps=4, tensorboard=False, save_final=False), echo=False,"
    " runs_root=RUNS)",
    "import ipywidgets\nbars = [w for w in ipywidgets.Widget.widgets.values() if isinstance(w, ipywidgets.FloatProgress)]\n"
    "assert (bars[-1].value, bars[-1].max, bars[-1].bar_style) == (4, 4, 'success'), bars[-1]",
    # a plain function: no step total, what most lessons launch
    "def plain(ctx):\n    ctx.record(0, loss=1.0)\n    return ctx.rank\n"
    "assert labkit.launch(plain, world_size=2, echo=False, runs_root=RUNS).result(1) == 1",
]


@pytest.mark.timeout(180)
def test_a_notebook_launch_shows_a_widget_bar(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"RUNS = {str(tmp_path)!r}")] + [nbformat.v4.new_code_cell(c) for c in CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    widget_views = [out for out in nb.cells[3].outputs
                    if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert len(widget_views) == 1, nb.cells[3].outputs


def test_the_bar_is_tqdms_and_its_clock_starts_at_the_first_recorded_step():
    from labkit.view.progress import Progress
    bar = Progress("demo", total_steps=10, world_size=2, enabled=False)
    box = bar.widget()                        # the panel's way: tqdm's notebook container, not shown
    bar.update([-1, -1])                      # ranks still starting: nothing done, no clock yet
    assert bar.bar.value == 0 and bar._tqdm.initial == 0
    bar.update([2, 3])                        # first record: 3 steps done by the slowest rank
    assert (bar.bar.value, bar._tqdm.initial, bar._tqdm.total) == (3, 3, 10)
    bar.update([5, 4])
    shown = bar._tqdm.format_dict
    assert (shown["n"], shown["initial"]) == (5, 3)    # tqdm's rate: (n - initial) / seconds since that record
    assert "per rank 6 · 5" in str(bar._tqdm) and box.children[1] is bar.bar
    bar.close(ok=True)
    assert bar.bar.bar_style == "success"


def test_a_run_of_unknown_length_updates_its_bar_without_asking_tqdm_for_its_truth():
    """A plain function's launch has no step total; a tqdm bar with total None raises on bool() (CI caught
    `self._tqdm or ...` failing in 16 lessons), so the bar is kept and updated, steps per rank only."""
    from labkit.view.progress import Progress
    bar = Progress("plain", total_steps=None, world_size=2, enabled=False)
    bar.widget()
    bar.update([-1, -1])
    bar.update([0, 2])
    bar.update([3, 2])
    assert bar._tqdm.n == 3 and bar.text.startswith("plain: steps per rank 4 · 3"), bar.text
    bar.close(ok=True)
