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
    blanks.py      stubs first, solutions folded; solved and blank copies (python -m labkit.exercises ...);
                   answer lines (NAME = value  # ✏️) and %%writefile scripts blanked too
    checks_allreduce.py  a ring all-reduce from send/recv (lesson 24 to come): the reference, the checker
    checks_sync.py local SGD's periodic average (lesson 06): the reference, its checker
    checks_nanflag.py  one verdict on a non-finite loss, agreed by every rank (09): reference, checker
    checks_plateau.py  ReduceLROnPlateau fed the all-reduced held-out loss (10): reference, checker
    answers.py     answers that are a number or a name: check_number (formula, measurement, the usual
                   slips named), check_name
"""
from .answers import check_name, check_number
from .blanks import blank_copy, solved_copy, write_first
from .checknet import CheckNet
from .checks_a2a import a2a_combine, a2a_dispatch, a2a_reference, check_a2a
from .checks_allreduce import check_ring_allreduce, ring_all_reduce
from .checks_ddp import check_ddp
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
from .checks_sync import check_average, reference_average
__all__ += ["check_average", "reference_average"]
from .checks_nanflag import check_all_finite, reference_all_finite
__all__ += ["check_all_finite", "reference_all_finite"]
from .checks_plateau import check_plateau, reference_plateau_step
__all__ += ["check_plateau", "reference_plateau_step"]
