"""`profile_step=N`: step N of a run under torch.profiler, its operator table and summary beside the metrics, the
step's row marked so benchmarks leave its (profiler-slowed) times out."""

import json
import pathlib

import pytest

from hetrl.cli import main
from hetrl.trainer.config import load_config

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")
QUICK = ["steps=2", "eval_size=4", "checkpoint_every=0", "prompts_per_step=4", "responses_per_prompt=2",
         "mini_batches=1"]


def test_the_profiled_step_writes_its_operator_table_and_is_marked_in_the_metrics(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--config", TINY, *QUICK, "profile_step=2", f"out_dir={out}"]) == 0
    summary = json.loads((out / "profile_step_2.json").read_text())
    assert summary["step"] == 2 and summary["wall_s"] > 0 and summary["host_s"] > 0 and not summary["on_device"]
    names = [e["name"] for e in summary["top"]]
    assert "aten::mm" in names or "aten::addmm" in names      # the model's matmuls were seen
    assert "Self CPU" in (out / "profile_step_2.txt").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("profiled", False) for r in rows] == [False, True]
    assert not list(out.glob("profile_step_1.*"))


def test_profile_step_is_refused_where_it_cannot_profile():
    with pytest.raises(ValueError, match="after the last step"):
        load_config(TINY, ["steps=2", "profile_step=3"])
    with pytest.raises(ValueError, match="executor=local"):
        load_config(TINY, ["profile_step=1", "executor=ray", "emulate_cluster=examples/clusters/cpu-2x2.yaml"])
    assert load_config(TINY, ["steps=2"]).profile_step == 0
