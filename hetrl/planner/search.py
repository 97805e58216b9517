"""Search methods over the plan space of space.py, and the baselines users run today.

  exhaustive  every grouping x every GPU count per pool and group: the oracle for small clusters.
  hybrid      HetRL's search: successive halving over task groupings (level 1) with a doubling
              budget; inside each surviving grouping a genetic search over GPU counts per pool and
              group (levels 2-3: mutation, moves and swaps of GPUs between task groups, crossover, culling);
              level 4 (TP/PP/DP) by space.configurations; level 5 (shard order) is node-major.
  verl        all tasks colocated on one homogeneous pool (one GPU type, all of it or one region's);
              the best such pool.
  verl-all    verl as the HetRL paper ran it: all tasks colocated on every GPU of the cluster, DP replicas
              fed evenly (verl assumes identical GPUs), the best parallelism for that.
  streamrl    generation on one homogeneous pool, everything else on another; the best such pair.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from dataclasses import dataclass

from .plan import Plan
from .space import GroupConfig, best_combination, build_plan, compositions, configurations, groupings, pools
from .spec import ClusterSpec, WorkloadSpec

EXHAUSTIVE_LIMIT = 400_000


@dataclass(frozen=True)
class SearchResult:
    method: str
    plan: Plan | None
    iteration_time_s: float
    search_time_s: float
    evaluated: int
    optimality_gap: float | None = None
    stopped: str | None = None        # why the search ended before covering its space (the time limit), or None
    best_found_s: float | None = None  # hybrid: seconds into the search when its best plan was first scored


class Deadline:
    """The time limit of one search. Checked between group configurations, so a search ends at most one
    `configure` call after the limit (measured: benchmarks/README.md, "Numbers behind constants in the code")."""

    def __init__(self, time_limit_s: float | None):
        if time_limit_s is not None and not (isinstance(time_limit_s, (int, float)) and time_limit_s > 0
                                             and math.isfinite(time_limit_s)):
            raise ValueError(f"the time limit must be a number of seconds > 0, got {time_limit_s!r}")
        self.limit_s = time_limit_s
        self.start = time.perf_counter()
        self.end = None if time_limit_s is None else self.start + time_limit_s

    def passed(self) -> bool:
        return self.end is not None and time.perf_counter() > self.end

    def left_s(self) -> float:
        return math.inf if self.end is None else max(0.0, self.end - time.perf_counter())

    def stopped(self, what: str) -> str:
        return f"stopped at the {self.limit_s:g} s time limit after {what}"


def _score(cluster, w, grouping, counts, deadline: Deadline | None = None,
           exact: bool = False) -> tuple[float, list[GroupConfig] | None]:
    """A plan's seconds and its groups' configurations: each group's `configurations`, combined by
    `best_combination` (`exact`: every combination, for the oracle)."""
    if any(sum(c) == 0 for c in counts):
        return math.inf, None
    options = []
    for tasks, c in zip(grouping, counts):
        if deadline is not None and deadline.passed():   # between group configurations
            raise _OutOfTime
        found = configurations(cluster, w, tasks, c)
        if not found:
            return math.inf, None
        options.append(found)
    return best_combination(cluster, w, options, exact)


def _result(method, cluster, best_configs, best_t, t0, n, gap=None, stopped=None) -> SearchResult:
    plan = build_plan(cluster, best_configs) if best_configs else None
    return SearchResult(method, plan, best_t, time.perf_counter() - t0, n, gap, stopped)


# ------------------------------------------------------------------------------------------ exhaustive


def allocations(cluster: ClusterSpec, groups: int) -> int:
    """GPU allocations of one grouping of `groups` task groups: per pool, its steps split among them or unused."""
    return math.prod(math.comb(p.steps + groups, groups) for p in pools(cluster))


def exhaustive_size(cluster: ClusterSpec, w: WorkloadSpec) -> int:
    return sum(allocations(cluster, len(g)) for g in groupings(w))


def exhaustive(cluster: ClusterSpec, w: WorkloadSpec, time_limit_s: float | None = None) -> SearchResult:
    size = exhaustive_size(cluster, w)
    if size > EXHAUSTIVE_LIMIT:
        raise ValueError(f"exhaustive search would score {size:,} plans on {len(cluster.gpus)} GPUs (limit "
                         f"{EXHAUSTIVE_LIMIT:,}); it is the oracle for small clusters. Use method=hybrid or ilp")
    deadline = Deadline(time_limit_s)
    t0 = deadline.start
    best, best_t, n = None, math.inf, 0
    for grouping in groupings(w):
        k = len(grouping)
        for combo in itertools.product(*(list(compositions(p.steps, k)) for p in pools(cluster))):
            if deadline.passed():
                return _result("exhaustive", cluster, best, best_t, t0, n,
                               stopped=deadline.stopped(f"scoring {n:,} of {size:,} plans"))
            counts = tuple(tuple(c[g] for c in combo) for g in range(k))
            t, configs = _score(cluster, w, grouping, counts, exact=True)
            n += 1
            if t < best_t:
                best, best_t = configs, t
    return _result("exhaustive", cluster, best, best_t, t0, n)


# ------------------------------------------------------------------------------------------ baselines


def homogeneous_sets(cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Count vectors of homogeneous GPU sets: per GPU type, all its pools, and each single region's."""
    ps = pools(cluster)
    out = set()
    for gtype in {p.nodes[0].gpu for p in ps}:
        regions = {p.nodes[0].region for p in ps if p.nodes[0].gpu == gtype}
        for region in [None, *regions]:
            out.add(tuple(p.steps if p.nodes[0].gpu == gtype and region in (None, p.nodes[0].region) else 0
                          for p in ps))
    return sorted(out)


def verl(cluster: ClusterSpec, w: WorkloadSpec, time_limit_s: float | None = None) -> SearchResult:
    deadline = Deadline(time_limit_s)
    t0 = deadline.start
    (tasks,) = next(g for g in groupings(w) if len(g) == 1)
    best, best_t, n = None, math.inf, 0
    sets = homogeneous_sets(cluster)
    for pool in sets:
        if deadline.passed():
            return _result("verl", cluster, best, best_t, t0, n,
                           stopped=deadline.stopped(f"{n} of {len(sets)} homogeneous pools"))
        t, configs = _score(cluster, w, (tasks,), (pool,))
        n += 1
        if t < best_t:
            best, best_t = configs, t
    return _result("verl", cluster, best, best_t, t0, n)


def verl_all(cluster: ClusterSpec, w: WorkloadSpec) -> SearchResult:
    t0 = time.perf_counter()
    (tasks,) = next(g for g in groupings(w) if len(g) == 1)
    every = tuple(p.steps for p in pools(cluster))
    found = configurations(cluster, w, tasks, every, "even")
    t, configs = best_combination(cluster, w, [found]) if found else (math.inf, None)
    return _result("verl-all", cluster, configs, t, t0, 1)


def streamrl(cluster: ClusterSpec, w: WorkloadSpec, time_limit_s: float | None = None) -> SearchResult:
    deadline = Deadline(time_limit_s)
    t0 = deadline.start
    split = next(g for g in groupings(w) if len(g) == 2 and ("actor_gen",) in g)
    grouping = (("actor_gen",), next(b for b in split if b != ("actor_gen",)))
    pairs = [(a, b) for a, b in itertools.permutations(homogeneous_sets(cluster), 2)
             if not any(x and y for x, y in zip(a, b))]   # the two sets must not share a pool
    if not pairs:
        raise ValueError("streamrl: it generates on one GPU type (or one region of it) and trains on another, and "
                         f"{cluster.name} has {len({g.type.name for g in cluster.gpus})} GPU type in "
                         f"{len({g.region for g in cluster.gpus})} region(s): no two disjoint sets to split")
    best, best_t, n = None, math.inf, 0
    for a, b in pairs:
        if deadline.passed():
            return _result("streamrl", cluster, best, best_t, t0, n,
                           stopped=deadline.stopped(f"{n} pool pairs"))
        t, configs = _score(cluster, w, grouping, (a, b))
        n += 1
        if t < best_t:
            best, best_t = configs, t
    return _result("streamrl", cluster, best, best_t, t0, n)


# ------------------------------------------------------------------------------------------ hybrid


class _OutOfTime(Exception):
    """The hybrid search's time limit passed; it returns the best plan found so far."""


class _Arm:
    """One task grouping and the population of GPU allocations found for it so far."""

    def __init__(self, grouping, population_size: int, space: int):
        self.grouping, self.size = grouping, population_size
        self.space = space                                  # allocations this grouping has (exhaustive's count)
        self.population: list[tuple[tuple, tuple]] = []   # ((seconds, busy seconds), counts), best first
        self.scores: dict[tuple, tuple[float, float]] = {}

    @property
    def best(self) -> tuple[float, float]:
        return self.population[0][0] if self.population else (math.inf, math.inf)

    def offer(self, t: tuple[float, float], counts) -> None:
        if any(c == counts for _, c in self.population):
            return
        self.population.append((t, counts))
        self.population.sort(key=lambda x: (x[0], x[1]))
        del self.population[self.size:]          # cull the worst


def _random_counts(rng, cluster, k):
    out = [[0] * len(pools(cluster)) for _ in range(k)]
    for j, p in enumerate(pools(cluster)):
        for _ in range(p.steps):
            g = rng.randrange(k + 1)           # k = leave this step unused
            if g < k:
                out[g][j] += 1
    return tuple(map(tuple, out))


def _mutate(rng, cluster, counts):
    """Move GPUs between task groups (or to/from the unused set): HetRL's level-3 swaps."""
    k, m = len(counts), len(pools(cluster))
    c = [list(x) for x in counts]
    for _ in range(rng.choice((1, 1, 2, 3))):
        j = rng.randrange(m)
        src = rng.randrange(k + 1)
        dst = rng.randrange(k + 1)
        if src == dst:
            continue
        free = pools(cluster)[j].steps - sum(x[j] for x in c)
        have = free if src == k else c[src][j]
        if have == 0:
            continue
        amount = rng.randint(1, max(1, have // 2)) if rng.random() < 0.3 else 1
        if src < k:
            c[src][j] -= amount
        if dst < k:
            c[dst][j] += amount
    if rng.random() < 0.2 and k > 1:             # swap two groups' GPUs of one pool, or all their GPUs
        j, a, b = rng.randrange(m), *rng.sample(range(k), 2)
        if rng.random() < 0.5:
            c[a][j], c[b][j] = c[b][j], c[a][j]
        else:
            c[a], c[b] = c[b], c[a]
    return tuple(map(tuple, c))


def _neighbours(cluster, counts):
    """Every allocation one count step away: one step of one pool moved between two groups or the unused set."""
    k = len(counts)
    for j, p in enumerate(pools(cluster)):
        free = p.steps - sum(c[j] for c in counts)
        for src in range(k + 1):
            if (free if src == k else counts[src][j]) == 0:
                continue
            for dst in range(k + 1):
                if dst == src:
                    continue
                c = list(counts)     # only the two rows that change are rebuilt
                if src < k:
                    c[src] = (*counts[src][:j], counts[src][j] - 1, *counts[src][j + 1:])
                if dst < k:
                    c[dst] = (*counts[dst][:j], counts[dst][j] + 1, *counts[dst][j + 1:])
                yield tuple(c)


def _crossover(rng, cluster, a, b):
    """Pool-wise mix of two allocations of the same grouping, repaired to fit the pools."""
    k = len(a)
    child = [[(a if rng.random() < 0.5 else b)[g][j] for j in range(len(pools(cluster)))] for g in range(k)]
    for j, p in enumerate(pools(cluster)):
        while sum(x[j] for x in child) > p.steps:
            g = max(range(k), key=lambda g: child[g][j])
            child[g][j] -= 1
    return tuple(map(tuple, child))


def hybrid(cluster: ClusterSpec, w: WorkloadSpec, budget: int = 20000, seed: int = 0,
           time_limit_s: float | None = None) -> SearchResult:
    """Successive halving over groupings; inside each arm, genetic moves and local descents over allocations.

    Each round, every surviving grouping spends its budget on descents: start from a fresh random
    allocation, a mutated or crossed-over good one, then take the best one-step move (a step of GPUs
    from one group to another) until none improves. Then the worse half of the groupings is dropped
    and the survivors' budget doubles. `budget` counts distinct plans scored. Without a time limit the search
    ends there (deterministic for a seed); with one it is anytime: it runs the halving again over every grouping
    with twice the budget, keeping what it found, until the limit (or until a run finds nothing new).
    """
    deadline = Deadline(time_limit_s)
    t0 = deadline.start
    stopped = None
    rng = random.Random(seed)
    arms = [_Arm(g, population_size=8, space=allocations(cluster, len(g))) for g in groupings(w)]
    rounds = max(1, math.ceil(math.log2(len(arms))))
    per_arm = max(8, budget // (len(arms) * rounds))
    n = 0
    found = [math.inf, None]    # best seconds so far, and when it was scored

    def score(arm, counts) -> tuple[float, float]:
        """(iteration seconds, total busy seconds): the second breaks the ties of a max-shaped objective,
        so descents cross plateaus where only a non-critical group changed."""
        nonlocal n
        if deadline.passed():   # also on known plans: a rerun may descend a while through scores it has
            raise _OutOfTime
        if counts not in arm.scores:
            t, configs = _score(cluster, w, arm.grouping, counts, deadline)
            arm.scores[counts] = (t, sum(c.time(c.tasks) for c in configs) if configs else math.inf)
            n += 1
            if t < found[0]:
                found[:] = [t, time.perf_counter() - t0]
            if math.isfinite(t):
                arm.offer(arm.scores[counts], counts)
        return arm.scores[counts]

    def descend(arm, counts) -> None:
        current = score(arm, counts)
        while True:
            moves = [(score(arm, nb), nb) for nb in _neighbours(cluster, counts)]
            best = min(moves, default=((math.inf, math.inf), None))
            if best[0] >= current:
                return
            current, counts = best

    def start(arm):
        k, op = len(arm.grouping), rng.random()
        if arm.population and op < 0.4:
            return _mutate(rng, cluster, arm.population[min(int(rng.expovariate(0.7)), len(arm.population) - 1)][1])
        if len(arm.population) >= 2 and op < 0.6:
            return _crossover(rng, cluster, *rng.sample([c for _, c in arm.population], 2))
        return _random_counts(rng, cluster, k)

    for arm in arms:      # seeds: whole pools per group (homogeneous groups)
        k, m = len(arm.grouping), len(pools(cluster))
        owners = [tuple(rng.randrange(k + 1) for _ in range(m)) for _ in range(per_arm)] if (k + 1) ** m > 4096 \
            else rng.sample(list(itertools.product(range(k + 1), repeat=m)), min(per_arm, (k + 1) ** m))
        for owner in owners:
            try:
                score(arm, tuple(tuple(p.steps if owner[j] == g else 0 for j, p in enumerate(pools(cluster)))
                                 for g in range(k)))
            except _OutOfTime:
                stopped = deadline.stopped(f"scoring {n:,} plans")
                break
    all_arms, first_per_arm = list(arms), per_arm

    def halving(arms, per_arm, goal) -> None:
        last_n = -1
        while True:
            for arm in arms:
                target = n + per_arm
                tries = 0
                while n < target and tries < 4 * per_arm and len(arm.scores) < arm.space:   # else: all scored
                    before = n
                    descend(arm, start(arm))
                    tries += 1 + (n == before)
            if len(arms) == 1:
                if n >= goal or n == last_n:   # n == last_n: the arm has nothing new left to score
                    return
                last_n = n
            else:
                arms.sort(key=lambda a: (a.best, a.grouping))
                arms = arms[: max(1, len(arms) // 2)]     # successive halving: keep the better half...
                per_arm *= 2                               # ...and double their budget

    try:
        rerun = 0
        while True:
            before = n
            halving(list(all_arms), first_per_arm << rerun, n + (budget << rerun))
            # With a time limit the search is anytime: while time is left it runs the halving again over every
            # grouping with twice the budget, the populations and scores found so far kept, until the limit or
            # until a whole run finds no plan it had not scored.
            if not stopped and deadline.end is not None and n > before and not deadline.passed():
                rerun += 1
                continue
            break
    except _OutOfTime:
        stopped = deadline.stopped(f"scoring {n:,} plans")
    best_arm = min(all_arms, key=lambda a: (a.best, a.grouping))
    if not best_arm.population:
        return SearchResult("hybrid", None, math.inf, time.perf_counter() - t0, n, stopped=stopped)
    (t, _), counts = best_arm.population[0]
    _, configs = _score(cluster, w, best_arm.grouping, counts)
    return dataclasses.replace(_result("hybrid", cluster, configs, t, t0, n, stopped=stopped), best_found_s=found[1])
