"""DeepSeek's mixture of experts, measured: balance, expert parallelism's traffic, the unused-expert traps, MLA.

    from labkit.tricks import experts
    runs = experts.train({"none": {}, "bias": {"balancing": "bias"}}, steps=30)   # tinymoe runs, by name
    experts.maxvio(runs["bias"])            # per step: MaxVio of the load summed over every rank (and a window)
    experts.balance_figure(runs)            # MaxVio | language-model loss over steps, a line per run
    experts.traffic(run)                    # per rank and counted step: all_to_all bytes counted vs the formula
    experts.leaving_share(run)              # per rank: the share of its rows that left for another EP rank, whole run
    experts.expert_split(run)               # per rank: rows its experts received, seconds in them, in all_to_all
    experts.at_the_combine(run)             # per (rank, step), in lesson 11's columns: monitor.stragglers(...) reads it
    experts.rows_per_shard(run, ep=2)       # rows each EP rank would receive, from a run's routing
    experts.trap("fsdp", timeout=2)         # the unused-expert traps, reported: TrapOutcome(failed, rank, ...)
    experts.two_fixes(30)                   # find_unused_parameters vs every expert, side by side, metered
    experts.router_grads(cfg, top_k=1)      # each router's weight gradient after one backward, in this process
    experts.kv_cache()                      # KV cache per token: MLA's (from generate()) vs MHA's, same width
    experts.deepseek_v2_kv()                # Table 1 of DeepSeek-V2 at its sizes (a model: the inputs printed)
    experts.v3_all_to_all()                 # DeepSeek-V3's dispatch traffic per token, node-limited or not (a model)

MaxVio here is DeepSeek-V3's: max load / mean load - 1 over a layer's experts, for the worst layer; "global"
sums the loads of every rank first (what the bias update balances). One step of this toy routes a few thousand
assignments, so its MaxVio carries sampling noise; `window` sums the loads of that many steps first.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

from ..config import RunConfig
from ..measure import Metered, metered
from ..records import Run
from ..run.failure import RankFailure
from ..run.launch import launch
from ..training.moe_task import TinyMoE, moe_model_config
from ..training.parallel.expert_traps import idle_expert, two_fixes as two_fixes_in_rank, warm_imports
from ..training.routing import capacity_keep  # noqa: F401 - the lesson shows which assignments it drops
from ..view import COLORS, new_figure, shown

BASE = dict(task="tinymoe", world_size=1, global_batch=32, lr=1e-2, tensorboard=False, save_final=False)


def lesson_config(**fields: Any) -> RunConfig:
    """The lesson's tinymoe run: 8 experts, top-2 of one of 2 groups, 32 sentences of 32 tokens per step."""
    return RunConfig(**{**BASE, **fields})


def train(cases: dict[str, dict[str, Any]], *, steps: int, runs_root: Any = None, **common: Any) -> dict[str, Run]:
    """One tinymoe run per case ({name: RunConfig fields}), in order:  train({"bias": {"balancing": "bias"}}, steps=30)."""
    return {name: launch(lesson_config(steps=steps, name=name, **{**common, **fields}), echo=False,
                         runs_root=runs_root) for name, fields in cases.items()}


def loads(run: Run) -> np.ndarray:
    """[steps, ranks, layers, experts]: the assignments each rank's routers asked for, per step."""
    df = run.df.sort_values(["step", "rank"])
    ranks = df["rank"].nunique()
    return np.array(df["expert_load"].tolist()).reshape(-1, ranks, *np.shape(df["expert_load"].iloc[0]))


def max_vio(load: np.ndarray) -> np.ndarray:
    """MaxVio of the worst layer, over the last axis (experts) and then the one before it (layers)."""
    mean = load.mean(-1)
    return (load.max(-1) / np.where(mean > 0, mean, 1) - 1).max(-1)


def maxvio(run: Run, window: int = 10) -> pd.DataFrame:
    """Per step: maxvio (of the global load: every rank's summed), maxvio_window (loads summed over the last
    `window` steps first) and lm_loss (mean over ranks)."""
    total = loads(run).sum(1)                                  # [steps, layers, experts]
    summed = np.cumsum(total, 0)
    windowed = summed - np.concatenate([np.zeros((window, *total.shape[1:])), summed[:-window]])[:len(total)]
    steps = run.df.groupby("step")
    return pd.DataFrame({"step": sorted(run.df["step"].unique()), "maxvio": max_vio(total),
                         "maxvio_window": max_vio(windowed), "lm_loss": steps["lm_loss"].mean().to_numpy()})


def balance_table(runs: dict[str, Run], last: int = 10) -> pd.DataFrame:
    """One row per run: MaxVio over the first and the last `last` steps (loads summed over them), the smallest
    share of a layer's assignments any expert got over the last `last` steps, final lm_loss (mean of the last
    `last` steps) and the loss floor."""
    rows = []
    for name, run in runs.items():
        total = loads(run).sum(1)
        end = total[-last:].sum(0)                                   # [layers, experts]
        rows.append({"run": name, "maxvio_first": float(max_vio(total[:last].sum(0))),
                     "maxvio_last": float(max_vio(end)),
                     "least_load_fraction": float((end / end.sum(-1, keepdims=True)).min()),
                     "lm_loss_last": float(maxvio(run)["lm_loss"].tail(last).mean()),
                     "floor": run.config.loss_floor})
    return pd.DataFrame(rows).set_index("run")


@shown
def balance_figure(runs: dict[str, Run], window: int = 10) -> Figure:
    """MaxVio (global, windowed) | language-model loss, over steps, a line per run; the floor dashed."""
    fig = new_figure(figsize=(11, 3.6))
    left, right = fig.subplots(1, 2)
    for i, (name, run) in enumerate(runs.items()):
        table = maxvio(run, window)
        left.plot(table.step, table.maxvio_window, color=COLORS[i % len(COLORS)], label=name)
        right.plot(table.step, table.lm_loss, color=COLORS[i % len(COLORS)], label=name)
    floor = next(iter(runs.values())).config.loss_floor
    right.axhline(floor, color="grey", ls="--", lw=1, label="floor ln(branching)")
    left.set(xlabel="step", ylabel=f"MaxVio (loads of {window} steps)", title="balance")
    right.set(xlabel="step", ylabel="language-model loss", title="quality")
    left.legend(fontsize=8), right.legend(fontsize=8)
    return fig


def bias_by_rank(run: Run, layer: int = 0) -> pd.DataFrame:
    """Per (step, rank): the bias the routers chose with (expert_bias) and the bias after this rank's own
    update (bias_after), for one layer."""
    df = run.df.sort_values(["step", "rank"])
    return pd.DataFrame({"step": df.step, "rank": df["rank"],
                         "used": [b[layer] for b in df.expert_bias], "after": [b[layer] for b in df.bias_after]})


def traffic(run: Run) -> pd.DataFrame:
    """Per rank and counted step of an expert-parallel run: the all_to_all bytes the collective counter saw
    (the whole input of each call, this rank's own chunk included), the formula from the rows the routing sent
    and received, and the bytes that left the rank (what the (N-1)/N formula counts): as the dispatcher counted
    them, as the routers' loads say (no capacity factor: every assignment is sent), the uniform formula, and the
    bounds on it that the rank's measured balance gives (see uniform_bounds)."""
    cfg = run.config
    model = moe_model_config(cfg)
    width, layers = model.hidden_size, model.num_hidden_layers
    df = run.df.dropna(subset=["bytes_all_to_all"]).copy()
    df["formula"] = 2 * (df.ep_rows_out + df.ep_rows_in) * width * 4 + layers * cfg.grad_accum * cfg.experts * 8
    tokens = cfg.batch_per_rank * cfg.grad_accum * cfg.seq_len
    n = cfg.expert_parallel
    df["leaving_measured"] = df.ep_rows_leaving * width * 4   # forward dispatch, all layers and micro-batches
    df["leaving_routing"] = [leaving_rows(load, r % n, n) * width * 4 for load, r in zip(df.expert_load, df["rank"])]
    df["leaving_uniform"] = tokens * cfg.top_k * width * 4 * (n - 1) / n * layers
    bounds = [uniform_bounds(load, n) for load in df.expert_load]
    df["uniform_low"] = [low * width * 4 for low, _ in bounds]
    df["uniform_high"] = [high * width * 4 for _, high in bounds]
    return df[["step", "rank", "n_all_to_all", "bytes_all_to_all", "formula", "ep_rows_out", "ep_rows_in",
               "ep_rows_leaving", "leaving_measured", "leaving_routing", "leaving_uniform", "uniform_low",
               "uniform_high", "ep_t_experts", "ep_t_a2a"]]


def leaving_rows(load: list, position: int, ep: int) -> float:
    """Assignments (rows) that leave a rank, from its routers' loads [layer][expert]: those for experts that
    another rank of its EP group owns (position = its place in the group, rank % ep)."""
    load = np.asarray(load)
    share = load.shape[-1] // ep
    return float(load.sum() - load[:, position * share:(position + 1) * share].sum())


def uniform_bounds(load: list, ep: int) -> tuple[float, float]:
    """(low, high): where the rows leaving a rank must lie, given only each layer's MaxVio v of its own load
    [layer][expert] and its assignments A: its E/ep local experts hold at most (1+v)/ep of A, the others at most
    (ep-1)/ep (1+v) of A, so (ep-1)/ep A - v A/ep <= leaving <= (ep-1)/ep A + v (ep-1)/ep A, summed over layers.
    At v = 0 (perfect balance) both are the uniform formula's (ep-1)/ep A."""
    load = np.asarray(load, dtype=float)
    rows, vio = load.sum(-1), max_vio(load[:, None, :])   # per layer
    uniform = (ep - 1) / ep * rows
    return float((uniform - vio * rows / ep).sum()), float((uniform * (1 + vio)).sum())


def leaving_share(run: Run) -> pd.Series:
    """Per rank of an expert-parallel run, over all its steps: rows that left for another rank of its EP group over
    rows it dispatched (the dispatcher's counts). The uniform formula's (N-1)/N is what balanced routing gives."""
    sums = run.df.groupby("rank")[["ep_rows_leaving", "ep_rows_out"]].sum()
    return sums.ep_rows_leaving / sums.ep_rows_out


def expert_split(run: Run, after: int = 2) -> pd.DataFrame:
    """Per rank of an expert-parallel run, from step `after` on: rows its experts received, seconds in them
    (ep_t_experts), in the forward all_to_alls (ep_t_a2a: the transfers, and waiting for the others) and in the
    combines alone (ep_t_combine: sending the experts' rows back, after the slowest rank's experts are done)."""
    df = run.df[run.df.step >= after]
    return df.groupby("rank")[["ep_rows_in", "ep_t_experts", "ep_t_a2a", "ep_t_combine"]].sum()


def at_the_combine(run: Run) -> pd.DataFrame:
    """Per (rank, step) of a run with one expert-parallel group, lesson 11's split moved from DDP's all-reduce to the
    combine all_to_all:  monitor.stragglers(experts.at_the_combine(run)). A combine ends for every rank when the
    rank whose experts took longest arrives, so t_fwd_bwd = seconds in the combines and t_step = that plus seconds
    in the rank's own experts; monitor.compute_and_wait then gives wait = a rank's combine time beyond the fastest
    rank's, and compute = its experts' time plus that fastest combine (the transfer)."""
    df = run.df[["rank", "step", "ep_t_experts", "ep_t_combine"]]
    return pd.DataFrame({"rank": df["rank"], "step": df.step, "t_fwd_bwd": df.ep_t_combine,
                         "t_step": df.ep_t_experts + df.ep_t_combine, "ep_t_experts": df.ep_t_experts})


def router_grads(config: RunConfig, **fields: Any) -> list[float]:
    """In this process: the norm of each router's weight gradient after one forward and backward of a fresh
    tinymoe (config with `fields` changed) on step 0's batch:  router_grads(cfg, top_k=1)."""
    cfg = config.replace(world_size=1, **fields)
    torch.manual_seed(cfg.seed)
    task = TinyMoE(cfg)
    model = task.build_model()
    loss, _ = task.loss(model, *task.batch(0, 0, 0))
    loss.backward()
    return [float(router.weight.grad.norm()) for router in task.routing.routers]


@dataclass(frozen=True)
class TrapOutcome:
    """How one unused-expert trap ended."""
    wrap: str
    every_expert: bool
    failed: bool
    rank: int | None
    step: int | None
    reason: str            # "raised", "hung", or "" when it ran to the end
    seconds: float         # from the launch to its end or its failure report (imports done before: warm_imports)
    report: str            # the failure's report, or the ranks' results
    idle_tokens: list | None = None
    places: dict | None = None       # on failure, per rank: what the report says it was doing
    stalled_s: float | None = None   # a hang: from the ranks' last sign of progress to the report
    fused: bool = False


def trap(wrap: str, *, every_expert: bool = False, fused: bool = False, timeout: float = 6.0,
         runs_root: Any = None) -> TrapOutcome:
    """Launch the idle-expert trap (parallel/expert_traps.py) on 2 ranks; never raises for the rank's failure:
    trap("ddp"), trap("fsdp", timeout=2), trap("ddp", every_expert=True), trap("fsdp", fused=True)."""
    cfg = lesson_config(world_size=2, global_batch=16, steps=3, name=f"trap {wrap}{' fused' * fused}")
    warm_imports()  # a process's first launch imports DDP's and FSDP2's modules (seconds): not the trap's time
    started = time.monotonic()
    try:
        run = launch(functools.partial(idle_expert, wrap=wrap, every_expert=every_expert, fused=fused), config=cfg,
                     timeout=timeout, echo=False, progress=False, runs_root=runs_root)
    except RankFailure as failure:
        beats = [s.time for s in failure.statuses if s.state in ("hung", "waiting")]
        return TrapOutcome(wrap, every_expert, True, failure.rank, failure.step, failure.reason,
                           time.monotonic() - started, str(failure),
                           places={s.rank: s.detail for s in failure.statuses},
                           stalled_s=time.time() - max(beats) if beats else None, fused=fused)
    results = [run.result(r) for r in range(2)]
    return TrapOutcome(wrap, every_expert, False, None, None, "", time.monotonic() - started, repr(results),
                       [r["idle_tokens"] for r in results], fused=fused)


def two_fixes(steps: int = 30, cores: int = 2, runs_root: Any = None) -> Metered:
    """Both fixes of the DDP trap in one launch on 2 ranks, pinned to `cores` cores and metered (a gate can judge
    and repeat it):  fixes = two_fixes(30); fixes.value is the Run; fix_costs(fixes.value) its medians."""
    cfg = lesson_config(world_size=2, global_batch=16, steps=steps, name="two fixes")
    warm_imports()
    return metered(lambda: launch(functools.partial(two_fixes_in_rank, steps=steps), config=cfg, echo=False,
                                  progress=False, runs_root=runs_root), cores=cores)


def fix_costs(run: Run, after: int = 2) -> pd.DataFrame:
    """From step `after` on, per rank and for both ranks together: median forward milliseconds under each fix
    (find_unused_parameters with the idle expert skipped: "unused"; every expert run: "every"), and the median of
    the differences unused - every, step by step (paired: both ran the same step, one after the other), forward
    and whole step."""
    df = run.df[run.df.step >= after]
    out = {}
    for label, part in [*((r, df[df["rank"] == r]) for r in sorted(df["rank"].unique())), ("both", df)]:
        out[label] = {"fwd_every_ms": part.t_fwd_every.median() * 1e3, "fwd_unused_ms": part.t_fwd_unused.median() * 1e3,
                      "fwd_extra_ms": (part.t_fwd_unused - part.t_fwd_every).median() * 1e3,
                      "step_extra_ms": (part.t_step_unused - part.t_step_every).median() * 1e3}
    return pd.DataFrame(out).T.rename_axis("rank")


def kv_cache(config: RunConfig | None = None, prompt: int = 4, new_tokens: int = 6) -> pd.DataFrame:
    """Values cached per token per layer, read from the cache tensors generate() leaves: tinymoe's MLA against
    multi-head attention (a Llama with the same width, heads and layers)."""
    from transformers import DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM
    mla_cfg = moe_model_config(config or lesson_config())
    mha_cfg = LlamaConfig(vocab_size=mla_cfg.vocab_size, hidden_size=mla_cfg.hidden_size, intermediate_size=64,
                          num_hidden_layers=mla_cfg.num_hidden_layers, num_attention_heads=mla_cfg.num_attention_heads,
                          num_key_value_heads=mla_cfg.num_attention_heads, bos_token_id=0, eos_token_id=0,
                          pad_token_id=0, max_position_embeddings=64)
    rows = []
    for name, model in (("MLA (DeepSeek-V3)", DeepseekV3ForCausalLM(mla_cfg)), ("MHA (Llama)", LlamaForCausalLM(mha_cfg))):
        x = torch.randint(mla_cfg.vocab_size, (1, prompt))
        out = model.eval().generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                                    do_sample=False, return_dict_in_generate=True, pad_token_id=0)
        layers = out.cache.layers
        cached = layers[0].keys.shape[-2]
        values = sum(l.keys.numel() + l.values.numel() for l in layers)
        rows.append({"attention": name, "tokens_cached": cached, "layers": len(layers),
                     "values_per_token_per_layer": values / cached / len(layers),
                     "bytes_per_token": values / cached * layers[0].keys.element_size(),
                     "shapes": f"{tuple(layers[0].keys.shape)} + {tuple(layers[0].values.shape)}"})
    return pd.DataFrame(rows).set_index("attention")


V2 = {"n_h": 128, "d_h": 128, "d_c": 512, "d_rope": 64, "layers": 60}
"""DeepSeek-V2's sizes (arXiv 2405.04434, §2.1 and Appendix): heads, head dim, KV compression dim, rope dim."""


def deepseek_v2_kv(sizes: dict[str, int] = V2) -> dict[str, float]:
    """Table 1 of DeepSeek-V2 at its sizes, per token: MHA caches 2 n_h d_h l values, MLA (d_c + d_rope) l."""
    mha = 2 * sizes["n_h"] * sizes["d_h"] * sizes["layers"]
    mla = (sizes["d_c"] + sizes["d_rope"]) * sizes["layers"]
    return {**sizes, "mha_values": mha, "mla_values": mla, "ratio": mha / mla}


V3 = {"hidden": 7168, "experts": 256, "top_k": 8, "nodes_limit": 4, "dispatch_bytes": 1, "combine_bytes": 2,
      "ib_GBps": 50.0, "nvlink_GBps": 160.0, "nodes": 8}
"""DeepSeek-V3's figures (arXiv 2412.19437, §2.1.2, §3.2.2): hidden size, 256 routed experts, 8 per token, at most 4
nodes per token, FP8 dispatch and BF16 combine, IB ~50 GB/s and NVLink ~160 GB/s per GPU (the H800's NVLink: the
H100's is faster), 256 experts over 64 GPUs on 8 nodes (EP 64)."""


def v3_all_to_all(sizes: dict[str, float] = V3) -> pd.DataFrame:
    """A model, not a measurement: copies of a token crossing InfiniBand per MoE layer, under uniform routing, and
    the bytes and microseconds per 1000 tokens they cost at IB's bandwidth. One definition, shared with lesson 21
    (deepseek_scale.ep_copies): "no limit" is once per remote node the token's experts use, with no cap on the nodes
    (4.6 at V3's sizes); once per remote expert (7) is the send with no per-node sharing; V3's cap of 4 nodes gives
    at most 4 x 7/8 = 3.5 (an upper bound: a token's experts may sit on fewer nodes)."""
    from .deepseek_scale import ep_copies
    copies = ep_copies({"ep": sizes["nodes"] * 8, "gpus_per_node": 8, "top_k": sizes["top_k"],
                        "experts": sizes["experts"], "node_limit": sizes["nodes_limit"]})
    per_copy = sizes["hidden"] * (sizes["dispatch_bytes"] + sizes["combine_bytes"])
    rows = {"once per remote expert (no sharing per node)": copies.iloc[0],
            "no limit: once per remote node used": copies.iloc[1],
            f"<= {sizes['nodes_limit']:g} nodes (V3): at most": copies.iloc[2]}
    out = pd.DataFrame({"copies_over_ib": rows})
    out["ib_bytes_per_token"] = out.copies_over_ib * per_copy
    out["us_per_1000_tokens"] = out.ib_bytes_per_token * 1000 / (sizes["ib_GBps"] * 1e9) * 1e6
    return out


def rows_per_rank(run: Run) -> pd.Series:
    """Rows each rank's experts received over the run (expert-parallel runs)."""
    return run.df.groupby("rank")["ep_rows_in"].sum()


def rows_per_shard(run: Run, ep: int) -> np.ndarray:
    """Rows each of `ep` expert-parallel ranks would receive over the run (all layers), from the routers' loads:
    expert e lives on rank e // (experts / ep). For a run on one process, what EP would have sent where."""
    per_expert = loads(run).sum((0, 1, 2))
    return per_expert.reshape(ep, -1).sum(1)


@shown
def load_figure(run: Run, layer: int = 0) -> Figure:
    """Routing drawn: assignments per expert per step (all ranks summed), one layer, as an image."""
    load = loads(run).sum(1)[:, layer, :]
    fig = new_figure(figsize=(11, 2.8))
    ax = fig.subplots()
    image = ax.imshow(load.T, aspect="auto", cmap="viridis", origin="lower")
    ax.set(xlabel="step", ylabel="expert", title=f"{run.config.label}: assignments per expert, layer {layer}")
    fig.colorbar(image, ax=ax, label="assignments")
    return fig
