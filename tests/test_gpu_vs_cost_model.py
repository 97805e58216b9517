"""benchmarks.studies.gpu_vs_cost_model over the committed GPU files: every measured phase and operator row gets
the cost model's price for the same shape (the study the GPU page quotes)."""

import csv
import json
import shutil

import pytest

from benchmarks.studies import gpu_vs_cost_model as study
from hetrl.planner import optables
from hetrl.planner.catalog import gpu


def test_every_phase_of_every_committed_run_is_priced():
    split = json.loads((study.FIRST / "train_split_cuda.json").read_text())
    rows = study.train_rows(split, "H100")
    assert {(r["model"], r["phase"]) for r in rows} == {
        (m, p) for m in split["runs"] for p in ("rollout", "log-probs", "update", "step")}
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)


def test_operator_rows_are_priced_by_the_table_the_cost_model_uses():
    with open(study.FIRST / "operators_cuda.csv", newline="") as f:
        measured = list(csv.DictReader(f))
    rows = study.operator_rows(measured, "H100")
    gemms = [r for r in rows if r["op"] == "gemm"]
    assert len(gemms) == sum(r["op"] == "gemm" for r in measured)
    m, n, k = 4096, 4096, 4096
    row = next(r for r in gemms if r["shape"] == f"{m} x {n} x {k}")
    assert row["table_s"] == optables.gemm_s(gpu("H100"), m, n, k)
    assert all(r["table_s"] > 0 for r in rows if r["op"] in ("gemm", "attention_decode"))
    # qwen3-8b and qwen3-4b share their attention shape: measured twice, one row each
    dedup = study._dedupe(rows)
    assert len({(r["op"], r["shape"]) for r in dedup}) == len(dedup) < len(rows)


def test_a_later_calls_folder_is_priced_on_the_gpu_it_ran_on(tmp_path, monkeypatch):
    """The next lent GPU (an H200, say) lands in its own folder; the study prices its rows on the H200, names the
    H200's tables, leaves the first call's folder and notes alone, and refuses a folder without stage b's and d's
    files."""
    folder = tmp_path / "h200-2026-12-09"
    folder.mkdir()
    for name in ("operators_cuda.csv", "README.md"):
        shutil.copy(study.FIRST / name, folder / name)
    split = json.loads((study.FIRST / "train_split_cuda.json").read_text())
    (folder / "train_split_cuda.json").write_text(json.dumps(split | {"device_name": "NVIDIA H200"}))
    before = (study.FIRST / "cost_model.md").read_text()
    monkeypatch.chdir(tmp_path)
    study.main(["--dir", str(folder)])
    text = (folder / "cost_model.md").read_text()
    assert text.startswith("# The cost model beside a lent GPU (NVIDIA H200, 2026-11-28)")
    assert "--dir h200-2026-12-09`" in text and "on one H200, every task" in text
    assert "scaled from H100" in text and "4.8 TB/s" in text and "## What it says" not in text
    got = json.loads((folder / "cost_model.json").read_text())
    h100 = json.loads((study.FIRST / "cost_model.json").read_text())
    one = [r for r in got["operators"] if r["op"] == "gemm" and r["shape"].startswith("1 x ")]
    ref = {r["shape"]: r["table_s"] for r in h100["operators"]}
    assert one and all(r["table_s"] < ref[r["shape"]] for r in one)   # weight-read bound: the H200's faster HBM
    assert (study.FIRST / "cost_model.md").read_text() == before
    (folder / "operators_cuda.csv").unlink()           # stage d cut by its budget: stage b's page alone
    study.main(["--dir", str(folder)])
    text = (folder / "cost_model.md").read_text()
    assert "Not measured: the call's stage d wrote no operators_cuda.csv" in text and "| config:qwen2.5-1.5b |" in text
    shutil.copy(study.FIRST / "operators_cuda.csv", folder)
    (folder / "train_split_cuda.json").unlink()        # stage b cut: the GPU named by the operator rows' sources
    study.main(["--dir", str(folder)])
    text = (folder / "cost_model.md").read_text()
    assert text.startswith("# The cost model beside a lent GPU (NVIDIA H100 80GB HBM3, 2026-11-28)")
    assert "Not measured: the call's stage b wrote no train_split_cuda.json" in text and "| gemm |" in text
    (folder / "operators_cuda.csv").unlink()
    with pytest.raises(SystemExit, match="neither train_split_cuda.json nor operators_cuda.csv"):
        study.main(["--dir", str(folder)])
    (folder / "train_split_cuda.json").write_text(json.dumps(split | {"device_name": "NVIDIA GeForce RTX 4090"}))
    with pytest.raises(SystemExit, match="not a catalog GPU"):
        study.main(["--dir", str(folder)])


def test_the_committed_page_is_what_the_study_writes(tmp_path):
    """The first call's page regenerates from its files and notes unchanged."""
    folder = tmp_path / study.FIRST.name
    shutil.copytree(study.FIRST, folder)
    study.main(["--dir", str(folder)])
    got = (folder / "cost_model.md").read_text()
    want = (study.FIRST / "cost_model.md").read_text()
    assert got.replace(f" --dir {folder}", "") == want
