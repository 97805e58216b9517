"""The engine contract: what the training loop needs from whatever runs its roles, and the local engine.

The loop (hetrl/trainer/loop.py) calls nothing beyond `Engine`. `LocalEngine` keeps every role in this process on
one shared policy; `hetrl.trainer.ray_executor.RayEngine` places them as Ray actors as a planner plan says.
`make_engine` picks one from the run config (Ray is imported only when asked for).
"""

from __future__ import annotations

import copy
import pathlib
import time
from typing import Protocol

import torch

from hetrl.trainer import build, checkpoint, vllm_engine
from hetrl.trainer.config import RunConfig
from hetrl.trainer.episodes import Agent, EpisodeWorker
from hetrl.trainer.learner import CriticStats, Groups, UpdateStats
from hetrl.trainer.precision import RunPrecision, samples_in_bf16
from hetrl.trainer.rollout import Sample


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, logprobs: bool = False) -> list[list[Sample]]: ...


class LogProbs(Protocol):
    def logprobs(self, groups: Groups) -> torch.Tensor: ...


class Trainer(LogProbs, Protocol):
    def update(self, groups: Groups, advantages: torch.Tensor, weights: torch.Tensor, old_logp: torch.Tensor | None,
               ref_logp: torch.Tensor | None = None, lr_step: int | None = None,
               is_weights: torch.Tensor | None = None) -> UpdateStats: ...


class Episodes(Protocol):
    def generate(self, examples, n: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 greedy: bool = False, logprobs: bool = False) -> list[list[Sample]]: ...


class ValueModel(Protocol):
    """What the loop asks of a critic (hetrl.trainer.learner.Critic, or Ray's CriticGroup)."""

    def values(self, groups: Groups) -> torch.Tensor: ...

    def update(self, groups: Groups, returns: torch.Tensor, old_values: torch.Tensor,
               weights: torch.Tensor) -> CriticStats: ...


class Engine(Protocol):
    """Where the roles of a run live. `worker` samples (actor_gen), `learner` gives the old log-probs and takes
    optimizer steps (actor_infer, actor_train), `reference` gives the KL reference's log-probs (None without KL),
    `critic` gives values and takes value steps (critic_infer, critic_train; PPO only, else None). `precision`:
    what every role computes in, decided once (precision.decide) and carried by each.
    `episodes` rolls out multi-turn tool-use episodes (hetrl.data Examples in, their tools run where the rollout
    runs) in a run with tools or an environment (else None).
    `rollout_logprobs`: whether the loop asks `worker.generate(..., logprobs=True)` for its samples' log-probs,
    which a sync update takes as old log-probs (where the rollout's sampling logits are fp32:
    RolloutWorker.gives_logprobs; with vLLM only under bypass_mode).
    `correction`: where the samples come from another engine (vLLM), hetrl.algo.rollout_correction's options: the
    loop asks for the samples' log-probs, measures them against the trainer's old log-probs every step and
    corrects the loss; None where the rollout is the trainer's own model (hf)."""

    worker: Generator
    learner: Trainer
    reference: LogProbs | None
    critic: ValueModel | None
    episodes: Episodes | None
    rollout_logprobs: bool
    correction: dict | None
    precision: RunPrecision

    def phase_seconds(self) -> dict[str, float]:
        """Running totals of the rollout's phases measured in this process (prefill_s, decode_s, and tool_s with
        tools); the loop reports each step's difference. Empty where the rollout runs elsewhere."""

    def sync_weights(self, version: int) -> dict:
        """Make the rollout side sample from policy version `version`; -> metrics (bytes, seconds)."""

    def save(self, run_dir: pathlib.Path, step: int, extra: dict, config: dict) -> pathlib.Path:
        """A checkpoint of the policy, optimizer and `extra` trainer state; -> its directory."""

    def load(self, path: pathlib.Path) -> dict:
        """Restore the checkpoint at `path`; -> its trainer state."""

    def save_merged(self, run_dir: pathlib.Path) -> pathlib.Path:
        """A LoRA run's final policy with the adapter merged in, as a plain transformers model directory."""

    def close(self) -> None: ...


class LocalEngine:
    """Every role in this process. The rollout worker samples from the policy itself, or, where the run is
    bf16-mixed (precision.samples_in_bf16), from a bf16 copy of it that each update's weight sync refreshes, or
    with rollout_engine=vllm from vLLM's engine in this process, into which each update's weights are pushed."""

    def __init__(self, cfg: RunConfig, model, tokenizer, precision: RunPrecision, agent: Agent | None = None,
                 rollout_engine: str = "hf"):
        self.tokenizer, self.precision = tokenizer, precision
        self.rollout_engine = rollout_engine
        # before the policy: LoRA changes `model`
        self.critic = build.critic(cfg, build.critic_model(cfg, model), precision) if cfg.has_critic else None
        self.policy = build.policy(cfg, model)
        self.reference = build.reference(cfg, self.policy, lambda: copy.deepcopy(model), precision)
        self.optimizer = build.optimizer(cfg, self.policy)
        self.learner = build.learner(cfg, self.policy, self.optimizer, precision)
        self.bf16_rollout = rollout_engine == "hf" and samples_in_bf16(precision, self.policy.module,
                                                                       self.policy.lora)
        self.correction = None
        if rollout_engine == "vllm":
            self.worker = build.vllm_worker(cfg, self.policy, tokenizer, precision)
            self.correction = vllm_engine.correction(cfg)
        else:
            sampler = build.bf16_copy(self.policy.module) if self.bf16_rollout else self.policy.module
            self.worker = build.rollout_worker(cfg, sampler, tokenizer, precision)
        self.rollout_logprobs = self.worker.gives_logprobs(cfg.old_logprobs)
        self.episodes = EpisodeWorker(self.worker, agent) if agent is not None else None

    def phase_seconds(self) -> dict[str, float]:
        return dict(self.worker.phase_seconds)

    def sync_weights(self, version: int) -> dict:
        """The updated policy into vLLM now, or into the bf16 rollout's copy (applied before its next generate
        call); -> seconds (and bytes for vLLM)."""
        if self.rollout_engine == "vllm":
            return self.worker.load_weights(self.policy.merged_weights())
        if not self.bf16_rollout:
            return {}
        t0 = time.perf_counter()
        self.worker.queue_weights(build.bf16_weights_of(self.policy.module.state_dict()))
        return {"weight_sync_s": time.perf_counter() - t0}

    def save(self, run_dir: pathlib.Path, step: int, extra: dict, config: dict) -> pathlib.Path:
        staged = {checkpoint.CRITIC: checkpoint.stage(run_dir, checkpoint.CRITIC, self.critic.state())} \
            if self.critic is not None else None
        return checkpoint.save(run_dir, step, self.policy.saved, self.tokenizer, self.optimizer, extra, config,
                               staged=staged)

    def load(self, path: pathlib.Path) -> dict:
        critic = checkpoint.read_staged(path, checkpoint.CRITIC) if self.critic is not None else None
        state = checkpoint.load(path, self.policy.saved, self.optimizer)
        if critic is not None:
            self.critic.load_state(critic)
        self.sync_weights(state["step"])       # a bf16 rollout samples from the loaded weights too
        return state

    def save_merged(self, run_dir: pathlib.Path) -> pathlib.Path:
        return checkpoint.save_merged(run_dir, self.policy.merged(), self.tokenizer)

    def close(self) -> None:
        if self.rollout_engine == "vllm":
            self.worker.close()


def make_engine(cfg: RunConfig, model, tokenizer, prompt_len: int, precision: RunPrecision,
                agent: Agent | None = None, rollout_engine: str = "hf") -> Engine:
    """`agent`: the run's tools or environment (their episodes run where the rollout runs); `rollout_engine`: hf or
    vllm (vllm_engine.choose, decided once where the run is built)."""
    if cfg.executor == "local":
        return LocalEngine(cfg, model, tokenizer, precision, agent, rollout_engine)
    from hetrl.trainer.ray_executor import RayEngine  # ray is imported only when asked for

    return RayEngine(cfg, model.config, tokenizer, prompt_len, precision, agent, rollout_engine)
