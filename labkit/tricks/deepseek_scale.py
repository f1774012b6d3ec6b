"""The two layouts at DeepSeek-V3's size: a model, not a measurement. Every input is in V3 (printable, changeable).

    from labkit.tricks import deepseek_scale as scale
    scale.inputs()                           # every input, with where it comes from
    scale.traffic_table()                    # GPU-microseconds per token of each layout's traffic beside compute
    scale.tp_table()                         # TP's per-layer all-reduces: inside a node (NVLink) or across (IB)
    scale.ep_copies()                        # InfiniBand copies of a token per MoE layer: node-limited or not
    scale.traffic_table({**scale.V3, "ib_GBps": 25})    # any input changed

**What is scaled from the toy.** The counts labkit.tricks.deepseek asserts on tinymoe (message_table) are
formulas in the model's sizes; here they are evaluated at V3's: tensor parallelism on MLA + MoE all-reduces, per
layer and token, 2h values forward (o_proj's output, the shared expert's) and q_lora + kv_lora + rope + h backward
(the column-wise inputs and the rotary key: `tp_values`); expert parallelism moves each routed copy of a token's
hidden state to its expert and back, forward and backward; the pipeline sends one activation forward and one
gradient back per token and stage boundary; ZeRO-3 gathers every parameter for forward and again for backward and
reduce-scatters its gradient, every microbatch.

**The network** (DeepSeek-V3 report, arXiv 2412.19437, section 3.2.2): H800 nodes of 8 GPUs, NVLink inside a
node at about 160 GB/s (the H800's NVLink), InfiniBand between nodes at about 50 GB/s per GPU. (The H800 is the H100 with NVLink cut
down for export; lesson 14 uses the H100's figures, 450 GB/s each way.) A ring all-reduce over t GPUs costs each
2(t-1)/t of the message over its slowest link (lesson 02's ring model, labkit.tricks.comm.ring_time): inside a
node that is NVLink, across nodes InfiniBand. The all-to-all model is this module's own (`a2a_time`): the bytes
that leave a GPU over each kind of link, at that link's bandwidth, the two kinds in parallel (V3 forwards IB
traffic over NVLink inside the receiving node and overlaps the two), plus a latency per peer.

**Compute, the yardstick**: the report's own figure, 180K H800 GPU-hours per trillion training tokens, is
648 GPU-microseconds per token, everything included; `inputs()` also shows the fraction of the H800's dense BF16
peak it implies for 6 x 37B FLOPs per token. Traffic in GPU-microseconds per token (link time summed over the
GPUs it occupies) is compared with it. What overlaps with compute in V3 (DualPipe hides the all-to-all and the
pipeline's sends behind other microbatches' compute) is marked, as is what sits on the critical path (TP's
all-reduces: the next matmul needs each result).
"""
from __future__ import annotations

import math

import pandas as pd

from .comm import ring_time

V3: dict[str, float] = {
    "hidden": 7168, "layers": 61, "moe_layers": 58, "experts": 256, "top_k": 8, "moe_intermediate": 2048,
    "q_lora": 1536, "kv_lora": 512,
    "rope": 64, "params_total": 671e9, "params_active": 37e9, "seq": 4096,
    "gpus": 2048, "gpus_per_node": 8, "pp": 16, "ep": 64, "node_limit": 4,
    "nvlink_GBps": 160.0, "ib_GBps": 50.0, "alpha_us": 5.0, "h800_bf16_tflops": 989.0,
    "gpu_hours_per_trillion_tokens": 180e3, "tokens_per_step": 15360 * 4096,
    "act_bytes": 2, "dispatch_bytes": 1, "combine_bytes": 2, "grad_bytes": 2, "article_tp": 8,
    "microbatch_seqs": 1,
}
SOURCES = {
    "hidden .. seq": "DeepSeek-V3 report, section 4.2 and Table 1 (the model's sizes, 4K sequences)",
    "gpus .. node_limit": "report section 3.2: 2048 H800s, 8 per node, 16-way PP, 64-way EP, each token to <= 4 nodes",
    "nvlink_GBps, ib_GBps": "report section 3.2.2: NVLink about 160 GB/s (H800), InfiniBand about 50 GB/s per GPU",
    "alpha_us": "an assumed latency per message (not in the report): change it",
    "h800_bf16_tflops": "NVIDIA's H100/H800 SXM datasheet, dense BF16",
    "gpu_hours_per_trillion_tokens": "report, section 1: 180K H800 GPU hours per trillion tokens",
    "tokens_per_step": "report section 4.2: batch of 15360 sequences of 4K tokens",
    "act_bytes .. grad_bytes": "BF16 activations and gradients; FP8 dispatch, BF16 combine (report section 3.3)",
    "article_tp, microbatch_seqs": "the article's layout at this size: TP inside a node, one 4K sequence per microbatch",
}


def inputs(sizes: dict[str, float] = V3) -> pd.DataFrame:
    """Every input, and the derived yardsticks (compute per token, the peak fraction the report's figure implies)."""
    out = pd.Series(sizes, dtype=float).to_frame("value")
    out.loc["compute_gpu_us_per_token"] = compute_us(sizes)
    flops = 6 * sizes["params_active"]
    out.loc["implied_fraction_of_bf16_peak"] = flops / (compute_us(sizes) * 1e-6 * sizes["h800_bf16_tflops"] * 1e12)
    return out


def compute_us(sizes: dict[str, float] = V3) -> float:
    """GPU-microseconds per training token, from the report's GPU-hours per trillion tokens."""
    return sizes["gpu_hours_per_trillion_tokens"] * 3600 / 1e12 * 1e6


def tp_values(sizes: dict[str, float]) -> float:
    """Values all-reduced per token and layer by TP on MLA + MoE: 2h forward, q_lora + kv_lora + rope + h backward."""
    return 2 * sizes["hidden"] + sizes["q_lora"] + sizes["kv_lora"] + sizes["rope"] + sizes["hidden"]


def link_GBps(sizes: dict[str, float], gpus: int) -> float:
    """The slowest link of a group of `gpus` consecutive GPUs: NVLink inside one node, InfiniBand beyond."""
    return sizes["nvlink_GBps"] if gpus <= sizes["gpus_per_node"] else sizes["ib_GBps"]


def tp_us_per_token(sizes: dict[str, float], t: int) -> float:
    """GPU-microseconds per token of TP's all-reduces over all layers (t GPUs' links each carry the ring's share);
    the latency of the 6 calls per layer is spread over a microbatch's tokens."""
    if t < 2:
        return 0.0
    tokens = sizes["seq"] * sizes["microbatch_seqs"]
    moved = ring_time(tp_values(sizes) * sizes["act_bytes"] * tokens, t, 0.0, link_GBps(sizes, t) * 1e9)
    latency = 6 * 2 * (t - 1) * sizes["alpha_us"] * 1e-6   # 6 calls per layer, 2(t-1) ring steps each
    return float(t * (moved + latency) * sizes["layers"] / tokens * 1e6)


def tp_table(sizes: dict[str, float] = V3, degrees: tuple[int, ...] = (2, 4, 8, 16, 32)) -> pd.DataFrame:
    """For each TP degree: the link its all-reduces use, GPU-microseconds per token and their share of compute.
    Beyond gpus_per_node the ring crosses InfiniBand: the per-layer all-reduces, on the critical path, outgrow
    the compute they split."""
    rows = {t: {"link": "NVLink" if t <= sizes["gpus_per_node"] else "InfiniBand",
                "gpu_us_per_token": tp_us_per_token(sizes, t)} for t in degrees}
    out = pd.DataFrame.from_dict(rows, orient="index").rename_axis("tp")
    out["vs_compute"] = out.gpu_us_per_token / compute_us(sizes)
    return out


def expert_params(sizes: dict[str, float]) -> float:
    """Routed experts' parameters: moe_layers x experts x 3 matrices of hidden x moe_intermediate (SwiGLU)."""
    return sizes["moe_layers"] * sizes["experts"] * 3 * sizes["hidden"] * sizes["moe_intermediate"]


def ep_copies(sizes: dict[str, float] = V3) -> pd.Series:
    """Copies of a token's hidden state crossing InfiniBand per MoE layer, expected under uniform routing over
    nodes = ep / gpus_per_node. The one definition lessons 19 and 21 share: sent once per remote expert (7 at V3's
    sizes); "no limit" is once per remote node its experts use (4.6); with V3's cap of node_limit nodes, at most
    node_limit x (nodes - 1) / nodes (3.5: an upper bound, since a token's experts may sit on fewer nodes)."""
    nodes, k, e = sizes["ep"] / sizes["gpus_per_node"], sizes["top_k"], sizes["experts"]
    per_node = e / nodes
    miss = math.comb(int(e - per_node), int(k)) / math.comb(int(e), int(k))  # a given node gets none of the k
    return pd.Series({"once per remote expert": k * (nodes - 1) / nodes,
                      "once per remote node, no limit": (nodes - 1) * (1 - miss),
                      f"once per remote node, <= {sizes['node_limit']:g} nodes (V3): at most":
                          sizes["node_limit"] * (nodes - 1) / nodes}, name="IB copies per token per MoE layer")


def a2a_time(ib_bytes: float, nvlink_bytes: float, peers: int, sizes: dict[str, float]) -> float:
    """Seconds for an all-to-all in which a GPU sends ib_bytes over InfiniBand and nvlink_bytes over NVLink, the two
    at once (V3 overlaps them), plus alpha per peer."""
    return peers * sizes["alpha_us"] * 1e-6 + max(ib_bytes / (sizes["ib_GBps"] * 1e9),
                                                  nvlink_bytes / (sizes["nvlink_GBps"] * 1e9))


def ep_us_per_token(sizes: dict[str, float], copies: float) -> float:
    """GPU-microseconds per token of the experts' all-to-all over all MoE layers: `copies` over InfiniBand, each
    FP8 dispatch + BF16 combine forward and two BF16 ways backward, then fanned out to top_k experts over NVLink."""
    per_value = sizes["dispatch_bytes"] + sizes["combine_bytes"] + 2 * sizes["grad_bytes"]
    tokens = sizes["seq"] * sizes["microbatch_seqs"]
    ib = copies * sizes["hidden"] * per_value * tokens
    nvlink = sizes["top_k"] * sizes["hidden"] * per_value * tokens
    one = a2a_time(ib, nvlink, int(sizes["ep"]) - 1, sizes)
    return one * sizes["moe_layers"] / tokens * 1e6


def traffic_table(sizes: dict[str, float] = V3) -> pd.DataFrame:
    """Each layout's traffic per token at V3's size, in GPU-microseconds, beside compute (the report's figure)."""
    t, d = int(sizes["article_tp"]), sizes["gpus"] / sizes["article_tp"]
    tokens = sizes["seq"] * sizes["microbatch_seqs"]
    ib = sizes["ib_GBps"] * 1e9
    # ZeRO-3: each GPU gathers its TP slice of every parameter twice a microbatch and reduce-scatters its gradient;
    # its t-GPU group shares the microbatch's tokens
    zero3 = t * 3 * sizes["params_total"] / t * sizes["act_bytes"] * (d - 1) / d / ib / tokens * 1e6
    # ZeRO-1: once per step, each GPU all-reduces its stage's dense gradients over the stage's data-parallel
    # GPUs, and its experts' over the copies of those experts (replicas / ep), in fp32
    replicas = int(sizes["gpus"] / sizes["pp"])
    experts = expert_params(sizes)
    dense = (sizes["params_total"] - experts) / sizes["pp"] * 4
    own = experts / sizes["pp"] / sizes["ep"] * 4
    step = ring_time(dense, replicas, 0.0, ib) + ring_time(own, max(2, int(replicas / sizes["ep"])), 0.0, ib)
    zero1 = sizes["gpus"] * step / sizes["tokens_per_step"] * 1e6
    copies = ep_copies(sizes).iloc[-1]
    rows = [
        ("ZeRO-3 + TP (article)", f"TP {t}: all-reduces per layer", tp_us_per_token(sizes, t), "critical path"),
        ("ZeRO-3 + TP (article)", "ZeRO-3: gather params twice, reduce-scatter grads", zero3, "prefetchable"),
        ("PP x EP x ZeRO-1 (V3)", f"EP all-to-all, <= {sizes['node_limit']:g} nodes",
         ep_us_per_token(sizes, copies), "overlapped (DualPipe)"),
        ("PP x EP x ZeRO-1 (V3)", "PP: activation + gradient per stage boundary",
         (sizes["pp"] - 1) * 2 * sizes["hidden"] * sizes["act_bytes"] / ib * 1e6, "overlapped (DualPipe)"),
        ("PP x EP x ZeRO-1 (V3)", "ZeRO-1: gradients once per step (fp32)", zero1, "once per step"),
    ]
    out = pd.DataFrame(rows, columns=["layout", "traffic", "gpu_us_per_token", "when"])
    out["vs_compute"] = out.gpu_us_per_token / compute_us(sizes)
    return out
