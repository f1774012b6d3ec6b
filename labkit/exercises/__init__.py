"""Build DDP and ZeRO yourself: reference solutions, and checkers that run your code on real gloo ranks.

    from labkit import exercises as ex
    report = ex.check_ddp(MyDDP)                              # 2 ranks against one process on the same data
    report = ex.check_ddp(MyOverlapDDP, overlap=True)         # all-reduces must start during backward
    report = ex.check_ddp(MyBucketedDDP, bucket_size_mb=0.01) # and respect the bucket size
    report = ex.check_sharded_optimizer(MyShardedOptimizer)   # ZeRO-1: same steps, 1/N of the state per rank
    report = ex.check_pipeline(my_1f1b)                       # 1F1B for two stages with send/recv
    report = ex.check_ring(my_ring)                           # ring attention, on 2 and 4 ranks
    report = ex.check_a2a(dispatch, combine)                  # MoE all-to-all dispatch and combine, 2 and 3 ranks
    report = ex.check_ring_allreduce(my_all_reduce)           # a ring from send/recv on 2, 3 and 4 ranks
    report = ex.check_swap(my_swap)                           # send/recv between 2 ranks, without a deadlock
    report = ex.check_script(ex.script_path("first_job.py"))  # your script under torchrun on 2 local ranks
    report = ex.check_number(BUSBW, "bus bandwidth", formula=f, measured=m)   # a number written first, judged
    print(report); report.measured                            # what was checked, and the numbers behind it
    MyDDP = report.use(ex.NaiveDDP)                           # yours if it passed (blank mode: the reference)
    traced = ex.trace_step(MyOverlapDDP)                      # one step under torch.profiler: Chrome trace JSON
    ex.match_trace(ex.read_trace(traced.path(0)), traced.probe(0))   # the trace's all-reduces are the probe's
    ex.solved_copy("notebooks/16_build_ddp_yourself.ipynb", "16.solved.ipynb")   # the folded solutions put in
    ex.blank_copy("notebooks/16_build_ddp_yourself.ipynb")    # a copy in blank mode (wrong code said, not raised)

The interface (that of well-known course assignments): a wrapper whose constructor broadcasts rank 0's parameters
and which has finish_gradient_synchronization() to call after backward(); a bucketed variant taking
bucket_size_mb; a sharded optimizer built as (params, optimizer_cls, **optimizer_kwargs).

    report.py      Report, Finding, blank mode (LABKIT_EXERCISES=blank)
    references.py  NaiveDDP, OverlapDDP, BucketedDDP, ShardedOptimizer, plan_buckets
    checknet.py    the model the checkers train: a tied weight, a frozen layer; its data
    probe.py       CommProbe: every collective's bytes, start, end, and whether it was waited on
    learner.py     a learner's code that raises, hangs or is not written yet, told apart
    ddp_rank.py    inside a rank: drive a DDP wrapper;    checks_ddp.py, traffic.py: judge what it did
    zero_rank.py   inside a rank: drive an optimizer;     checks_zero.py: judge it; holdings.py: state it holds
    speeds.py      wrappers side by side on a tiny GPT-2 (TorchDDP: torch's DDP behind the same interface)
    traced.py      one step of a wrapper under torch.profiler: the trace read back, drawn, matched to the probe
    zero_runs.py   optimizer state per rank at several world sizes; training curves
    pipe_rank.py   inside a rank: drive a two-stage pipeline step;  checks_pipeline.py: judge it, one_f_one_b
    checks_tp.py   column- and row-parallel linear layers (tensor parallelism): references, checker;
                   tp_rank.py: inside a rank, drive them through the checker's residual block
    checks_ring.py ring attention (context parallelism): the Ring a learner uses, the reference, its checker
    checks_a2a.py  MoE dispatch and combine with all_to_all_single: the reference pair, its checker
    charts.py      timeline, bucket_sweep, state_per_rank
    editions.py    the classroom: student and solutions editions in nbgrader's form (python -m labkit.exercises
                   student|solutions OUTDIR); grading.py: grade learners' notebooks headless (... grade)
    blanks.py      stubs first, solutions folded; solved and blank copies (python -m labkit.exercises ...);
                   answer lines (NAME = value  # ✏️) and %%writefile scripts blanked too
    checks_allreduce.py  a ring all-reduce from send/recv (lesson 24 to come): the reference, the checker
    checks_p2p.py  two ranks swap a tensor with send/recv (lesson 24): the reference, the checker (the deadlock)
    checks_torchrun.py  your first script under torchrun (lesson 24): contract, checker, labkit's first_job.py
    checks_sync.py local SGD's periodic average (lesson 06): the reference, its checker
    checks_nanflag.py  one verdict on a non-finite loss, agreed by every rank (09): reference, checker
    checks_plateau.py  ReduceLROnPlateau fed the all-reduced held-out loss (10): reference, checker
    answers.py     answers that are a number or a name: check_number (formula, measurement, the usual
                   slips named), check_name
    checks_loop.py the DDP loop (00) and accumulation under no_sync (04): references, checkers; loop_rank.py inside a rank
    checks_data.py each rank's share of every epoch (lesson 07): sharded_loader, check_epoch_loader
    checks_seeds.py  the same initial weights, per-rank noise (lesson 08): seeded_build, check_seeding
    checks_lr.py   the linear scaling rule with warmup as a pure lr_at (lesson 03): scaled_lr, check_lr_at
    checks_ringtime.py  one all_reduce's time predicted from α and B, then measured (lesson 02)
    checks_straggler.py the straggler found from a real run's records, planted at random (lesson 11)
    checks_fingerprint.py  the field two ranks' fingerprints differ in, named and found (lesson 01)
    checks_hang.py a hang report read (check_hang_report) and the planted early stop fixed (check_hang_fix)
    checks_loader.py  a rank's DataLoader (lesson 05): its shard, workers that last; check_loader
    checks_compress.py   a DDP compression hook (fp16/bf16, lesson 26): the reference fp16_hook, the checker, hook_bytes
    checks_resume.py     save and load for a resume bit for bit (lesson 13): the references, the checker
    checks_mfu.py  MFU from a run's counts, tokens/s and peak (lesson 14): reference_mfu, check_mfu
    checks_statebytes.py model-state bytes per GPU, written first (17): model_state_bytes_per_gpu, check_state_bytes
    checks_tpbytes.py    TP's all-reduce and activation bytes per block, written first (27): check_tp_bytes
    checks_bubble.py     GPipe's and 1F1B's bubble and microbatches in flight, worked out first (18)
    checks_moebytes.py   the MoE all-to-all's bytes per token, worked out first (19)
    checks_cpbytes.py    ring, all-gather and Ulysses attention's bytes per rank, worked out first (23);
                         checks_formulas.py: a pure function judged on a grid, its slip named
"""
from .answers import check_name, check_number
from .blanks import blank_copy, solved_copy, write_first
from .checknet import CheckNet
from .checks_data import check_epoch_loader, sharded_loader
from .checks_seeds import check_seeding, seeded_build
from .checks_lr import check_lr_at, scaled_lr
from .checks_ringtime import check_ring_time, ring_time_ms
from .checks_straggler import check_straggler, slowest_compute
from .checks_fingerprint import check_differs, check_fields_that_differ, differing_fields
from .checks_hang import check_hang_fix, check_hang_report, train_until_fixed
from .checks_loader import check_loader, rank_loader
from .checks_compress import check_compression_hook, fp16_hook, hook_bytes
from .checks_resume import check_resume, resume_reference
from .checks_sync import check_average, reference_average
from .checks_nanflag import check_all_finite, reference_all_finite
from .checks_plateau import check_plateau, reference_plateau_step
from .checks_loop import accumulate_with_no_sync, check_accumulation, check_ddp_loop, ddp_train
from .checks_a2a import a2a_combine, a2a_dispatch, a2a_reference, check_a2a
from .checks_allreduce import check_ring_allreduce, ring_all_reduce
from .checks_ddp import check_ddp
from .checks_p2p import check_swap, swap
from .checks_torchrun import FIRST_JOB, check_script, script_path, torchrun_command
from .checks_pipeline import check_pipeline, one_f_one_b
from .checks_ring import Ring, check_ring, ring_attention
from .checks_tp import TP_REFERENCE, ColumnParallelLinear, RowParallelLinear, check_tp
from .checks_zero import check_sharded_optimizer
from .holdings import state_holdings
from .references import BucketedDDP, NaiveDDP, OverlapDDP, ShardedOptimizer, plan_buckets
from .report import ExerciseFailed, Finding, Report, blank_mode
from .traced import match_trace, read_trace, trace_step, trace_timeline

__all__ = ["check_ring", "ring_attention", "Ring", "check_ddp", "check_sharded_optimizer", "check_pipeline", "one_f_one_b", "NaiveDDP", "OverlapDDP", "BucketedDDP", "ShardedOptimizer",
           "plan_buckets", "Report", "Finding", "ExerciseFailed", "blank_mode", "blank_copy", "solved_copy", "write_first", "CheckNet",
           "state_holdings"]
__all__ += ["check_tp", "TP_REFERENCE", "ColumnParallelLinear", "RowParallelLinear"]
__all__ += ["check_a2a", "a2a_dispatch", "a2a_combine", "a2a_reference"]
__all__ += ["trace_step", "read_trace", "match_trace", "trace_timeline"]
__all__ += ["check_number", "check_name", "check_ring_allreduce", "ring_all_reduce"]
__all__ += ["check_swap", "swap", "check_script", "script_path", "torchrun_command", "FIRST_JOB"]
__all__ += ["check_ddp_loop", "ddp_train", "check_accumulation", "accumulate_with_no_sync"]
__all__ += ["check_epoch_loader", "sharded_loader", "check_seeding", "seeded_build"]
__all__ += ["check_lr_at", "scaled_lr", "check_ring_time", "ring_time_ms", "check_straggler", "slowest_compute"]
__all__ += ["check_differs", "check_fields_that_differ", "differing_fields"]
__all__ += ["check_hang_fix", "check_hang_report", "train_until_fixed", "check_loader", "rank_loader"]
__all__ += ["check_compression_hook", "fp16_hook", "hook_bytes", "check_resume", "resume_reference"]
__all__ += ["check_average", "reference_average", "check_all_finite", "reference_all_finite", "check_plateau",
            "reference_plateau_step"]
from .checks_mfu import check_mfu, reference_mfu  # noqa: E402 - lesson 14's MFU
__all__ += ["check_mfu", "reference_mfu"]
from .checks_statebytes import check_state_bytes, model_state_bytes_per_gpu  # noqa: E402
from .checks_tpbytes import TP_BYTES_REFERENCE, check_tp_bytes, kept_per_layer, tp_allreduce_bytes  # noqa: E402
__all__ += ["check_state_bytes", "model_state_bytes_per_gpu", "check_tp_bytes", "TP_BYTES_REFERENCE",
            "tp_allreduce_bytes", "kept_per_layer"]
from .checks_bubble import check_pipeline_costs, reference_pipeline_costs  # noqa: E402
from .checks_moebytes import check_a2a_bytes, reference_a2a_bytes  # noqa: E402
from .checks_cpbytes import check_cp_bytes, reference_cp_bytes  # noqa: E402
__all__ += ["check_pipeline_costs", "reference_pipeline_costs", "check_a2a_bytes", "reference_a2a_bytes",
            "check_cp_bytes", "reference_cp_bytes"]

from .checks_compose import COMPOSE_REFERENCE, check_parallelize  # noqa: E402
__all__ += ["check_parallelize", "COMPOSE_REFERENCE"]
