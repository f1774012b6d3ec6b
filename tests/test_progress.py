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
    "assert bar._bar.value == 4 and bar._bar.max == 10, bar._bar.value\n"
    "assert 'step 4/10' in bar.text and '4 · 5 per rank' in bar.text, bar.text\n"
    "bar.close(ok=False); assert bar._bar.bar_style == 'danger'",
    "run = labkit.launch(labkit.RunConfig(world_size=2, steps=4, tensorboard=False, save_final=False), echo=False,"
    " runs_root=RUNS)",
    "import ipywidgets\nbars = [w for w in ipywidgets.Widget.widgets.values() if isinstance(w, ipywidgets.IntProgress)]\n"
    "assert (bars[-1].value, bars[-1].max, bars[-1].bar_style) == (4, 4, 'success'), bars[-1]",
]


@pytest.mark.timeout(180)
def test_a_notebook_launch_shows_a_widget_bar(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"RUNS = {str(tmp_path)!r}")] + [nbformat.v4.new_code_cell(c) for c in CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3").execute()
    widget_views = [out for out in nb.cells[-2].outputs
                    if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    assert len(widget_views) == 1, nb.cells[-2].outputs
