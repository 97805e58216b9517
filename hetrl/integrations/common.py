"""What every engine export shares: the plan "as the engine runs it", the gaps (what the engine cannot express,
each naming the plan or workload field), the canonical GPU choice of a resource pool, and writing the export
folder all at once (a temporary folder renamed into place, so a refused or failed export leaves nothing).

An engine module (verl.py, openrlhf.py) provides `view(cluster, w, plan) -> View` (the plan and workload the
engine will really run, with the gaps) and `render(view, cluster) -> {file name: text}`. `export` checks the
plan first (structure and memory, through the planner's one validation layer), so a bad plan is refused before
anything is written; it then predicts both plans with the one cost model and writes the files.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import yaml

from hetrl.fsmode import as_open_would
from hetrl.planner import evaluate
from hetrl.planner.plan import BOUND, Group, Parallelism, Plan
from hetrl.planner.spec import ClusterSpec, WorkloadSpec
from hetrl.schema import InputError


@dataclass(frozen=True)
class Gap:
    field: str      # the plan or workload field the engine cannot honour, e.g. "groups[1].data_split"
    text: str       # what the engine does instead

    def line(self) -> str:
        return f"{self.field}: {self.text}"


@dataclass
class View:
    engine: str
    plan: Plan                  # the plan as the engine runs it
    workload: WorkloadSpec      # the workload as the engine runs it (batch rounding, no DualKV, ...)
    gaps: list[Gap]
    settings: dict = field(default_factory=dict)   # engine-specific choices the renderer needs


class Draft:
    """A mutable copy of a plan's groups that an engine view edits: tasks move between groups, degrees and
    memory strategies change, and every change that alters the plan is recorded as a gap."""

    def __init__(self, plan: Plan):
        self.groups = [{"tasks": list(g.tasks), "gpus": list(g.gpus), "par": dict(g.parallelism),
                        "swap": g.swap, "split": g.data_split, "src": i} for i, g in enumerate(plan.groups)]
        self.gaps: list[Gap] = []
        for g in self.groups:   # the exports write tp / pp / dp and memory options; the #37 dimensions not yet
            for task, p in list(g["par"].items()):
                if not p.default_layout:
                    self.set_par(task, dataclasses.replace(p, ep=1, sp=1, vpp=1, engine=None, dp=p.dp * p.sp),
                                 "ep, sp, vpp and engine are not exported yet: set expert / sequence parallelism "
                                 "and virtual stages in the engine's config by hand")

    def where(self, task: str) -> dict | None:
        return next((g for g in self.groups if task in g["tasks"]), None)

    def name(self, g: dict) -> str:
        return f"groups[{g['src']}]"

    def gap(self, fieldname: str, text: str) -> None:
        if not any(x.field == fieldname and x.text == text for x in self.gaps):
            self.gaps.append(Gap(fieldname, text))

    def move(self, task: str, to: dict, why: str) -> None:
        src = self.where(task)
        if src is to:
            return
        self.gap(f"{self.name(src)}.tasks", f"{task} runs with {to['tasks'][0]} on {self.name(to)}'s GPUs: {why}")
        old = src["par"].pop(task)
        src["tasks"].remove(task)
        to["tasks"].append(task)
        to["par"][task] = model_parallel(old, len(to["gpus"]))

    def set_par(self, task: str, new: Parallelism, why: str = "") -> None:
        g = self.where(task)
        old = g["par"][task]
        if new != old:
            self.gap(f"{self.name(g)}.parallelism.{task}", f"{_show(old)} runs as {_show(new)}"
                     + (f" ({why})" if why else ""))
            g["par"][task] = new

    def drop_empty(self, cluster: ClusterSpec) -> None:
        for g in [g for g in self.groups if not g["tasks"]]:
            self.gap(f"{self.name(g)}.gpus", f"no task is left on these {len(g['gpus'])} GPUs "
                     f"({_nodes_text(cluster, g['gpus'])}); they stay idle")
            self.groups.remove(g)

    def plan(self) -> Plan:
        return Plan(tuple(Group(tuple(g["tasks"]), tuple(g["gpus"]), tuple((t, g["par"][t]) for t in g["tasks"]),
                                g["split"], g["swap"]) for g in self.groups))


def model_parallel(p: Parallelism, n: int) -> Parallelism:
    """`p`'s tensor and pipeline degrees on n GPUs (data parallel over the rest) when they divide n, else pure
    data parallelism; default memory strategy."""
    tp, pp = (p.tp, p.pp) if n % (p.tp * p.pp) == 0 else (1, 1)
    return Parallelism(tp, pp, n // (tp * pp))


def pool_layout(counts: dict[str, int]) -> tuple[int, int]:
    """(nnodes, n_gpus_per_node) of an engine's "N nodes x M GPUs" pool shape; an uneven spread is one 'node' of
    all GPUs (verl's launcher then carries the real per-node counts)."""
    c = set(counts.values())
    return (len(counts), c.pop()) if len(c) == 1 else (1, sum(counts.values()))


def cheapest(cluster: ClusterSpec, variants: list[View]) -> View:
    """Of the ways an engine can run a plan, the one that fits with the least predicted time per prompt; the first
    (the engine's plain way) when none fits."""
    best, cost = None, math.inf
    for v in variants:
        e = evaluate(cluster, v.workload, v.plan)
        if e.feasible and e.iteration_time_s / v.workload.prompts_per_step < cost - 1e-12:
            best, cost = v, e.iteration_time_s / v.workload.prompts_per_step
    return best or variants[0]


def _show(p: Parallelism) -> str:
    out = f"tp {p.tp} pp {p.pp} dp {p.dp}"
    if not p.default_memory:
        out += f" zero {p.zero} offload {p.offload} recompute {str(p.recompute).lower()}"
    for key, default in (("ep", 1), ("sp", 1), ("vpp", 1), ("engine", None)):
        if getattr(p, key) != default:
            out += f" {key} {getattr(p, key)}"
    return out


def _nodes_text(cluster: ClusterSpec, gpus) -> str:
    return ", ".join(f"{n} x{c}" for n, c in node_counts(cluster, gpus).items())


def node_counts(cluster: ClusterSpec, gpus) -> dict[str, int]:
    """GPUs per node, in the cluster's node order: what an engine's resource pool says of a GPU set."""
    counts = {n.name: 0 for n in cluster.nodes}
    for i in gpus:
        counts[cluster.gpus[i].node] += 1
    return {n: c for n, c in counts.items() if c}


def canonical_gpus(cluster: ClusterSpec, pools: list[dict[str, int]]) -> list[list[int]]:
    """The GPUs an engine gives pools that ask for {node: count}: ranks node by node in the cluster's order, and
    on a node shared by several pools the lowest free indices to the first pool. GPUs of one node are alike,
    so this choice is the engine's placement up to renaming."""
    free = {n.name: [g.id for g in cluster.gpus if g.node == n.name] for n in cluster.nodes}
    out = []
    for pool in pools:
        ids = []
        for node in (n.name for n in cluster.nodes):
            c = pool.get(node, 0)
            if c > len(free[node]):
                raise InputError(f"a pool asks for {c} GPUs on node {node}, which has {len(free[node])} left")
            ids += free[node][:c]
            free[node] = free[node][c:]
        unknown = set(pool) - set(free)
        if unknown:
            raise InputError(f"a pool names nodes not in cluster {cluster.name}: {sorted(unknown)}")
        out.append(ids)
    return out


def even_split_and_order(d: Draft, cluster: ClusterSpec, engine: str) -> None:
    """Engines split a batch evenly over a role's ranks and number ranks node by node (one GPU type per pool
    assumed): the plan's uneven split and its shard order inside a group are not expressible."""
    pools = [node_counts(cluster, g["gpus"]) for g in d.groups]
    for g, ids in zip(d.groups, canonical_gpus(cluster, pools)):
        types = sorted({cluster.gpus[i].type.name for i in g["gpus"]})
        if len(types) > 1:
            if g["split"] == "by_speed":
                d.gap(f"{d.name(g)}.data_split", f"by_speed: {engine} splits each batch evenly over a role's "
                      f"ranks, so the slowest of {', '.join(types)} sets the pace")
            d.gap(f"{d.name(g)}.gpus", f"mixes {', '.join(types)} in one pool; {engine} assumes one GPU type "
                  "per pool (the ranks still run where the pool is)")
        g["split"] = "even"
        if [cluster.gpus[i].node for i in g["gpus"]] != [cluster.gpus[i].node for i in ids]:
            d.gap(f"{d.name(g)}.gpus", f"the shard order (which GPU holds which shard) is {engine}'s: ranks go "
                  "node by node in the cluster's order")
        g["gpus"] = ids


def bind_inference(d: Draft) -> None:
    """Old log-probs and critic values run in the training worker, with its parallelism."""
    for infer, train in BOUND.items():
        g = d.where(train)
        if g is not None and infer in g["tasks"]:
            d.set_par(infer, dataclasses.replace(g["par"][train], recompute=True),
                      f"{infer} runs in the {train} workers")


def even_batches(w: WorkloadSpec, plan: Plan, splitting: tuple[str, ...], keep_micro: bool = True) -> tuple[int, int]:
    """(prompts per step, responses per micro-batch) an engine that splits batches evenly can run: the ranks of
    every task in `splitting` divide each mini-batch, and a trainer rank's share is a whole number of
    micro-batches. With `keep_micro`, the smallest count that keeps the workload's micro-batch within a quarter
    more prompts, if any; else the smallest count, with the largest micro-batch up to the workload's that fits."""
    dps = [plan.group_of(t).par(t).dp for g in plan.groups for t in g.tasks
           if t in splitting]
    lcm = math.lcm(*dps)
    k, n = w.optimizer_steps, w.responses_per_prompt
    prompts = w.prompts_per_step
    trainers = [plan.group_of(t).par(t).dp for g in plan.groups for t in g.tasks
                if t in ("actor_train", "critic_train")]

    def fits(p: int, micro: int = 1) -> bool:
        return p % k == 0 and (p // k * n) % lcm == 0 and all((p // k * n // dp) % micro == 0 for dp in trainers)

    for p in range(w.prompts_per_step, w.prompts_per_step + max(1, w.prompts_per_step // 4) + 1):
        if keep_micro and fits(p, w.micro_batch_responses):
            return p, w.micro_batch_responses
    prompts = w.prompts_per_step
    while not fits(prompts):
        prompts += 1
    share = math.gcd(*(prompts // k * n // dp for dp in trainers))
    micro = max(m for m in range(1, min(w.micro_batch_responses, share) + 1) if share % m == 0)
    return prompts, micro


def engine_workload(d: Draft, w: WorkloadSpec, plan: Plan, engine: str, splitting: tuple[str, ...],
                    keep_micro: bool, mode: str) -> WorkloadSpec:
    """The workload as an engine runs it: no DualKV, bf16, the batch rounded for even splits (even_batches); each
    change recorded as a gap on its workload field."""
    if w.turns > 1:
        d.gap("workload.turns", f"{w.turns} turns with tool results" + (f", forking into {w.branches}"
              if w.branches > 1 else "") + f": the export configures {engine}'s single-turn rollout (no agent loop "
              f"or tools); each of a task's {w.leaves} leaves runs as one response of its {w.completion_tokens.max} "
              "tokens")
        w = dataclasses.replace(w, turns=1, tool_tokens=None, tool_latency_s=0.0, branches=1, max_leaves=None,
                                responses_per_prompt=w.leaves, response_tokens=w.completion_tokens)
    if w.rollout_batch_multiplier > 1:
        d.gap("workload.rollout_batch_multiplier", f"{w.rollout_batch_multiplier:g}x the prompts generated and groups "
              f"whose rewards do not vary dropped (DAPO's dynamic sampling): the export does not configure it, so "
              f"{engine} trains every group it generates")
        w = dataclasses.replace(w, rollout_batch_multiplier=1.0)
    if w.dualkv:
        d.gap("workload.dualkv", f"{engine} computes each response with its own copy of the prompt")
    if w.precision != "bf16":
        d.gap("workload.precision", f"{w.precision}: {engine} trains in bf16 mixed precision")
    prompts, micro = even_batches(w, plan, splitting, keep_micro)
    if prompts != w.prompts_per_step:
        d.gap("workload.prompts_per_step", f"{w.prompts_per_step} -> {prompts}: {engine} splits each batch evenly "
              "over a role's ranks, so the batch is rounded up to a count they all divide")
    if micro != w.micro_batch_responses:
        d.gap("workload.micro_batch_responses", f"{w.micro_batch_responses} -> {micro}: a rank's share of a "
              "mini-batch must be a whole number of micro-batches")
    return dataclasses.replace(w, mode=mode, dualkv=False, precision="bf16", prompts_per_step=prompts,
                               micro_batch_responses=micro)


# ---------------------------------------------------------------------------------------------- export


def check_plan(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan) -> float:
    """The plan's predicted seconds per iteration, or refuse it (it cannot run as given)."""
    e = evaluate(cluster, w, plan)
    if not e.feasible:
        raise InputError(f"the plan cannot run, nothing was exported: {e.reason}")
    return e.iteration_time_s


def predict(cluster: ClusterSpec, view: View) -> tuple[float | None, str]:
    e = evaluate(cluster, view.workload, view.plan)
    return (e.iteration_time_s, "") if e.feasible else (None, e.reason)


def workload_dict(w: WorkloadSpec, original: dict) -> dict:
    """The workload YAML of `w`, keeping the user's model entries (presets stay presets)."""
    out = dict(original)
    for f in ("algorithm", "mode", "prompts_per_step", "responses_per_prompt", "dualkv", "precision",
              "micro_batch_responses", "optimizer_steps", "old_logprob_share", "rollout_logprob_pass"):
        out[f] = getattr(w, f)
    out["prompt_tokens"] = {"max": w.prompt_tokens.max, "mean": w.prompt_tokens.mean}
    out["response_tokens"] = {"max": w.response_tokens.max, "mean": w.response_tokens.mean}
    for f in ("turns", "tool_tokens", "tool_latency_s", "branches", "max_leaves"):   # an export's runs one turn
        out.pop(f, None)
    if w.turns > 1:
        out |= {"turns": w.turns, "tool_tokens": {"max": w.tool_tokens.max, "mean": w.tool_tokens.mean},
                "tool_latency_s": w.tool_latency_s, "branches": w.branches, "max_leaves": w.max_leaves}
    return out


def check_out_dir(out_dir: str) -> None:
    """Refuse an --out that is not a new (or empty) folder in an existing, writable parent: before any search."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise InputError(f"--out {out_dir} exists and is not an empty folder; give a new folder name")
    if not os.path.isdir(parent):
        raise InputError(f"--out {out_dir}: the folder {parent} does not exist; create it first (mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"--out {out_dir}: the folder {parent} is not writable by this user")


def write_folder(out_dir: str, files: dict[str, str], executable: tuple[str, ...] = ()) -> None:
    """Write every file into a fresh temporary folder next to `out_dir`, then move it into place. An existing
    non-empty `out_dir` is refused (an export never overwrites a user's files)."""
    check_out_dir(out_dir)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".hetrl-export.")
    as_open_would(tmp, directory=True)
    try:
        for name, text in files.items():
            path = os.path.join(tmp, name)
            with open(path, "w") as f:
                f.write(text)
            if name in executable:
                os.chmod(path, 0o755)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def common_files(cluster_yaml: dict, workload_yaml: dict, plan: Plan, view: View, cluster: ClusterSpec,
                 report: dict) -> dict[str, str]:
    """The files every export carries: the inputs, the plan as given and as the engine runs it, the report."""
    return {
        "cluster.yaml": yaml.safe_dump(cluster_yaml, sort_keys=False),
        "workload.yaml": yaml.safe_dump(workload_yaml, sort_keys=False),
        "plan.json": json.dumps(plan.to_dict(cluster), indent=2) + "\n",
        "engine_plan.json": json.dumps(view.plan.to_dict(cluster), indent=2) + "\n",
        "engine_workload.yaml": yaml.safe_dump(workload_dict(view.workload, workload_yaml), sort_keys=False),
        "report.json": json.dumps(report, indent=2) + "\n",
    }


def report_of(view: View, plan_s: float, engine_s: float | None, engine_why: str) -> dict:
    return {"engine": view.engine, "plan_iteration_time_s": plan_s, "engine_iteration_time_s": engine_s,
            "engine_infeasible": engine_why or None, "gaps": [dataclasses.asdict(g) for g in view.gaps]}


def summary(view: View, plan_s: float, engine_s: float | None, engine_why: str, out_dir: str) -> str:
    """What `hetrl plan --export` prints: where the files are, the two predictions, every gap."""
    lines = [f"exported for {view.engine} to {out_dir} (see its README.md)",
             f"  predicted: {plan_s:.1f} s per iteration as planned; "
             + (f"{engine_s:.1f} s as {view.engine} runs it" if engine_s is not None
                else f"as {view.engine} runs it the plan does not fit: {engine_why}")]
    if view.gaps:
        lines.append(f"  {len(view.gaps)} plan field(s) {view.engine} cannot express as given:")
        lines += [f"  - {g.line()}" for g in view.gaps]
    return "\n".join(lines)
