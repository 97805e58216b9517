"""HetRL planner: where and how every RL task runs on a heterogeneous cluster. Pure Python (no torch).

    cluster = load_cluster("examples/clusters/paper-multi-region.yaml")
    workload = load_workload("examples/workloads/qwen3-8b-grpo-sync.yaml")
    result = plan(cluster, workload, method="hybrid")   # exhaustive | hybrid | ilp | verl | verl-all | streamrl
    estimate(cluster, workload, result.plan)                    # seconds per iteration, with breakdown
"""

import inspect

from .catalog import GPUS, gpu
from .cost import Estimate, estimate
from .ilp import ilp
from .plan import Plan, load_plan, plan_from_dict, workload_tasks
from .search import SearchResult, exhaustive, hybrid, streamrl, verl, verl_all
from .spec import PRESETS, ClusterSpec, WorkloadSpec, load_cluster, load_workload

METHODS = {"hybrid": hybrid, "ilp": ilp, "exhaustive": exhaustive, "verl": verl, "verl-all": verl_all,
           "streamrl": streamrl}


def plan(cluster: ClusterSpec, workload: WorkloadSpec, method: str = "hybrid", *, seed: int | None = None,
         time_limit_s: float | None = None, budget: int | None = None) -> SearchResult:
    """Search a plan with one of METHODS; unknown methods list the valid ones.

    seed and budget steer `hybrid`; time_limit_s bounds every method but `verl-all` (which scores one plan):
    it returns its best plan by then, and `SearchResult.stopped` says it stopped (default 120 s for ilp).
    An option the method does not take is refused, not dropped. Raises ValueError when no plan fits in
    memory (or none was found in the time limit), saying what to change.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    fn = METHODS[method]
    takes = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in dict(seed=seed, budget=budget, time_limit_s=time_limit_s).items() if v is not None}
    refused = [k for k in kwargs if k not in takes]
    if refused:
        raise ValueError(f"method {method} takes no {', '.join(refused)} (it takes: "
                         f"{', '.join(k for k in takes if k not in ('cluster', 'w')) or 'no options'})")
    result = fn(cluster, workload, **kwargs)
    if result.plan is None:
        if result.stopped:
            raise ValueError(f"{method}: no plan found before the time limit ({result.stopped}); raise the time "
                             "limit, or use method=hybrid, which has a plan within seconds")
        raise ValueError(_no_plan_message(cluster, workload, method))
    return result


def _no_plan_message(cluster: ClusterSpec, workload: WorkloadSpec, method: str) -> str:
    biggest = max(g.type.memory_bytes for g in cluster.gpus) / 1e9
    width = 4 if workload.precision == "fp32" else 2
    actor = workload.actor.params * width / 1e9
    return (f"{method}: no plan fits in memory: the actor alone is {actor:.1f} GB of {workload.precision} weights, "
            f"and training needs ~16 bytes per parameter ({16 * workload.actor.params / 1e9:.0f} GB) spread over the "
            "GPUs of its group, next to "
            f"the other models and the KV cache; the largest GPU has {biggest:.0f} GB and the cluster "
            f"{len(cluster.gpus)} GPUs. Add GPUs, use a smaller model, or shorten prompt/response lengths")


def evaluate(cluster: ClusterSpec, workload: WorkloadSpec, plan_: Plan) -> Estimate:
    """Score a given plan (e.g. a user's current setup): predicted time with breakdown, or why it cannot run."""
    return estimate(cluster, workload, plan_)


__all__ = ["GPUS", "METHODS", "PRESETS", "ClusterSpec", "Estimate", "Plan", "SearchResult", "WorkloadSpec",
           "estimate", "evaluate", "gpu", "ilp", "load_cluster", "load_plan", "load_workload", "plan", "plan_from_dict",
           "workload_tasks"]
