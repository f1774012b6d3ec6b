"""A figure helper shows its figure exactly once in a notebook, whether the cell assigns it, ends with it, or both;
and still returns the Figure for savefig."""
import json

import nbformat
import pytest
from nbclient import NotebookClient

SETUP = """
import json, pathlib, labkit
path = pathlib.Path(RUN_DIR)
path.mkdir(parents=True, exist_ok=True)
with open(path / "rank0.jsonl", "w") as f:
    for step in range(5):
        f.write(json.dumps({"rank": 0, "step": step, "loss": 2.0 - 0.1 * step, "lr": 1e-3, "t_step": 0.01,
                            "samples": 8, "grad_norm": 1.0}) + "\\n")
run = labkit.load_run(path)
"""

CELLS = {  # cell source -> images it must show
    "fig = labkit.compare([run])": 1,
    "labkit.compare([run])": 1,
    "fig = labkit.compare([run])\nfig": 1,
    "fig": 1,                                       # a later cell shows the figure again, as any value
    "print('before')\nlabkit.curves([run], 'grad_norm')\nx = 2": 1,
    "from labkit.view import show\nshow(fig)\nshow(fig)": 1,
    "fig.savefig(RUN_DIR + '/f.png'); pathlib.Path(RUN_DIR + '/f.png').stat().st_size > 0": 0,
}


def images(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.outputs)


@pytest.mark.timeout(180)
def test_each_figure_helper_call_shows_one_image_per_cell(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"RUN_DIR = {json.dumps(str(tmp_path / 'run'))}\n" + SETUP)]
    nb.cells += [nbformat.v4.new_code_cell(source) for source in CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    shown = {cell.source: images(cell) for cell in nb.cells[1:]}
    assert shown == CELLS
    assert nb.cells[-1].outputs[-1]["data"]["text/plain"] == "True"  # savefig still wrote the PNG
