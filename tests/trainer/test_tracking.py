"""report_to=tensorboard: the rows of metrics.jsonl and eval.jsonl, read back with TensorBoard's own reader."""

import importlib.util
import json
import math
import pathlib

import pytest

from hetrl.cli import main

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")


def test_tensorboard_holds_the_same_rows_as_metrics_jsonl(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    out = tmp_path / "tb"
    assert main(["train", "--config", TINY, f"out_dir={out}", "report_to=tensorboard", "eval_size=8"]) == 0
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    rows = [json.loads(x) for name in ("metrics.jsonl", "eval.jsonl")
            for x in (out / name).read_text().splitlines()]
    expected = {(k, r["step"]): float(v) for r in rows for k, v in r.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    got = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    assert set(got) == set(expected)
    assert all(math.isclose(got[k], expected[k], rel_tol=1e-6, abs_tol=1e-12) for k in expected)  # float32 events
    assert {"loss", "reward_mean", "eval_accuracy"} <= {k for k, _ in got}


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_missing_tracker_package_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'w'}", "report_to=wandb"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "report_to=wandb needs the wandb package" in err[0] and "wandb==0.31.0" in err[0]
