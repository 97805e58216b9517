"""Execution plans: task groups on disjoint GPU sets, TP/PP/DP per task, and the shard -> GPU map.

A group's GPU list is ordered; shard (dp rank r, pipeline stage s, tensor rank t) of a task with
degrees (tp, pp, dp) runs on gpus[(r * pp + s) * tp + t]. The order is therefore the fine-grained
placement: reordering a group's GPUs moves shards between GPUs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .spec import ClusterSpec, WorkloadSpec

TASKS = ("actor_gen", "actor_infer", "ref_infer", "reward_infer", "critic_infer", "actor_train", "critic_train")
# Tasks that read the same weights as a training task run where it runs (old log-probs on the trainer,
# critic values on the critic trainer), as in verl; the planner moves them together.
BOUND = {"actor_infer": "actor_train", "critic_infer": "critic_train"}
# How a group's DP replicas share its batch: in proportion to their speed (HetRL's load balancing), or
# evenly, as verl / Megatron / vLLM data parallelism does (they assume identical GPUs).
DATA_SPLITS = ("by_speed", "even")


def workload_tasks(w: WorkloadSpec) -> tuple[str, ...]:
    tasks = ["actor_gen", "actor_infer"]
    if w.reference is not None:
        tasks.append("ref_infer")
    if w.reward is not None:
        tasks.append("reward_infer")
    if w.critic is not None:
        tasks.append("critic_infer")
    tasks.append("actor_train")
    if w.critic is not None:
        tasks.append("critic_train")
    return tuple(tasks)


@dataclass(frozen=True)
class Parallelism:
    tp: int
    pp: int
    dp: int

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class Group:
    tasks: tuple[str, ...]
    gpus: tuple[int, ...]                       # GPU ids in shard order
    parallelism: tuple[tuple[str, Parallelism], ...]
    data_split: str = "by_speed"                # one of DATA_SPLITS

    def par(self, task: str) -> Parallelism:
        return dict(self.parallelism)[task]


@dataclass(frozen=True)
class Plan:
    groups: tuple[Group, ...]

    def group_of(self, task: str) -> Group:
        return next(g for g in self.groups if task in g.tasks)

    def to_dict(self, cluster: ClusterSpec) -> dict:
        return {"groups": [
            {"tasks": list(g.tasks), "gpus": [cluster.gpus[i].name for i in g.gpus],
             "parallelism": {t: {"tp": p.tp, "pp": p.pp, "dp": p.dp} for t, p in g.parallelism},
             "data_split": g.data_split}
            for g in self.groups]}


def plan_from_dict(data: dict, cluster: ClusterSpec, workload: WorkloadSpec) -> Plan:
    """Read a plan written by `hetrl plan --json` (or by hand) and check it against the cluster and workload."""
    if not isinstance(data, dict) or not isinstance(data.get("groups"), list):
        raise ValueError("a plan is a mapping with a list under 'groups'")
    by_name = {g.name: g.id for g in cluster.gpus}
    groups, seen_tasks, seen_gpus = [], [], []
    for i, g in enumerate(data["groups"]):
        tasks = tuple(g.get("tasks") or ())
        unknown = [t for t in tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"plan group {i}: unknown task(s) {unknown}; tasks are {', '.join(TASKS)}")
        gpus = []
        for name in g.get("gpus") or ():
            if name not in by_name:
                raise ValueError(f"plan group {i}: GPU {name!r} is not in cluster {cluster.name} "
                                 f"(GPUs are named <node>:<index>, e.g. {cluster.gpus[0].name})")
            gpus.append(by_name[name])
        par = []
        for t in tasks:
            p = (g.get("parallelism") or {}).get(t)
            if not p:
                raise ValueError(f"plan group {i}: no parallelism for {t}")
            par.append((t, Parallelism(int(p.get("tp", 1)), int(p.get("pp", 1)), int(p.get("dp", 1)))))
        split = g.get("data_split", "by_speed")
        if split not in DATA_SPLITS:
            raise ValueError(f"plan group {i}: data_split must be one of {', '.join(DATA_SPLITS)} (by_speed: "
                             f"replicas get data in proportion to their speed; even: as verl does), got {split!r}")
        groups.append(Group(tasks, tuple(gpus), tuple(par), split))
        seen_tasks += tasks
        seen_gpus += gpus
    plan = Plan(tuple(groups))
    check_structure(plan, cluster, workload)
    return plan


def check_structure(plan: Plan, cluster: ClusterSpec, workload: WorkloadSpec) -> None:
    """Every task exactly once, disjoint GPU sets, tp*pp*dp = group size, bound tasks together."""
    want = workload_tasks(workload)
    got = [t for g in plan.groups for t in g.tasks]
    if sorted(got) != sorted(want):
        raise ValueError(f"the plan must place each task once: {', '.join(want)}; it places {', '.join(got)}")
    used = [i for g in plan.groups for i in g.gpus]
    if len(used) != len(set(used)):
        dup = sorted({cluster.gpus[i].name for i in used if used.count(i) > 1})
        raise ValueError(f"task groups must own disjoint GPUs; shared: {dup}")
    for g in plan.groups:
        for t, p in g.parallelism:
            if p.size != len(g.gpus):
                raise ValueError(f"{t}: tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {p.size} must equal the group's "
                                 f"{len(g.gpus)} GPUs")
    for t, owner in BOUND.items():
        if t in got and plan.group_of(t) is not plan.group_of(owner):
            raise ValueError(f"{t} reads {owner}'s weights and must be in its group")


def dumps(plan: Plan, cluster: ClusterSpec) -> str:
    return json.dumps(plan.to_dict(cluster), indent=2)
