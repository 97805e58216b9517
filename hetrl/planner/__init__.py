"""HetRL planner: where and how every RL task runs on a heterogeneous cluster. Pure Python (no torch).

    cluster = load_cluster("examples/clusters/paper-multi-region.yaml")
    workload = load_workload("examples/workloads/qwen3-8b-grpo-sync.yaml")
    result = plan(cluster, workload, method="exhaustive")      # or "verl", "streamrl"
    estimate(cluster, workload, result.plan)                    # seconds per iteration, with breakdown
"""

from .catalog import GPUS, gpu
from .cost import Estimate, estimate
from .plan import Plan, plan_from_dict, workload_tasks
from .search import SearchResult, exhaustive, streamrl, verl
from .spec import PRESETS, ClusterSpec, WorkloadSpec, load_cluster, load_workload

METHODS = {"exhaustive": exhaustive, "verl": verl, "streamrl": streamrl}


def plan(cluster: ClusterSpec, workload: WorkloadSpec, method: str = "exhaustive") -> SearchResult:
    """Search a plan with one of METHODS; unknown methods list the valid ones."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    return METHODS[method](cluster, workload)


__all__ = ["GPUS", "METHODS", "PRESETS", "ClusterSpec", "Estimate", "Plan", "SearchResult", "WorkloadSpec",
           "estimate", "gpu", "load_cluster", "load_workload", "plan", "plan_from_dict", "workload_tasks"]
