"""Both paths through the exercise lessons. The lessons ship their ✏️ cells as stubs (make test runs them as they
are: every checker says NOT WRITTEN YET and the lesson goes on with labkit's reference). Here, the solved path: each
folded solution runs through its checker on real ranks and is what report.use hands back, and a solved copy puts
each solution in its cell and changes nothing else."""
import json
from pathlib import Path

import pytest
import torch

from labkit import exercises as ex
from labkit.exercises import blanks

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXERCISE_LESSONS = ["16_build_ddp_yourself.ipynb", "17_build_zero_yourself.ipynb", "18_pipeline_parallel.ipynb",
                    "27_tensor_and_sequence_parallel.ipynb", "19_mixture_of_experts.ipynb",
                    "23_context_parallelism.ipynb", "24_first_principles.ipynb", "00_first_ddp_run.ipynb",
                    "04_communication_efficiency.ipynb"]
EXERCISE_LESSONS += ["07_data_sharding.ipynb", "08_seeds_and_reproducibility.ipynb"]
EXERCISE_LESSONS += ["03_batch_size_and_scaling.ipynb"]
# 02's answer is a number from the lesson's own fit (alpha, bandwidth): its solution needs the lesson's
# namespace, so it is in EXERCISE_LESSONS only; tests/test_exercises_ringtime.py checks its checker.
EXERCISE_LESSONS += ["02_backends_and_bandwidth.ipynb", "11_monitoring.ipynb", "01_pin_versions.ipynb"]
EXERCISE_LESSONS += ["12_debugging_hangs.ipynb", "05_data_loading.ipynb"]
EXERCISE_LESSONS += ["26_mixed_precision_and_compression.ipynb", "13_checkpoint_and_resume.ipynb"]
EXERCISE_LESSONS += ["06_sync_vs_async.ipynb", "09_gradient_clipping.ipynb", "10_lr_schedules.ipynb"]
EXERCISE_LESSONS += ["14_zero_and_tensor_parallel.ipynb"]
# Each lesson's folded solutions go through their checkers (the lesson itself runs under make test with labkit's
# reference in its place). lesson -> [(checker of the solution's names,
# the names report.use hands back once it passed), ...], one per exercise.
SOLUTION_CHECKS = {
    "27_tensor_and_sequence_parallel.ipynb": [(lambda ns: ex.check_tp(ns["MyColumnParallelLinear"], ns["MyRowParallelLinear"]),
                                           lambda ns: (ns["MyColumnParallelLinear"], ns["MyRowParallelLinear"]))],
    "16_build_ddp_yourself.ipynb": [(lambda ns: ex.check_ddp(ns["MyNaiveDDP"]), lambda ns: ns["MyNaiveDDP"]),
                                    (lambda ns: ex.check_ddp(ns["MyOverlapDDP"], overlap=True),
                                     lambda ns: ns["MyOverlapDDP"]),
                                    (lambda ns: ex.check_ddp(ns["MyBucketedDDP"], bucket_size_mb=0.01),
                                     lambda ns: ns["MyBucketedDDP"])],
    "17_build_zero_yourself.ipynb": [(lambda ns: ex.check_sharded_optimizer(ns["MyShardedOptimizer"]),
                                      lambda ns: ns["MyShardedOptimizer"])],
    "18_pipeline_parallel.ipynb": [(lambda ns: ex.check_pipeline_costs(ns["pipeline_costs"]),
                                    lambda ns: ns["pipeline_costs"]),
                                   (lambda ns: ex.check_pipeline(ns["my_1f1b"]), lambda ns: ns["my_1f1b"])],
    "19_mixture_of_experts.ipynb": [(lambda ns: ex.check_a2a(ns["dispatch"], ns["combine"]),
                                     lambda ns: (ns["dispatch"], ns["combine"])),
                                    (lambda ns: ex.check_a2a_bytes(ns["a2a_bytes_per_token"]),
                                     lambda ns: ns["a2a_bytes_per_token"])],
    "23_context_parallelism.ipynb": [(lambda ns: ex.check_cp_bytes(ns["cp_bytes"]), lambda ns: ns["cp_bytes"]),
                                     (lambda ns: ex.check_ring(ns["my_ring"]), lambda ns: ns["my_ring"])],
    # a %%writefile solution is written to a file (its path in ns["%%writefile"]) and checked there
    "24_first_principles.ipynb": [(lambda ns: ex.check_script(ns["%%writefile"]), lambda ns: ns["%%writefile"]),
                                  (lambda ns: ex.check_swap(ns["my_swap"]), lambda ns: ns["my_swap"]),
                                  (lambda ns: ex.check_ring_allreduce(ns["my_all_reduce"]),
                                   lambda ns: ns["my_all_reduce"]),
                                  (lambda ns: ex.check_number(ns["RING_SENT"], "share", formula=1.5),
                                   lambda ns: ns["RING_SENT"])],
    "00_first_ddp_run.ipynb": [(lambda ns: ex.check_ddp_loop(ns["train_ddp"]), lambda ns: ns["train_ddp"])],
    "04_communication_efficiency.ipynb": [(lambda ns: ex.check_accumulation(ns["accumulation_step"]),
                                           lambda ns: ns["accumulation_step"])],
    # 12's reading (HUNG_RANK, COLLECTIVE) is judged against the failure the lesson's planted run raised, which only
    # the lesson's namespace holds: the lesson checks it; here, the fix
    "12_debugging_hangs.ipynb": [(lambda ns: ex.check_hang_fix(ns["my_train_until"]),
                                  lambda ns: ns["my_train_until"])],
    "05_data_loading.ipynb": [(lambda ns: ex.check_loader(ns["make_loader"]), lambda ns: ns["make_loader"])],
    "26_mixed_precision_and_compression.ipynb": [(lambda ns: ex.check_compression_hook(ns["my_fp16_hook"]),
                                                  lambda ns: ns["my_fp16_hook"])],
    "13_checkpoint_and_resume.ipynb": [(lambda ns: ex.check_resume(ns["save_state"], ns["load_state"]),
                                        lambda ns: (ns["save_state"], ns["load_state"]))],
    "06_sync_vs_async.ipynb": [(lambda ns: ex.check_average(ns["average_parameters"]),
                                lambda ns: ns["average_parameters"])],
    "09_gradient_clipping.ipynb": [(lambda ns: ex.check_all_finite(ns["all_finite"]),
                                    lambda ns: ns["all_finite"])],
    "10_lr_schedules.ipynb": [(lambda ns: ex.check_plateau(ns["plateau_step"]),
                               lambda ns: ns["plateau_step"])],
}
SOLUTION_CHECKS["07_data_sharding.ipynb"] = [(lambda ns: ex.check_epoch_loader(ns["epoch_loader"]),
                                              lambda ns: ns["epoch_loader"])]
SOLUTION_CHECKS["08_seeds_and_reproducibility.ipynb"] = [(lambda ns: ex.check_seeding(ns["build_for_rank"]),
                                                          lambda ns: ns["build_for_rank"])]
SOLUTION_CHECKS["03_batch_size_and_scaling.ipynb"] = [(lambda ns: ex.check_lr_at(ns["lr_at"]),
                                                       lambda ns: ns["lr_at"])]
SOLUTION_CHECKS["11_monitoring.ipynb"] = [(lambda ns: ex.check_straggler(ns["find_straggler"]),
                                           lambda ns: ns["find_straggler"])]
# 14's my_mfu: the lesson checks it against its ddp run's records; here the checker trains its own run
SOLUTION_CHECKS["14_zero_and_tensor_parallel.ipynb"] = [(lambda ns: ex.check_mfu(ns["my_mfu"]),
                                                         lambda ns: ns["my_mfu"])]
SOLUTION_CHECKS["01_pin_versions.ipynb"] = [  # DIFFERS judged against what the lesson's run flags
    (lambda ns: ex.check_differs(ns["DIFFERS"], ["env.NCCL_IB_DISABLE"]), lambda ns: ns["DIFFERS"]),
    (lambda ns: ex.check_fields_that_differ(ns["fields_that_differ"]), lambda ns: ns["fields_that_differ"])]
# numbers first (issue 44): pure functions judged on the formula's big case, then on real gloo ranks
SOLUTION_CHECKS["17_build_zero_yourself.ipynb"] += [(lambda ns: ex.check_state_bytes(ns["state_bytes_per_gpu"]),
                                                     lambda ns: ns["state_bytes_per_gpu"])]
SOLUTION_CHECKS["27_tensor_and_sequence_parallel.ipynb"] += [
    (lambda ns: ex.check_tp_bytes(ns["tp_allreduce_bytes"], ns["kept_per_layer"]),
     lambda ns: (ns["tp_allreduce_bytes"], ns["kept_per_layer"]))]


@pytest.mark.parametrize("lesson", EXERCISE_LESSONS)
def test_a_lesson_ships_stubs_with_each_solution_folded_after_its_checker(lesson, tmp_path):
    cells = json.loads((NOTEBOOKS / lesson).read_text())["cells"]
    exercises = [i for i, cell in enumerate(cells) if blanks.is_exercise(cell)]
    assert exercises
    for index in exercises:
        stub = "".join(cells[index]["source"])
        checker = blanks._checker_after(cells, index)
        solution = blanks.solution_of(cells[checker + 1])
        assert solution and "NotImplementedError" not in solution and "<details>" in "".join(cells[checker + 1]["source"])
        compile(blanks.split_magic(solution)[1] or solution, lesson, "exec")   # a %%writefile script below its magic
        # its stub: a function's body raises NotImplementedError; an answer line is `NAME = ...  # ✏️`
        assert "NotImplementedError" in stub or "= ...  # ✏️" in stub
        assert stub == blanks.blank_source(solution.rstrip("\n"))
    # and writing it first again changes nothing
    again = blanks.write_first(NOTEBOOKS / lesson, tmp_path / lesson)
    assert json.loads(again.read_text())["cells"] == cells


@pytest.mark.parametrize("lesson", EXERCISE_LESSONS)
def test_the_solved_copy_puts_each_folded_solution_in_its_cell(lesson, tmp_path):
    # Running a solved copy top to bottom cost CI 26-30 s a lesson; the solutions' checkers run below instead.
    cells = json.loads((NOTEBOOKS / lesson).read_text())["cells"]
    solved = json.loads(ex.solved_copy(NOTEBOOKS / lesson, tmp_path / lesson).read_text())["cells"]
    exercises = [i for i, cell in enumerate(cells) if blanks.is_exercise(cell)]
    for index in exercises:
        solution = blanks.solution_of(cells[blanks._checker_after(cells, index) + 1])
        assert "".join(solved[index]["source"]).rstrip("\n") == solution.rstrip("\n")
    assert [c["source"] for i, c in enumerate(solved) if i not in exercises] == \
        [c["source"] for i, c in enumerate(cells) if i not in exercises]


@pytest.mark.parametrize("lesson", sorted(SOLUTION_CHECKS))
def test_a_folded_solution_passes_its_checker_on_real_ranks(lesson, monkeypatch, runs_root, no_leftovers):
    monkeypatch.setenv("LABKIT_RUNS", str(runs_root))
    cells = json.loads((NOTEBOOKS / lesson).read_text())["cells"]
    namespace: dict = {"torch": torch, "dist": torch.distributed, "nn": torch.nn, "F": torch.nn.functional, "ex": ex}   # the lessons' imports
    namespace["DDP"] = torch.nn.parallel.DistributedDataParallel   # lesson 00's import
    for index in [i for i, cell in enumerate(cells) if blanks.is_exercise(cell)]:
        solution = blanks.solution_of(cells[blanks._checker_after(cells, index) + 1])
        magic, body = blanks.split_magic(solution)
        if magic:   # a script the learner writes: into a file, as %%writefile would
            namespace["%%writefile"] = runs_root / "solution.py"
            namespace["%%writefile"].parent.mkdir(parents=True, exist_ok=True)
            namespace["%%writefile"].write_text(body)
            continue
        exec(compile(solution, f"{lesson}'s solution", "exec"), namespace)
    for check, names in SOLUTION_CHECKS[lesson]:
        report = check(namespace)
        assert report.ok, report.text()
        assert report.use("labkit's reference") == names(namespace)   # passed: the learner's own code is used


def test_a_stub_not_written_yet_is_said_and_the_reference_used_while_wrong_code_stops(monkeypatch, capsys):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)
    stub = ex.Report("Yours on 2 ranks", implementation="stub")
    stub.add("gradients", "missing", "finish_gradient_synchronization is not written yet")
    assert stub.use("reference") == "reference"
    assert "[not written yet] the cells below use labkit's reference until yours passes." in capsys.readouterr().out
    wrong = ex.Report("Yours on 2 ranks", implementation="wrong")
    wrong.add("gradients", "missing", "forward is not written yet")
    wrong.add("gradients", "fail", "gradients are summed, not averaged")
    with pytest.raises(ex.ExerciseFailed, match="summed, not averaged"):
        wrong.use("reference")
