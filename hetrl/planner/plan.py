"""Execution plans: task groups on disjoint GPU sets, TP/PP/DP per task, and the shard -> GPU map.

A group's GPU list is ordered; shard (dp rank r, pipeline stage s, tensor rank t) of a task with
degrees (tp, pp, dp) runs on gpus[(r * pp + s) * tp + t]. The order is therefore the fine-grained
placement: reordering a group's GPUs moves shards between GPUs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from hetrl.schema import (
    InputError,
    check,
    choice_error,
    from_mapping,
    read_json,
    reject_unknown,
    require_mapping,
    rule,
    show,
)

from .spec import ClusterSpec, WorkloadSpec

ROLE_OF_TASK = {"actor_gen": "actor", "actor_infer": "actor", "actor_train": "actor", "ref_infer": "reference",
                "reward_infer": "reward", "critic_infer": "critic", "critic_train": "critic"}
TASKS = ("actor_gen", "actor_infer", "ref_infer", "reward_infer", "critic_infer", "actor_train", "critic_train")
# Tasks that read the same weights as a training task run where it runs (old log-probs on the trainer,
# critic values on the critic trainer), as in verl; the planner moves them together.
BOUND = {"actor_infer": "actor_train", "critic_infer": "critic_train"}
# How a group's DP replicas share its batch: in proportion to their speed (HetRL's load balancing), or
# evenly, as verl / Megatron / vLLM data parallelism does (they assume identical GPUs).
DATA_SPLITS = ("by_speed", "even")
OFFLOADS = ("none", "optimizer", "params")
# How a training or log-prob task runs where the two styles differ (memory and time); absent: the model before
# engines were told apart (FSDP-style activations, no pipeline in-flight micro-batches)
ENGINES = ("fsdp", "megatron")


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
    """Degrees of one task, and its memory strategy (training and inference tasks; generation keeps defaults):
    zero 1 | 2 | 3 (3 = FSDP full sharding of parameters, gradients and optimizer states over the DP group),
    offload none | optimizer | params (to host memory; params needs zero 3), recompute (activation
    checkpointing: +1 forward of FLOPs, activations of one layer instead of all)."""

    tp: int = rule(1, ge=1)
    pp: int = rule(1, ge=1)
    dp: int = rule(1, ge=1)
    zero: int = rule(1, choices=(1, 2, 3))
    offload: str = rule("none", choices=OFFLOADS)
    recompute: bool = True
    # expert parallelism (MoE): the routed experts split over `ep` ranks of one pipeline stage's tp*sp*dp GPUs
    # (Megatron's rule with expert tensor parallelism 1: ep divides tp*sp*dp and the experts); the experts are not
    # TP-sharded when ep > 1. Tokens reach their experts by an all-to-all (dispatch) and come back (combine)
    ep: int = rule(1, ge=1)
    # sequence parallelism (Ulysses, verl's ulysses_sequence_parallel_size; Megatron's context parallelism sizes the
    # same way): each sequence split over `sp` GPUs, heads exchanged by all-to-alls; size = tp * sp * pp * dp
    sp: int = rule(1, ge=1)
    # virtual pipeline stages per GPU (Megatron's interleaved 1F1B): bubble (pp-1)/(vpp*m), pp hops x vpp
    vpp: int = rule(1, ge=1)
    engine: str | None = rule(None, choices=ENGINES)

    def __post_init__(self):
        check(self)
        if self.offload == "params" and self.zero != 3:
            raise ValueError(f"offload: params needs zero: 3 (parameters are offloaded shard by shard, as FSDP and "
                             f"ZeRO-3 do), got zero: {self.zero}; set zero: 3 or offload: optimizer")
        if self.ep > 1 and (self.tp * self.sp * self.dp) % self.ep:
            raise ValueError(f"ep {self.ep} must divide tp*sp*dp = {self.tp}*{self.sp}*{self.dp} = "
                             f"{self.tp * self.sp * self.dp} (the GPUs of one pipeline stage the experts are "
                             "spread over); "
                             f"valid: {', '.join(str(e) for e in _divisors(self.tp * self.sp * self.dp))}")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp {self.vpp} (virtual pipeline stages) needs pp > 1; set vpp: 1 or pp >= 2")

    @property
    def default_memory(self) -> bool:
        return self.zero == 1 and self.offload == "none" and self.recompute

    @property
    def default_layout(self) -> bool:
        """None of the dimensions added for MoE, long sequences and Megatron is set."""
        return self.ep == 1 and self.sp == 1 and self.vpp == 1 and self.engine is None

    @property
    def size(self) -> int:
        return self.tp * self.sp * self.pp * self.dp

    @property
    def replicas(self) -> int:
        """Data-parallel ranks of one (stage, tensor slice): dp x sp (FSDP and Megatron's distributed optimizer
        shard over both; the gradient reduction spans both)."""
        return self.dp * self.sp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Group:
    tasks: tuple[str, ...]
    gpus: tuple[int, ...]                       # GPU ids in shard order
    parallelism: tuple[tuple[str, Parallelism], ...]
    data_split: str = "by_speed"                # one of DATA_SPLITS
    swap: bool = False                          # time-shared colocation: roles idle in a phase wait in host memory

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
             "parallelism": {t: _par_dict(p) for t, p in g.parallelism},
             "data_split": g.data_split, "swap": g.swap}
            for g in self.groups]}


GROUP_KEYS = ("tasks", "gpus", "parallelism", "data_split", "swap")


def _par_dict(p: Parallelism) -> dict:
    out = {"tp": p.tp, "pp": p.pp, "dp": p.dp}
    if not p.default_memory:
        out |= {"zero": p.zero, "offload": p.offload, "recompute": p.recompute}
    for key, default in (("ep", 1), ("sp", 1), ("vpp", 1), ("engine", None)):
        if getattr(p, key) != default:
            out[key] = getattr(p, key)
    return out


def plan_from_dict(data: dict, cluster: ClusterSpec, workload: WorkloadSpec, where: str = "plan") -> Plan:
    """Read a plan written by `hetrl plan --json` (or by hand) and check it against the cluster and workload.
    A whole `hetrl plan --json` report is accepted too (its `plan`)."""
    plan = plan_shape(data, where, {g.name: g.id for g in cluster.gpus}, cluster)
    try:
        check_structure(plan, cluster, workload)
    except InputError:
        raise
    except ValueError as e:
        raise InputError(f"{where}: {e}", located=True) from None
    return plan


def load_plan(path: str, cluster: ClusterSpec, workload: WorkloadSpec) -> Plan:
    """A plan JSON file (`hetrl plan --out`, or written by hand), checked against the cluster and workload."""
    return plan_from_dict(read_json(path, "plan JSON"), cluster, workload, path)


def plan_shape(data, where: str, gpu_ids: dict[str, int] | None = None, cluster: ClusterSpec | None = None) -> Plan:
    """The plan's own form (keys, types, task names, degrees); GPU names are resolved when `gpu_ids` is given
    (else numbered in order of appearance: enough to check a plan file without its cluster)."""
    data = require_mapping(data, where)
    if "plan" in data and "groups" not in data:      # a whole `hetrl plan --json` report
        data, where = require_mapping(data["plan"], f"{where}: plan"), f"{where}: plan"
    elif "groups" not in data and {"iteration_time_s", "baselines", "breakdown"} & data.keys():
        raise InputError(f"{where}: this is a `hetrl plan --out` report without its 'plan' key, which holds the "
                         "plan ('groups'); write the report again, or give a plan JSON of 'groups'", located=True)
    reject_unknown(data, ("groups",), where)
    if not isinstance(data.get("groups"), list) or not data["groups"]:
        raise InputError(f"{where}: a plan is a mapping with a non-empty list under 'groups', got "
                         f"{show(data.get('groups'))}", located=True)
    names: dict[str, int] = {}
    groups = []
    for i, g in enumerate(data["groups"]):
        at = f"{where}: groups[{i}]"
        g = require_mapping(g, at)
        reject_unknown(g, GROUP_KEYS, at)
        tasks, gpus = g.get("tasks"), g.get("gpus")
        if not isinstance(tasks, list) or not tasks or not all(isinstance(t, str) for t in tasks):
            raise InputError(f"{at}.tasks must be a non-empty list of task names ({', '.join(TASKS)}), got "
                             f"{show(tasks)}", located=True)
        for t in tasks:
            if t not in TASKS:
                raise InputError(f"{at}.tasks: {choice_error('a task', t, TASKS)}", located=True)
        if len(set(tasks)) != len(tasks):
            raise InputError(f"{at}.tasks names a task twice: {tasks}", located=True)
        if not isinstance(gpus, list) or not gpus or not all(isinstance(n, str) for n in gpus):
            raise InputError(f"{at}.gpus must be a non-empty list of GPU names (<node>:<index>), got {show(gpus)}",
                             located=True)
        ids = []
        for name in gpus:
            if gpu_ids is None:
                ids.append(names.setdefault(name, len(names)))
            elif name not in gpu_ids:
                example = cluster.gpus[0].name if cluster else "node:0"
                raise InputError(f"{at}.gpus: GPU {name!r} is not in cluster {cluster.name if cluster else ''} "
                                 f"(GPUs are named <node>:<index>, e.g. {example})", located=True)
            else:
                ids.append(gpu_ids[name])
        par_data = require_mapping(g.get("parallelism", {}), f"{at}.parallelism")
        extra = set(par_data) - set(tasks)
        if extra:
            raise InputError(f"{at}.parallelism names {sorted(map(str, extra))}, which the group does not run "
                             f"(its tasks: {', '.join(tasks)})", located=True)
        par = []
        for t in tasks:
            if t not in par_data:
                raise InputError(f"{at}.parallelism has no entry for {t}; give {{tp, pp, dp}}", located=True)
            par.append((t, from_mapping(Parallelism, par_data[t], f"{at}.parallelism.{t}")))
        split = g.get("data_split", "by_speed")
        if split not in DATA_SPLITS:
            raise InputError(f"{at}: {choice_error('data_split', split, DATA_SPLITS)} (by_speed: replicas get data "
                             "in proportion to their speed; even: as verl does)", located=True)
        swap = g.get("swap", False)
        if not isinstance(swap, bool):
            raise InputError(f"{at}.swap must be true or false (time-shared colocation), got {show(swap)}",
                             located=True)
        for t, p in par:
            if t == "actor_gen" and not p.default_memory:
                raise InputError(f"{at}.parallelism.actor_gen: generation keeps its weights whole per TP shard; "
                                 "zero, offload and recompute apply to training and inference tasks", located=True)
            if t not in ("actor_train", "critic_train") and not p.recompute:
                raise InputError(f"{at}.parallelism.{t}: recompute applies to training tasks only", located=True)
        groups.append(Group(tuple(tasks), tuple(ids), tuple(par), split, swap))
    return Plan(tuple(groups))


def check_form(plan: Plan, gpu_name) -> None:
    """What a plan must hold whatever the cluster and workload: no task twice, disjoint GPU sets, tp*pp*dp = group
    size. `gpu_name`: GPU id -> its name, for the message."""
    got = [t for g in plan.groups for t in g.tasks]
    twice = sorted({t for t in got if got.count(t) > 1})
    if twice:
        raise ValueError(f"the plan must place each task once; it places {', '.join(twice)} more than once")
    used = [i for g in plan.groups for i in g.gpus]
    if len(used) != len(set(used)):
        dup = sorted({gpu_name(i) for i in used if used.count(i) > 1})
        raise ValueError(f"task groups must own disjoint GPUs; shared: {dup}")
    for g in plan.groups:
        for t, p in g.parallelism:
            if p.size != len(g.gpus):
                names, values = ("tp*pp*dp*sp", f"{p.tp}*{p.pp}*{p.dp}*{p.sp}") if p.sp > 1 else \
                    ("tp*pp*dp", f"{p.tp}*{p.pp}*{p.dp}")
                raise ValueError(f"{t}: {names} = {values} = {p.size} must equal the group's {len(g.gpus)} GPUs")


def check_structure(plan: Plan, cluster: ClusterSpec, workload: WorkloadSpec) -> None:
    """Every task exactly once, disjoint GPU sets, tp*pp*dp = group size (check_form), bound tasks together."""
    want = workload_tasks(workload)
    got = [t for g in plan.groups for t in g.tasks]
    check_form(plan, lambda i: cluster.gpus[i].name)
    if sorted(got) != sorted(want):
        raise ValueError(f"the plan must place each task once: {', '.join(want)}; it places {', '.join(got)}")
    for g in plan.groups:
        for t, p in g.parallelism:
            model = workload.model(ROLE_OF_TASK[t])
            if p.ep > 1 and (not model.experts or model.experts % p.ep):
                raise ValueError(f"{t}: ep {p.ep} needs an MoE whose experts it divides; {model.name} has "
                                 f"{model.experts} experts"
                                 + (" (valid ep: " + ", ".join(str(e) for e in _divisors(model.experts)
                                                               if (p.tp * p.sp * p.dp) % e == 0) + ")"
                                    if model.experts else " (a dense model: ep 1)"))
            if p.sp > 1 and model.heads % (p.tp * p.sp):
                raise ValueError(f"{t}: sp {p.sp} x tp {p.tp} must divide the {model.heads} attention heads (Ulysses "
                                 "splits heads over the sequence-parallel group)")
            if p.vpp > 1 and model.layers % (p.pp * p.vpp):
                raise ValueError(f"{t}: pp {p.pp} x vpp {p.vpp} must divide the {model.layers} layers (each virtual "
                                 "stage holds the same number of layers)")
            if t == "actor_gen" and (p.sp > 1 or p.vpp > 1 or p.engine is not None):
                raise ValueError(f"{t}: sp, vpp and engine apply to training and log-prob tasks; generation takes "
                                 "tp, pp, dp and ep")
    for t, owner in BOUND.items():
        if t in got and plan.group_of(t) is not plan.group_of(owner):
            raise ValueError(f"{t} reads {owner}'s weights and must be in its group")


def dumps(plan: Plan, cluster: ClusterSpec) -> str:
    return json.dumps(plan.to_dict(cluster), indent=2)
