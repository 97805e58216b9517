"""device=auto | cpu | cuda | cuda:N for the local executor: where the roles run, and a missing GPU as one line."""

import json
import pathlib

import pytest
import torch

from hetrl.cli import main
from hetrl.trainer.metrics import TIMING_KEYS
from hetrl.trainer.precision import device

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")


def test_auto_is_cuda_when_present_else_cpu():
    assert device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'x'}", "device=cuda:1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "device=cuda:1: torch" in err[0] and "sees 0 CUDA device(s)" in err[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, auto is CUDA, whose numbers differ from the CPU's; "
                    "test_auto_is_cuda_when_present_else_cpu covers the choice there")
def test_device_cpu_and_auto_give_the_same_run_on_a_cpu_machine(tmp_path):
    for name in ("cpu", "auto"):
        assert main(["train", "--config", TINY, f"out_dir={tmp_path / name}", f"device={name}", "eval_size=8"]) == 0
    rows = [[json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("cpu", "auto")]
    timing = TIMING_KEYS
    assert [{k: v for k, v in r.items() if k not in timing} for r in rows[0]] == \
        [{k: v for k, v in r.items() if k not in timing} for r in rows[1]]


@pytest.mark.gpu
def test_a_tiny_run_trains_on_cuda(tmp_path):
    out = tmp_path / "cuda"
    assert main(["train", "--config", TINY, f"out_dir={out}", "device=cuda", "eval_size=8"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["loss"] == r["loss"] for r in rows) and any(r["grad_norm"] > 0 for r in rows)
