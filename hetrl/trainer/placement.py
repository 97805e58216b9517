"""From a planner plan to the Ray actors of `hetrl train executor=ray`: which role, how many replicas, what
each one asks Ray for. Pure Python over the planner's types (no Ray, no torch), so it is tested alone.

Roles: `rollout` runs actor_gen; `learner` runs actor_train and its bound actor_infer (old log-probs);
`reference` runs ref_infer; `critic` (PPO) runs critic_train and its bound critic_infer (old values). One actor
per data-parallel replica; replica r of a task with degrees (tp, pp, dp) owns the group's GPUs
[r*tp*pp, (r+1)*tp*pp) (the plan's shard order). A GPU is a Ray custom resource named after its cluster node
(`hetrl-node:<node>`, one unit per GPU), so the same request works on a real cluster (each node started with its
resource) and on one CPU machine that declares all of them (`emulate_cluster=`). Roles in one task group time-share
its GPUs, as in the plan, so each asks for an equal fraction of them.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import Counter
from dataclasses import dataclass

from hetrl.planner import ClusterSpec, Plan, WorkloadSpec, load_cluster, load_plan
from hetrl.planner import plan as plan_search
from hetrl.planner.spec import ModelSpec, TokenLengths
from hetrl.trainer.config import logits_give_old_logprobs

log = logging.getLogger(__name__)


class ExecutorFailure(RuntimeError):
    """The Ray executor lost what it cannot replace (a learner, or every rollout actor): the run stops with its
    last checkpoint intact, and the message says how to resume."""


ROLE_OF_TASK = {"actor_gen": "rollout", "actor_train": "learner", "ref_infer": "reference", "critic_train": "critic"}
ROLES = ("rollout", "learner", "reference", "critic")
NODE_RESOURCE = "hetrl-node:{}"


@dataclass(frozen=True)
class Replica:
    """One Ray actor: a data-parallel replica of a role on its GPUs."""

    role: str
    rank: int
    replicas: int
    gpus: tuple[str, ...]                 # `<node>:<index>` names from the plan
    resources: tuple[tuple[str, float], ...]   # Ray custom resources this actor requests
    sharded: bool                         # tp * pp > 1 in the plan (the executor runs the replica unsharded)
    zero: int = 1                         # the plan's ZeRO stage (learners, critics: 2 and 3 = FSDP2 over the DP ranks)
    offload: str = "none"                 # the plan's offload (learners, critics: with zero 2 / 3, FSDP2's CPU offload)
    recompute: bool = True                # the plan's recompute (learners, critics: activation checkpointing)
    tp: int = 1                           # the plan's tensor parallelism (rollout: vLLM's tensor_parallel_size)

    @property
    def name(self) -> str:
        return f"hetrl-{self.role}-{self.rank}"

    @property
    def gpu_share(self) -> float:
        return sum(v for _, v in self.resources)


def node_resources(cluster: ClusterSpec) -> dict[str, float]:
    """The custom resources a (real or emulated) cluster declares: one unit per GPU of each node."""
    return {NODE_RESOURCE.format(n.name): float(n.count) for n in cluster.nodes}


def replicas(plan: Plan, cluster: ClusterSpec, *, single_node: bool) -> list[Replica]:
    """Every actor the plan asks for. `single_node`: all node resources live on one Ray node (emulation),
    so a replica may span cluster nodes; on a real cluster it may not (one actor is one process)."""
    out = []
    for group in plan.groups:
        roles = [t for t in group.tasks if t in ROLE_OF_TASK]
        share = 1.0 / len(roles) if roles else 1.0
        for task in roles:
            par = group.par(task)
            width = par.tp * par.pp
            for r in range(par.dp):
                gpus = [cluster.gpus[i] for i in group.gpus[r * width:(r + 1) * width]]
                per_node = Counter(g.node for g in gpus)
                if len(per_node) > 1 and not single_node:
                    raise ValueError(
                        f"{task} replica {r} spans nodes {sorted(per_node)} (tp={par.tp}, pp={par.pp}); the Ray "
                        "executor runs a replica as one process on one node. Plan with GPUs per node >= tp*pp "
                        "or use a plan whose replicas stay within a node")
                res = tuple((NODE_RESOURCE.format(node), _floor4(k * share)) for node, k in sorted(per_node.items()))
                out.append(Replica(ROLE_OF_TASK[task], r, par.dp, tuple(g.name for g in gpus), res, width > 1,
                                   par.zero, par.offload, par.recompute, par.tp))
    return out


def actor_threads(replicas: list[Replica], cluster: ClusterSpec, mode: str, cpus_per_node: int, *,
                  single_node: bool) -> dict[str, int]:
    """Torch threads of each actor: the CPU cores of the plan devices it was given, so that a plan is run as
    written (a replica on `cpu:1` computes on one core, not on every core of the machine). A Ray node's cores
    are split evenly over the plan devices it hosts (all of the cluster's when `single_node`, i.e. emulated;
    else its own node's); a replica on k devices gets k devices' cores. Roles that compute at the same time on
    one device split its cores: in async mode rollout and learner replicas sharing a device; in sync mode the
    phases take turns, so each role in its phase has the device's cores."""
    node_of = {g.name: g.node for g in cluster.gpus}
    together = ("rollout", "learner") if mode == "async" else ()
    busy = Counter(g for r in replicas if r.role in together for g in r.gpus)
    out = {}
    for r in replicas:
        devices = len(cluster.gpus) if single_node else cluster.node(node_of[r.gpus[0]]).count
        sharing = max(busy[g] for g in r.gpus) if r.role in together else 1
        out[r.name] = max(1, int(cpus_per_node * len(r.gpus) / devices // sharing))
    return out


def _floor4(x: float) -> float:
    """Ray keeps fractional resources to 1e-4; round down so that shares of one GPU never add above 1."""
    return math.floor(x * 10_000) / 10_000


def model_spec_from_hf(config, name: str = "run") -> ModelSpec:
    """Architecture numbers of a Hugging Face causal-LM config, as the planner reads them."""
    heads = config.num_attention_heads
    return ModelSpec(layers=config.num_hidden_layers, hidden=config.hidden_size, heads=heads,
                     kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                     head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                     intermediate=config.intermediate_size, vocab=config.vocab_size,
                     tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), name=name)


def old_logprob_share(cfg, precision: str) -> float:
    """Share of the samples a run's learner recomputes old log-probs for (loop.update_policy): none in async
    mode (they come with the samples) or where the rollout's fp32 sampling logits give them (old_logprobs; local
    and Ray rollouts alike); else the mini-batches after the first, whose groups np.array_split puts after the
    first ceil(G/k)."""
    groups, k = cfg.prompts_per_step, min(cfg.mini_batches, cfg.prompts_per_step)
    if cfg.mode == "async" or k == 1:
        return 0.0
    if logits_give_old_logprobs(cfg.old_logprobs, precision != "fp32"):
        return 0.0
    return 1 - math.ceil(groups / k) / groups


def run_workload(cfg, actor: ModelSpec, prompt_tokens: TokenLengths, precision: str,
                 rollout_engine: str = "hf") -> WorkloadSpec:
    """The planner workload of a `hetrl train` run: its model, batch and lengths; a reference model only when
    the KL term needs one; a critic of the actor's size for PPO; rewards are verifiers (no reward model); its
    precision (the planner's name: the run's RunPrecision.planner), its mini-batches as optimizer steps and the old
    log-prob passes its learner runs (old_logprob_share). Its executor runs every task as data parallelism, but
    generation on the run's `rollout_engine` vllm (data_parallel_only), so a plan searched for it is one it runs as
    priced."""
    # the cost model's mini-batches hold whole groups in equal numbers; a split that is not even is priced as one
    # optimizer step (its per-step gradient sync and Adam step then counted once)
    steps = cfg.mini_batches if cfg.prompts_per_step % cfg.mini_batches == 0 else 1
    return WorkloadSpec(**_episode_shape(cfg),
        algorithm=cfg.algorithm if cfg.algorithm in ("grpo", "dapo", "ppo") else "grpo", mode=cfg.mode, actor=actor,
        reference=actor if cfg.has_reference else None,
        reward=None, critic=actor if cfg.has_critic else None, prompts_per_step=cfg.prompts_per_step,
        responses_per_prompt=cfg.responses_per_prompt, prompt_tokens=prompt_tokens,
        dualkv=True, precision=precision,
        optimizer_steps=steps, old_logprob_share=old_logprob_share(cfg, precision),
        rollout_logprob_pass=cfg.mode == "async" and not logits_give_old_logprobs(cfg.old_logprobs,
                                                                                  precision != "fp32"),
        data_parallel_only="but_generation" if rollout_engine == "vllm" else "all")


def _episode_shape(cfg) -> dict:
    """The response of a run as the planner's workload fields. Single-turn: max_new_tokens. With tools (multi-turn
    episodes): the most turns an episode may take (max_tool_calls + 1), each model turn and each tool result an
    equal share of max_new_tokens, which bounds them together (so the longest sequence is priced as the run caps
    it; how a real episode splits its budget is not known before it runs), its branches and max_leaves; tool
    latency is not known either, so none is priced."""
    budget = cfg.max_new_tokens
    if not cfg.multi_turn:
        return {"response_tokens": TokenLengths(budget, float(budget))}
    turns = cfg.max_tool_calls + 1
    share = max(1, budget // (2 * turns - 1))
    return {"response_tokens": TokenLengths(share, float(share)), "turns": turns,
            "tool_tokens": TokenLengths(share, float(share)), "branches": cfg.branches, "max_leaves": cfg.max_leaves}


def plan_for_run(cfg, model_config, prompt_len: int, precision: str,
                 rollout_engine: str = "hf") -> tuple[ClusterSpec, Plan]:
    """The cluster of a Ray run (`emulate_cluster` or `cluster`) and its plan: the user's `plan` file checked
    against the run's workload (in the planner's `precision`), or else the hybrid search's for the run's model,
    batch and lengths, among the layouts the executor runs (run_workload)."""
    cluster = load_cluster(cfg.emulate_cluster or cfg.cluster)
    workload = run_workload(cfg, model_spec_from_hf(model_config, cfg.model), TokenLengths(prompt_len, prompt_len),
                            precision, rollout_engine)
    if cfg.plan:
        return cluster, load_plan(cfg.plan, cluster, workload)
    found = plan_search(cluster, workload, "hybrid", seed=cfg.seed, time_limit_s=30).plan
    return cluster, _lora_learners(cfg, found)


def _lora_learners(cfg, plan: Plan) -> Plan:
    """A LoRA run's searched plan with actor_train on ZeRO-1 (DDP-style learners, no offload): hetrl runs LoRA only
    there, and the adapter's optimizer states are small; the planner prices full fine-tuning, whose ZeRO-3 it may
    choose (a user's own plan with ZeRO-2/3 is refused by the executor instead)."""
    if not cfg.lora_rank:
        return plan
    groups, changed = [], None
    for g in plan.groups:
        par = []
        for t, p in g.parallelism:
            if t == "actor_train" and (p.zero > 1 or p.offload != "none"):
                changed = p
                p = dataclasses.replace(p, zero=1, offload="none")
            par.append((t, p))
        groups.append(dataclasses.replace(g, parallelism=tuple(par)))
    if changed is not None:
        log.info("lora_rank=%d: actor_train runs ZeRO-1 without offload (the plan searched for full fine-tuning "
                 "gave it zero %d, offload %s)", cfg.lora_rank, changed.zero, changed.offload)
    return dataclasses.replace(plan, groups=tuple(groups))
