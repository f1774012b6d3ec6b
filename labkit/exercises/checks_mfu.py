"""MFU, model FLOPs utilization, computed by the learner before labkit shows it (lesson 14).

    def my_mfu(model, tokens_per_s, peak_flops, ranks):
        ...                              # the share (0..1) of the ranks' peak the model used
    report = check_mfu(my_mfu, run=run)  # run: a real run (none: the checker trains its own)
    my_mfu = report.use(reference_mfu)   # yours if it passed
    report.measured["peak_flops"]        # one rank's peak FLOP/s, measured by a matmul

`model` is a run's counts and shape as Run.model() gives them (params, params_active,
params_embedding, layers, hidden, seq_len); tokens_per_s all ranks' tokens per second;
peak_flops ONE rank's peak FLOP/s; ranks how many. The answer is labkit.measure.mfu's formula
(PaLM, appendix B):

    N = params_active - params_embedding     the parameters one token's matmuls use
    FLOPs per token = 6N + 12·L·h·s          2N forward, 4N backward; attention's scores, values
    MFU = FLOPs per token x tokens_per_s / (peak_flops x ranks)

The checker runs the learner's function on 2 gloo ranks (learner.run_checked: a timeout, the
learner's line on a raise) on four cases, and judges it two ways:

    formula    three models whose numbers part where the slips part: tinymoe (8 experts, top-2:
               active and total parameters differ), a 70B dense model on 1024 GPUs, DeepSeek-V3
               (671B, 37B active) on 2048, against labkit.measure's flops_per_token and
               utilization. A wrong answer that matches a usual slip on every case is named as
               that slip: forward only (2N), the attention term forgotten or halved, total for
               active parameters, the embedding lookups counted, one rank's peak for all ranks',
               FLOPs for FLOP/s, a percentage
    measured   a real run's records (the lesson's, or a tinylm run the checker trains on 2 gloo
               ranks): given run.model() and the run's tokens per second, the function must give
               Run.mfu() (records.py's path, not this module's)

A stub (NotImplementedError) is "not written yet"; `use` then hands back reference_mfu.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

from ..config import RunConfig
from ..measure.mfu import flops_per_token, matmul_flops, matmul_params, utilization
from ..records import Run
from ..run import launch
from .learner import learner_part, run_checked
from .checks_formulas import close
from .report import Report

REL = 1e-4
H100_BF16 = 989e12  # an H100 SXM's dense bf16 peak, FLOP/s (NVIDIA's datasheet; H800's the same)
# tinymoe (RunConfig(task="tinymoe"): 2 layers, h 32, 8 experts of 1,536 parameters, top-2);
# tests/test_mfu.py counts it by hand and against the built model
TINYMOE = dict(
    params=37072, params_active=18640, params_embedding=2048, layers=2, hidden=32, seq_len=32
)
# a 70B dense model: Llama 2 70B's shape, untied 32,000 x 8,192 token embeddings (looked up)
DENSE_70B = dict(
    params=70_000_000_000,
    params_active=70_000_000_000,
    params_embedding=262_144_000,
    layers=80,
    hidden=8192,
    seq_len=4096,
)
# DeepSeek-V3: 671B parameters, 37B active per token, 129,280 x 7,168 token embeddings
DEEPSEEK_V3 = dict(
    params=671_000_000_000,
    params_active=37_000_000_000,
    params_embedding=926_679_040,
    layers=61,
    hidden=7168,
    seq_len=4096,
)
# (label, model, tokens_per_s, peak_flops, ranks): a 4M-token batch every 4.5 s; DeepSeek-V3's
# report: 180K GPU hours per trillion tokens, on 2048 GPUs (3.16M tokens/s)
CASES = [
    ("tinymoe on 2 ranks", TINYMOE, 20_000.0, 2e10, 2),
    ("a 70B dense model on 1024 GPUs", DENSE_70B, 4e6 / 4.5, H100_BF16, 1024),
    ("DeepSeek-V3 on 2048 GPUs", DEEPSEEK_V3, 1e12 / (180e3 * 3600) * 2048, H100_BF16, 2048),
]

FORWARD = (
    "forward only: 2N (and 4·L·h·s) is one forward pass; backward costs twice forward, "
    "so training a token costs 3x: 6N + 12·L·h·s"
)
TWO_N = "2N instead of 6N: the parameters' backward (2x forward) is forgotten; training costs 6N"
NO_ATTENTION = (
    "the attention term is forgotten: 6N counts the parameters' matmuls; the scores "
    "and the weighted values (12·L·h·s per token, no parameters) come on top"
)
HALVED = (
    "the attention term is halved for the causal mask; labkit (and PaLM) count the whole "
    "s x s: 12·L·h·s"
)
TOTAL = (
    "total parameters where the active ones belong: a token of an MoE uses top_k of its "
    "experts, params_active, not params"
)
LOOKUPS = (
    "the embedding lookups are counted: a lookup is no matmul; N = params_active - params_embedding"
)
ALL = (
    "all parameters, embeddings and an MoE's idle experts included: "
    "N = params_active - params_embedding"
)
ONE_PEAK = (
    "one rank's peak: tokens_per_s is all ranks' work, so divide by all ranks' peak, "
    "peak_flops x ranks"
)
FLOPS = (
    "FLOPs, not FLOP/s: FLOPs per token over a peak in FLOP/s; the achieved FLOP/s is "
    "FLOPs per token x tokens_per_s"
)
PERCENT = "a percentage: MFU is asked as a fraction (0.4, not 40)"


def reference_mfu(model: dict, tokens_per_s: float, peak_flops: float, ranks: int) -> float:
    """labkit's reference: (6N + 12·L·h·s) x tokens_per_s / (peak_flops x ranks), N the
    parameters one token's matmuls use."""
    n = model["params_active"] - model["params_embedding"]
    per_token = 6 * n + 12 * model["layers"] * model["hidden"] * model["seq_len"]
    return per_token * tokens_per_s / (peak_flops * ranks)


def _want(model: dict, tokens_per_s: float, peak_flops: float, ranks: int) -> float:
    """The formula from labkit.measure's parts (independent of reference_mfu)."""
    shape = model["layers"], model["hidden"], model["seq_len"]
    return utilization(
        flops_per_token(matmul_params(model), *shape) * tokens_per_s, peak_flops, ranks
    )


def _slips(m: dict, tps: float, peak: float, ranks: int) -> dict[str, float]:
    """The usual wrong answers for one case, each with the sentence naming it (in this order)."""
    n, attention = (
        m["params_active"] - m["params_embedding"],
        12 * m["layers"] * m["hidden"] * m["seq_len"],
    )
    right = 6 * n + attention
    share = tps / (peak * ranks)
    return {
        FORWARD: (2 * n + attention / 3) * share,
        TWO_N: (2 * n + attention) * share,
        NO_ATTENTION: 6 * n * share,
        HALVED: (6 * n + attention / 2) * share,
        TOTAL: (6 * (m["params"] - m["params_embedding"]) + attention) * share,
        LOOKUPS: (6 * m["params_active"] + attention) * share,
        ALL: (6 * m["params"] + attention) * share,
        ONE_PEAK: right * share * ranks,
        FLOPS: right / (peak * ranks),
        PERCENT: 100 * right * share,
    }


def _drive(ctx: Any, fn: Callable, name: str, cases: list[tuple]) -> list[Any]:
    """One rank: the learner's function on every case (it is pure: every rank must say the same)."""
    with learner_part(ctx, name):
        return [fn(dict(model), tps, peak, ranks) for _, model, tps, peak, ranks in cases]


def lesson_run(runs_root: Any = None) -> Run:
    """A short real run when the lesson gives none: tinylm on 2 gloo ranks, 6 steps."""
    config = RunConfig(world_size=2, steps=6, tensorboard=False, save_final=False)
    return launch(config, echo=False, progress=False, name="check-mfu-run", runs_root=runs_root)


def check_mfu(
    fn: Callable,
    *,
    run: Run | None = None,
    peak_flops: float | None = None,
    world: int = 2,
    timeout: float = 20.0,
    runs_root: Any = None,
) -> Report:
    """Run `fn` on 2 gloo ranks against the formula and a run's records:
    check_mfu(my_mfu, run=run).ok."""
    name = getattr(fn, "__name__", "my_mfu")
    run = run if run is not None else lesson_run(runs_root)
    peak = float(peak_flops) if peak_flops is not None else matmul_flops()
    labkit = run.mfu(peak)
    report = Report(
        f"{name}: MFU of {len(CASES)} models and of the run {run.name}, on {world} gloo ranks",
        implementation=fn,
    )
    report.measured.update(peak_flops=peak, run_mfu=labkit)
    if "missing" in labkit:
        report.add(
            "measured",
            "fail",
            f"the run {run.name} has no MFU to compare with: {labkit['missing']}",
        )
        return report
    on_run = (f"the run {run.name}", run.model(), labkit["tokens_per_s"], peak, labkit["ranks"])
    cases = CASES + [on_run]
    got = run_checked(
        report,
        functools.partial(_drive, fn=fn, name=name, cases=cases),
        world_size=world,
        timeout=timeout,
        name=f"check-{name}",
        runs_root=runs_root,
        hang_hint="Your function computes a number from its arguments: it needs no collective.",
    )
    if got is None:
        return report
    if _formula(report, got[0][: len(CASES)], name):
        _measured(report, got[0][-1], labkit, run, name)
    return report


def _formula(report: Report, got: list[Any], name: str) -> bool:
    want = [_want(*case[1:]) for case in CASES]
    wrong = [i for i, (g, w) in enumerate(zip(got, want)) if not close(g, w, REL)]
    if not wrong:
        report.add(
            "formula",
            "pass",
            "(6N + 12·L·h·s) x tokens/s over peak x ranks on "
            + ", ".join(f"{label}: {w:.3f}" for (label, *_), w in zip(CASES, want)),
        )
        return True
    for why in _slips(*CASES[0][1:]):
        if all(close(g, _slips(*case[1:])[why], REL) for g, case in zip(got, CASES)):
            report.add("formula", "fail", why, part=name)
            return False
    i = wrong[0]
    said = (
        f"{float(got[i]):.4g}"
        if _number(got[i])
        else f"{got[i]!r} ({type(got[i]).__name__}, not a number)"
    )
    report.add(
        "formula",
        "fail",
        f"{CASES[i][0]}: your MFU is {said}, the formula's {want[i]:.4g} "
        f"({len(wrong)} of {len(CASES)} models wrong, and none of the usual slips)",
        part=name,
    )
    return False


def _number(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _measured(report: Report, got: Any, labkit: dict, run: Run, name: str) -> None:
    want = labkit["mfu"]
    parts = (
        f"{labkit['flops_per_token']:,.0f} FLOPs per token x {labkit['tokens_per_s']:,.0f} "
        "tokens/s over "
        f"{labkit['ranks']} x {labkit['peak_flops'] / 1e9:.3g} GFLOP/s"
    )
    if close(got, want, REL):
        report.measured["mfu"] = float(got)
        report.add(
            "measured",
            "pass",
            f"the run {run.name} ({labkit['ranks']} gloo ranks): your {float(got):.3f} "
            f"is Run.mfu()'s, {parts}",
        )
    else:
        report.add(
            "measured",
            "fail",
            f"the run {run.name}: your MFU is {got!r}, Run.mfu() says {want:.4g} "
            f"({parts}); your function is given run.model(): read its fields",
            part=name,
        )
