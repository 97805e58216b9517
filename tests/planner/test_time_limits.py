"""Time limits are limits: every method returns its best plan by --time-limit plus a stated overhead (one group
configuration, ~2 s at 4096 GPUs on 2 cores), at any cluster size, and says it stopped."""

import time

import pytest

from hetrl.cli import main
from hetrl.planner import load_cluster, load_workload, plan
from hetrl.planner.search import Deadline
from hetrl.planner.spec import cluster_from_dict

WORKLOAD = "examples/workloads/qwen3-8b-grpo-sync.yaml"
OVERHEAD_S = 4.0   # one configure call at these sizes, plus building the plan, on a loaded 2-core machine


def _one_pool(nodes: int):
    return cluster_from_dict({"name": f"a100x{nodes * 8}", "nodes": [
        {"name": f"a{i}", "region": "r", "gpu": "A100-80G", "count": 8} for i in range(nodes)]})


@pytest.mark.parametrize("method", ["ilp", "hybrid"])
def test_a_large_cluster_is_planned_within_the_limit(method):
    """2048 GPUs in one pool: the ILP would cost ~3,900 group configurations of ~1 s each before solving."""
    cluster, w = _one_pool(256), load_workload(WORKLOAD)
    t0 = time.perf_counter()
    r = plan(cluster, w, method, time_limit_s=5.0)
    took = time.perf_counter() - t0
    assert took <= 5.0 + OVERHEAD_S, f"{method} took {took:.1f} s for a 5 s limit"
    assert r.plan is not None and r.stopped and "5 s time limit" in r.stopped
    if method == "ilp":
        assert r.optimality_gap is None      # a gap over a sample of the space would claim too much


def test_exhaustive_stops_at_the_limit_with_its_best_plan():
    w = load_workload(WORKLOAD)
    small = cluster_from_dict({"name": "s", "nodes": [
        {"name": "a", "region": "r", "gpu": "A100-80G", "count": 4},
        {"name": "b", "region": "r", "gpu": "L40S", "count": 4, "intra_node": "pcie"}]})
    full = plan(small, w, "exhaustive")
    assert full.stopped is None
    cut = plan(small, w, "exhaustive", time_limit_s=0.02)   # the scores are cached by now: ~0.1 s in all
    assert cut.stopped and cut.evaluated < full.evaluated
    assert cut.iteration_time_s >= full.iteration_time_s


def test_the_cli_says_the_search_stopped(capsys):
    assert main(["plan", "--cluster", "examples/clusters/paper-multi-region.yaml", "--workload", WORKLOAD,
                 "--time-limit", "0.5"]) == 0
    assert "search stopped at the 0.5 s time limit" in capsys.readouterr().out


def test_options_a_method_does_not_take_are_refused(capsys):
    cluster, w = load_cluster("examples/clusters/paper-single-region.yaml"), load_workload(WORKLOAD)
    with pytest.raises(ValueError, match="method verl-all takes no time_limit_s"):
        plan(cluster, w, "verl-all", time_limit_s=5)
    with pytest.raises(ValueError, match="method ilp takes no seed"):
        plan(cluster, w, "ilp", seed=3)
    with pytest.raises(ValueError, match="time limit must be a number of seconds > 0"):
        Deadline(-1)
