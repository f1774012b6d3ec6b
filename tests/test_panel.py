"""The control panel, driven from the kernel side: set the widgets' values, press its buttons (their click
handlers), and check that real ranks ran with exactly those values, and that Stop leaves nothing behind."""
from __future__ import annotations

import time

import pytest

import labkit
from labkit import Fault, RunConfig
from labkit.fault import FAULT_KINDS
from labkit.app.controls import CONTROLS, config_from, describe, make_knobs
from labkit.app.panel import Panel, recorded_steps

from .conftest import leftover_processes

BASE = RunConfig(world_size=2, global_batch=32, steps=6, tensorboard=False, save_final=False)


def test_every_knob_shows_its_fields_value_and_gives_it_back():
    base = BASE.replace(clip_norm=0.7, faults=(Fault(kind="slow", rank=1, step=2, delay_s=0.01),))
    knobs = make_knobs(base, list(CONTROLS) + ["seed", "no_sync", "name"])
    assert {f: k.value for f, k in knobs.items()} == {f: getattr(base, f) for f in knobs}
    assert config_from(base, knobs) == base


def test_moving_the_widgets_changes_the_config():
    knobs = make_knobs(BASE, ["world_size", "lr", "clip_norm", "precision", "faults", "no_sync"])
    knobs["world_size"].widget.value = 4
    knobs["lr"].widget.value = 0.01
    knobs["clip_norm"].widget.value = 1.0
    knobs["precision"].widget.value = "bf16"
    knobs["no_sync"].widget.value = False
    faults = knobs["faults"]
    faults.kind.value, faults.rank.value, faults.step.value = "raise", 1, 3
    cfg = config_from(BASE, knobs)
    assert (cfg.world_size, cfg.lr, cfg.clip_norm, cfg.precision, cfg.no_sync) == (4, 0.01, 1.0, "bf16", False)
    assert cfg.faults == (Fault(kind="raise", rank=1, step=3),)
    knobs["clip_norm"].widget.value = "off"
    faults.kind.value = "none"
    assert config_from(BASE, knobs).clip_norm is None and config_from(BASE, knobs).faults == ()
    assert describe(cfg, BASE) == "world_size=4, no_sync=False, lr=0.01, clip_norm=1, precision=bf16, " \
                                  "faults=raise@r1s3"


def test_the_fault_menu_offers_every_kind_and_a_slow_fault_keeps_its_delay():
    knobs = make_knobs(BASE, ["faults"])
    assert list(knobs["faults"].kind.options) == ["none", *FAULT_KINDS]
    knobs["faults"].kind.value, knobs["faults"].delay.value = "slow", 0.05
    assert knobs["faults"].value == (Fault(kind="slow", rank=0, step=0, delay_s=0.05),)


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(ValueError, match="worldsize"):
        make_knobs(BASE, ["worldsize"])


def _panel(runs_root, **options) -> Panel:
    fields = options.pop("fields", ["world_size", "global_batch", "grad_accum", "steps", "lr", "clip_norm", "faults"])
    return labkit.panel(options.pop("config", BASE), fields=fields, runs_root=runs_root, **options)


def test_a_click_runs_exactly_the_values_set_on_the_widgets(runs_root, no_leftovers):
    panel = _panel(runs_root)
    panel.controls["world_size"].widget.value = 1
    panel.controls["global_batch"].widget.value = 16
    panel.controls["grad_accum"].widget.value = 2
    panel.controls["lr"].widget.value = 0.01
    panel.controls["clip_norm"].widget.value = 0.5
    panel.run_button.click()
    assert panel.run_button.disabled and not panel.stop_button.disabled
    run = panel.wait(timeout=120)
    expected = BASE.replace(world_size=1, global_batch=16, grad_accum=2, lr=0.01, clip_norm=0.5)
    assert run.config == expected
    assert run.finished and len(run.steps()) == expected.steps
    # what the rank itself recorded: one rank, 16 samples per step, at that LR
    assert set(run.df["rank"]) == {0} and (run.df["samples"] == 16).all() and (run.df["lr"] == 0.01).all()
    assert "finished" in panel.status.value
    assert panel.table.ticked() == [run.path]              # the new run is ticked, and drawn
    assert panel.figure.value[:4] == b"\x89PNG"
    assert not panel.run_button.disabled and panel.stop_button.disabled
    assert panel.jobs[0].progress.bar.value == expected.steps


def test_stop_ends_the_run_mid_way_and_leaves_no_process(runs_root, no_leftovers):
    panel = _panel(runs_root, config=BASE.replace(steps=100_000), live_every_s=0.5)
    panel.run_button.click()
    job = panel.jobs[-1]
    deadline = time.monotonic() + 60
    try:
        while (job.run_dir is None or min(recorded_steps(job.run_dir, 2)) < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.run_dir is not None, "the run never started"
        # the bar follows the run while it goes; its thread also redraws the live figure, which a busy machine slows
        while job.progress.bar.value < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.progress.bar.value >= 2
    except AssertionError:
        job.stop.set()  # a 100 000-step run left going would load every later test of this session
        panel.wait(timeout=30)
        raise
    pressed = time.monotonic()
    panel.stop_button.click()
    run = panel.wait(timeout=30)
    assert time.monotonic() - pressed < 5
    assert run.meta["outcome"] == "stopped"
    assert 2 <= len(run.steps()) < 100_000
    assert "stopped after" in panel.status.value
    assert job.progress.bar.bar_style == "danger"
    assert not leftover_processes()


def test_a_failing_run_is_reported_in_the_panel(runs_root, no_leftovers):
    panel = _panel(runs_root, timeout=10)
    faults = panel.controls["faults"]
    faults.kind.value, faults.rank.value, faults.step.value = "raise", 1, 2
    panel.run_button.click()
    run = panel.wait(timeout=60)
    assert "failed" in panel.status.value and "rank 1" in panel.status.value, panel.status.value
    assert run is not None and "InjectedFault" in run.failure()
    assert "failed" in panel.table.rows.children[-1].children[1].value
    assert not leftover_processes()


def test_a_panel_with_restarts_restarts_from_a_checkpoint_and_a_fault_in_the_config_fires_again(runs_root,
                                                                                                no_leftovers):
    """A fault in the config is a bug in the code: every attempt meets it at the same step, so a restart from the
    newest checkpoint fails there again (a restart helps against a node's death, not against a bug)."""
    panel = _panel(runs_root, config=BASE.replace(steps=8, checkpoint_every=2), max_restarts=1,
                   fields=["checkpoint_every", "faults"])
    faults = panel.controls["faults"]
    faults.kind.value, faults.rank.value, faults.step.value = "exit", 1, 5
    panel.run_button.click()
    run = panel.wait(timeout=120)
    assert "rank 1" in str(panel.jobs[-1].error) and "failed" in panel.status.value, panel.status.value
    attempts = run.attempts()
    assert run.meta["max_restarts"] == 1 and len(attempts) == 2, attempts
    assert list(attempts["first_step"]) == [0, 4] and list(attempts["last_step"]) == [4, 4], attempts  # resumed at 4
    with pytest.raises(ValueError, match="max_restarts"):
        _panel(runs_root, max_restarts=-1)


def test_knobs_that_make_no_valid_config_start_nothing(runs_root):
    panel = _panel(runs_root)
    panel.controls["world_size"].widget.value = 3          # 32 samples do not split over 3 ranks
    assert panel.start() is None and panel.jobs == []
    assert "global_batch" in panel.status.value and not runs_root.exists()


def test_a_second_press_while_a_run_goes_starts_nothing(runs_root, no_leftovers):
    panel = _panel(runs_root, config=BASE.replace(steps=100_000))
    first = panel.start()
    assert panel.start() is None and "is going" in panel.status.value
    panel.stop()
    panel.wait(timeout=60)
    assert len(panel.jobs) == 1 and first.done.is_set()


def test_the_table_lists_this_process_runs_and_draws_the_ticked_ones(runs_root, no_leftovers):
    one = labkit.launch(BASE.replace(world_size=1), runs_root=runs_root, echo=False)
    two = labkit.launch(BASE, runs_root=runs_root, echo=False)
    panel = _panel(runs_root)
    assert [p.name for p in panel.table.runs()] == [one.path.name, two.path.name]
    assert panel.figure.layout.display == "none"           # nothing ticked: no figure
    panel.table.boxes[one.path].value = True                # a person ticks a row
    assert panel.figure.value[:4] == b"\x89PNG" and panel.figure.layout.display is None
    assert _panel(runs_root, past="all").table.runs() == panel.table.runs()


KERNEL_CELLS = [
    "import time, psutil, labkit\nfrom labkit.app.panel import recorded_steps\n"
    "base = labkit.RunConfig(world_size=2, steps=5, tensorboard=False, save_final=False)\n"
    "panel = labkit.panel(base, fields={'scale': ['world_size', 'steps'], 'optimizer': ['lr', 'faults']},"
    " runs_root=RUNS, live_every_s=0.5)\npanel",
    # what a browser's click delivers to the kernel: a comm message that calls the button's handlers
    "panel.controls['world_size'].widget.value = 1\npanel.controls['lr'].widget.value = 0.02\n"
    "panel.run_button._handle_button_msg(None, {'event': 'click'}, [])\nrun = panel.wait(timeout=120)\n"
    "assert run.config == base.replace(world_size=1, lr=0.02), run.config\nassert run.finished",
    "panel.controls['steps'].widget.value = 300\npanel.run_button.click()\njob = panel.jobs[-1]\n"
    "while job.run_dir is None or min(recorded_steps(job.run_dir, 1)) < 2:\n    time.sleep(0.05)\n"
    "panel.stop_button._handle_button_msg(None, {'event': 'click'}, [])\nstopped = panel.wait(timeout=60)\n"
    "assert stopped.meta['outcome'] == 'stopped' and len(stopped.steps()) < 300\n"
    "left = [p for p in psutil.Process().children(recursive=True)\n"
    "        if p.status() != psutil.STATUS_ZOMBIE and p.name() != 'labkit-warm']  # the kernel's, not the run's\n"
    "assert not left, left",
]


def _count_shell_sends(monkeypatch) -> list[str]:
    """Every message nbclient's Output-widget stand-in sends back to the kernel on the shell channel: the send that
    can swallow a cell's execute_reply (jupyter/nbclient#312, see labkit/app/panel.py)."""
    from nbclient.output_widget import OutputWidget
    sent, original = [], OutputWidget._publish_msg

    def counting(self, msg_type, *args, **kwargs):
        sent.append(msg_type)
        return original(self, msg_type, *args, **kwargs)
    monkeypatch.setattr(OutputWidget, "_publish_msg", counting)
    return sent


def test_the_send_counter_sees_an_output_widget(monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    sent = _count_shell_sends(monkeypatch)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import ipywidgets\nout = ipywidgets.Output()\ndisplay(out)\n"
                                          "with out:\n    print('inside')")]
    # This cell can itself hit the race the send counter is for: its reply then waits out the whole cell timeout
    # (1 run in 3 took 61 s at timeout=60) and is found by nbclient's last poll. 15 s bounds that cost and leaves
    # the cell's real work (an import and a print) room on a busy machine.
    NotebookClient(nb, timeout=15, kernel_name="python3").execute()
    assert sent, "an Output widget's print makes nbclient send on the shell channel"


@pytest.mark.timeout(300)
def test_in_a_kernel_a_click_runs_the_set_values_and_stop_leaves_nothing(tmp_path, monkeypatch):
    """The same through a real Jupyter kernel, executed by nbclient as nbmake does. nbclient never sends on the
    shell channel while the panel works (so the race of jupyter/nbclient#312 cannot happen: labkit/app/panel.py),
    no cell comes near its timeout, and the panel holds no Output widget."""
    import nbformat
    from nbclient import NotebookClient
    sent = _count_shell_sends(monkeypatch)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"RUNS = {str(tmp_path)!r}")] + [nbformat.v4.new_code_cell(c)
                                                                          for c in KERNEL_CELLS]
    took = {}
    client = NotebookClient(nb, timeout=100, kernel_name="python3",
                            on_cell_execute=lambda cell, cell_index: took.__setitem__(cell_index, time.monotonic()),
                            on_cell_executed=lambda cell, cell_index, execute_reply: took.__setitem__(
                                cell_index, time.monotonic() - took[cell_index]))
    client.execute()
    assert sent == [] and client.comm_objects == {}
    assert max(took.values()) < 60, took
    models = {state.get("_model_name") for state in client.widget_state.values()}
    assert "OutputModel" not in models and "ButtonModel" in models, models
    views = [o for o in nb.cells[1].outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(views) == 1


def test_the_table_reads_runs_whose_records_lack_timings(runs_root):
    """A run of a RunConfig whose ranks recorded only some fields (a failed run, a function's own records)."""
    from labkit.app.table import RunTable
    path = runs_root / "20250101-000000-partial-abcd"
    path.mkdir(parents=True)
    BASE.save(path / "config.json")
    (path / "meta.json").write_text('{"name": "partial", "outcome": "failed"}')
    (path / "rank0.jsonl").write_text('{"rank": 0, "step": 0, "loss": 2.5}\n{"rank": 0, "step": 1}\n')
    (row,) = RunTable(runs_root, past="all").rows.children
    assert "2/6 steps · failed" in row.children[1].value and "samples/s" not in row.children[1].value
