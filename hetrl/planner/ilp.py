"""Exact plan search as a mixed-integer program, solved by HiGHS (highspy, the open-source MIP solver).

It searches the same space as exhaustive search (space.py): every group configuration a grouping
can use is enumerated once and costed by the cost model, so the only non-linear parts left are the
max over groups and the terms between two groups (sample transfer, weight sync), which depend on
the pair of group *signatures*: sample transfer is linearised per generation signature with a big-M row
(tight once generation's signature is fixed), weight sync with product variables. Sections:

  1. candidates  x[b, k]: task block b runs as its k-th candidate, a configuration on some GPU counts
                 (memory-feasible; space.configurations: the shortest on those counts and its trade-offs)
  2. variables   z[G] grouping chosen; x[b, k] binary; u[st, sg] >= 0 sync products; T* continuous
  3. constraints C1 one grouping; C2 each block of it gets one configuration; C3 pool capacity;
                 C4 Y[s] = generation-side x of signature s; transfer >= sum_sb t(s, sb) y[b, sb] - M (1 - Y[s])
                    for every block b apart from generation; sync products u >= Y_train + Y_gen - 1;
                 C5 phase times >= each group's share (sync) / T >= each group's busy time (async)
  4. objective   sync: gen + transfer + inference phase + training phase + weight sync
                 async: T = max(busiest group, transfer, weight sync)
  5. decode      the chosen configurations -> Plan; its cost-model time must equal the objective.
"""

from __future__ import annotations

import itertools
import math
import random
import time

from .cost import INFER_TASKS, TRAIN_TASKS
from .search import Deadline, SearchResult
from .space import build_plan, configurations, groupings, iteration_s, pools, signature, sync_s, transfer_s
from .spec import ClusterSpec, WorkloadSpec

MAX_CANDIDATES = 200_000


ENUMERATION_SHARE = 0.6     # of the time limit, at most, for costing candidates; the solver gets the rest
MIN_SOLVE_S = 1.0


def ilp(cluster: ClusterSpec, w: WorkloadSpec, time_limit_s: float = 120.0) -> SearchResult:
    import highspy

    deadline = Deadline(time_limit_s)
    t0 = deadline.start
    all_groupings = groupings(w)
    blocks = sorted({b for g in all_groupings for b in g})
    count_space = [c for c in itertools.product(*(range(p.steps + 1) for p in pools(cluster))) if any(c)]
    total = len(blocks) * len(count_space)
    if total > MAX_CANDIDATES:
        raise ValueError(f"the ILP would enumerate {total:,} group configurations "
                         f"(limit {MAX_CANDIDATES:,}) on {len(cluster.gpus)} GPUs; use method=hybrid")

    # 1. candidates: every (block, counts), costed by the cost model. Counts in a fixed shuffled order, all
    #    blocks per counts (largest first), the whole cluster first: if the time limit cuts the enumeration
    #    short, the blocks have a sample of the space and the one-group plan on every GPU is among them.
    order = count_space[-1:] + random.Random(0).sample(count_space[:-1], len(count_space) - 1)
    enumeration_end = t0 + ENUMERATION_SHARE * time_limit_s
    cands: dict = {b: [] for b in blocks}
    done = 0
    by_size = sorted(blocks, key=lambda b: -len(b))   # the whole workload first: a one-group plan always exists
    for c in order:
        for b in by_size:
            if time.perf_counter() > enumeration_end:
                break
            cands[b].extend(configurations(cluster, w, b, c))
            done += 1
        else:
            continue
        break
    stopped = (deadline.stopped(f"costing {done:,} of {total:,} group configurations; the plan is the best over "
                                "those") if done < total else None)

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", max(MIN_SOLVE_S, deadline.left_s()))
    h.setOptionValue("mip_rel_gap", 1e-6)
    h.setOptionValue("random_seed", 0)
    inf = highspy.kHighsInf

    # 2. variables --------------------------------------------------------------------------------
    z = {g: h.addBinary() for g in all_groupings}
    x = {(b, i): h.addBinary() for b in blocks for i in range(len(cands[b]))}

    # C1, C2, C3
    h.addConstr(sum(z.values()) == 1)
    for b in blocks:
        h.addConstr(sum(x[b, i] for i in range(len(cands[b]))) - sum(z[g] for g in all_groupings if b in g) == 0)
    for j, p in enumerate(pools(cluster)):
        terms = [cfg.counts[j] * x[b, i] for b in blocks for i, cfg in enumerate(cands[b]) if cfg.counts[j]]
        if terms:
            h.addConstr(sum(terms) <= p.steps)

    # C4: signature indicators and pair products. The terms between two groups depend only on the two groups'
    #     signatures, and exactly one block holding actor_gen is chosen, so one indicator per generation-side
    #     signature serves every block holding it: Y[s] = sum of x over generation blocks of signature s.
    sigs = {b: {} for b in blocks}
    for b in blocks:
        for i, cfg in enumerate(cands[b]):
            sigs[b].setdefault(signature(cluster, cfg.counts), []).append((i, cfg.counts))

    def y(b, s):
        return sum(x[b, i] for i, _ in sigs[b][s])

    def indicators(pred):
        """Signature -> (indicator expression over the blocks satisfying pred, counts with that signature)."""
        out = {}
        for b in blocks:
            if pred(b):
                for s, members in sigs[b].items():
                    expr, counts = out.get(s, (0, members[0][1]))
                    out[s] = (expr + y(b, s), counts)
        return out

    def products(left, right):
        """u >= L + R - 1 for every pair of signatures: u is 1 when both are chosen."""
        out = []
        for (ls, (le, lc)), (rs, (re_, rc)) in itertools.product(left.items(), right.items()):
            u = h.addVariable(lb=0, ub=1)
            h.addConstr(u - le - re_ >= -1)
            out.append((u, lc, rc))
        return out

    gen_side = indicators(lambda b: "actor_gen" in b)
    # Samples from generation to every other chosen block: for each generation signature sg and block b apart from
    # generation, transfer >= sum_sb transfer(sg, sb) * y(b, sb) - M (1 - Y[sg]), M = the largest of those. Exact
    # for a chosen sg (Y = 1) and vacuous otherwise; no product variables, and a tighter relaxation than products.
    transfer_rows = []
    for b in blocks:
        if "actor_gen" in b:
            continue
        for sg, (ye, cg) in gen_side.items():
            terms = [(transfer_s(cluster, w, cg, m[0][1]), y(b, sb)) for sb, m in sigs[b].items()]
            big = max((t for t, _ in terms), default=0.0)
            if big > 0:
                transfer_rows.append((sum(t * e for t, e in terms if t) + big * ye, big))
    # weight sync between separate groups: train-side blocks without generation, generation-side without training
    syncs = [(u, sync_s(cluster, w, ct, cg)) for u, ct, cg in
             products(indicators(lambda b: "actor_train" in b and "actor_gen" not in b),
                      indicators(lambda b: "actor_gen" in b and "actor_train" not in b))]
    local_sync = sum(cfg.local_sync_s * x[b, i] for b in blocks for i, cfg in enumerate(cands[b]) if cfg.local_sync_s)
    # ZeRO-3 actor training apart from generation gathers its shards before sending (in local_sync when together)
    gather = sum(cfg.gather_s * x[b, i] for b in blocks if "actor_gen" not in b
                 for i, cfg in enumerate(cands[b]) if cfg.gather_s)

    # C5 + 4. objective ---------------------------------------------------------------------------
    def share(b, tasks):
        return sum(cfg.time(tasks) * x[b, i] for i, cfg in enumerate(cands[b]) if cfg.time(tasks))

    if w.mode == "sync":
        t_tr, t_inf, t_train = (h.addVariable(lb=0, ub=inf) for _ in range(3))
        for expr, big in transfer_rows:
            h.addConstr(t_tr - expr >= -big)
        for b in blocks:
            if any(t in INFER_TASKS for t in b):
                h.addConstr(t_inf - share(b, INFER_TASKS) >= 0)
            if any(t in TRAIN_TASKS for t in b):
                h.addConstr(t_train - share(b, TRAIN_TASKS) >= 0)
        gen = sum(share(b, ("actor_gen",)) for b in blocks if "actor_gen" in b)
        objective = gen + t_tr + t_inf + t_train + sum(s * u for u, s in syncs) + local_sync + gather
    else:
        objective = h.addVariable(lb=0, ub=inf)
        for b in blocks:
            h.addConstr(objective - share(b, b) >= 0)
        for expr, big in transfer_rows:
            h.addConstr(objective - expr >= -big)
        for u, s in syncs:   # the chosen pair's sync plus its gather; for other pairs this only says T >= gather
            h.addConstr(objective - s * u - gather >= 0)
        if not isinstance(local_sync, (int, float)):
            h.addConstr(objective - local_sync >= 0)
    h.minimize(objective)

    # 5. decode -----------------------------------------------------------------------------------
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    chosen = [b for b in blocks for i in range(len(cands[b])) if h.val(x[b, i]) > 0.5]
    if status == "Time limit reached":
        stopped = stopped or deadline.stopped(f"{info.mip_node_count:,} branch-and-bound nodes (gap "
                                              f"{info.mip_gap:.2%})")
    if not chosen:
        return SearchResult("ilp", None, math.inf, time.perf_counter() - t0, info.mip_node_count, None, stopped)
    configs = [cands[b][i] for b in blocks for i in range(len(cands[b])) if h.val(x[b, i]) > 0.5]
    seconds = iteration_s(cluster, w, configs)
    assert math.isclose(seconds, info.objective_function_value, rel_tol=1e-6, abs_tol=1e-6), \
        f"ILP objective {info.objective_function_value} != cost model {seconds} ({status})"
    # the gap is the solver's over the candidates it was given: no bound on the whole space if they were cut
    gap = None if done < total else 0.0 if status == "Optimal" else float(info.mip_gap)
    return SearchResult("ilp", build_plan(cluster, configs), seconds, time.perf_counter() - t0,
                        int(info.mip_node_count), gap, stopped)
