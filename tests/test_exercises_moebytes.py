"""Lesson 19's numbers-first exercise: the all-to-all bytes per token of top-k routing, judged on a
grid and against the bytes real gloo ranks hand all_to_all_single; each usual slip is named."""

from __future__ import annotations

from labkit.exercises.checks_moebytes import check_a2a_bytes, reference_a2a_bytes


def test_the_reference_passes_and_equals_the_bytes_counted_on_the_ranks(runs_root, no_leftovers):
    report = check_a2a_bytes(reference_a2a_bytes, runs_root=runs_root)
    assert report.ok, report.text()
    # k = 2, h = 8, float32: 2 x 2 x 8 x 4 x (e - 1)/e per token
    assert report.measured["counted"] == {2: 64.0, 4: 96.0}
    assert reference_a2a_bytes(8, 7168, 64, 2) == 225_792  # DeepSeek-V3's sizes, bf16 both ways
    assert report.use(None) is reference_a2a_bytes


def k_forgotten(k, h, e, value_bytes):
    return 2 * h * value_bytes * (e - 1) / e


def stays_forgotten(k, h, e, value_bytes):
    return 2 * k * h * value_bytes


def dispatch_only(k, h, e, value_bytes):
    return k * h * value_bytes * (e - 1) / e


def values_not_bytes(k, h, e, value_bytes):
    return 2 * k * h * (e - 1) / e


def test_each_usual_slip_is_named_with_the_learners_function(runs_root, no_leftovers):
    for fn, words in [
        (k_forgotten, "k forgotten"),
        (stays_forgotten, "(e - 1)/e forgotten"),
        (dispatch_only, "the dispatch only"),
        (values_not_bytes, "values, not bytes"),
    ]:
        report = check_a2a_bytes(fn, worlds=(2,), runs_root=runs_root)
        assert not report.ok and report.blamed == [fn.__name__], (fn.__name__, report.text())
        assert words in report.text(), (fn.__name__, report.text())


def test_the_stub_is_not_written_yet_and_use_gives_the_reference(
    runs_root, no_leftovers, monkeypatch
):
    monkeypatch.delenv("LABKIT_EXERCISES", raising=False)

    def a2a_bytes_per_token(k, h, e, value_bytes):
        raise NotImplementedError("a2a_bytes_per_token is not written yet")

    report = check_a2a_bytes(a2a_bytes_per_token, worlds=(2,), runs_root=runs_root)
    assert report.missing and not report.failures, report.text()
    assert report.use(reference_a2a_bytes) is reference_a2a_bytes
