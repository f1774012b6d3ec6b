"""Lesson 23's numbers-first exercise: the bytes one rank sends for ring, all-gather and Ulysses
attention, judged on a grid and against the bytes real gloo ranks hand their collectives; each
usual slip is named."""

from __future__ import annotations

from labkit.exercises.checks_cpbytes import check_cp_bytes, reference_cp_bytes


def test_the_reference_passes_and_equals_the_bytes_counted_on_the_ranks(runs_root, no_leftovers):
    report = check_cp_bytes(reference_cp_bytes, runs_root=runs_root)
    assert report.ok, report.text()
    # s = 16, h = 32, float32: a rank's K is 4 x 32 x 4 = 512 bytes at 4 ranks
    assert report.measured["counted"][("ring", 4)] == 6 * 512
    assert report.measured["counted"][("ulysses", 4)] == 3 * 512
    assert report.use(None) is reference_cp_bytes


def _ref(method, s, h, c, value_bytes):
    return reference_cp_bytes(method, s, h, c, value_bytes)


def kv_forgotten(method, s, h, c, value_bytes):
    out = _ref(method, s, h, c, value_bytes)
    return out / 2 if method != "ulysses" else out


def c_not_c_minus_1(method, s, h, c, value_bytes):
    return 2 * s * h * value_bytes if method != "ulysses" else _ref(method, s, h, c, value_bytes)


def ulysses_two(method, s, h, c, value_bytes):
    out = _ref(method, s, h, c, value_bytes)
    return out / 2 if method == "ulysses" else out


def forward_and_backward(method, s, h, c, value_bytes):
    return 2 * _ref(method, s, h, c, value_bytes)


def test_each_usual_slip_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [
        (kv_forgotten, "K and V"),
        (c_not_c_minus_1, "c where c - 1 belongs"),
        (ulysses_two, "four all-to-alls"),
        (forward_and_backward, "forward and backward"),
    ]:
        report = check_cp_bytes(fn, worlds=(2,), runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(
    runs_root, no_leftovers, monkeypatch
):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)

    def cp_bytes(method, s, h, c, value_bytes):
        raise NotImplementedError("cp_bytes is not written yet")

    report = check_cp_bytes(cp_bytes, worlds=(2,), runs_root=runs_root)
    assert report.missing and not report.failures, report.text()
    assert report.use(reference_cp_bytes) is reference_cp_bytes
