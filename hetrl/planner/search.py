"""Search methods over the plan space of space.py: the exhaustive oracle and the baselines users run today.

  exhaustive  every grouping x every GPU count per node and group (small clusters only: the oracle).
  verl        all tasks colocated on one homogeneous pool (one GPU type, optionally one region),
              with verl-style per-task parallelism chosen by the same level-4 rule; the best such pool.
  streamrl    generation on one homogeneous pool, everything else on another (types and regions may
              differ); the best such pair.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

from .plan import Plan
from .space import compositions, groupings, plan_from_counts, score
from .spec import ClusterSpec, WorkloadSpec

EXHAUSTIVE_LIMIT = 300_000


@dataclass(frozen=True)
class SearchResult:
    method: str
    plan: Plan | None
    iteration_time_s: float
    search_time_s: float
    evaluated: int
    optimality_gap: float | None = None


def exhaustive_size(cluster: ClusterSpec, w: WorkloadSpec) -> int:
    total = 0
    for g in groupings(w):
        k = len(g)
        total += math.prod(math.comb(n.count + k, k) for n in cluster.nodes)
    return total


def exhaustive(cluster: ClusterSpec, w: WorkloadSpec) -> SearchResult:
    size = exhaustive_size(cluster, w)
    if size > EXHAUSTIVE_LIMIT:
        raise ValueError(f"exhaustive search would score {size:,} plans on {len(cluster.gpus)} GPUs (limit "
                         f"{EXHAUSTIVE_LIMIT:,}); it is the oracle for small clusters. Use method=hybrid or ilp")
    t0 = time.perf_counter()
    best, best_t, n = None, math.inf, 0
    for grouping in groupings(w):
        k = len(grouping)
        per_node = [list(compositions(node.count, k)) for node in cluster.nodes]
        for combo in itertools.product(*per_node):
            counts = tuple(tuple(c[g] for c in combo) for g in range(k))
            if any(sum(c) == 0 for c in counts):
                continue
            plan = plan_from_counts(cluster, w, grouping, counts)
            t = score(cluster, w, plan)
            n += 1
            if t < best_t:
                best, best_t = plan, t
    return SearchResult("exhaustive", best, best_t, time.perf_counter() - t0, n)


def homogeneous_pools(cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Per GPU type: all its nodes, and the nodes of each single region, as node-count vectors."""
    pools = set()
    for gtype in {n.gpu for n in cluster.nodes}:
        regions = {n.region for n in cluster.nodes if n.gpu == gtype}
        for region in [None, *regions]:
            pools.add(tuple(n.count if n.gpu == gtype and region in (None, n.region) else 0
                            for n in cluster.nodes))
    return sorted(pools)


def verl(cluster: ClusterSpec, w: WorkloadSpec) -> SearchResult:
    t0 = time.perf_counter()
    (all_tasks,) = next(g for g in groupings(w) if len(g) == 1)
    best, best_t, n = None, math.inf, 0
    for pool in homogeneous_pools(cluster):
        plan = plan_from_counts(cluster, w, (all_tasks,), (pool,))
        t = score(cluster, w, plan)
        n += 1
        if t < best_t:
            best, best_t = plan, t
    return SearchResult("verl", best, best_t, time.perf_counter() - t0, n)


def streamrl(cluster: ClusterSpec, w: WorkloadSpec) -> SearchResult:
    t0 = time.perf_counter()
    split = next(g for g in groupings(w) if len(g) == 2 and ("actor_gen",) in g)
    gen_first = (("actor_gen",), next(b for b in split if b != ("actor_gen",)))
    best, best_t, n = None, math.inf, 0
    pools = homogeneous_pools(cluster)
    for a, b in itertools.permutations(pools, 2):
        if any(x and y for x, y in zip(a, b)):
            continue   # pools must not share a node
        plan = plan_from_counts(cluster, w, gen_first, (a, b))
        t = score(cluster, w, plan)
        n += 1
        if t < best_t:
            best, best_t = plan, t
    return SearchResult("streamrl", best, best_t, time.perf_counter() - t0, n)
