"""hetrl plan -> OpenRLHF 0.11 (`python -m openrlhf.cli.train_ppo_ray`): the command line, and what it cannot say.

What OpenRLHF runs, and how a plan maps onto it (checked against OpenRLHF 0.11.2's own argument parser and the
checks that follow it in train_ppo_ray.py, run from its source by the tests):

- Placement. Each role asks Ray for `num_nodes x num_gpus_per_node` GPUs: the actor (training and old
  log-probs), the reference, the critic, the reward model, and `vllm.num_engines x vllm.tensor_parallel_size`
  for generation. Colocation is three switches: `train.colocate_actor_ref`, `train.colocate_critic_reward`
  and `train.colocate_all` (every model, vLLM included, on the actor's GPUs). A plan group OpenRLHF cannot
  form is re-formed the nearest way it can (the reference joins the actor, the reward model joins the
  critic); failing that, everything is colocated on the actor's GPUs. OpenRLHF cannot pin a role to nodes
  or GPU types: the prediction assumes Ray puts each role on the plan's GPUs, and the README says so.
- Parallelism. One DeepSpeed config for every DeepSpeed model: one ZeRO stage (`ds.zero_stage`), one tensor
  parallel size (`ds.tensor_parallel_size`, AutoTP), Adam offload for both trainers (`ds.adam_offload`), and
  gradient checkpointing from `actor.gradient_checkpointing_enable` for actor and critic. There is no
  pipeline parallelism: a plan's pipeline stages become data-parallel ranks under ZeRO-3. The reference and
  reward model run under ZeRO-3 when the stage is 3 (else whole), with `ref.offload` / `reward.offload`.
  vLLM has tensor parallelism only.
- Swap: `vllm.enable_sleep` + `ds.enable_sleep`, which OpenRLHF allows with `train.colocate_all` only.
- Async (`train.async_enable`) does not colocate vLLM with the actor, so a colocated plan runs sync.
- Batches split evenly over ranks (the prompts per step are rounded up as for verl); no DualKV.
"""

from __future__ import annotations

import shlex

from hetrl.planner.plan import Parallelism, Plan
from hetrl.planner.spec import ClusterSpec, WorkloadSpec

from .common import (
    Draft,
    View,
    bind_inference,
    cheapest,
    engine_workload,
    even_split_and_order,
    node_counts,
    pool_layout,
)

OPENRLHF = "OpenRLHF 0.11.2"
TRAINERS = ("actor_train", "critic_train")


def view(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan) -> View:
    """The plan as OpenRLHF runs it. Where OpenRLHF leaves a choice (round the batch keeping the micro-batch or
    shrink it; ZeRO-3; gradient checkpointing; sleeping colocated models), the variant that fits with the least
    predicted time per prompt (the plain one when none fits)."""
    return cheapest(cluster, [_view(cluster, w, plan, keep, rec, z3, sleep) for rec in (False, True)
                              for z3 in (False, True) for sleep in (False, True) for keep in (True, False)])


def _legal(tasks: set[str]) -> bool:
    units = [{"actor_gen"}, {"actor_train", "actor_infer"}, {"actor_train", "actor_infer", "ref_infer"},
             {"ref_infer"}, {"critic_train", "critic_infer"}, {"critic_train", "critic_infer", "reward_infer"},
             {"reward_infer"}]
    return tasks in units


def _view(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan, keep_micro: bool, recompute: bool, zero3: bool,
          sleep: bool) -> View:
    d = Draft(plan)
    actor = d.where("actor_train")
    colocate_all = len(plan.groups) == 1 or d.where("actor_gen") is actor
    if not colocate_all:
        for task, home in (("ref_infer", "actor_train"), ("reward_infer", "critic_train")):
            g = d.where(task)
            if g is not None and not _legal(set(g["tasks"])) and d.where(home) is not None:
                d.move(task, d.where(home), f"OpenRLHF colocates it only there "
                       f"(train.colocate_{'actor_ref' if task == 'ref_infer' else 'critic_reward'})")
        colocate_all = not all(_legal(set(g["tasks"])) for g in d.groups if g["tasks"])
    if colocate_all:
        for task in [t for g in d.groups for t in g["tasks"] if g is not actor]:
            d.move(task, actor, "OpenRLHF colocates models only all together (train.colocate_all) or as "
                   "actor+reference and critic+reward")
    d.drop_empty(cluster)
    # one DeepSpeed config: one stage, one TP size, Adam offload and checkpointing for both trainers
    trainers = [t for t in TRAINERS if d.where(t) is not None]
    pars = {t: d.where(t)["par"][t] for t in trainers}
    a = pars["actor_train"]
    stage = max(3 if zero3 or p.pp > 1 or p.zero == 3 or p.offload == "params" else p.zero for p in pars.values())
    adam = any(p.offload != "none" for p in pars.values())
    tp = a.tp
    for t in trainers:
        g = d.where(t)
        n, p = len(g["gpus"]), pars[t]
        ttp = tp if n % tp == 0 else 1
        why = "OpenRLHF has one DeepSpeed config (one ZeRO stage, TP size, Adam offload and checkpointing " \
              "flag) and no pipeline parallelism"
        d.set_par(t, Parallelism(ttp, 1, n // ttp, stage, "optimizer" if adam else "none", a.recompute or recompute),
                  why if not (recompute and not a.recompute) else "as OpenRLHF runs it the plan fits only with "
                  "gradient checkpointing")
    bind_inference(d)
    for t, flag in (("ref_infer", "ref.offload"), ("reward_infer", "reward.offload")):
        g = d.where(t)
        if g is None:
            continue
        p, n = g["par"][t], len(g["gpus"])
        ttp = tp if n % tp == 0 else 1
        offload = "params" if stage == 3 and p.offload == "params" else "none"
        d.set_par(t, Parallelism(ttp, 1, n // ttp, 3 if stage == 3 else 1, offload),
                  f"DeepSpeed runs it under the trainers' ZeRO stage {stage} and TP size ({flag})")
    g = d.where("actor_gen")
    p, n = g["par"]["actor_gen"], len(g["gpus"])
    if p.pp > 1:
        d.set_par("actor_gen", Parallelism(p.tp, 1, n // p.tp), "OpenRLHF's vLLM engines have no pipeline stages")
    if colocate_all and sleep and not actor["swap"]:
        actor["swap"] = True
        d.gap(f"{d.name(actor)}.swap", "false -> true: as OpenRLHF runs it the plan fits only with the colocated "
              "models asleep while others run (vllm.enable_sleep, ds.enable_sleep)")
    for g in d.groups:
        if g["swap"] and not colocate_all:
            d.gap(f"{d.name(g)}.swap", "OpenRLHF sleeps models (vllm/ds.enable_sleep) only with train.colocate_all")
            g["swap"] = False
    even_split_and_order(d, cluster, "OpenRLHF")
    if len({x.type.name for x in cluster.gpus}) > 1 or len({x.region for x in cluster.gpus}) > 1:
        d.gap("groups[*].gpus", "OpenRLHF asks Ray for a number of GPUs per role and cannot pin a role to nodes "
              "or GPU types; the prediction assumes each role lands on the plan's GPUs")
    mode = w.mode
    if w.mode == "async" and colocate_all:
        d.gap("workload.mode", "async: OpenRLHF's async mode does not colocate vLLM with the actor, so the "
              "colocated plan runs synchronously")
        mode = "sync"
    eng = d.plan()
    ew = engine_workload(d, w, eng, "OpenRLHF", ("actor_train", "critic_train"), keep_micro, mode)
    return View("OpenRLHF", eng, ew, d.gaps, {"colocate_all": colocate_all, "stage": stage, "adam_offload": adam,
                                               "tp": tp})


def flags(cluster: ClusterSpec, v: View) -> list[str]:
    """train_ppo_ray's arguments (model, data and reward paths come from run.sh)."""
    w, plan, s = v.workload, v.plan, v.settings
    actor = plan.group_of("actor_train")
    a = actor.par("actor_train")
    gen = plan.group_of("actor_gen").par("actor_gen")
    out = []

    def role(name, task):
        nn, per = pool_layout(node_counts(cluster, plan.group_of(task).gpus))
        out.extend([f"--{name}.num_nodes", str(nn), f"--{name}.num_gpus_per_node", str(per)])

    role("actor", "actor_train")
    if w.reference is not None:
        role("ref", "ref_infer")
    if w.critic is not None:
        role("critic", "critic_train")
    if w.reward is not None:
        role("reward", "reward_infer")
    out += ["--vllm.num_engines", str(gen.dp), "--vllm.tensor_parallel_size", str(gen.tp)]
    if s["colocate_all"]:
        out.append("--train.colocate_all")
        if actor.swap:
            out += ["--vllm.enable_sleep", "--ds.enable_sleep"]
    else:
        if w.reference is not None and plan.group_of("ref_infer") is actor:
            out.append("--train.colocate_actor_ref")
        if w.reward is not None and w.critic is not None and plan.group_of("reward_infer") is plan.group_of(
                "critic_train"):
            out.append("--train.colocate_critic_reward")
    out += ["--ds.zero_stage", str(s["stage"]), "--ds.tensor_parallel_size", str(s["tp"]), "--ds.param_dtype", "bf16"]
    if s["adam_offload"]:
        out.append("--ds.adam_offload")
    if a.recompute:
        out.append("--actor.gradient_checkpointing_enable")
    for t, flag in (("ref_infer", "--ref.offload"), ("reward_infer", "--reward.offload")):
        if any(t in g.tasks and g.par(t).offload == "params" for g in plan.groups):
            out.append(flag)
    samples = w.prompts_per_step * w.responses_per_prompt
    out += ["--rollout.batch_size", str(w.prompts_per_step), "--rollout.n_samples_per_prompt",
            str(w.responses_per_prompt), "--train.batch_size", str(samples // w.optimizer_steps),
            "--train.micro_batch_size", str(w.micro_batch_responses), "--rollout.micro_batch_size",
            str(w.micro_batch_responses), "--data.max_len", str(w.prompt_tokens.max + w.response_tokens.max),
            "--rollout.max_new_tokens", str(w.response_tokens.max),
            "--algo.advantage.estimator", "gae" if w.algorithm == "ppo" else "group_norm"]
    if w.reference is None:
        out += ["--algo.kl.init_coef", "0"]
    elif w.algorithm != "ppo":
        out += ["--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
    if w.algorithm == "dapo":
        out += ["--actor.eps_clip_low_high", "0.2", "0.28"]
    if w.mode == "async":
        out.append("--train.async_enable")
    return out


def render(cluster: ClusterSpec, v: View, summary: str) -> dict[str, str]:
    w = v.workload
    fl = flags(cluster, v)
    env = ["MODEL", "PROMPT_DATA"] + (["CRITIC_MODEL"] if w.critic is not None else []) + \
        (["REWARD_MODEL"] if w.reward is not None else ["REWARD_URL"])
    paths = ['--actor.model_name_or_path "$MODEL"', '--data.prompt_dataset "$PROMPT_DATA"']
    if w.critic is not None:
        paths.append('--critic.model_name_or_path "$CRITIC_MODEL"')
    paths.append('--reward.model_name_or_path "$REWARD_MODEL"' if w.reward is not None
                 else '--reward.remote_url "$REWARD_URL"')
    body = []
    i = 0
    while i < len(fl):   # one flag (and its values) per line
        j = i + 1
        while j < len(fl) and not fl[j].startswith("--"):
            j += 1
        body.append(" ".join(shlex.quote(x) for x in fl[i:j]))
        i = j
    run = "\n".join([
        "#!/usr/bin/env bash",
        f"# OpenRLHF run of a hetrl plan ({OPENRLHF}). Set {', '.join(env)}; extra flags may follow.",
        "set -euo pipefail",
        *[f': "${{{e}:?set {e} (see README.md)}}"' for e in env],
        "exec python3 -m openrlhf.cli.train_ppo_ray \\",
        *[f"  {b} \\" for b in body + paths],
        '  "$@"', ""])
    readme = "\n".join([
        "# This hetrl plan on OpenRLHF", "",
        f"Written by `hetrl plan --export openrlhf` for {OPENRLHF} (`openrlhf.cli.train_ppo_ray`).", "",
        "```", summary, "```", "",
        "## Launch", "",
        "1. Install OpenRLHF 0.11.2 with its GPU dependencies (DeepSpeed, vLLM) and start Ray on the plan's nodes.",
        f"2. `{' '.join(f'{e}=...' for e in env)} ./run.sh` (extra flags may follow).", "",
        "Files: `run.sh` (the command line), `flags.txt` (the same flags, one per line), `plan.json` (the plan as "
        "given), `engine_plan.json` and `engine_workload.yaml` (as OpenRLHF runs it; `hetrl plan --evaluate` "
        "scores them), `report.json`.", "",
        "## What OpenRLHF cannot express", "",
        *([f"- `{g.field}`: {g.text}" for g in v.gaps] or ["Nothing: OpenRLHF runs this plan as planned."]), ""])
    return {"run.sh": run, "flags.txt": "\n".join(body) + "\n", "README.md": readme}
