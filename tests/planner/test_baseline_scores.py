"""Plans that do not use the fields added for issue #37 (MoE layer pattern, ep, sp, engine, vpp, token budgets,
operator tables) price BIT-IDENTICALLY to the cost model before them.

The fixture (fixtures/baseline_scores.json, written by fixtures/make_baseline_scores.py at ddf2dd2, before the
change) holds every examples/plans/*.json with a GPU workload, the 19 published runs of
benchmarks/cost_model_validation.py and 10 exhaustive optima of the random small cases, as cluster / workload /
plan dicts, with the iteration time, every task's seconds and terms, and every GPU's peak bytes they scored.
Since issue #44 a decode step on a GPU is priced from the operator tables (hetrl/planner/optables.py): with the
tables off (HETRL_OPERATOR_TABLES=off) every entry still prices bit-identically, and with them only the
generation's decode terms move.
The one MoE run (Qwen3-30B-A3B, FSDP, ep 1) is among them: with ep 1 and 1,536 tokens per expert per micro-batch
its grouped GEMMs lose nothing to tile quantization or the memory roofline (catalog.gemm_efficiency = 1), so it
prices as before.
"""

import json
import pathlib

import pytest

from hetrl.planner import estimate
from hetrl.planner.plan import plan_from_dict
from hetrl.planner.spec import cluster_from_dict, workload_from_dict

ENTRIES = json.loads((pathlib.Path(__file__).parent / "fixtures" / "baseline_scores.json").read_text())


def _score(e):
    c = cluster_from_dict(e["cluster"], e["name"])
    w = workload_from_dict(e["workload"], e["name"])
    return estimate(c, w, plan_from_dict(e["plan"], c, w, e["name"]))


def test_fixture_covers_examples_and_validation_runs():
    names = [e["name"] for e in ENTRIES]
    assert sum(n.startswith("examples/plans/") for n in names) == 4
    assert sum(n.startswith("validation: ") for n in names) == 19
    assert sum(n.startswith("random small case") for n in names) == 10


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["name"])
def test_scores_are_bit_identical_without_the_new_fields(entry, roofline_only):
    got, want = _score(entry), entry["scores"]
    assert got.feasible == want["feasible"]
    assert got.iteration_time_s == want["iteration_time_s"]      # exact: no tolerance
    assert got.task_times_s == want["task_times_s"]
    assert got.task_terms == want["task_terms"]
    assert got.breakdown == want["breakdown"]
    assert {str(k): v for k, v in got.memory_bytes.items()} == want["memory_bytes"]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e["name"].startswith("random")], ids=lambda e: e["name"])
def test_the_operator_tables_move_only_the_decode(entry):
    """With the tables on, every task but generation prices as before except the TP and DP all-reduces of passes
    inside an NVLink node (the collective tables) and an MoE pass's permutation (a new term); generation keeps its
    prefill and its communication (its TP all-reduces inside an NVLink node from vLLM's measured kernels), its KV
    reads come from the decode-attention table where a GPU has one, and its weight reads / decode compute become
    the step's kernels from the tables (decode_ops) plus the engine's per-step CPU time (engine_step)."""
    got, want = _score(entry), entry["scores"]
    assert got.feasible == want["feasible"]
    in_node = ("tp_comm", "dp_comm")
    for task, terms in want["task_terms"].items():
        if task != "actor_gen":
            assert {k: v for k, v in got.task_terms[task].items() if k not in in_node + ("moe_permute",)} == \
                {k: v for k, v in terms.items() if k not in in_node}, task
            for k in in_node:
                assert (got.task_terms[task].get(k, 0) > 0) == (terms.get(k, 0) > 0), (task, k)
            assert got.task_terms[task].get("moe_permute", 1.0) > 0, task   # an MoE pass's permutation: new
    gen, old = got.task_terms["actor_gen"], want["task_terms"]["actor_gen"]
    assert gen["decode_ops"] > 0 and gen["engine_step"] > 0
    for term in ("pp_comm", "ep_comm", "tool_wait"):
        assert gen.get(term) == old.get(term), term
    assert (gen.get("tp_comm", 0) > 0) == (old.get("tp_comm", 0) > 0)
    assert gen["compute"] <= old["compute"]      # the prefill (and tool chunks) only: decode steps are decode_ops
    assert {str(k): v for k, v in got.memory_bytes.items()} == want["memory_bytes"]
