"""A plan's ep / sp / vpp / engine are not written into engine configs yet: the export's view drops them and says
so as a gap naming the field (no config silently without them)."""

from hetrl.integrations import verl
from hetrl.planner import load_cluster, load_workload
from hetrl.planner.plan import load_plan


def test_expert_parallel_plan_exports_with_a_gap():
    c = load_cluster("examples/clusters/h100-4x8.yaml")
    w = load_workload("examples/workloads/qwen3-30b-a3b-grpo-nemorl.yaml")
    p = load_plan("examples/plans/nemorl-qwen3-30b-a3b-32xh100-ep8.json", c, w)
    v = verl.view(c, w, p)
    lines = [g.line() for g in v.gaps]
    assert any(line.startswith("groups[0].parallelism.actor_train:") and "ep 8" in line and "not exported" in line
               for line in lines), lines
    assert all(par.default_layout for g in v.plan.groups for _, par in g.parallelism)
