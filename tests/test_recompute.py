"""RunConfig.recompute (training/parallel/recompute.py) on real gloo ranks: the same numbers, the activations the
formula gives for a block that keeps its input only, under DDP and FSDP2; refusals; the state dict unchanged."""
import pytest
import torch

import labkit
from labkit import ConfigError, RunConfig
from labkit.training.parallel.recompute import recompute_blocks
from labkit.training.tasks import make_task
from labkit.tricks import parallel, tpclaim

STEPS = 3


def config(strategy, world=2, **fields):
    return parallel.lesson_config(strategy, world, steps=STEPS, tensorboard=False, save_final=False, **fields)


def launch(cfg, root):
    return labkit.launch(cfg, runs_root=root, echo=False, progress=False)


def losses(run):
    return run.df.sort_values(["step", "rank"])["loss"].tolist()


def test_recomputation_trains_the_same_numbers_and_keeps_the_formulas_activations(runs_root, no_leftovers):
    runs = {how: launch(config("ddp", recompute=how, name=f"ddp {how}"), runs_root) for how in ("none", "full")}
    assert losses(runs["full"]) == losses(runs["none"])           # bit for bit: the same forward, run twice
    for how, run in runs.items():
        held = parallel.held(run)["activations"]
        predicted = tpclaim.predicted_activations(run.config)
        assert abs(held - predicted) <= 0.01 * predicted, (how, held, predicted)
    assert parallel.held(runs["none"])["activations"] > 5 * parallel.held(runs["full"])["activations"]


def test_with_dropout_the_recomputed_forward_draws_the_same_masks(runs_root, no_leftovers):
    runs = [launch(config("ddp", recompute=how, dropout=0.1, name=f"dropout {how}"), runs_root)
            for how in ("none", "full")]
    assert losses(runs[0]) == losses(runs[1])


def test_under_fsdp2_recomputation_trains_as_ddp_does(runs_root, no_leftovers):
    ddp = launch(config("ddp", name="ddp"), runs_root)
    fsdp = launch(config("fsdp", recompute="full", name="fsdp full"), runs_root)
    assert max(abs(a - b) for a, b in zip(losses(ddp), losses(fsdp))) < 1e-5
    held = parallel.held(fsdp)["activations"]
    assert abs(held - tpclaim.predicted_activations(fsdp.config)) <= 0.01 * held


def test_the_wrapped_model_keeps_its_state_dict_keys_and_values():
    cfg = RunConfig(task="tinylm", world_size=1, global_batch=4)
    plain, wrapped = (make_task(cfg, 1).build_model() for _ in range(2))
    wrapped.load_state_dict(plain.state_dict())
    assert recompute_blocks(wrapped, "full") == len(plain.transformer.h)
    assert list(wrapped.state_dict()) == list(plain.state_dict())   # a checkpoint loads either way
    plain.load_state_dict(wrapped.state_dict())
    wrapped.load_state_dict(plain.state_dict())
    assert recompute_blocks(plain, "none") == 0
    with pytest.raises(ValueError, match="recompute = 'some'"):
        recompute_blocks(plain, "some")
    with pytest.raises(ValueError, match="no .transformer.h"):
        recompute_blocks(torch.nn.Linear(2, 2), "full")


@pytest.mark.parametrize("fields, words", [
    ({"task": "digits"}, "recomputes tinylm's GPT-2 blocks"),
    ({"strategy": "pp", "pipeline_ranks": 2, "layers": 2}, "not with RunConfig.strategy = 'pp'"),
    ({"context_parallel": 2}, "not with RunConfig.context_parallel = 2"),
    ({"recompute": "selective"}, "recompute"),
])
def test_recomputation_is_refused_where_it_does_not_apply(fields, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig(**{"task": "tinylm", "world_size": 2, "global_batch": 8, "recompute": "full", **fields}).validate()


# --- lesson 27's measurements (tricks/tpclaim.py) ----------------------------------------------------------

def test_recomputed_cases_are_named_after_their_plain_runs_and_paired_with_them():
    cases = tpclaim.recomputed([("fsdp", 2), ("tp", 2, {"sequence_parallel": True})])
    assert cases == [("fsdp", 2, {"recompute": "full", "name": "fsdp w2 recompute"}),
                     ("tp", 2, {"sequence_parallel": True, "recompute": "full", "name": "tp+sp w2 recompute"})]
    assert tpclaim.paired({"fsdp w2": "a", "fsdp w2 recompute": "b", "ddp w2": "c"}) == {"fsdp w2": ("a", "b")}
    with pytest.raises(KeyError, match="run \\['tp w2'\\] too"):
        tpclaim.paired({"tp w2 recompute": "b"})


class _Recorded:   # what loss_gap and extra_calls read of a Run: its name and its per-rank records
    def __init__(self, name, rows):
        import pandas as pd
        self.name, self.df = name, pd.DataFrame(rows)


def _rows(losses, gathers):
    return [{"rank": r, "step": s, "loss": loss + r, "allreduces": 1.0, "n_all_gather": gathers,
             "bytes_all_gather": 8.0 * gathers, "n_all_reduce": 1.0, "bytes_all_reduce": 8.0}
            for s, loss in enumerate(losses) for r in range(2)]


def test_loss_gap_and_extra_calls_compare_two_runs_step_for_step():
    none, full = _Recorded("none", _rows([3.0, 2.5], 6.0)), _Recorded("full", _rows([3.0, 2.5], 10.0))
    assert tpclaim.loss_gap(none, full) == 0.0
    assert tpclaim.loss_gap(none, _Recorded("off", _rows([3.0, 2.25], 6.0))) == 0.25
    assert tpclaim.extra_calls(none, full) == {"all_gather": 4} and tpclaim.extra_bytes(none, full) == {"all_gather": 32}
    assert tpclaim.extra_calls(none, none) == {}
    with pytest.raises(ValueError, match="run the same steps"):
        tpclaim.loss_gap(none, _Recorded("short", _rows([3.0], 6.0)))


def test_worst_gap_and_slowdown_read_their_tables():
    import pandas as pd
    from labkit.measure import Timing, Timings
    table = pd.DataFrame({"measured none": [100.0], "formula none": [99.0], "measured full": [10.0],
                          "formula full": [9.0]})
    assert tpclaim.worst_gap(table) == pytest.approx(1 / 9)
    timings = {label: Timing(label, None, step, 1.0, 0.0, tuple((0.0, s) for s in steps))
               for label, step, steps in (("ddp w2", 0.02, (0.02, 0.03, 0.02)),
                                          ("ddp w2 recompute", 0.03, (0.03, 0.03, 0.04)))}
    timed = Timings(timings, {}, {})
    assert tpclaim.slowdown(timed) == pytest.approx(1.5)   # the median of 1.5, 1.0 and 2.0
    assert tpclaim.summary(timed)["ms full"] == pytest.approx(30.0)


def test_recomputation_repeats_sequence_parallel_collectives_and_no_fsdp_gather(runs_root, no_leftovers):
    cases = [("fsdp", 2), ("tp", 2, {"sequence_parallel": True})]
    runs = parallel.run_strategies(cases + tpclaim.recomputed(cases), steps=STEPS, runs_root=runs_root,
                                   tensorboard=False, save_final=False)
    pairs = tpclaim.paired(runs)
    assert tpclaim.extra_calls(*pairs["fsdp w2"]) == {}   # the wrapper sits inside fully_shard's unit
    # each block's forward again, up to the last tensor backward needs: 2 all-gathers, 1 of 2 reduce-scatters
    assert tpclaim.extra_calls(*pairs["tp+sp w2"]) == {"all_gather": 4, "reduce_scatter": 2}
    table = tpclaim.activation_table(pairs)
    assert (table.kept < 0.1).all() and tpclaim.worst_gap(table) < 0.02, table
    assert all(tpclaim.loss_gap(*pair) == 0.0 for pair in pairs.values())
