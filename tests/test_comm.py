"""labkit.comm: nccl-tests bandwidth arithmetic, the ring model fit, and a real gloo benchmark."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from labkit.tricks import comm

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
