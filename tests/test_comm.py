"""labkit.comm: nccl-tests bandwidth arithmetic, the ring model fit, and a real gloo benchmark."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from labkit.tricks import comm, comm_claims

MiB = 1024 * 1024


def test_algbw_is_bytes_per_second_in_gigabytes():
    assert comm.algbw(1e9, 1.0) == pytest.approx(1.0)
    assert comm.algbw(64 * MiB, 0.05) == pytest.approx(1.34217728)  # 67108864 B / 0.05 s / 1e9
    with pytest.raises(ValueError, match="seconds"):
        comm.algbw(1024, 0.0)


@pytest.mark.parametrize("op, world, seconds, expected", [
    ("all_reduce", 2, 1.0, 1.0),        # 2(n-1)/n = 1 at two ranks
    ("all_reduce", 4, 2.0, 0.75),       # algbw 0.5 x 2*3/4
    ("all_reduce", 8, 1.0, 1.75),       # 2*7/8
    ("all_gather", 4, 1.0, 0.75),       # (n-1)/n
    ("reduce_scatter", 8, 0.5, 1.75),   # algbw 2.0 x 7/8
    ("broadcast", 4, 1.0, 1.0),         # x1 at any world size
])
def test_busbw_uses_the_nccl_tests_factors(op, world, seconds, expected):
    assert comm.busbw(op, 1e9, seconds, world) == pytest.approx(expected)


def test_bad_ops_and_world_sizes_are_rejected():
    with pytest.raises(ValueError, match="all_to_all"):
        comm.bus_factor("all_to_all", 2)
    with pytest.raises(ValueError, match="world = 1"):
        comm.busbw("all_reduce", 1024, 1.0, 1)


def test_ring_time_by_hand():
    # world 4: 2(n-1) = 6 latencies of 100 us, plus 2(n-1)/n = 1.5 passes of 1 GB at 1 GB/s
    assert comm.ring_time(1e9, 4, alpha=1e-4, bandwidth=1e9) == pytest.approx(1.5006)
    assert comm.ring_time([0, 1e9], 2, alpha=1e-4, bandwidth=1e9).tolist() == pytest.approx([2e-4, 1.0002])


def test_the_fit_recovers_a_known_alpha_and_bandwidth():
    sizes = np.array(comm.message_sizes(4096, 64 * MiB, 2), dtype=float)
    times = comm.ring_time(sizes, 4, alpha=50e-6, bandwidth=2e9)
    alpha, bandwidth = comm.fit_ring_model(sizes, times, 4)
    assert alpha == pytest.approx(50e-6, rel=1e-9) and bandwidth == pytest.approx(2e9, rel=1e-9)
    assert comm.relative_errors(sizes, times, 4, alpha, bandwidth).max() < 1e-9

    noisy = times * np.random.default_rng(0).uniform(0.9, 1.1, len(times))  # +-10% per point
    alpha, bandwidth = comm.fit_ring_model(sizes, noisy, 4)
    assert alpha == pytest.approx(50e-6, rel=0.1) and bandwidth == pytest.approx(2e9, rel=0.1)
    assert np.median(comm.relative_errors(sizes, noisy, 4, alpha, bandwidth)) < 0.1


def test_the_fit_rejects_nonsense():
    with pytest.raises(ValueError, match="not fit"):       # bigger messages faster: 1/B would be negative
        comm.fit_ring_model([4096, MiB, 16 * MiB], [1e-2, 1e-3, 1e-4], 2)
    with pytest.raises(ValueError, match="two distinct"):
        comm.fit_ring_model([MiB, MiB], [1e-3, 1e-3], 2)
    with pytest.raises(ValueError, match="two distinct"):
        comm.fit_ring_model([4096, MiB], [1e-3, -1.0], 2)
    with pytest.raises(ValueError, match="equal length"):
        comm.fit_ring_model([4096, MiB], [1e-3], 2)
    with pytest.raises(ValueError, match="world"):
        comm.fit_ring_model([4096, MiB], [1e-3, 2e-3], 1)


def test_message_sizes():
    assert comm.message_sizes(4096, 65536, 4) == [4096, 16384, 65536]
    assert comm.message_sizes(4096, 5000, 2) == [4096]


def test_benchmark_on_gloo_gives_sane_positive_figures(runs_root, no_leftovers):
    df = comm.benchmark(ops=comm.OPS, sizes=[4096, 65536], world_size=2, repeats=3, warmup=1, backend="gloo",
                        runs_root=runs_root)
    assert list(df.columns) == comm.COLUMNS and len(df) == 8
    assert set(df.op) == set(comm.OPS) and set(df.size_bytes) == {4096, 65536}
    assert (df.backend == "gloo").all() and (df.world_size == 2).all() and not df.skipped.any()
    assert (df.time_s > 1e-6).all() and (df.time_s < 1.0).all()      # microseconds to milliseconds, not 0 or hours
    assert (df.busbw_GBps > 0).all() and np.isfinite(df.busbw_GBps).all()
    ar = df[df.op == "all_reduce"].set_index("size_bytes")
    assert ar.busbw_GBps[65536] == pytest.approx(65536 / ar.time_s[65536] / 1e9)  # world 2: busbw = algbw
    assert (df.oversubscribed == (2 > comm.usable_cores())).all()


def test_an_op_the_backend_refuses_is_skipped_with_the_reason(monkeypatch, runs_root, no_leftovers):
    def refusing_broadcast(*args, **kwargs):
        raise RuntimeError("broadcast is not supported by this backend")
    monkeypatch.setattr(torch.distributed, "broadcast", refusing_broadcast)  # forked ranks inherit it
    df = comm.benchmark(ops=("broadcast", "all_reduce"), sizes=[4096], world_size=2, repeats=2, backend="gloo",
                        runs_root=runs_root)
    skipped = df[df.op == "broadcast"].iloc[0]
    assert math.isnan(skipped.time_s) and "not supported" in skipped.skipped
    assert df[df.op == "all_reduce"].time_s.iloc[0] > 0


def test_bad_requests_are_refused_before_launching(runs_root):
    with pytest.raises(ValueError, match="all_to_all"):
        comm.benchmark(ops=("all_to_all",), runs_root=runs_root)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="CUDA GPUs"):
            comm.benchmark(backend="nccl", runs_root=runs_root)
    assert not runs_root.exists()


def test_sizes_read_as_people_write_them():
    assert comm.human_bytes(4096) == "4 KiB" and comm.human_bytes(3 * MiB // 2) == "1.5 MiB"
    assert comm.human_bytes(100) == "100 B"


def test_a_ring_prediction_is_the_model_time_and_its_busbw():
    row = comm.ring_prediction(MiB, 4, alpha=1e-4, bandwidth=1e9)
    t = 6 * 1e-4 + 1.5 * MiB / 1e9                     # 2(n-1) alpha + 2(n-1)/n S/B at n = 4
    assert row["size"] == "1 MiB" and row["ranks"] == 4
    assert row["predicted ms"] == round(t * 1e3, 3)
    assert row["busbw GB/s"] == round(1.5 * MiB / t / 1e9, 3)


# --- lesson 02: the collectives' definitions, the ring drawn, and the speed claims' checks --------------------

def test_expected_after_works_out_each_collective_by_hand():
    two = comm_claims.expected_after([[0, 1, 2, 3], [10, 11, 12, 13]])
    assert [r["all_reduce"] for r in two] == [[10, 12, 14, 16]] * 2
    assert [r["broadcast"] for r in two] == [[0, 1, 2, 3]] * 2
    assert [r["all_gather"] for r in two] == [[0, 1, 2, 3, 10, 11, 12, 13]] * 2
    assert [r["reduce_scatter"] for r in two] == [[10, 12], [14, 16]]
    with pytest.raises(ValueError, match="divide"):
        comm_claims.expected_after([[0, 1, 2], [3, 4, 5]])


def test_the_real_collectives_leave_what_expected_after_says(runs_root, no_leftovers):
    import torch.distributed as dist
    import labkit

    def four(ctx):
        x = torch.arange(4.0) + 10 * ctx.rank
        out = {"start": x.tolist()}
        y = x.clone(); dist.all_reduce(y); out["all_reduce"] = y.tolist()
        y = x.clone(); dist.broadcast(y, src=0); out["broadcast"] = y.tolist()
        parts = [torch.empty_like(x) for _ in range(ctx.world_size)]
        dist.all_gather(parts, x); out["all_gather"] = torch.cat(parts).tolist()
        mine = torch.empty(2); dist.reduce_scatter(mine, list(x.chunk(2))); out["reduce_scatter"] = mine.tolist()
        return out

    run = labkit.launch(four, world_size=2, runs_root=runs_root, echo=False, progress=False)
    held = [run.result(r) for r in range(2)]
    expected = comm_claims.expected_after([h["start"] for h in held])
    assert all(h[op] == e[op] for h, e in zip(held, expected) for op in e)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_ring_takes_2n_minus_2_steps_and_ends_with_the_full_sum_everywhere(world):
    steps = comm_claims.ring_allreduce_steps(world)
    assert len(steps) == 1 + 2 * (world - 1)
    everyone = frozenset(range(world))
    after_reduce_scatter = steps[world - 1][1]
    assert [sum(cell == everyone for cell in row) for row in after_reduce_scatter] == [1] * world  # one chunk each
    assert all(cell == everyone for row in steps[-1][1] for cell in row)
    assert all(sorted(sent) == list(range(world)) for _, _, sent in steps[:-1])   # every rank sends one chunk a step
    fig = comm_claims.plot_ring(world)
    assert len(fig.axes) == len(steps)


def _bench(world: int, alpha: float, bandwidth: float, others: float = 0.0):
    """A stand-in for a metered benchmark: the ring model's times, exactly, for all_reduce and broadcast."""
    from types import SimpleNamespace
    sizes = comm.message_sizes(4096, 16 * MiB, 4)
    rows = [{"op": op, "backend": "gloo", "world_size": world, "size_bytes": s,
             "time_s": float(comm.ring_time(s, world, alpha, bandwidth)), "skipped": ""}
            for op in ("all_reduce", "broadcast") for s in sizes]
    df = pd.DataFrame(rows)
    df["busbw_GBps"] = [comm.busbw(o, s, t, world) for o, s, t in zip(df.op, df.size_bytes, df.time_s)]
    return SimpleNamespace(value=df, others=others, again=lambda: _bench(world, alpha, bandwidth))


def test_the_speed_checks_pass_on_what_they_claim_and_fail_otherwise():
    two, four = _bench(2, 2e-4, 1e9), _bench(4, 3e-4, 4e8)
    assert "growth" in comm_claims.busbw_grows(two) and "bandwidth term" in comm_claims.small_messages_are_latency_bound(two)
    assert comm_claims.ring_model_fits(two) == "median error 0%"
    assert "x at 16 MiB" in comm_claims.more_ranks_take_longer((two, four))
    assert comm_claims.more_ranks_lower_bandwidth((two, four)).startswith("B 0.40 vs 1.00")
    with pytest.raises(AssertionError):
        comm_claims.more_ranks_lower_bandwidth((four, two))
    flat = _bench(2, 1e-9, 1e9)           # next to no latency: small messages are not latency-bound
    with pytest.raises(AssertionError):
        comm_claims.small_messages_are_latency_bound(flat)


def test_shared_lets_the_next_claim_start_from_a_fresh_measurement():
    from types import SimpleNamespace
    made = []

    def measure(others):
        made.append(others)
        return SimpleNamespace(value=len(made), others=others, again=lambda: measure(0.0),
                               wait_for_quiet=lambda limit, timeout_s=10.0: 0.0)

    shared = comm_claims.Shared(measure(0.9))
    assert shared.others == 0.9 and shared.again() is shared
    assert (shared.others, shared.value, made) == (0.0, 2, [0.9, 0.0])
