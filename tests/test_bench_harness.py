"""The benchmark harness does what its numbers claim: warm-up calls are not timed, variants take turns within each
round, the spread is the median with its min and max, a step's peak RSS counts what it allocated, and results land
whole in NAME.json and NAME.md."""

from __future__ import annotations

import json

from hetrl.bench import harness


def test_rounds_interleave_after_untimed_warmups():
    calls = []
    times = harness.interleaved_times({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                      rounds=3, warmup=2)
    assert calls == ["a", "b"] * 5                      # 2 warm-up rounds, then 3 timed ones, in turn
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert all(t >= 0 for v in times.values() for t in v)


def test_spread_and_median_times():
    assert harness.spread([3.0, 1.0, 2.0]) == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0}
    assert set(harness.median_times({"x": lambda: None}, 2)) == {"x"}


def test_timed_returns_the_value():
    value, seconds = harness.timed(lambda: 42)
    assert value == 42 and seconds >= 0


def test_machine_names_what_the_numbers_ran_on():
    m = harness.machine()
    assert {"model", "flags", "cpus", "torch_threads", "torch", "python", "platform", "cuda"} <= set(m)
    assert json.loads(json.dumps(m)) == m


def test_results_are_written_whole(tmp_path):
    path = harness.write_results(tmp_path / "out", "bench", {"x": [1, 2]}, "# table")
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == {"x": [1, 2]}
    assert (tmp_path / "out" / "bench.md").read_text() == "# table\n"
    assert path == str(tmp_path / "out" / "bench")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["bench.json", "bench.md"]   # no .tmp left


def test_peak_rss_increase_counts_what_the_step_touched_and_frees():
    import torch

    held = []
    got = harness.peak_rss_increase(lambda: held.append(torch.ones(64 << 20, dtype=torch.uint8)))   # 64 MiB, touched
    assert got["increase_kb"] == got["peak_kb"] - got["resident_kb"] >= 64 << 10
    held.clear()
    assert harness.peak_rss_increase(lambda: None)["increase_kb"] < 16 << 10    # the peak was reset, not carried


def test_child_results_take_each_childs_last_json_line_or_its_error():
    out = harness.child_results({"ok": ["-c", "print('{\"n\": 1}'); print('{\"n\": 2}')"],
                                 "fails": ["-c", "raise SystemExit('bad input')"]}, jobs=2)
    assert out == {"ok": {"n": 2}, "fails": {"error": "bad input"}}
