"""Per-rank structured records, and reading a run back into pandas.

On disk, one directory per run, the same under labkit's launcher and under torchrun (rundir.py names every file):
config.json, meta.json, rank<r>.jsonl (one JSON object per recorded step, flushed line by line), rank<r>.log (a rank
that raises writes FAILURE_MARKER there, then its traceback), rank<r>.error.json, failure.txt, tb/, final/,
checkpoints/, attempts/.

A run that restarted (launch(..., max_restarts=N), torchrun --max-restarts) appends every attempt's records to
the same files, each record saying which `attempt` wrote it; a restarted attempt records again the steps after the
checkpoint it resumed from, and those records supersede the earlier attempt's (Run.df shows one continuous run,
Run.attempts() what each attempt did).

Reading:
    run = labkit.load_run("runs/tinylm-w2-...")
    run.df            # every record of every rank, sorted by step then rank
    run.steps()       # one row per step: mean loss, loss spread over ranks, lr, global throughput
    run.summary()     # median throughput, final loss, time to first step
    run.lr_disagreement()   # the first step where the ranks' LRs differ (None: they agree)
    run.mfu(peak_flops=1e11)  # model FLOPs utilization, from the model's counts its records hold (labkit.measure.mfu)
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd

from .display import Summary
from .rundir import RunDir, rank_of

FAILURE_MARKER = "labkit: this rank failed"  # heads the traceback in a rank's log (the live echo stops there)
ATTEMPT_ENV = "LABKIT_ATTEMPT"  # set by labkit's launcher for runs that may restart; torchrun sets its own


def current_attempt() -> int | None:
    """Which attempt of a restartable run this process is (0 first): LABKIT_ATTEMPT, set by launch(...,
    max_restarts=N), or torchrun's TORCHELASTIC_RESTART_COUNT; None when neither is set."""
    value = os.environ.get(ATTEMPT_ENV, os.environ.get("TORCHELASTIC_RESTART_COUNT"))
    return int(value) if value not in (None, "") else None


def rank_error(rank: int, step: int, exc: BaseException) -> dict[str, Any]:
    """The one error record of a failed rank, as rank<r>.error.json holds it (Run.failure reads the earliest):
    rank_error(1, 7, exc) -> {"rank": 1, "step": 7, "type": ..., "message": ..., "traceback": ..., "time": ...}."""
    import traceback
    return {"rank": rank, "step": step, "type": type(exc).__name__, "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)), "time": time.time()}


class RankRecorder:
    """Writes one rank's records as JSON lines, the source of truth:

        rec = RankRecorder(run_dir, rank=0)
        rec.write({"step": 0, "loss": 2.3})
        rec.close()

    Nothing else happens in the training loop: TensorBoard events are made from these files when the run ends
    (write_tensorboard), because writing them per step cost about 2% of a tiny model's step on this CPU.
    """

    def __init__(self, run_dir: Path, rank: int):
        self.rank = rank
        self.attempt = current_attempt()
        path = RunDir(run_dir).records(rank)
        # Line-buffered: each record reaches the file when written, so a crashed rank loses nothing.
        self._file = open(path, "a", buffering=1)
        if path.stat().st_size and _last_byte(path) != b"\n":
            self._file.write("\n")  # a killed attempt's last line was cut short: the next record starts afresh

    def write(self, record: dict[str, Any]) -> None:
        tag = {"attempt": self.attempt} if self.attempt is not None else {}
        self._file.write(json.dumps({"rank": self.rank, **tag, **record}, allow_nan=True) + "\n")

    def close(self) -> None:
        self._file.close()


def write_tensorboard(run_dir: Path, ranks: list[int] | None = None) -> None:
    """TensorBoard events under run_dir/tb/rank<r>/ from the ranks' records:  write_tensorboard(run.path).

    Every numeric field becomes a scalar at its step; rewriting replaces the events written before."""
    import shutil
    from torch.utils.tensorboard import SummaryWriter
    run_dir = RunDir(run_dir)
    for path in run_dir.record_files():
        rank = rank_of(path)
        if ranks is not None and rank not in ranks:
            continue
        out = run_dir.tensorboard(rank)
        shutil.rmtree(out, ignore_errors=True)
        with SummaryWriter(log_dir=str(out)) as writer:
            for record in current_records(read_jsonl(path)):
                for key, value in record.items():
                    if key not in ("rank", "step", "time") and isinstance(value, (int, float)) \
                            and not isinstance(value, bool):
                        writer.add_scalar(key, value, record.get("step", 0), walltime=record.get("time"))


def current_records(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a restarted run stands by: for each (rank, step), the one of the latest attempt that recorded
    it (records without an attempt count as attempt 0). Runs that never restarted come back unchanged."""
    if not any("attempt" in r for r in rows):
        return rows
    latest: dict[tuple[Any, Any], dict[str, Any]] = {}
    for row in rows:
        key = (row.get("rank"), row.get("step"))
        if key not in latest or (row.get("attempt") or 0) >= (latest[key].get("attempt") or 0):
            latest[key] = row
    return list(latest.values())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of one file; a last line cut short by a crash is skipped, not an error."""
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class Run:
    """A finished (or still running) run, read from its directory:  Run("runs/<run-id>")."""

    def __init__(self, path: str | Path):
        self.dir = RunDir(path)
        self.path = self.dir.path
        if not self.path.is_dir():
            raise FileNotFoundError(f"no run directory at {self.path}")
        self.meta: dict[str, Any] = read_meta(self.path)
        self._df: pd.DataFrame | None = None

    def __repr__(self) -> str:
        return f"Run({self.name!r}, world_size={self.world_size}, records={len(self.df)})"

    @property
    def config(self):
        from .config import RunConfig
        path = self.dir.config
        return RunConfig.from_dict(upgraded(_read_json(path), path)) if path.exists() else None

    @property
    def name(self) -> str:
        return self.meta.get("name") or self.path.name

    @property
    def world_size(self) -> int:
        return int(self.meta.get("world_size") or len(self.dir.record_files()))

    @property
    def df(self) -> pd.DataFrame:
        """All records of all ranks, one row per (step, rank)."""
        if self._df is None:
            self._df = self.read_records()
        return self._df

    def read_records(self, superseded: bool = False) -> pd.DataFrame:
        """Read the records now (also while the run is going; `df` caches this). A restarted run's records that a
        later attempt recorded again are left out unless `superseded` (see the module docstring)."""
        rows = [r for f in self.dir.record_files() for r in read_jsonl(f)]
        rows = rows if superseded else current_records(rows)
        if not rows:
            return pd.DataFrame(columns=["rank", "step"])
        return pd.DataFrame(rows).sort_values(["step", "rank"], kind="stable").reset_index(drop=True)

    def steps(self, df: pd.DataFrame | None = None) -> pd.DataFrame:
        """One row per step: loss (mean over ranks), loss_min/max over ranks, lr, global samples/s and tokens/s.

    Every rank has the same batch size, so the mean of the ranks' local losses is the global batch's loss: the
    value an all-reduce would give, without a collective in the training loop."""
        return per_step(self.df if df is None else df)

    def slowest(self, *columns: str, after: int = 0) -> pd.DataFrame:
        """One row per step (from step `after` on), each column at its largest over ranks: what the step waited
    for, since a synchronous step ends when its slowest rank does:  run.slowest("t_step", "t_data", after=2)."""
        return slowest_per_step(self.df, columns or ("t_step",), after=after)

    def summary(self) -> Summary:
        """Headline figures: global throughput over the whole run and its per-step median (steps after the first),
    final loss, time to first step."""
        steps = self.steps()
        launched = self.meta.get("launched_at")
        first = self.df["time"].min() if "time" in self.df and len(self.df) else math.nan
        later = steps[steps["step"] > steps["step"].min()] if len(steps) > 1 else steps
        return Summary({
            "steps": int(len(steps)),
            "samples_per_s": whole_run_throughput(self.df),
            "median_samples_per_s": (float(later["samples_per_s"].median()) if "samples_per_s" in later and len(later)
                                     else math.nan),  # records without timings (a function's own) have none
            "median_tokens_per_s": float(later["tokens_per_s"].median()) if "tokens_per_s" in later else math.nan,
            "final_loss": float(steps["loss"].iloc[-1]) if len(steps) else math.nan,
            "time_to_first_step_s": float(first - launched) if launched else math.nan,
        })

    def model(self) -> dict[str, int]:
        """The model's counts and shape, from the first records (Task.model_fields); {} before labkit wrote them."""
        got = {c[6:]: self.df[c].dropna() for c in self.df.columns if str(c).startswith("model_")}
        return {k: int(v.iloc[0]) for k, v in got.items() if len(v)}

    def mfu(self, peak_flops: float | None = None) -> Summary:
        """Model FLOPs utilization, flops_per_token x tokens_per_s (whole_run_throughput) / (peak_flops x ranks), with
    its parts or what is `missing`; labkit.measure.mfu(run) measures one rank's peak_flops and explains the parts."""
        m, tokens_per_s = self.model(), whole_run_throughput(self.df, "tokens")
        need = [k for k in ("params_active", "params_embedding", "layers", "hidden", "seq_len") if k not in m]
        per_token = math.nan if need else flops_per_token(m["params_active"] - m["params_embedding"], m["layers"],
                                                          m["hidden"], m["seq_len"])
        out = Summary(flops_per_token=per_token, tokens_per_s=tokens_per_s, achieved_flops_per_s=per_token
                      * tokens_per_s, peak_flops=peak_flops or math.nan, ranks=self.world_size)
        out["mfu"] = out["achieved_flops_per_s"] / (out["peak_flops"] * self.world_size)
        if need or not peak_flops:   # an old run (or a model without tokens), or no peak: say which
            out["missing"] = (f"model_{', model_'.join(need)}: recorded by a labkit before MFU, or no token model"
                              if need else "peak_flops: labkit.measure.mfu(run) measures one rank's by a matmul")
        return out

    def lr_disagreement(self) -> int | None:
        """The first step at which the ranks' recorded LRs differ, or None when they agree at every step: a
    per-rank LR decision (a scheduler fed each rank's own loss) silently trains the ranks differently."""
        lrs = self.df.dropna(subset=["lr"]).groupby("step")["lr"].nunique() if "lr" in self.df else None
        differ = [] if lrs is None else lrs.index[lrs > 1]
        return int(differ[0]) if len(differ) else None

    def attempts(self) -> pd.DataFrame:
        """One row per attempt (a run that never restarted has one): the first and last step it recorded and when,
    the failure that ended it (meta.json), and for each restart the time from the last record before the failure to
    the first record after it (`downtime_s`) and the steps recorded twice (`redone_steps`, work the failure cost).
    An attempt that failed before recording anything has its failure and no steps."""
        df = self.read_records(superseded=True)
        noted = {a["attempt"]: a for a in read_meta(self.path).get("attempts", [])}
        df = pd.DataFrame(columns=["attempt", "step", "time"]) if df.empty else df
        df = df.assign(attempt=df["attempt"].fillna(0).astype(int)) if "attempt" in df else df.assign(attempt=0)
        g = df.groupby("attempt")
        out = pd.DataFrame({"first_step": g["step"].min(), "last_step": g["step"].max(),
                            "started": g["time"].min(), "ended": g["time"].max()})
        out = out.reindex(sorted(set(out.index) | set(noted))).rename_axis("attempt")
        out["downtime_s"] = out["started"] - out["ended"].ffill().shift()
        out["redone_steps"] = out["last_step"].ffill().shift() - out["first_step"] + 1
        out["failure"] = [noted.get(a, {}).get("failure") for a in out.index]
        return out

    def final_state(self, rank: int = 0) -> dict[str, Any]:
        """The parameters rank `rank` ended with (RunConfig.save_final)."""
        import torch
        return torch.load(self.dir.final_params(rank), weights_only=True)

    def result(self, rank: int = 0) -> Any:
        """What the launched function returned on `rank` (None if it returned nothing)."""
        import torch
        path = self.dir.result(rank)
        return torch.load(path, weights_only=False) if path.exists() else None

    @property
    def finished(self) -> bool:
        """True when the launcher saw every rank end cleanly (meta.json's outcome)."""
        return read_meta(self.path).get("outcome") == "finished"

    def failure(self) -> str | None:
        """The failure report the launcher raised (failure.txt), or what the ranks' error files say (a torchrun
        run has no launcher of ours), or None."""
        report = self.dir.failure_report
        if report.exists():
            return report.read_text()
        if self.finished:
            return None  # error files of an earlier attempt that a restart recovered from
        errors = [_read_json(p) for p in self.dir.error_files()]
        if not errors:
            return None
        first = min(errors, key=lambda e: e.get("time", 0))
        return (f"rank {first['rank']} raised at step {first['step']}: {first['type']}: {first['message']}\n"
                + first.get("traceback", ""))

    def log(self, rank: int = 0) -> str:
        """Everything rank `rank` printed."""
        path = self.dir.log(rank)
        return path.read_text(errors="replace") if path.exists() else ""


def per_step(df: pd.DataFrame) -> pd.DataFrame:
    """Collapse per-rank records to one row per step (see Run.steps)."""
    if df.empty or "loss" not in df:
        return pd.DataFrame(columns=["step", "loss", "loss_min", "loss_max", "lr", "samples_per_s", "tokens_per_s"])
    g = df.groupby("step", sort=True)
    out = pd.DataFrame({"loss": g["loss"].mean(), "loss_min": g["loss"].min(), "loss_max": g["loss"].max()})
    if "lr" in df:
        out["lr"] = g["lr"].first()
    if "t_step" in df and "samples" in df:
        # A step ends when its slowest rank ends: global throughput = all ranks' samples / the slowest rank's time.
        slowest = g["t_step"].max()
        out["samples_per_s"] = g["samples"].sum() / slowest
        out["samples_seen"] = g["samples"].sum().cumsum()
        if "tokens" in df:
            out["tokens_per_s"] = g["tokens"].sum() / slowest
    for extra in ("grad_norm", "accuracy", "eval_accuracy", "rss_mb"):
        if extra in df:
            out[extra] = g[extra].mean()
    return out.reset_index()


def slowest_per_step(df: pd.DataFrame, columns: tuple[str, ...] | list[str], after: int = 0) -> pd.DataFrame:
    """Per step (index), the maximum over ranks of each of `columns`, for steps >= `after` (see Run.slowest)."""
    missing = [c for c in columns if c not in df]
    if missing:
        raise KeyError(f"no recorded {missing}; the records have {sorted(df.columns)}")
    return df[df["step"] >= after].groupby("step")[list(columns)].max()


def whole_run_throughput(df: pd.DataFrame, of: str = "samples") -> float:
    """Global samples/s (`of`: or tokens) after the first step: all samples / the slowest rank's total time. Unlike
    the median of per-step rates (each over that step's slowest rank), jitter at step boundaries does not bias it."""
    if df.empty or "t_step" not in df or of not in df:
        return math.nan
    later = df[df["step"] > df["step"].min()]
    later = df if later.empty else later
    return float(later[of].sum() / later.groupby("rank")["t_step"].sum().max())


def flops_per_token(params: float, layers: int, hidden: int, seq: int) -> float:
    """Model FLOPs to train on one token: 6N + 12·L·h·s (PaLM, appendix B; labkit.measure.mfu says why)."""
    return 6 * params + 12 * layers * hidden * seq


def load_run(path: str | Path) -> Run:
    """Open a run directory:  run = labkit.load_run("runs/<run-id>")."""
    return Run(path)


def write_meta(run_dir: Path, **meta: Any) -> None:
    """Write meta.json whole or not at all (a temporary file renamed over it): a panel or a table reading it while
    the launcher writes never sees half a file."""
    meta.setdefault("launched_at", time.time())
    path = RunDir(run_dir).meta
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(json.dumps(meta, indent=2, default=str))
    os.replace(partial, path)


def read_meta(run_dir: str | Path) -> dict[str, Any]:
    """A run directory's meta.json:  read_meta(path).get("outcome")  ({} before the launcher has written it).
    A meta.json that is not valid JSON (a full disk, a hand edit) raises BadRunFile naming it."""
    return _read_json(RunDir(run_dir).meta)


def write_outcome(run_dir: Path, failure: str | None, *, stopped: bool = False) -> None:
    """How the run ended, beside its records: meta.json's outcome ("finished", "failed", or "stopped" when it was
    asked to end early) and, if it failed, the report as failure.txt."""
    meta = read_meta(run_dir)
    meta.update(outcome="failed" if failure else "stopped" if stopped else "finished", ended_at=time.time())
    write_meta(run_dir, **meta)
    if failure:
        RunDir(run_dir).failure_report.write_text(failure)


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


class BadRunFile(ValueError):
    """A file of a run directory that labkit wrote whole is not what it wrote (not JSON, not an object)."""


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRunFile(f"{path}: not valid JSON ({exc}); the file is damaged (a full disk, a hand edit?): "
                         "restore it or delete it") from None
    if not isinstance(data, dict):
        raise BadRunFile(f"{path}: holds {type(data).__name__}, not a JSON object: restore it or delete it")
    return data


# Fields that older labkits wrote under another name: old name -> (new name, how an old value maps to a new one).
RENAMED = {"stop_on_nan": ("nan_policy", lambda stop: "raise" if stop else "ignore")}


def upgraded(data: dict[str, Any], source: Any) -> dict[str, Any]:
    """A config a run recorded, perhaps with an older labkit, in this version's fields: renamed fields are carried
    over, fields this version no longer has are dropped with a warning (a config a person writes is not forgiven:
    RunConfig.load refuses unknown fields)."""
    import dataclasses
    import warnings
    from .config import RunConfig
    data = dict(data)
    for old, (new, convert) in RENAMED.items():
        if old in data:
            value = data.pop(old)
            data.setdefault(new, convert(value))
    known = {f.name for f in dataclasses.fields(RunConfig)}
    dropped = sorted(set(data) - known)
    if dropped:
        warnings.warn(f"{source}: written by another labkit version; ignoring fields {dropped}", stacklevel=3)
    return {k: v for k, v in data.items() if k in known}
