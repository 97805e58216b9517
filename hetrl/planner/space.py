"""The plan space every method searches, and the per-group parallelism choice (HetRL's level 4).

A plan is (1) a grouping of the placement units into task groups, (2) per group, how many GPUs
it takes from each *pool* (nodes that are interchangeable: same GPU type, region, links and size),
(3) TP/PP/DP per task. Counts come in steps of one GPU on small clusters (<= 16 GPUs) and of one
node above that, where whole nodes are how such clusters are shared out. Shards are laid out
node-major inside a group (TP groups fill a node before spanning two).

Given (1) and (2), `configure` picks (3) deterministically: each task's fastest option, then more
sharding for the task holding the most memory until the group fits (within the host's memory, where
offloading), then that fit improved one task at a
time while a change shortens the group's own seconds (trading a task's speed for generation's KV cache; a
faster option that does not fit is made to fit by sharding the others further, as the first fit does).
A group's own seconds are a proxy for the plan's time, so `configurations` also offers the configurations
that search met and that are better in some part of what the iteration's time depends on (`profile`: in a
sync plan each phase's seconds, in an async one the busy seconds and the weight sync the group does alone);
the plan's search picks among them (`best_combination`; the ILP takes each as a candidate). Everything about
a group's own time and memory depends only on (tasks, counts); what crosses groups (sample transfer, weight
sync) depends only on each group's `Signature` (its regions and network speed). Exhaustive search,
the ILP and the hybrid search all go through these functions, so they search the same space.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass

from . import optables
from .cost import (
    PHASES,
    ROLE_OF,
    TRAIN_TASKS,
    aggregate,
    group_transfer_s,
    memory,
    sample_bytes,
    shard_gather_s,
    task_costs,
    task_memory,
    usable_host_bytes,
    weight_sync_s,
)
from .plan import BOUND, Group, Parallelism, Plan, workload_tasks
from .spec import ClusterSpec, Node, WorkloadSpec

MAX_TP = 8
FINE_GRAINED_GPUS = 16


def units(w: WorkloadSpec) -> list[tuple[str, ...]]:
    """Placement units: a task plus the tasks bound to it (old log-probs run where the actor trains)."""
    tasks = workload_tasks(w)
    return [tuple([*(b for b, owner in BOUND.items() if owner == t and b in tasks), t])
            for t in tasks if t not in BOUND]


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
    """Every way to split the units into task groups (a Bell number of them), in a fixed order."""
    return [tuple(sorted(tuple(t for u in block for t in u) for block in part))
            for part in set_partitions(units(w))]


# ------------------------------------------------------------------------------------------ pools


@dataclass(frozen=True)
class Pool:
    nodes: tuple[Node, ...]
    step: int                      # GPUs per count step (1 GPU, or one node)

    @property
    def gpus(self) -> int:
        return sum(n.count for n in self.nodes)

    @property
    def steps(self) -> int:
        return self.gpus // self.step


@functools.lru_cache(maxsize=64)
def pools(cluster: ClusterSpec) -> tuple[Pool, ...]:
    fine = len(cluster.gpus) <= FINE_GRAINED_GPUS
    by_kind: dict[tuple, list[Node]] = {}
    for n in cluster.nodes:
        # nodes that differ in anything the cost model reads are never interchangeable
        by_kind.setdefault((n.gpu, n.region, n.intra_node, n.network_gbps, n.count, n.host_memory_gb,
                            n.concurrent_devices, n.intra_node_gbps), []).append(n)
    return tuple(Pool(tuple(ns), 1 if fine else ns[0].count) for ns in by_kind.values())


@functools.lru_cache(maxsize=64)
def _pool_gpu_ids(cluster: ClusterSpec) -> tuple[tuple[int, ...], ...]:
    by_node: dict[str, list[int]] = {}
    for g in cluster.gpus:
        by_node.setdefault(g.node, []).append(g.id)
    return tuple(tuple(i for n in pool.nodes for i in by_node[n.name]) for pool in pools(cluster))


def gpu_ids(cluster: ClusterSpec, counts: tuple[int, ...], offsets: list[int] | None = None) -> tuple[int, ...]:
    """GPU ids for counts[k] steps of pool k (node-major), after `offsets[k]` GPUs already handed out."""
    ids = []
    for k, (pool, c, flat) in enumerate(zip(pools(cluster), counts, _pool_gpu_ids(cluster))):
        start = offsets[k] if offsets else 0
        ids += flat[start:start + c * pool.step]
        if offsets is not None:
            offsets[k] = start + c * pool.step
    return tuple(ids)


# ------------------------------------------------------------------------------------------ level 4


MAX_EP = 64
SP_DEGREES = (2, 4, 8)


def expert_degrees(model, tp: int, dp: int, sp: int = 1) -> list[int]:
    """ep > 1 the search tries for an MoE at these degrees: divisors of the experts that divide tp * sp * dp
    (Megatron's rule, expert tensor parallelism 1), up to MAX_EP; none for a dense model."""
    if not model.experts:
        return []
    return [e for e in range(2, min(MAX_EP, model.experts, tp * sp * dp) + 1)
            if model.experts % e == 0 and (tp * sp * dp) % e == 0]


def parallelisms(w: WorkloadSpec, task: str, n: int, long_sequences: bool = False) -> list[Parallelism]:
    """TP/PP/DP options of a task on n GPUs, and for an MoE every admissible ep (expert_degrees). With
    `long_sequences` (the memory ladder: nothing fit without it) also Ulysses sp in SP_DEGREES for training and
    log-prob tasks, where sp x tp divides the heads. A task the workload's executor runs as data parallelism only
    (`data_parallel_only`) has the one option dp = n."""
    gen = task == "actor_gen"
    if w.data_parallel_only == "all" or (w.data_parallel_only == "but_generation" and not gen):
        return [Parallelism(1, 1, n)]
    return list(_parallelisms(w.model(ROLE_OF[task]), gen, n, long_sequences))


@functools.lru_cache(maxsize=10_000)   # the search asks for the same model, task kind and size many times
def _parallelisms(model, gen: bool, n: int, long_sequences: bool) -> tuple[Parallelism, ...]:
    out = []
    sps = (1, *SP_DEGREES) if long_sequences and not gen else (1,)
    for sp in sps:
        for tp in (1, 2, 4, 8):
            if tp > MAX_TP or n % (tp * sp) or model.heads % (tp * sp):
                continue
            for pp in range(1, n // (tp * sp) + 1):
                if (n // (tp * sp)) % pp or pp > model.layers:
                    continue
                dp = n // (tp * sp * pp)
                out.append(Parallelism(tp, pp, dp, sp=sp))
                out += [Parallelism(tp, pp, dp, sp=sp, ep=e) for e in expert_degrees(model, tp, dp, sp)]
    return tuple(out)


def _task_seconds(cluster, w, group: Group, task: str) -> float:
    return task_costs(cluster, w, group)[task].seconds


def _footprint(w: WorkloadSpec, task: str, p: Parallelism) -> float:
    """GPU bytes the task holds (the cost model's own rule), to pick what to shard further."""
    return task_memory(w, task, p).gpu


@functools.lru_cache(maxsize=200_000)
def _host_bytes(w: WorkloadSpec, task: str, ranked: tuple) -> dict:
    """Host bytes per GPU of each of a task's options (`_ranked`'s), as the cost model keeps them (offload)."""
    return {p: task_memory(w, task, p).host for p, _, _ in ranked}


@functools.lru_cache(maxsize=100_000)
def _host_room(cluster: ClusterSpec, gpus: tuple[int, ...]) -> float:
    """Host bytes each GPU of the group may keep (offload, swap): its node's usable host memory shared by the
    group's GPUs on that node (`cost.memory`'s rule, for this group alone); the least over its nodes."""
    per_node: dict[str, int] = {}
    for i in gpus:
        per_node[cluster.gpus[i].node] = per_node.get(cluster.gpus[i].node, 0) + 1
    return min(usable_host_bytes(cluster, n) / k for n, k in per_node.items())


@dataclass(frozen=True)
class GroupConfig:
    """A configured task group on canonical GPUs: its parallelism and its tasks' seconds."""

    tasks: tuple[str, ...]
    counts: tuple[int, ...]
    parallelism: tuple[tuple[str, Parallelism], ...]
    seconds: tuple[tuple[str, float], ...]
    local_sync_s: float            # weight sync when generation and actor training share this group
    data_split: str = "by_speed"
    swap: bool = False
    gather_s: float = 0.0          # ZeRO-3 actor training: gathering its shards before any weight sync

    def time(self, tasks) -> float:
        return sum(s for t, s in self.seconds if t in tasks)


# Memory strategies tried, in this order, only when a group does not fit with everything resident (ZeRO-1):
# each step holds less per GPU and costs more time (communication, PCIe, host Adam).
TRAIN_STRATEGIES = ({}, {"zero": 2}, {"zero": 3}, {"zero": 3, "offload": "optimizer"}, {"zero": 3, "offload": "params"})
INFER_STRATEGIES = ({}, {"zero": 3}, {"zero": 3, "offload": "params"})


@functools.lru_cache(maxsize=100_000)   # pure; options repeat across the groups the search configures
def _variants(task: str, p: Parallelism, strategies: bool) -> tuple[Parallelism, ...]:
    """Options of one task for one set of degrees. Always, for training, those that can be faster: no
    recompute (a quarter less compute where memory allows) and, on pure data parallelism, ZeRO-3 (FSDP as
    verl and NeMo-RL run it: gathers that hide behind compute instead of TP and pipeline costs). With
    `strategies` (memory forces it), every rung of the ladder."""
    if task == "actor_gen":
        return (p,)
    if not strategies:
        if task not in TRAIN_TASKS:
            return (p,)
        out = [p, dataclasses.replace(p, recompute=False)]
        if p.tp == p.pp == 1 and p.dp > 1 and p.sp == 1:
            out += [dataclasses.replace(p, zero=3), dataclasses.replace(p, zero=3, recompute=False)]
        return tuple(out)
    ladder = TRAIN_STRATEGIES if task in TRAIN_TASKS else INFER_STRATEGIES
    # ZeRO-2/3 shard over the DP group: with one replica only offloading changes anything
    return tuple(dataclasses.replace(p, **s) for s in ladder if p.replicas > 1 or not s or "offload" in s)


def configure(cluster: ClusterSpec, w: WorkloadSpec, tasks: tuple[str, ...], counts: tuple[int, ...],
              data_split: str = "by_speed") -> GroupConfig | None:
    """The group's configuration with the shortest `group_seconds` (None when nothing fits): the first of
    `configurations`."""
    found = configurations(cluster, w, tasks, counts, data_split)
    return found[0] if found else None


@functools.lru_cache(maxsize=500_000)
def configurations(cluster: ClusterSpec, w: WorkloadSpec, tasks: tuple[str, ...], counts: tuple[int, ...],
                   data_split: str = "by_speed") -> tuple[GroupConfig, ...]:
    """Pick TP/PP/DP, a memory strategy and time-shared colocation for every task of a group: of what each pass
    of `_configure` reaches (everything resident; with the memory ladder; with swapping between phases), the
    configuration with the shortest `group_seconds`, then the `trade_offs` against it among every configuration
    the passes met that fits; () when nothing fits in memory. A pass runs only when its lower bound (every task's
    fastest option alone) is under the best so far, and the next passes only when memory cost the last one time
    (its best is above that bound): as before, the memory ladder is for groups memory constrains."""
    gpus = gpu_ids(cluster, counts)
    if not gpus:
        return ()
    phases = {next(i for i, ph in enumerate(PHASES) if t in ph) for t in tasks}
    best, best_s = None, math.inf
    visited: list[GroupConfig] = []
    for strategies, swap in ((False, False), (True, False), (True, True)):
        if swap and len(phases) < 2:
            break
        ranked = {t: _ranked(cluster, w, t, gpus, data_split, strategies) for t in tasks}
        floor = sum(r[0][1] for r in ranked.values()) if all(ranked.values()) else math.inf
        if floor >= best_s * BETTER:
            continue
        found = _configure(cluster, w, tasks, counts, gpus, data_split, swap, ranked, visited=visited)
        if found is not None and swap:
            # swapping only adds seconds: where the options swap found fit without it, improve from there unswapped
            # (the ladder pass's own search can end elsewhere)
            found = min((f for f in (found, _configure(cluster, w, tasks, counts, gpus, data_split, False, ranked,
                                                       dict(found.parallelism), visited)) if f is not None),
                        key=group_seconds)
        if found is not None and (s := group_seconds(found)) < best_s * BETTER:
            best, best_s = found, s
        if best is not None and sum(x for _, x in best.seconds) <= floor / BETTER:
            break   # memory cost this pass nothing: the ladder and swap are for groups where it does
    if best is None:
        return ()
    return (best, *trade_offs(w.mode, best, visited))


def profile(mode: str, cfg: GroupConfig) -> tuple[float, ...]:
    """What of a configured group the iteration's time depends on, by the rule `cost.aggregate` prices it. sync:
    (its generation plus the weight sync it does alone: they add to the iteration; its inference phase; its
    training phase: each enters through the phase's longest group); async: (its busy seconds: the busiest group
    sets the pace; the sync it does alone: it sets the pace when longer)."""
    alone = group_seconds(cfg) - sum(s for _, s in cfg.seconds)
    if mode != "sync":
        return (sum(s for _, s in cfg.seconds), alone)
    return (cfg.time(PHASES[0]) + alone, cfg.time(PHASES[1]), cfg.time(PHASES[2]))


def trade_offs(mode: str, best: GroupConfig, visited: list[GroupConfig]) -> list[GroupConfig]:
    """The configurations the search met that the plan's time can prefer to `best` (shortest group_seconds):
    those no other configuration beats or equals on every part of `profile`, and `best` does not; shortest
    group_seconds first."""
    def dominated(a, b):   # b is at least as good as a everywhere
        return all(y <= x for x, y in zip(a, b))

    out, profiles = [], [profile(mode, best)]
    for cfg in sorted(visited, key=group_seconds):
        p = profile(mode, cfg)
        if any(dominated(p, q) for q in profiles):
            continue
        if any(dominated(q, p) for q in profiles[1:]):
            keep = [i for i, q in enumerate(profiles[1:]) if not dominated(q, p)]
            out, profiles = [out[i] for i in keep], [profiles[0], *(profiles[1 + i] for i in keep)]
        out.append(cfg)
        profiles.append(p)
    return out


BETTER = 1 - 1e-9   # a configuration replaces the best only when shorter by more than rounding


@functools.lru_cache(maxsize=200_000)
def _ranked(cluster, w, task: str, gpus: tuple[int, ...], data_split: str,
            strategies: bool) -> tuple[tuple[Parallelism, float, float], ...]:
    """One task's options on these GPUs as (option, its seconds alone on them, its GPU bytes), fastest first.
    Alone is a lower bound on its seconds in any group: the others only add (swapping, time-sharing) or take KV
    cache from generation. Cached: every block holding the task on the same counts shares them."""
    opts = [v for p in parallelisms(w, task, len(gpus), strategies) for v in _variants(task, p, strategies)]
    ranked = [(p, _task_seconds(cluster, w, Group((task,), gpus, ((task, p),), data_split), task),
               _footprint(w, task, p)) for p in opts]
    return tuple(sorted(ranked, key=lambda x: (x[1], x[0].pp, x[0].tp)))


def _evaluate(cluster, w, tasks, counts, gpus, data_split, swap, choice: dict) -> GroupConfig | None:
    """The group with these options, or None when it does not fit (or a task cannot run)."""
    group = Group(tasks, gpus, tuple((t, choice[t]) for t in tasks), data_split, swap)
    mem = memory(cluster, w, Plan((group,)))
    if mem.why:
        return None
    costs = task_costs(cluster, w, group, mem.kv_free, mem.swap_s[0])
    seconds = tuple((t, costs[t].seconds) for t in tasks)
    if not all(math.isfinite(s) for _, s in seconds):
        return None
    local = weight_sync_s(cluster, w, group, group, True) if {"actor_gen", "actor_train"} <= set(tasks) else 0.0
    return GroupConfig(tasks, counts, group.parallelism, seconds, local, data_split, swap,
                       shard_gather_s(cluster, w, group))


def group_seconds(cfg: GroupConfig) -> float:
    """What a configured group adds to an iteration by itself: its tasks one after another, and the weight sync
    it does alone (inside the group when it both generates and trains; else the ZeRO-3 gather before a sync)."""
    alone = cfg.local_sync_s if "actor_gen" in cfg.tasks else cfg.gather_s if "actor_train" in cfg.tasks else 0.0
    return sum(s for _, s in cfg.seconds) + alone


def _frontier(task: str, ranked) -> list[tuple[Parallelism, float, float]]:
    """The options worth trading: fastest first, each holding less GPU memory than every faster one (generation
    keeps all of its: its seconds depend on the KV cache the others leave it)."""
    if task == "actor_gen":
        return list(ranked)
    out, least = [], math.inf
    for r in ranked:
        if r[2] < least:
            out.append(r)
            least = r[2]
    return out


def _configure(cluster, w, tasks, counts, gpus, data_split, swap: bool, ranked: dict,
               start: dict | None = None, visited: list | None = None) -> GroupConfig | None:
    """A first fit (each task's fastest option, then more sharding for the task holding the most memory, or the
    next heaviest where it can shard no further, until the group fits; never into offload the host's memory cannot
    hold; where that finds nothing, each option of each task with the others made to fit around it), then
    improved one task at a time over the options that trade seconds for memory until no change shortens
    `group_seconds`; a change that does not fit is made to fit by sharding the other tasks further in the same way
    (`make_room`: one task's speed paid for by the memory of any number of others). A change is tried only while
    the tasks' seconds alone with it stay under the best (options come fastest first, so the first that does not
    ends that task's turn). `ranked`: each task's options by `_ranked` for the pass (none empty); `start`: options
    to improve from instead of the first fit (None when they do not fit)."""
    seen: dict[tuple, GroupConfig | None] = {}

    def evaluate(choice: dict) -> GroupConfig | None:   # a sweep meets the configurations of the last one again
        key = tuple(choice[t] for t in tasks)
        if key not in seen:
            seen[key] = _evaluate(cluster, w, tasks, counts, gpus, data_split, swap, choice)
            if visited is not None and seen[key] is not None:
                visited.append(seen[key])
        return seen[key]

    # a task's next, smaller option is taken only while the tasks' own host bytes (offload) stay within the host's
    # room: more offload cannot make a group fit whose host memory it overflows (what the GPUs hold is sharded
    # further in another task, or in a later option of this one, instead)
    room = _host_room(cluster, gpus)
    host = {t: _host_bytes(w, t, r) for t, r in ranked.items()}

    host_bound = [False]   # whether the host's room turned an option away (then the first fit's fallback runs)

    def smaller(trial: dict, task: str, i: int) -> int | None:
        """Index of `task`'s next option after its i-th holding fewer GPU bytes, within the host's room."""
        others = None
        for j in range(i + 1, len(ranked[task])):
            if ranked[task][j][2] < ranked[task][i][2]:
                if not (kept := host[task][ranked[task][j][0]]):
                    return j
                if others is None:
                    others = sum(host[u][trial[u]] for u in tasks if u != task)
                if others + kept <= room:
                    return j
                host_bound[0] = True
        return None

    alone = {t: {p: s for p, s, _ in r} for t, r in ranked.items()}
    position = {t: {p: i for i, (p, _, _) in enumerate(r)} for t, r in ranked.items()}
    best = math.inf

    def make_room(trial: dict, keep: str | None) -> tuple[dict, GroupConfig | None]:
        """`trial` made to fit: the task holding the most GPU memory (`keep` aside) sharded further (its next option
        with a smaller per-GPU share), or the next heaviest where it can shard no further, until the group fits,
        while the tasks' seconds alone stay under the best: one task's speed paid for by the memory of any number
        of others."""
        for _ in range(sum(len(r) for r in ranked.values())):
            for heavy in sorted((u for u in tasks if u != keep), key=lambda u: -ranked[u][position[u][trial[u]]][2]):
                nxt = smaller(trial, heavy, position[heavy][trial[heavy]])
                if nxt is not None:
                    trial = {**trial, heavy: ranked[heavy][nxt][0]}
                    break
            else:
                return trial, None
            if sum(alone[u][trial[u]] for u in tasks) >= best * BETTER:
                return trial, None
            if (cfg := evaluate(trial)) is not None:
                return trial, cfg
        return trial, None

    if start is not None:
        found = evaluate(start)
    else:   # the first fit: every task's fastest option, made to fit
        fastest = {t: ranked[t][0][0] for t in tasks}
        found = evaluate(fastest) or make_room(fastest, None)[1]
        if found is None and host_bound[0]:
            # sharding the heaviest first can end where nothing fits because the host's memory turned the offload
            # it needed away (another task's offload, or none, would fit): each option of each task in turn, the
            # others made to fit around it; the shortest that fits. Only then: a group too small for the tasks
            # (the search meets many) is not searched again.
            for t in tasks:
                for p, _, _ in ranked[t]:
                    cfg = evaluate({**fastest, t: p}) or make_room({**fastest, t: p}, t)[1]
                    if cfg is not None and group_seconds(cfg) < best * BETTER:
                        found, best = cfg, group_seconds(cfg)
    if found is None:
        return None
    choice, best = dict(found.parallelism), group_seconds(found)
    candidates = {t: _frontier(t, ranked[t]) for t in tasks}

    improved = True
    while improved:
        improved = False
        for t in tasks:
            rest = sum(alone[u][choice[u]] for u in tasks if u != t)   # only t's choice changes in its turn
            for p, s, _ in candidates[t]:
                if rest + s >= best * BETTER:
                    break
                if p == choice[t]:
                    continue
                trial = {**choice, t: p}
                cfg = evaluate(trial)
                if cfg is None:
                    trial, cfg = make_room(trial, t)
                if cfg is not None and (secs := group_seconds(cfg)) < best * BETTER:
                    found, best, choice, improved = cfg, secs, trial, True
                    rest = sum(alone[u][choice[u]] for u in tasks if u != t)
    return found


def every_configuration(cluster: ClusterSpec, w: WorkloadSpec, tasks: tuple[str, ...],
                        counts: tuple[int, ...]) -> GroupConfig | None:
    """The oracle for `configure`: every option of every task in every pass (resident; the memory ladder; swap),
    each combination priced whole; the one with the shortest group_seconds (None when none fits). Exponential in
    the tasks: for tests and studies of small groups, not for the search."""
    gpus = gpu_ids(cluster, counts)
    phases = {next(i for i, ph in enumerate(PHASES) if t in ph) for t in tasks}
    best, best_s = None, math.inf
    for strategies, swap in ((False, False), (True, False), (True, True)):
        if swap and len(phases) < 2:
            break
        options = [[p for p, _, _ in _ranked(cluster, w, t, gpus, "by_speed", strategies)] for t in tasks]
        for combo in itertools.product(*options):
            cfg = _evaluate(cluster, w, tasks, counts, gpus, "by_speed", swap, dict(zip(tasks, combo)))
            if cfg is not None and group_seconds(cfg) < best_s:
                best, best_s = cfg, group_seconds(cfg)
    return best


# ------------------------------------------------------------------------------------------ plans


@dataclass(frozen=True)
class Signature:
    """What the cross-group terms see of a group: its regions and its fastest NIC."""

    regions: frozenset
    nic_gbps: float


def signature(cluster: ClusterSpec, counts: tuple[int, ...]) -> Signature:
    used = [p for p, c in zip(pools(cluster), counts) if c]
    return Signature(frozenset(p.nodes[0].region for p in used), max(p.nodes[0].network_gbps for p in used))


def _sig_group(cluster, counts) -> Group:
    return Group((), gpu_ids(cluster, counts), ())


@functools.lru_cache(maxsize=200_000)
def transfer_s(cluster, w, a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """Samples from the generation group (counts a) to another group (counts b)."""
    return group_transfer_s(cluster, _sig_group(cluster, a), _sig_group(cluster, b), sample_bytes(w))


@functools.lru_cache(maxsize=200_000)
def sync_s(cluster, w, train: tuple[int, ...], gen: tuple[int, ...]) -> float:
    return weight_sync_s(cluster, w, _sig_group(cluster, train), _sig_group(cluster, gen), False)


def iteration_s(cluster, w, configs: list[GroupConfig]) -> float:
    """The cost model's iteration time from configured groups (equals cost.estimate on the built plan)."""
    gen = next(c for c in configs if "actor_gen" in c.tasks)
    train = next(c for c in configs if "actor_train" in c.tasks)
    transfer = max([transfer_s(cluster, w, gen.counts, c.counts) for c in configs if c is not gen], default=0.0)
    sync = gen.local_sync_s if gen is train else sync_s(cluster, w, train.counts, gen.counts) + train.gather_s
    return aggregate(w.mode, [dict(c.seconds) for c in configs], transfer, sync)[0]


def best_combination(cluster, w, options: list[tuple[GroupConfig, ...]], exact: bool = False
                     ) -> tuple[float, list[GroupConfig]]:
    """(iteration seconds, one configuration per group) from each group's `configurations`: with `exact`, the best
    of every combination (the exhaustive oracle's rule, which the ILP matches); else each group's first (the
    shortest group_seconds), then one group at a time changed to any alternative that shortens the iteration,
    until none does."""
    configs = [o[0] for o in options]
    best = iteration_s(cluster, w, configs)
    if all(len(o) == 1 for o in options):
        return best, configs
    if exact:
        for combo in itertools.product(*options):
            if (t := iteration_s(cluster, w, list(combo))) < best * BETTER:
                best, configs = t, list(combo)
        return best, configs
    improved = True
    while improved:
        improved = False
        for i, o in enumerate(options):
            for alt in o:
                trial = [*configs[:i], alt, *configs[i + 1:]]
                if (t := iteration_s(cluster, w, trial)) < best * BETTER:
                    best, configs, improved = t, trial, True
    return best, configs


def build_plan(cluster: ClusterSpec, configs: list[GroupConfig]) -> Plan:
    offsets = [0] * len(pools(cluster))
    return Plan(tuple(Group(c.tasks, gpu_ids(cluster, c.counts, offsets), c.parallelism, c.data_split, c.swap)
                      for c in configs))


def compositions(total: int, parts: int):
    """All ways to give `parts` groups non-negative counts summing to at most `total`."""
    for cut in itertools.combinations(range(total + parts), parts):
        prev, out = -1, []
        for c in cut:
            out.append(c - prev - 1)
            prev = c
        yield tuple(out)


# what the caches above hold was priced from the operator tables: forgotten when they are read again
for _cache in (configurations, _ranked, transfer_s, sync_s):
    optables.on_reload(_cache.cache_clear)
