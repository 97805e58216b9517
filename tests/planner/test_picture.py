"""The plan's picture and the timeline it draws: the timeline is the cost model's own rule (its last bar ends at
the predicted iteration time, a group's bars never overlap), and `hetrl plan --png` writes a PNG."""

import json
import pathlib

import pytest

from hetrl.cli import main
from hetrl.planner.cost import aggregate, timeline
from hetrl.planner.report import plan_report

ROOT = pathlib.Path(__file__).parents[2]
CLUSTER = str(ROOT / "examples" / "clusters" / "paper-multi-region.yaml")


def test_a_sync_timeline_ends_at_the_iteration_time_and_groups_never_overlap():
    groups = [{"actor_gen": 10.0}, {"ref_infer": 2.0, "actor_infer": 3.0, "actor_train": 7.0}, {"critic_infer": 4.0,
                                                                                                 "critic_train": 5.0}]
    total, _ = aggregate("sync", groups, 1.5, 0.5)
    bars = timeline("sync", groups, 1.5, 0.5)
    assert max(b["end_s"] for b in bars) == pytest.approx(total) == 10 + 1.5 + 5 + 7 + 0.5
    for k in range(len(groups)):
        mine = sorted((b["start_s"], b["end_s"]) for b in bars if b["group"] == k)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))
        assert {b["task"] for b in bars if b["group"] == k} == set(groups[k])
    train = next(b for b in bars if b["task"] == "actor_train")
    assert train["start_s"] == pytest.approx(10 + 1.5 + 5)    # after the slowest group's inference phase
    total, _ = aggregate("async", groups, 1.5, 0.5)
    assert max(b["end_s"] for b in timeline("async", groups, 1.5, 0.5)) == pytest.approx(total)


@pytest.mark.parametrize("workload", ["qwen3-4b-grpo-sync.yaml", "qwen3-4b-ppo-async.yaml"])
def test_plan_png_draws_the_placement_and_the_timeline(tmp_path, capsys, workload):
    path = str(ROOT / "examples" / "workloads" / workload)
    report = plan_report(CLUSTER, path)
    assert max(b["end_s"] for b in report["timeline"]) == pytest.approx(report["iteration_time_s"])
    assert sum(h["count"] for hw in report["hardware"] for h in hw) == sum(len(g["gpus"])
                                                                          for g in report["plan"]["groups"])
    png = tmp_path / "plan.png"
    assert main(["plan", "--cluster", CLUSTER, "--workload", path, "--png", str(png), "--out",
                 str(tmp_path / "plan.json")]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"picture: {png}" in capsys.readouterr().out
    saved = json.loads((tmp_path / "plan.json").read_text())
    evaluated = tmp_path / "again.png"
    assert main(["plan", "--cluster", CLUSTER, "--workload", path, "--evaluate", str(tmp_path / "plan.json"),
                 "--png", str(evaluated)]) == 0
    assert evaluated.is_file() and saved["timeline"]


def test_a_png_path_that_cannot_be_written_is_refused_before_the_search(tmp_path, capsys):
    rc = main(["plan", "--cluster", CLUSTER, "--workload", str(ROOT / "examples" / "workloads" /
                                                                "qwen3-4b-grpo-sync.yaml"),
               "--png", str(tmp_path / "missing" / "plan.png")])
    assert rc == 2 and "does not exist" in capsys.readouterr().err


def test_measured_times_are_printed_and_drawn_beside_the_predicted(tmp_path, capsys):
    path = str(ROOT / "examples" / "workloads" / "qwen3-4b-grpo-sync.yaml")
    assert main(["plan", "--cluster", CLUSTER, "--workload", path, "--out", str(tmp_path / "plan.json"),
                 "--time-limit", "2"]) == 0
    saved = json.loads((tmp_path / "plan.json").read_text())
    times = tmp_path / "times.yaml"
    times.write_text("actor_gen: 12.5\nactor_train: 9\niteration: 30\n")
    png = tmp_path / "measured.png"
    capsys.readouterr()
    assert main(["plan", "--cluster", CLUSTER, "--workload", path, "--evaluate", str(tmp_path / "plan.json"),
                 "--measured", str(times), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    gen = saved["task_times_s"]["actor_gen"]
    assert f"actor_gen 12.5 s vs {gen:.1f} s ({(gen - 12.5) / 12.5:+.0%})" in out and "iteration 30.0 s vs" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = plan_report(CLUSTER, path, evaluate_path=str(tmp_path / "plan.json"), measured_path=str(times))
    assert report["measured"] == {"actor_gen": 12.5, "actor_train": 9.0, "iteration": 30.0}


@pytest.mark.parametrize("text, message", [("actor_gne: 3\n", "'actor_gne' is not a task of this plan"),
                                           ("actor_gen: -1\n", "must be a positive number"),
                                           ("[1, 2]\n", "expected a mapping"), ("a: [\n", "not JSON or YAML")])
def test_bad_measured_times_are_refused_in_one_line(tmp_path, capsys, text, message):
    path = str(ROOT / "examples" / "workloads" / "qwen3-4b-grpo-sync.yaml")
    assert main(["plan", "--cluster", CLUSTER, "--workload", path, "--out", str(tmp_path / "plan.json"),
                 "--time-limit", "1"]) == 0
    times = tmp_path / "times.yaml"
    times.write_text(text)
    capsys.readouterr()
    rc = main(["plan", "--cluster", CLUSTER, "--workload", path, "--evaluate", str(tmp_path / "plan.json"),
               "--measured", str(times)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1
    rc = main(["plan", "--cluster", CLUSTER, "--workload", path, "--measured", str(times)])
    assert rc == 2 and "give the plan with --evaluate" in capsys.readouterr().err
