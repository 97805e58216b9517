"""hetrl plan -> verl 0.9 (`main_ppo`, the v1 trainer): Hydra overrides, resource pools, a launcher, and back.

What verl runs, and how a plan maps onto it (checked against verl 0.9.1's own code: tests compose its
`ppo_trainer` config with our overrides and run its `validate_config`):

- Roles. verl's actor worker holds training, old log-probs and (unless separated) the reference; with the
  hybrid engine (`actor_rollout_ref.hybrid_engine`) it also holds the vLLM rollout. A plan whose generation
  group is not the actor's runs verl's `separate_async` trainer with a standalone rollout pool
  (`actor_rollout_ref.rollout.nnodes / n_gpus_per_node`): verl runs a separate rollout only asynchronously.
  The critic and the reward model go to any resource pool (`ResourcePoolManager` mapping); the reference
  gets its own pool only in separate mode (verl's `Role.RefPolicy`), else it runs in the actor worker.
- Pools. When roles sit on different GPU sets, or the cluster mixes GPU types, `launch_hetrl.py` runs verl's
  trainer with a `ResourcePoolManager` built from `hetrl_pools.json`: one pool per plan group, each bundle
  asking for a node resource `hetrl_<pool>` (verl's `RayResourcePool(accelerator_type=...)`), so a pool lands
  on the plan's nodes when each node is started with the resources the README lists.
- Training backend. Every training task with tp = pp = 1 -> FSDP2 (`model_engine=dp`, `strategy=fsdp2`):
  ZeRO-3 = `reshard_after_forward=true`, ZeRO-1/2 = `false` (FSDP keeps ZeRO-2's memory; it has no ZeRO-1),
  offload params = FSDP2's `offload_policy` (host Adam, streamed parameters), offload optimizer =
  `optimizer_offload`. Otherwise Megatron (`model_engine=megatron`) with the plan's tp/pp, the distributed
  optimizer (ZeRO-1), `optimizer_offload`, and recompute as full uniform recomputation.
- Swap (time-shared colocation) = the trainers' `param_offload` + `optimizer_offload` (verl moves their states
  to host memory while other roles run) and, on the hybrid group, `free_cache_engine` (the rollout's
  weights and KV cache are released while training).
- Batches. verl splits every batch evenly over a role's ranks (`DataProto.chunk` asserts it), so the
  prompts per step are rounded up to the nearest count every role's ranks divide; micro-batches are per GPU.
- DualKV: verl's v1 trainer computes each response with its own copy of the prompt (the reading of
  `use_prefix_grouper` is in the legacy trainer only), so the engine view turns DualKV off.

`read(dir)` rebuilds a hetrl plan and workload from an export folder's `overrides.txt` and
`hetrl_pools.json` alone (plus the model specs in its workload.yaml): the round trip the tests run.
"""

from __future__ import annotations

import dataclasses
import json
import os

import yaml

from hetrl.planner.plan import Parallelism, Plan
from hetrl.planner.spec import ClusterSpec, WorkloadSpec
from hetrl.schema import InputError, read_json, read_yaml

from .common import (
    Draft,
    View,
    bind_inference,
    canonical_gpus,
    cheapest,
    engine_workload,
    even_split_and_order,
    model_parallel,
    node_counts,
    pool_layout,
)

TRAINERS = ("actor_train", "critic_train")
VERL = "verl 0.9.1"


def view(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan) -> View:
    """The plan as verl runs it. Where verl leaves a choice (round the batch keeping the plan's micro-batch or
    shrink the micro-batch; turn verl's time-sharing on for trainer groups the plan keeps resident; recompute
    activations where the plan keeps them), the
    variant that fits with the least predicted time per prompt; the plain one when none fits."""
    return cheapest(cluster, [_view(cluster, w, plan, swap, keep, rec) for rec in (False, True)
                              for swap in (False, True) for keep in (True, False)])


def _view(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan, swap_trainers: bool, keep_micro: bool,
          recompute: bool) -> View:
    d = Draft(plan)
    actor, gen = d.where("actor_train"), d.where("actor_gen")
    separate = gen is not actor
    # 1. roles verl cannot place where the plan does
    if "ref_infer" in _tasks(d):
        ref = d.where("ref_infer")
        if ref is not actor and not separate:
            d.move("ref_infer", actor, "verl's hybrid engine runs the reference inside the actor worker")
        elif ref is gen and separate:
            d.move("ref_infer", actor, "verl's standalone rollout pool serves generation only")
    for task in ("critic_train", "reward_infer"):
        if task in _tasks(d) and separate and d.where(task) is gen:
            d.move(task, actor, "verl's standalone rollout pool serves generation only")
            if task == "critic_train":
                d.move("critic_infer", actor, "it runs in the critic workers")
    d.drop_empty(cluster)
    if swap_trainers:
        for g in d.groups:
            if not g["swap"] and any(t in g["tasks"] for t in TRAINERS):
                g["swap"] = True
                d.gap(f"{d.name(g)}.swap", "false -> true: as verl runs it the plan fits only with the trainers' "
                      "param and optimizer offload between phases (verl's time-sharing)")
    megatron = any(d.where(t)["par"][t].tp * d.where(t)["par"][t].pp > 1 for t in TRAINERS if t in _tasks(d))
    # 2. degrees and memory strategies as verl's workers run them
    for task in TRAINERS:
        if task not in _tasks(d):
            continue
        g = d.where(task)
        p, n = g["par"][task], len(g["gpus"])
        moved = "critic_train" not in plan.group_of("actor_train").tasks
        if task == "critic_train" and g is actor and megatron and moved:
            p = dataclasses.replace(p, tp=actor["par"]["actor_train"].tp, pp=actor["par"]["actor_train"].pp)
        if not megatron:
            new = Parallelism(1, 1, n, 3 if p.zero == 3 else 2, p.offload, p.recompute)
            why = "FSDP2 has no ZeRO-1: reshard_after_forward=false keeps ZeRO-2's memory" if p.zero == 1 else ""
        else:
            offload = "none" if p.offload == "none" else "optimizer"
            new = dataclasses.replace(model_parallel(p, n), offload=offload, recompute=p.recompute)
            why = "Megatron runs ZeRO-1 (its distributed optimizer) and offloads optimizer states, not streamed " \
                  "parameters" if (p.zero, p.offload) != (1, offload) else ""
        if recompute and not new.recompute:
            new = dataclasses.replace(new, recompute=True)
            why = "as verl runs it the plan fits only with activation recomputation (gradient checkpointing)"
        if g["swap"] and new.offload == "optimizer":
            new = dataclasses.replace(new, offload="none")
            why = "swap already moves the optimizer states to host memory between phases"
        d.set_par(task, new, why)
    bind_inference(d)
    if "ref_infer" in _tasks(d):
        g = d.where("ref_infer")
        p, n = g["par"]["ref_infer"], len(g["gpus"])
        if not megatron:
            new = Parallelism(1, 1, n, 3, "params" if p.offload == "params" else "none")
            why = "verl's FSDP reference shards its parameters over its ranks"
        elif g is actor:
            a = actor["par"]["actor_train"]
            new, why = Parallelism(a.tp, a.pp, a.dp), "the reference runs in the actor workers"
        else:
            new, why = model_parallel(p, n), "Megatron keeps the reference's weights whole per shard"
        d.set_par("ref_infer", new, why)
    if "reward_infer" in _tasks(d):
        g = d.where("reward_infer")
        d.set_par("reward_infer", model_parallel(g["par"]["reward_infer"], len(g["gpus"])),
                  "verl serves the reward model with vLLM replicas (weights whole per shard)")
    # 3. swap: what verl's offload flags and the rollout's free_cache_engine express
    for g in d.groups:
        if g["swap"] and not any(t in g["tasks"] for t in TRAINERS):
            d.gap(f"{d.name(g)}.swap", "verl time-shares a pool only around its trainers (param/optimizer "
                  "offload); this group trains nothing, so everything stays resident")
            g["swap"] = False
    even_split_and_order(d, cluster, "verl")
    # 4. the workload as verl runs it
    mode = "async" if separate else w.mode
    if mode != w.mode:
        d.gap("workload.mode", "sync: verl runs a separate rollout pool only asynchronously (separate_async)")
    eng = d.plan()
    ew = engine_workload(d, w, eng, "verl", ("actor_train", "critic_train", "ref_infer"), keep_micro, mode)
    trainer_mode = "separate_async" if separate else ("sync" if w.mode == "sync" else "colocate_async")
    return View("verl", eng, ew, d.gaps, {"megatron": megatron, "trainer_mode": trainer_mode})


def _tasks(d: Draft) -> list[str]:
    return [t for g in d.groups for t in g["tasks"]]


# ---------------------------------------------------------------------------------------------- render


def pools(cluster: ClusterSpec, v: View) -> dict:
    """hetrl_pools.json: one pool per group of the engine plan, its nodes and the verl roles it holds."""
    out = {}
    separate = v.settings["trainer_mode"] == "separate_async"
    for i, g in enumerate(v.plan.groups):
        roles = []
        if "actor_train" in g.tasks:
            roles.append("actor")
        if "actor_gen" in g.tasks:
            roles.append("rollout" if separate else "actor_rollout")
        if "ref_infer" in g.tasks:
            roles.append("ref")
        if "critic_train" in g.tasks:
            roles.append("critic")
        if "reward_infer" in g.tasks:
            roles.append("rm")
        name = "rollout" if roles == ["rollout"] else "_".join(r for r in roles if r != "actor_rollout") or "pool"
        out[name] = {"nodes": node_counts(cluster, g.gpus), "roles": roles, "resource": f"hetrl_{name}",
                     "gpu_types": sorted({cluster.gpus[k].type.name for k in g.gpus})}
    return out


def overrides(cluster: ClusterSpec, v: View) -> list[str]:
    """The Hydra overrides for verl's ppo_trainer config (model and data paths come from run.sh)."""
    w, plan, megatron = v.workload, v.plan, v.settings["megatron"]
    separate = v.settings["trainer_mode"] == "separate_async"
    actor, gen = plan.group_of("actor_train"), plan.group_of("actor_gen")
    a, gp = actor.par("actor_train"), gen.par("actor_gen")
    mini = w.prompts_per_step // w.optimizer_steps
    mb = w.micro_batch_responses
    ar = "actor_rollout_ref"
    o = [f"model_engine={'megatron' if megatron else 'dp'}",
         f"algorithm.adv_estimator={'gae' if w.algorithm == 'ppo' else 'grpo'}",
         f"data.train_batch_size={w.prompts_per_step}",
         f"data.max_prompt_length={w.prompt_tokens.max}",
         f"data.max_response_length={w.response_tokens.max}",
         f"{ar}.rollout.name=vllm",
         f"{ar}.rollout.n={w.responses_per_prompt}",
         f"{ar}.rollout.tensor_model_parallel_size={gp.tp}",
         f"{ar}.rollout.pipeline_model_parallel_size={gp.pp}",
         f"{ar}.rollout.log_prob_micro_batch_size_per_gpu={mb}",
         f"{ar}.actor.ppo_mini_batch_size={mini}",
         f"{ar}.actor.ppo_micro_batch_size_per_gpu={mb}",
         f"{ar}.actor.strategy={'megatron' if megatron else 'fsdp2'}",
         f"{ar}.model.enable_gradient_checkpointing={_b(a.recompute)}",
         "trainer.logger=[console]",
         f"trainer.v1.trainer_mode={v.settings['trainer_mode']}"]
    nn, per = pool_layout(node_counts(cluster, actor.gpus))
    o += [f"trainer.nnodes={nn}", f"trainer.n_gpus_per_node={per}"]
    if w.algorithm == "dapo":
        o += [f"{ar}.actor.clip_ratio_high=0.28", f"{ar}.actor.loss_agg_mode=token-mean"]
    if w.reference is not None:
        o += [f"{ar}.actor.use_kl_loss=true" if w.algorithm != "ppo" else "algorithm.use_kl_in_reward=true",
              f"{ar}.ref.log_prob_micro_batch_size_per_gpu={mb}"]
    if separate:
        gn, gper = pool_layout(node_counts(cluster, gen.gpus))
        o += [f"{ar}.hybrid_engine=false", f"{ar}.rollout.nnodes={gn}", f"{ar}.rollout.n_gpus_per_node={gper}",
              f"trainer.v1.separate_async.parameter_sync_step={w.optimizer_steps}",
              f"{ar}.rollout.checkpoint_engine.backend=nccl"]
    else:
        o.append(f"{ar}.rollout.free_cache_engine={_b(actor.swap)}")
    o += _trainer(f"{ar}.actor", "megatron" if megatron else "fsdp_config", a, actor.swap, megatron)
    if w.reference is not None:
        g = plan.group_of("ref_infer")
        r = g.par("ref_infer")
        if megatron and g is not actor:
            o += [f"{ar}.ref.megatron.tensor_model_parallel_size={r.tp}",
                  f"{ar}.ref.megatron.pipeline_model_parallel_size={r.pp}"]
        elif not megatron:
            o.append(f"{ar}.ref.fsdp_config.offload_policy={_b(r.offload == 'params')}")
    if w.critic is not None:
        g = plan.group_of("critic_train")
        c = g.par("critic_train")
        o += [f"critic.strategy={'megatron' if megatron else 'fsdp2'}",
              f"critic.ppo_micro_batch_size_per_gpu={mb}",
              f"critic.model.enable_gradient_checkpointing={_b(c.recompute)}"]
        o += _trainer("critic", "megatron" if megatron else "fsdp", c, g.swap, megatron)
    if w.reward is not None:
        g = plan.group_of("reward_infer")
        r = g.par("reward_infer")
        rm = "reward.reward_model"
        o += [f"{rm}.enable=true", f"{rm}.rollout.name=vllm", f"{rm}.rollout.tensor_model_parallel_size={r.tp}",
              f"{rm}.rollout.pipeline_model_parallel_size={r.pp}"]
        if g is not actor:
            rn, rper = pool_layout(node_counts(cluster, g.gpus))
            o += [f"{rm}.enable_resource_pool=true", f"{rm}.nnodes={rn}", f"{rm}.n_gpus_per_node={rper}"]
    return o


def _trainer(prefix: str, engine_key: str, p: Parallelism, swap: bool, megatron: bool) -> list[str]:
    e = f"{prefix}.{engine_key}"
    o = [f"{e}.param_offload={_b(swap)}", f"{e}.optimizer_offload={_b(swap or p.offload != 'none')}"]
    if megatron:
        o += [f"{e}.tensor_model_parallel_size={p.tp}", f"{e}.pipeline_model_parallel_size={p.pp}",
              f"{e}.use_distributed_optimizer=true"]
        if p.recompute:
            o += [f"{e}.override_transformer_config.recompute_granularity=full",
                  f"{e}.override_transformer_config.recompute_method=uniform",
                  f"{e}.override_transformer_config.recompute_num_layers=1"]
    else:
        o += [f"{e}.reshard_after_forward={_b(p.zero == 3)}", f"{e}.offload_policy={_b(p.offload == 'params')}"]
        if p.offload == "params":   # FSDP2's offload policy already keeps the optimizer on the host
            o[1] = f"{e}.optimizer_offload={_b(swap)}"
    return o


def _b(x: bool) -> str:
    return "true" if x else "false"


def render(cluster: ClusterSpec, v: View, summary: str) -> dict[str, str]:
    pool_spec = pools(cluster, v)
    ov = overrides(cluster, v)
    w = v.workload
    launcher = len([p for p in pool_spec.values() if p["roles"] != ["rollout"]]) > 1 or len(
        {g.type.name for g in cluster.gpus}) > 1
    env = ["MODEL", "TRAIN_FILES", "VAL_FILES"] + (["CRITIC_MODEL"] if w.critic is not None else []) + \
        (["REWARD_MODEL"] if w.reward is not None else [])
    paths = ['actor_rollout_ref.model.path="$MODEL"', 'data.train_files="$TRAIN_FILES"',
             'data.val_files="$VAL_FILES"']
    if w.critic is not None:
        paths.append('critic.model.path="$CRITIC_MODEL"')
    if w.reward is not None:
        paths.append('reward.reward_model.model_path="$REWARD_MODEL"')
    entry = "python3 launch_hetrl.py" if launcher else "python3 -m verl.trainer.main_ppo"
    run = "\n".join([
        "#!/usr/bin/env bash",
        f"# verl run of a hetrl plan ({VERL}). Set {', '.join(env)}; extra Hydra overrides may follow.",
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        *[f': "${{{e}:?set {e} (see README.md)}}"' for e in env],
        "mapfile -t OVERRIDES < <(grep -v '^#' overrides.txt | grep -v '^$')",
        f'exec {entry} "${{OVERRIDES[@]}}" {" ".join(paths)} "$@"', ""])
    ray_lines = []
    per_node: dict[str, dict[str, int]] = {}
    for name, p in pool_spec.items():
        for node, c in p["nodes"].items():
            per_node.setdefault(node, {})[p["resource"]] = 1
    for node, res in per_node.items():
        ray_lines.append(f"    # on {node}\n    ray start {'--head' if not ray_lines else '--address=HEAD:6379'} "
                         f"--resources='{json.dumps(res)}'")
    readme = "\n".join([
        "# This hetrl plan on verl", "",
        f"Written by `hetrl plan --export verl` for {VERL} (`main_ppo`, the v1 trainer).", "",
        "```", summary, "```", "",
        "## Launch", "",
        f"1. Install verl 0.9.1 with its GPU dependencies (vLLM{', Megatron-Core' if v.settings['megatron'] else ''}).",
        "2. Start Ray on the plan's nodes" + (", each with the resources that pin verl's pools to it:" if launcher
                                               else ":"), "", "```", *ray_lines, "```", "",
        f"3. `{' '.join(f'{e}=...' for e in env)} ./run.sh` (extra Hydra overrides may follow).", "",
        "Files: `overrides.txt` (verl's Hydra overrides, one per line), `run.sh`, "
        + ("`launch_hetrl.py` and `hetrl_pools.json` (verl's trainer with one resource pool per plan group, "
           "pinned to nodes by the resources above), " if launcher else "`hetrl_pools.json` (the pool layout), ")
        + "`plan.json` (the plan as given), `engine_plan.json` and `engine_workload.yaml` (the plan and workload "
        "as verl runs them, which `hetrl plan --evaluate` scores), `report.json`.", "",
        "## What verl cannot express", "",
        *([f"- `{g.field}`: {g.text}" for g in v.gaps] or ["Nothing: verl runs this plan as planned."]), "",
        "The standalone rollout pool (separate mode) is created by verl itself and is not pinned by the launcher; "
        "start Ray so that the generation nodes are the ones left free." if v.settings["trainer_mode"] ==
        "separate_async" else "", ""])
    pools_json = {"verl": VERL, "cluster": cluster.name, "pools": pool_spec}
    files = {"overrides.txt": "\n".join(ov) + "\n", "run.sh": run, "README.md": readme,
             "hetrl_pools.json": json.dumps(pools_json, indent=2) + "\n"}
    if launcher:
        files["launch_hetrl.py"] = LAUNCHER
    return files


LAUNCHER = '''"""verl 0.9.1's PPO trainer with the resource pools of a hetrl plan (`hetrl plan --export verl`).

Same as `python -m verl.trainer.main_ppo` (same Hydra config, same validation, same trainer classes) except
that the trainer's ResourcePoolManager comes from hetrl_pools.json: one pool per plan group, the verl roles
it holds, and a node resource each bundle asks for (RayResourcePool's accelerator_type), so every pool runs
on the plan's nodes. Start each node with the resources README.md lists.
"""

import json
import math
import os

import hydra
import ray

POOLS = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hetrl_pools.json")))["pools"]


def pool_manager(role_worker_mapping):
    """verl's ResourcePoolManager for the plan: pool name -> GPUs per node, verl role -> pool."""
    from verl.single_controller.ray.base import RayResourcePool, ResourcePoolManager
    from verl.trainer.ppo.utils import Role

    class PinnedPools(ResourcePoolManager):
        def create_resource_pool(self):
            for name, counts in self.resource_pool_spec.items():
                self.resource_pool_dict[name] = RayResourcePool(
                    process_on_nodes=counts, use_gpu=True, max_colocate_count=self.max_colocate_count,
                    name_prefix=name, accelerator_type=POOLS[name]["resource"])
            self._check_resource_available()

    spec, mapping = {}, {}
    for name, pool in POOLS.items():
        if pool["roles"] == ["rollout"]:
            continue                       # verl's standalone rollout pool (separate mode) places itself
        spec[name] = list(pool["nodes"].values())
        for role in pool["roles"]:
            if role == "actor":
                for r in (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef):
                    if r in role_worker_mapping:
                        mapping[r] = name
            elif role == "ref":
                mapping[Role.RefPolicy] = name
            elif role == "critic":
                mapping[Role.Critic] = name
            elif role == "rm":
                mapping[Role.RewardModel] = name
    return PinnedPools(resource_pool_spec=spec, mapping=mapping)


def pinned(trainer_cls):
    class HetRLPools(trainer_cls):
        def _init_resource_pool_mgr(self):
            super()._init_resource_pool_mgr()      # verl's own roles and worker classes
            keep = {r: p for r, p in self.mapping.items() if p not in ("global_pool", "reward_pool")}
            self.resource_pool_manager = pool_manager(self.role_worker_mapping)
            self.resource_pool_manager.mapping.update(keep)
            self.mapping = self.resource_pool_manager.mapping
    return HetRLPools


@ray.remote(num_cpus=1)
class HetRLTaskRunner:
    """verl 0.9.1's TaskRunnerV1.run (verl/trainer/main_ppo.py) with the pinned trainer class."""

    def run(self, config):
        from pprint import pprint

        import transfer_queue as tq
        from omegaconf import OmegaConf
        from verl.trainer.ppo.v1 import AgentLoopManagerTQ, get_trainer_cls
        from verl.utils.logging_utils import configure_verl_logging

        from verl.utils.import_utils import load_class_from_fqn

        configure_verl_logging()
        trainer_cls = pinned(get_trainer_cls(config.trainer.v1.trainer_mode))
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        tq.init(config.transfer_queue)
        trainer, succeeded = None, False
        try:
            trainer = trainer_cls(config=config)
            trainer.init()
            fqn = config.actor_rollout_ref.rollout.get("agent", {}).get("agent_loop_manager_class")
            manager_cls = load_class_from_fqn(fqn, "AgentLoopManager") if fqn else AgentLoopManagerTQ
            manager = manager_cls.create(config=config, llm_client=trainer.get_llm_client(),
                                         teacher_client=trainer.get_teacher_client(),
                                         reward_loop_worker_handles=trainer.get_reward_handles())
            trainer.fit(manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config):
    from verl.trainer.main_ppo import run_ppo
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    run_ppo(config, task_runner_class=HetRLTaskRunner)


if __name__ == "__main__":
    main()
'''


# ---------------------------------------------------------------------------------------------- import


def parse_overrides(text: str) -> dict:
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "=" not in line:
            raise InputError(f"overrides.txt line {n}: expected key=value, got {line!r}")
        k, v = line.split("=", 1)
        out[k.lstrip("+")] = yaml.safe_load(v)
    return out


def read(folder: str, cluster: ClusterSpec | None = None, workload: WorkloadSpec | None = None
         ) -> tuple[ClusterSpec, WorkloadSpec, Plan]:
    """A hetrl plan and workload from a verl export folder's settings (overrides.txt, hetrl_pools.json); the
    cluster and the models come from the folder's cluster.yaml / workload.yaml unless given."""
    from hetrl.planner.spec import cluster_from_dict, workload_from_dict

    def path(name):
        p = os.path.join(folder, name)
        if not os.path.isfile(p):
            raise InputError(f"{folder} has no {name}; give a folder written by `hetrl plan --export verl`")
        return p

    with open(path("overrides.txt")) as f:
        o = parse_overrides(f.read())
    pool_spec = read_json(path("hetrl_pools.json"), "pools JSON")["pools"]
    if cluster is None:
        cluster = cluster_from_dict(read_yaml(path("cluster.yaml"), "cluster YAML"), path("cluster.yaml"))
    if workload is None:
        workload = workload_from_dict(read_yaml(path("workload.yaml"), "workload YAML"), path("workload.yaml"))
    ar = "actor_rollout_ref"
    prompts = o["data.train_batch_size"]
    w = dataclasses.replace(
        workload, prompts_per_step=prompts, responses_per_prompt=o[f"{ar}.rollout.n"],
        optimizer_steps=prompts // o[f"{ar}.actor.ppo_mini_batch_size"],
        micro_batch_responses=o[f"{ar}.actor.ppo_micro_batch_size_per_gpu"],
        mode="sync" if o["trainer.v1.trainer_mode"] == "sync" else "async", dualkv=False, precision="bf16",
        prompt_tokens=dataclasses.replace(workload.prompt_tokens, max=o["data.max_prompt_length"]),
        response_tokens=dataclasses.replace(workload.response_tokens, max=o["data.max_response_length"]))
    megatron = o["model_engine"] == "megatron"
    names = list(pool_spec)
    gpus = dict(zip(names, canonical_gpus(cluster, [pool_spec[n]["nodes"] for n in names])))
    groups = []
    from hetrl.planner.plan import Group
    for name in names:
        roles, ids = pool_spec[name]["roles"], gpus[name]
        n = len(ids)
        par, swap = {}, False
        if "rollout" in roles or "actor_rollout" in roles:
            tp, pp = o[f"{ar}.rollout.tensor_model_parallel_size"], o[f"{ar}.rollout.pipeline_model_parallel_size"]
            par["actor_gen"] = Parallelism(tp, pp, n // (tp * pp))
        if "actor" in roles:
            a = _trainer_par(o, f"{ar}.actor", "megatron" if megatron else "fsdp_config", megatron, n,
                             o[f"{ar}.model.enable_gradient_checkpointing"])
            swap = swap or o[f"{ar}.actor.{'megatron' if megatron else 'fsdp_config'}.param_offload"]
            par["actor_infer"] = dataclasses.replace(a, recompute=True)
            par["actor_train"] = a
        if "ref" in roles:
            if not megatron:
                par["ref_infer"] = Parallelism(1, 1, n, 3, "params" if o.get(f"{ar}.ref.fsdp_config.offload_policy")
                                               else "none")
            elif "actor" in roles:
                a = par["actor_train"]
                par["ref_infer"] = Parallelism(a.tp, a.pp, a.dp)
            else:
                tp, pp = o[f"{ar}.ref.megatron.tensor_model_parallel_size"], \
                    o[f"{ar}.ref.megatron.pipeline_model_parallel_size"]
                par["ref_infer"] = Parallelism(tp, pp, n // (tp * pp))
        if "critic" in roles:
            c = _trainer_par(o, "critic", "megatron" if megatron else "fsdp", megatron, n,
                             o["critic.model.enable_gradient_checkpointing"])
            swap = swap or o[f"critic.{'megatron' if megatron else 'fsdp'}.param_offload"]
            par["critic_infer"] = dataclasses.replace(c, recompute=True)
            par["critic_train"] = c
        if "rm" in roles:
            tp = o["reward.reward_model.rollout.tensor_model_parallel_size"]
            pp = o["reward.reward_model.rollout.pipeline_model_parallel_size"]
            par["reward_infer"] = Parallelism(tp, pp, n // (tp * pp))
        groups.append(Group(tuple(par), tuple(ids), tuple(par.items()), "even", bool(swap)))
    return cluster, w, Plan(tuple(groups))


def _trainer_par(o: dict, prefix: str, key: str, megatron: bool, n: int, recompute: bool) -> Parallelism:
    e = f"{prefix}.{key}"
    swap = o[f"{e}.param_offload"]
    if megatron:
        tp, pp = o[f"{e}.tensor_model_parallel_size"], o[f"{e}.pipeline_model_parallel_size"]
        offload = "optimizer" if o[f"{e}.optimizer_offload"] and not swap else "none"
        return Parallelism(tp, pp, n // (tp * pp), 1, offload, recompute)
    offload = "params" if o[f"{e}.offload_policy"] else \
        "optimizer" if o[f"{e}.optimizer_offload"] and not swap else "none"
    return Parallelism(1, 1, n, 3 if o[f"{e}.reshard_after_forward"] else 2, offload, recompute)
