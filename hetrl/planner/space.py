"""The plan space every method searches, and the per-group parallelism choice (HetRL's level 4).

A plan is (1) a grouping of the placement units into task groups, (2) for each group how many GPUs
of each node it takes, (3) TP/PP/DP per task. GPUs of one node are interchangeable (same type,
same links), so (2) is a count per node, and shards are laid out node-major inside a group (TP
groups fill a node before spanning two). Given (1) and (2), `configure_group` picks (3)
deterministically: each task's fastest option, then more sharding for the task using the most
memory until the group fits. Exhaustive search, the ILP and the hybrid search all score plans
through this one function, so they search the same space.
"""

from __future__ import annotations

import functools
import itertools
import math

from .cost import ROLE_OF, TRAIN_TASKS, _dense_pass, _generation, _memory, estimate
from .plan import BOUND, Group, Parallelism, Plan, workload_tasks
from .spec import ClusterSpec, WorkloadSpec

MAX_TP = 8


def units(w: WorkloadSpec) -> list[tuple[str, ...]]:
    """Placement units: a task and the tasks bound to it (old log-probs run where the actor trains)."""
    tasks = workload_tasks(w)
    out = []
    for t in tasks:
        if t in BOUND:
            continue
        out.append(tuple([*(b for b, owner in BOUND.items() if owner == t and b in tasks), t]))
    return out


def set_partitions(items: list) -> list[list[list]]:
    if not items:
        return [[]]
    first, rest = items[0], items[1:]
    out = []
    for part in set_partitions(rest):
        out.append([[first], *part])
        for i in range(len(part)):
            out.append([*part[:i], [first, *part[i]], *part[i + 1:]])
    return out


def groupings(w: WorkloadSpec) -> list[tuple[tuple[str, ...], ...]]:
    """Every way to split the units into task groups (Bell number of the unit count)."""
    return [tuple(tuple(t for u in block for t in u) for block in part) for part in set_partitions(units(w))]


def parallelisms(w: WorkloadSpec, task: str, n: int) -> list[Parallelism]:
    model = w.model(ROLE_OF[task])
    out = []
    for tp in (1, 2, 4, 8):
        if tp > MAX_TP or n % tp or model.heads % tp:
            continue
        for pp in range(1, n // tp + 1):
            if (n // tp) % pp or pp > model.layers:
                continue
            out.append(Parallelism(tp, pp, n // (tp * pp)))
    return out


def gpus_from_counts(cluster: ClusterSpec, counts: tuple[int, ...], taken: dict[str, int]) -> tuple[int, ...]:
    """GPU ids for `counts[k]` GPUs of node k, skipping the first `taken[node]` already used; node-major."""
    ids = []
    for node, k in zip(cluster.nodes, counts):
        start = taken.get(node.name, 0)
        first = next(g.id for g in cluster.gpus if g.node == node.name)
        ids += range(first + start, first + start + k)
        taken[node.name] = start + k
    return tuple(ids)


def _standalone(cluster, w, task, gpus, par) -> float:
    group = Group((task,), gpus, ((task, par),))
    model = w.model(ROLE_OF[task])
    if task == "actor_gen":
        _, free, _ = _memory(cluster, w, _single_plan(group))
        return _generation(cluster, w, model, group, free).seconds
    return _dense_pass(cluster, w, model, group, task, task in TRAIN_TASKS).seconds


def _single_plan(group: Group) -> Plan:
    return Plan((group,))


def configure_group(cluster: ClusterSpec, w: WorkloadSpec, tasks: tuple[str, ...], gpus: tuple[int, ...]) -> Group | None:
    """Pick TP/PP/DP for every task of a group on `gpus`; None when no choice fits in memory."""
    return _configure(cluster, w, tasks, gpus)


@functools.lru_cache(maxsize=100_000)
def _configure(cluster, w, tasks, gpus) -> Group | None:
    n = len(gpus)
    options = {}
    for t in tasks:
        opts = parallelisms(w, t, n)
        if not opts:
            return None
        options[t] = sorted(opts, key=lambda p: (_standalone(cluster, w, t, gpus, p), p.pp, p.tp))
    choice = {t: 0 for t in tasks}
    for _ in range(4 * sum(len(o) for o in options.values())):
        group = Group(tasks, gpus, tuple((t, options[t][choice[t]]) for t in tasks))
        peak, _, why = _memory(cluster, w, _single_plan(group))
        if not why:
            if "actor_gen" in tasks and math.isinf(
                    _generation(cluster, w, w.actor, group, _memory(cluster, w, _single_plan(group))[1]).seconds):
                why = "kv"
            else:
                return group
        # shard the heaviest task further: next option (in speed order) with a smaller per-GPU shard
        heavy = max(tasks, key=lambda t: _footprint(w, t, options[t][choice[t]]))
        cur = options[heavy][choice[heavy]]
        nxt = next((i for i in range(choice[heavy] + 1, len(options[heavy]))
                    if _footprint(w, heavy, options[heavy][i]) < _footprint(w, heavy, cur)), None)
        if nxt is None:
            others = [t for t in tasks if t != heavy and choice[t] + 1 < len(options[t])]
            if not others:
                return None
            choice[others[0]] += 1
        else:
            choice[heavy] = nxt
    return None


def _footprint(w: WorkloadSpec, task: str, p: Parallelism) -> float:
    params = w.model(ROLE_OF[task]).params / (p.tp * p.pp)
    return params * (4 + 12 / p.dp) if task in TRAIN_TASKS else params * 2


def plan_from_counts(cluster, w, grouping, counts) -> Plan | None:
    """Build a plan from a grouping and, per group, a GPU count per node; None if some group cannot fit."""
    taken: dict[str, int] = {}
    groups = []
    for tasks, c in zip(grouping, counts):
        gpus = gpus_from_counts(cluster, c, taken)
        if not gpus:
            return None
        group = configure_group(cluster, w, tasks, gpus)
        if group is None:
            return None
        groups.append(group)
    return Plan(tuple(groups))


def compositions(total: int, parts: int):
    """All ways to split `total` items into `parts` ordered non-negative counts (plus what stays unused)."""
    for cut in itertools.combinations(range(total + parts), parts):
        prev, out = -1, []
        for c in cut:
            out.append(c - prev - 1)
            prev = c
        yield tuple(out)


def score(cluster, w, plan: Plan | None) -> float:
    if plan is None:
        return math.inf
    e = estimate(cluster, w, plan)
    return e.iteration_time_s if e.feasible else math.inf
