"""Plans that do not use the fields added for issue #37 (MoE layer pattern, ep, sp, engine, vpp, token budgets,
operator tables) price BIT-IDENTICALLY to the cost model before them.

The fixture (fixtures/baseline_scores.json, written by fixtures/make_baseline_scores.py at ddf2dd2, before the
change) holds every examples/plans/*.json with a GPU workload, the 19 published runs of
benchmarks/cost_model_validation.py and 10 exhaustive optima of the random small cases, as cluster / workload /
plan dicts, with the iteration time, every task's seconds and terms, and every GPU's peak bytes they scored.
"""

import json
import pathlib

import pytest

from hetrl.planner import estimate
from hetrl.planner.plan import plan_from_dict
from hetrl.planner.spec import cluster_from_dict, workload_from_dict

ENTRIES = json.loads((pathlib.Path(__file__).parent / "fixtures" / "baseline_scores.json").read_text())
# Changed on purpose: the one MoE run. Before #37 an MoE was priced as a dense model of its active parameters;
# its expert GEMMs, the experts' FSDP gathers and routing are new physics for every model with experts > 0
# (docs/cost_model.md, "MoE"), so it is checked apart (test_moe_run_changes_only_where_moe_terms_apply).
MOE = {"validation: qwen3-30b-a3b GRPO LongReason, DualKV mb=8, 16x H100"}


def _score(e):
    c = cluster_from_dict(e["cluster"], e["name"])
    w = workload_from_dict(e["workload"], e["name"])
    return estimate(c, w, plan_from_dict(e["plan"], c, w, e["name"]))


def test_fixture_covers_examples_and_validation_runs():
    names = [e["name"] for e in ENTRIES]
    assert sum(n.startswith("examples/plans/") for n in names) == 4
    assert sum(n.startswith("validation: ") for n in names) == 19
    assert sum(n.startswith("random small case") for n in names) == 10


@pytest.mark.parametrize("entry", [e for e in ENTRIES if e["name"] not in MOE], ids=lambda e: e["name"])
def test_scores_are_bit_identical_without_the_new_fields(entry):
    got, want = _score(entry), entry["scores"]
    assert got.feasible == want["feasible"]
    assert got.iteration_time_s == want["iteration_time_s"]      # exact: no tolerance
    assert got.task_times_s == want["task_times_s"]
    assert got.task_terms == want["task_terms"]
    assert got.breakdown == want["breakdown"]
    assert {str(k): v for k, v in got.memory_bytes.items()} == want["memory_bytes"]


def test_moe_run_changes_only_where_moe_terms_apply():
    (entry,) = [e for e in ENTRIES if e["name"] in MOE]
    got, want = _score(entry), entry["scores"]
    assert got.feasible
    # generation of an MoE with ep = 1 prices as before (active FLOPs, total weights read per decode step)
    assert got.task_times_s["actor_gen"] == want["task_times_s"]["actor_gen"]
    # training and the log-prob passes now pay the expert GEMMs' efficiency and FSDP's gathers of every expert
    assert got.task_times_s["actor_train"] > want["task_times_s"]["actor_train"]
