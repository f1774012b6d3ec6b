"""A RunConfig and a run's summary as a notebook shows them: what changed first, numbers rounded, still Python."""
import json
import math

import pytest
from IPython.core.formatters import DisplayFormatter

from labkit import Fault, RunConfig
from labkit.display import Summary, rounded


def shown(obj) -> dict:
    """The mime bundle Jupyter would render for `obj` as a cell's last expression."""
    return DisplayFormatter().format(obj)[0]


def test_a_config_shows_the_fields_that_differ_first_in_text_and_html():
    cfg = RunConfig(world_size=4, global_batch=64, lr=0.01, faults=(Fault(kind="raise", rank=1, step=2),))
    bundle = shown(cfg)
    text = bundle["text/plain"]
    assert text.startswith("RunConfig(world_size=4, global_batch=64, lr=0.01, faults=(Fault(") and len(text) < 200
    assert eval(text, {"RunConfig": RunConfig, "Fault": Fault}) == cfg          # still round-trips
    page = bundle["text/html"]
    changed, folded = page.split("<details>")
    assert all(f"<code>{name}</code>" in changed for name in ("world_size", "global_batch", "lr", "faults"))
    assert "<code>task</code>" in folded and "<code>task</code>" not in changed
    assert "4 fields changed" in page
    assert shown(RunConfig())["text/plain"] == "RunConfig()"


def test_the_full_table_on_demand_puts_changed_fields_first():
    table = RunConfig(steps=7, lr=0.5).table()
    assert list(table.index[:2]) == ["steps", "lr"]           # changed first, in field order
    assert table.loc["steps", "value"] == 7 and table.loc["steps", "default"] == 20 and table.loc["steps", "changed"]
    assert not table.loc["task", "changed"] and len(table) == len(RunConfig.__dataclass_fields__)


def test_a_summary_stays_a_dict_and_is_shown_rounded():
    summary = Summary({"steps": 30, "samples_per_s": 506.96322114011434, "final_loss": math.nan,
                       "time_to_first_step_s": 0.0123456789})
    assert isinstance(summary, dict) and summary["samples_per_s"] == 506.96322114011434   # the value, unrounded
    assert json.loads(json.dumps(summary))["steps"] == 30
    bundle = shown(summary)
    assert bundle["text/plain"] == "{'steps': 30, 'samples_per_s': 507.0, 'final_loss': nan, " \
                                   "'time_to_first_step_s': 0.01235}"
    assert "<td>507.0</td>" in bundle["text/html"]


@pytest.mark.parametrize("value,expected", [(506.96322, 507.0), (0.000123456, 0.0001235), (12345678.9, 12350000.0),
                                            (3, 3), (0.0, 0.0), (True, True)])
def test_rounding_keeps_four_significant_figures(value, expected):
    assert rounded(value) == expected


def test_run_summary_is_shown_that_way_too(tmp_path):
    from labkit import load_run
    rows = [{"rank": 0, "step": s, "time": 100.0 + s, "loss": 2.0 / (s + 1), "lr": 0.1, "samples": 16,
             "t_step": 0.0316227766} for s in range(4)]
    (tmp_path / "rank0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = load_run(tmp_path).summary()
    assert isinstance(summary, Summary) and summary["steps"] == 4
    assert "'median_samples_per_s': 506.0" in shown(summary)["text/plain"]   # 16 / 0.0316227766 = 505.96...
