"""benchmarks.studies.gpu_vs_cost_model over the committed GPU files: every measured phase and operator row gets
the cost model's price for the same shape (the study the GPU page quotes)."""

import csv
import json

from benchmarks.studies import gpu_vs_cost_model as study
from hetrl.planner import optables
from hetrl.planner.catalog import gpu


def test_every_phase_of_every_committed_run_is_priced():
    split = json.loads((study.GPU_DIR / "train_split_cuda.json").read_text())
    rows = study.train_rows(split)
    assert {(r["model"], r["phase"]) for r in rows} == {
        (m, p) for m in split["runs"] for p in ("rollout", "log-probs", "update", "step")}
    assert all(r["predicted_s"] > 0 and r["measured_s"] > 0 for r in rows)


def test_operator_rows_are_priced_by_the_table_the_cost_model_uses():
    with open(study.GPU_DIR / "operators_cuda.csv", newline="") as f:
        measured = list(csv.DictReader(f))
    rows = study.operator_rows(measured)
    gemms = [r for r in rows if r["op"] == "gemm"]
    assert len(gemms) == sum(r["op"] == "gemm" for r in measured)
    m, n, k = 4096, 4096, 4096
    row = next(r for r in gemms if r["shape"] == f"{m} x {n} x {k}")
    assert row["table_s"] == optables.gemm_s(gpu("H100"), m, n, k)
    assert all(r["table_s"] > 0 for r in rows if r["op"] in ("gemm", "attention_decode"))
    # qwen3-8b and qwen3-4b share their attention shape: measured twice, one row each
    dedup = study._dedupe(rows)
    assert len({(r["op"], r["shape"]) for r in dedup}) == len(dedup) < len(rows)
