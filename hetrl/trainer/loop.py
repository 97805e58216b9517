"""`hetrl train`: the whole RL loop in one function you can read top to bottom.

sample N responses per prompt -> rewards (built-in checks or the user's functions, hetrl.data) ->
group-relative advantages -> pack groups (DualKV) -> old and reference log-probs -> clipped policy
update in `mini_batches` optimizer steps -> weight sync to the rollout workers -> log. Where the
roles run is the engine's business: the loop calls only the `Engine` protocol
(hetrl/trainer/engine.py); `LocalEngine` keeps the roles in this process on one shared policy (the
weight sync is a no-op), `RayEngine` places them as Ray actors following a planner plan. In async
mode (Ray only) the next steps' rollouts are collected in a background thread while the learner
updates, at most `max_staleness` policy versions behind. The run's entry (config, out_dir lock, resume,
data) is hetrl/trainer/run.py; scoring and the held-out evaluation are hetrl/trainer/evaluation.py.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import pathlib
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from hetrl.algo import (
    ADVANTAGE_ESTIMATORS,
    KLController,
    advantage,
    explained_variance,
    gae_returns,
    kl_in_reward,
    mismatch_metrics,
    rollout_correction,
    row_mask,
    to_packed,
    to_padded,
    token_weights,
    whiten,
)
from hetrl.algo.advantages import options_of
from hetrl.data import Example, RewardSet, RowSource, Scores, Source
from hetrl.data.containment import UserAbort
from hetrl.data.rewards import TrainerState, nested
from hetrl.trainer import episodes, files, guards, profiling
from hetrl.trainer.checkpoint import keep_newest, resume_command
from hetrl.trainer.config import RunConfig
from hetrl.trainer.engine import Engine, Episodes
from hetrl.trainer.evaluation import (
    decimals,
    evaluate,
    greedy_rewards,
    paired_comparison,
    replies,
    score_groups,
    score_name,
    shown,
)
from hetrl.trainer.metrics import MetricsLog, plot_curves
from hetrl.trainer.rollout import Sample

log = logging.getLogger(__name__)


@dataclass
class Rollout:
    """One prompt with its N samples and their rewards (the weighted total per sample)."""

    example: Example
    samples: list[Sample]
    rewards: list[float]
    baseline: float | None = None   # ReMax: the reward of the prompt's greedy response

    @property
    def prompt(self) -> list[int]:
        return self.example.prompt_ids


def collect_rollouts(cfg: RunConfig, source: Source, rewards: RewardSet, engine: Engine, start: int,
                     episode_worker: Episodes | None = None):
    """Sample groups until `prompts_per_step` are kept. DAPO's dynamic sampling drops groups whose rewards
    are all equal (no learning signal) and samples more prompts, for at most `max_sampling_rounds` rounds.
    -> (kept, sampled, next stream index, reward statistics of everything sampled)."""
    kept: list[Rollout] = []
    sampled: list[Rollout] = []
    episode_samples: list[Sample] = []
    scored: list[Scores] = []
    too_long = 0
    rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
    before = engine.phase_seconds()
    # the sync update takes them as old log-probs; async samples carry their behaviour policy's anyway; another
    # engine's (vLLM) are measured against the trainer's and corrected for
    want_logprobs = (cfg.mode != "async" and engine.rollout_logprobs) or engine.correction is not None
    for _ in range(rounds):
        if len(kept) >= cfg.prompts_per_step:
            break
        examples, start, skipped = source.train_examples(start, cfg.prompts_per_step - len(kept))
        too_long += skipped
        outputs = replies(engine.worker, episode_worker, examples, cfg.responses_per_prompt, cfg.max_new_tokens,
                          temperature=cfg.temperature, top_p=cfg.top_p, logprobs=want_logprobs)
        scores = score_groups(rewards, examples, outputs, check=True)
        scored.append(scores)
        baselines = (greedy_rewards(cfg, rewards, engine.worker, episode_worker, examples)
                     if cfg.adv_estimator == "remax" else None)
        episode_samples += [s for g in outputs for s in g]
        offset, failed = 0, set(scores.failed)
        for i, (example, samples) in enumerate(zip(examples, outputs)):
            r = Rollout(episodes.group_prompt(example, samples), samples, scores.total[offset:offset + len(samples)],
                        None if baselines is None else baselines[i])
            dropped = any(offset + k in failed for k in range(len(samples)))   # reward_errors=skip
            offset += len(samples)
            sampled.append(r)
            if (not cfg.dynamic_sampling or len(set(r.rewards)) > 1) and not dropped:
                kept.append(r)
    split = {k: v - before[k] for k, v in engine.phase_seconds().items()}
    return kept, sampled, start, {**_reward_stats(scored), "prompts_too_long": too_long, **split,
                                  **episodes.episode_metrics(episode_samples)}


def _reward_stats(scored: list[Scores]) -> dict:
    """The step's reward means over the rows scored: a row reward_errors=skip dropped has no reward (its 0 in
    `total` read as a falling reward_mean while every scored row got 1); NaN when none was scored."""
    dropped = [set(s.failed) for s in scored]
    ok = [[i not in d for i in range(len(s.total))] for s, d in zip(scored, dropped)]
    total = [v for s, keep in zip(scored, ok) for v, k in zip(s.total, keep) if k]
    out = {"reward_mean": guards.mean(total) if total else math.nan}
    for name in {k for s in scored for k in s.logged}:     # TRL's log_metric(name, value): the step's mean
        out[name] = guards.mean([v for s in scored for v in s.logged.get(name, [])])
    errors = [e for s in scored for e in s.errors]
    if errors:     # reward_errors=skip: their groups were dropped
        out["reward_errors"] = len(errors)
        log.warning("reward_errors=skip: %d row(s) dropped; the first: %s", len(errors), errors[0])
    if scored[0].correct is not None:
        correct = [c for s, keep in zip(scored, ok) for c, k in zip(s.correct, keep) if k and c is not None]
        out["accuracy"] = float(np.mean(correct)) if correct else math.nan
    merged = Scores(total, {k: [v for s in scored for v in s.per_function[k]] for k in scored[0].per_function},
                    {k: [v for s in scored for v in s.extra.get(k, [None] * len(s.total))]
                     for k in {k for s in scored for k in s.extra}})
    return out | merged.means()


@dataclasses.dataclass(frozen=True)
class RewardKL:
    """What the KL penalty in the token rewards is computed from (use_kl_in_reward): every token's behaviour
    log-prob [K], its reference log-prob [K], and the controller that holds the coefficient."""
    behaviour: torch.Tensor
    reference: torch.Tensor
    controller: KLController


def _per_token(rollouts: list[Rollout], cfg: RunConfig, kl: RewardKL | None = None):
    """Per-token advantages [K] of the run's estimator (hetrl.algo.advantage on the padded responses, each
    response's reward on its last token, tool tokens outside the mask), in the order of the packed responses.
    `kl`: to take the KL out of the reward (use_kl_in_reward). -> (advantages [K], metrics)."""
    lens, _ = _responses(rollouts, cfg)
    if cfg.branches > 1:   # a task's leaves (as many as its forks made), each one sample of the task (docs/agents.md)
        return torch.cat([episodes.leaf_advantages(r.samples, r.rewards, cfg.tree_advantage == "subtree",
                                                   cfg.scale_advantages) for r in rollouts]), {}
    rewards, mask, metrics = _token_rewards(rollouts, lens, cfg, kl)
    index = torch.arange(len(rollouts)).repeat_interleave(torch.tensor([len(r.samples) for r in rollouts]))
    takes = options_of(ADVANTAGE_ESTIMATORS[cfg.adv_estimator])
    options = {k: v for k, v in (("norm_adv_by_std_in_grpo", cfg.scale_advantages), ("gamma", cfg.gamma))
               if k in takes}
    if "reward_baselines" in takes:   # ReMax: the greedy response's reward, for each of the prompt's samples
        options["reward_baselines"] = torch.tensor([r.baseline for r in rollouts for _ in r.samples],
                                                   dtype=torch.float64)
    return to_packed(advantage(cfg.adv_estimator, rewards, mask, index, **options), lens), metrics


def _token_rewards(rollouts: list[Rollout], lens: torch.Tensor, cfg: RunConfig, kl: RewardKL | None):
    """Padded [M, T] token rewards (each response's reward on its last token, less the KL penalty per token with
    `kl`) and the mask of the model's tokens [M, T] (tool tokens 0). -> (rewards, mask, metrics)."""
    mask = _model_tokens(rollouts, lens)
    scores = torch.tensor([x for r in rollouts for x in r.rewards], dtype=torch.float64)
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    ends = lens > 0
    rewards[torch.arange(len(lens))[ends], lens[ends] - 1] = scores[ends]
    if kl is None:
        return rewards, mask, {}
    coef = kl.controller.value
    behaviour, reference = to_padded(kl.behaviour.double(), lens), to_padded(kl.reference.double(), lens)
    rewards, current = kl_in_reward(rewards, behaviour, reference, mask, kl.controller, cfg.kl_loss_type)
    return rewards, mask, {"reward_kl_penalty": current, "reward_kl_penalty_coeff": coef}


def _model_tokens(rollouts: list[Rollout], lens: torch.Tensor) -> torch.Tensor:
    """Padded [M, T] float64 mask of the model's own tokens (tool tokens are context: 0)."""
    flat = episodes.loss_mask([s for r in rollouts for s in r.samples])
    return to_padded((torch.ones(int(lens.sum()), dtype=torch.bool) if flat is None else flat).double(), lens)


def _weights(rollouts: list[Rollout], cfg: RunConfig, kept_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Loss weights [K] of a mini-batch's tokens (token_weights by the run's aggregation; tool tokens 0).
    `kept_tokens` [K] bool: the tokens the rollout correction's rejection kept (the others are out of the loss)."""
    lens, keep = _responses(rollouts, cfg)
    mask = episodes.loss_mask([s for r in rollouts for s in r.samples])
    if kept_tokens is not None:
        mask = kept_tokens if mask is None else mask & kept_tokens
    return token_weights(lens, keep, cfg.aggregation, mask, loss_scale_factor=cfg.loss_scale_factor or
                         cfg.max_new_tokens)


def _responses(rollouts: list[Rollout], cfg: RunConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens per response [M], and which responses the loss keeps [M] (DAPO's overlong filter drops some)."""
    lens = torch.tensor([len(s.tokens) for r in rollouts for s in r.samples])
    keep = torch.tensor([not (cfg.overlong_filter and s.truncated) for r in rollouts for s in r.samples])
    return lens, keep


def _ppo_targets(cfg: RunConfig, kept: list[Rollout], groups, critic, kl: RewardKL | None = None):
    """Old values [K] from the critic, then GAE on the token rewards (each response's reward on its last token):
    (old values, advantages, returns, metrics), advantages whitened over the batch's kept tokens when asked."""
    old_values = critic.values(groups).to(torch.float64)
    lens, keep = _responses(kept, cfg)
    rewards, mask, metrics = _token_rewards(kept, lens, cfg, kl)
    adv, ret = gae_returns(rewards, to_padded(old_values, lens), row_mask(lens), cfg.gamma, cfg.lam)
    adv, ret = to_packed(adv, lens), to_packed(ret, lens)
    if cfg.whiten_advantages:
        kept_tokens = torch.repeat_interleave(keep, lens)
        adv = adv.clone()
        adv[kept_tokens] = whiten(adv[kept_tokens])
    return old_values, adv, ret, metrics


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None     # metrics.jsonl stays strict JSON (no NaN)


def update_policy(cfg: RunConfig, learner, kept: list[Rollout], reference, critic=None,
                  train_policy: bool = True, step: int = 0, kl_ctrl: KLController | None = None,
                  correction: dict | None = None) -> dict:
    """Old (and reference) log-probs of the kept groups, the advantages of the whole batch, then one optimizer
    step per mini-batch of groups. Async: the importance ratio is taken against the behaviour policy that sampled
    each response (its log-probs come with the samples), not the learner's current weights. PPO: the critic's
    values, GAE, and a critic step before each policy step (`train_policy` off: the critic warms up alone).
    `kl_ctrl` (use_kl_in_reward): the KL to the reference comes out of the token rewards, not into the loss.
    `correction` (Engine.correction): the samples' log-probs are another engine's (vLLM): the trainer's old
    log-probs of every token are computed, their mismatch with the engine's measured, and the loss corrected
    (importance weights and rejection, hetrl.algo.rollout_correction)."""
    t0 = time.perf_counter()
    groups = [(r.prompt, [s.tokens for s in r.samples]) for r in kept]
    parts = np.array_split(np.arange(len(groups)), min(cfg.mini_batches, len(groups)))
    samples = [s for r in kept for s in r.samples]
    # the behaviour log-probs [K] read off the rollout's logits, where it gave them for every sample (old_logprobs)
    rollout_logp = torch.cat([s.logprobs for s in samples]) if all(s.logprobs is not None for s in samples) else None
    ref_logp = reference.logprobs(groups) if reference is not None else None
    old_logp, trainer_logp = _old_logprobs(cfg, learner, groups, parts, rollout_logp, correction, kl_ctrl)
    is_weights, kept_tokens, mismatch = None, None, {}
    if correction is not None and cfg.mode != "async":
        is_weights, kept_tokens, mismatch = _rollout_correction(kept, cfg, trainer_logp, rollout_logp, correction)
    kl = None
    if kl_ctrl is not None:   # every token's behaviour log-prob: the rollout's where they are the old ones, else ours
        kl = RewardKL(trainer_logp if trainer_logp is not None else rollout_logp, ref_logp, kl_ctrl)
    if critic is not None:
        old_values, ppo_adv, returns, kl_metrics = _ppo_targets(cfg, kept, groups, critic, kl)
    else:
        all_adv, kl_metrics = _per_token(kept, cfg, kl)
    # guards: every advantage (and PPO's return) finite before the first optimizer step; [K] per group's tokens
    skipped: list[str] = []
    sizes = [sum(len(s.tokens) for s in r.samples) for r in kept]
    targets = {"advantages": ppo_adv, "returns": returns} if critic is not None else {"advantages": all_adv}
    if any(guards.act(cfg.nonfinite, guards.check_advantages(step, v, sizes, k), skipped) for k, v in targets.items()):
        return {"skipped": skipped}
    t_update = time.perf_counter()
    stats, critic_stats = [], []
    for j, part in enumerate(parts):
        tok = _token_slice(groups, part)
        mb = [groups[i] for i in part]
        weights = _weights([kept[i] for i in part], cfg, None if kept_tokens is None else kept_tokens[tok])
        if critic is None:
            advantages = all_adv[tok]
        else:
            advantages = ppo_adv[tok]
            critic_stats.append(critic.update(mb, returns[tok], old_values[tok], weights))
            c = critic_stats[-1]
            guards.act(cfg.nonfinite, guards.check_update(step, "critic", j, c.value_loss, c.grad_norm), skipped)
        if train_policy:
            on_policy = j == 0 and cfg.mode != "async"
            stats.append(learner.update(mb, advantages, weights, None if on_policy else old_logp[tok],
                                        None if ref_logp is None else ref_logp[tok],
                                        lr_step=max(step - 1, 0) * cfg.mini_batches + j,
                                        is_weights=None if is_weights is None else is_weights[tok]))
            s = stats[-1]
            guards.act(cfg.nonfinite, guards.check_update(step, "policy", j, s.loss, s.grad_norm), skipped)
    row = _update_stats(stats, t_update - t0, time.perf_counter() - t_update) if stats else {
        "logprob_s": t_update - t0, "update_s": time.perf_counter() - t_update}
    if critic is not None:
        n = len(critic_stats)
        row |= {"value_loss": sum(c.value_loss for c in critic_stats) / n,
                "vf_clip_frac": sum(c.vf_clip_frac for c in critic_stats) / n,
                "critic_grad_norm": guards.worst(c.grad_norm for c in critic_stats),
                "value_mean": float(old_values.mean()) if old_values.numel() else 0.0,
                "return_mean": float(returns.mean()) if returns.numel() else 0.0,
                "explained_variance": _finite(explained_variance(old_values, returns)),
                "policy_updated": train_policy}
    return row | kl_metrics | mismatch | ({"skipped": skipped} if skipped else {})


def _old_logprobs(cfg: RunConfig, learner, groups, parts, rollout_logp: torch.Tensor | None,
                  correction: dict | None, kl_ctrl) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Where the update's old log-probs [K] come from, decided here alone. Async: the behaviour log-probs the
    samples carry. Sync: the first mini-batch is updated by the weights that sampled it, so its old log-probs are
    its own update forward's (Learner.update with None); the later mini-batches, updated after the policy has
    moved, take the samples' log-probs where they are the trainer's own (Engine.rollout_logprobs), else one
    no-grad pass computes them. That pass covers every group when the whole batch needs the trainer's log-probs
    (another engine's samples: the mismatch and its correction; use_kl_in_reward without the samples' own: the
    KL in the reward), once. -> (old log-probs [K], the trainer's log-probs of every token [K] or None)."""
    if cfg.mode == "async":
        assert rollout_logp is not None, "async samples carry their behaviour policy's log-probs"
        return rollout_logp, None
    if correction is not None:
        assert rollout_logp is not None, "the loop asks another engine's samples for their log-probs"
    own = rollout_logp if correction is None else None   # another engine's are never taken as old log-probs
    if correction is not None or (kl_ctrl is not None and own is None):
        trainer_logp = learner.logprobs(groups)
        return trainer_logp, trainer_logp
    first = _token_slice(groups, parts[0])
    old_logp = torch.zeros(len(first))
    if len(parts) > 1 and own is not None:
        old_logp = own
    elif len(parts) > 1:
        later = learner.logprobs([groups[i] for p in parts[1:] for i in p])
        old_logp = old_logp.to(later.dtype)
        old_logp[~first] = later
    return old_logp, None


def _rollout_correction(kept: list[Rollout], cfg: RunConfig, trainer_logp: torch.Tensor, engine_logp: torch.Tensor,
                        options: dict):
    """The rollout engine's log-probs [K] against the trainer's [K] on the model's tokens: mismatch metrics, and
    the correction (importance weights [K] or None, the tokens rejection keeps [K] bool, its metrics)."""
    lens, _ = _responses(kept, cfg)
    mask = _model_tokens(kept, lens)
    old, rollout = to_padded(trainer_logp.double(), lens), to_padded(engine_logp.double(), lens)
    metrics = mismatch_metrics(old, rollout, mask)
    weights, kept_mask, corr_metrics = rollout_correction(old, rollout, mask, **options)
    is_weights = None if weights is None else to_packed(weights, lens).float()
    return is_weights, to_packed(kept_mask, lens) > 0, metrics | corr_metrics


def run_steps(cfg: RunConfig, engine: Engine, source: Source, rewards: RewardSet, run_dir: pathlib.Path,
              metrics: MetricsLog, evals: MetricsLog, resumed: tuple[pathlib.Path, dict] | None = None) -> dict:
    """Held-out evaluation, `cfg.steps` training steps, held-out evaluation again; -> the run's summary. `resumed`:
    (the checkpoint the engine was restored from, its trainer state), the run continues at its step."""
    step, next_problem, before, version, unpaired = 0, 0, None, 0, None
    evaluating = cfg.eval_size > 0   # eval_size=0: no held-out evaluation, before, between or after
    eval_key = held_out_key(cfg, source, rewards)
    episode_worker = engine.episodes     # a run with tools or an environment: multi-turn episodes
    last_saved: pathlib.Path | None = None
    kl_ctrl = KLController(cfg.kl_coef, cfg.kl_ctrl, cfg.kl_target, cfg.kl_horizon) if cfg.use_kl_in_reward else None
    if resumed is not None:
        last_saved, state = resumed
        step, next_problem, before = state["step"], state["next_problem"], state["eval_before"]
        if kl_ctrl is not None and state.get("kl_reward_coef") is not None:   # the adaptive controller's value
            kl_ctrl.value = state["kl_reward_coef"]
        # checkpoints written before rewards were pluggable held correctness flags only
        before_means = state.get("eval_before_means") or \
            ({"eval_accuracy": float(np.mean(before))} if before else {})
        version = step
        unpaired = None if not evaluating else \
            state.get("eval_unpaired") or _changed_held_out(state, eval_key, source, rewards)
        if unpaired and not state.get("eval_unpaired"):
            tqdm.write(f"warning: {unpaired}: the final evaluation is not paired with the one before training "
                       "(summary.json says so); start a new run to compare")
    if before is None and not evaluating:
        before, before_means = [], {}
    elif before is None:
        rewards.trainer_state = TrainerState(global_step=0, max_steps=cfg.steps)
        before, before_means = evaluate(cfg, source, rewards, engine.worker, run_dir / "eval_step_0.jsonl",
                                        episode_worker)
        evals.write({"step": 0, **before_means})
        tqdm.write(f"held-out {score_name(before_means)} before training: {shown(before_means)} "
                   f"({len(before)} prompts, greedy)")

    def save(at_step):
        nonlocal last_saved
        last_saved = engine.save(run_dir, at_step, {
            "next_problem": next_problem, "eval_before": [float(v) for v in before],
            "eval_before_means": before_means, "data_fingerprint": source.fingerprint, "eval_key": eval_key,
            "eval_unpaired": unpaired,
            "reward_names": rewards.names, "kl_reward_coef": None if kl_ctrl is None else kl_ctrl.value},
            cfg.to_dict())
        keep_newest(run_dir, cfg.keep_checkpoints)
        return last_saved

    stream = _RolloutStream(lambda start: collect_rollouts(cfg, source, rewards, engine, start, episode_worker),
                            next_problem,
                            cfg.max_staleness if cfg.mode == "async" else 0, cfg.steps - step)
    bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step")
    with _StopAfterStep(resume_command(cfg)) as stop, contextlib.closing(bar):    # an error's line starts below the bar
        while step < cfg.steps and not stop.requested:
            with profiling.profiled(step + 1, cfg, run_dir) as profiled_now:
                t0 = time.perf_counter()
                rewards.trainer_state = TrainerState(global_step=step, max_steps=cfg.steps)   # TRL's reward kwarg
                kept, sampled, next_problem, reward_stats = stream.next()
                t_gen = time.perf_counter() - t0  # async: only the wait for rollouts the update did not hide
                row = {"step": step + 1, **reward_stats, **_rollout_stats(sampled, kept), "gen_s": t_gen}
                if isinstance(source, RowSource):
                    row["epoch"] = source.epoch(next_problem - 1)
                versions = [s.version for r in kept for s in r.samples if s.version is not None]
                if versions:
                    row["staleness"] = version - min(versions)
                    assert row["staleness"] <= (cfg.max_staleness if cfg.mode == "async" else 0), row
                skipped: list[str] = []
                if kept and guards.act(cfg.nonfinite, guards.check_rewards(step + 1, kept), skipped):
                    row["skipped"], kept = skipped, []     # nonfinite=skip: no update from this step's rewards
                if kept:
                    row |= update_policy(cfg, engine.learner, kept, engine.reference, engine.critic,
                                         train_policy=step >= cfg.critic_warmup_steps, step=step + 1, kl_ctrl=kl_ctrl,
                                         correction=engine.correction)
                    version += 1
                    row |= engine.sync_weights(version)
                step += 1
                row["step_s"] = time.perf_counter() - t0
                row["tokens_per_s"] = row["sample_tokens"] / row["step_s"]
            if profiled_now:
                row["profiled"] = True      # the profiler's overhead is in this row's times
            metrics.write(row)
            for reason in row.get("skipped", []):
                tqdm.write(f"nonfinite=skip: {reason}")
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                rewards.trainer_state = TrainerState(global_step=step, max_steps=cfg.steps)   # after `step` steps
                _, means = evaluate(cfg, source, rewards, engine.worker, run_dir / f"eval_step_{step}.jsonl",
                                    episode_worker)
                evals.write({"step": step, **means})
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop.requested:
                save(step)
            bar.update(1)
            bar.set_postfix(reward=decimals(row["reward_mean"], 2),
                            **({"acc": f"{row['accuracy']:.2f}"} if "accuracy" in row else {}),
                            tok_s=f"{row['tokens_per_s']:.0f}")
    stream.close()
    if stop.requested and step < cfg.steps:
        tqdm.write(f"stopped at step {step}; continue with: {resume_command(cfg)}")
        return {"stopped_at_step": step, "interrupted": True}

    after, after_means = [], {}
    if evaluating:
        rewards.trainer_state = TrainerState(global_step=step, max_steps=cfg.steps)
        after, after_means = evaluate(cfg, source, rewards, engine.worker, run_dir / f"eval_step_{step}.jsonl",
                                      episode_worker)
        evals.write({"step": step, **after_means})
    final = last_saved if last_saved is not None and last_saved.name == f"step_{step:06d}" else save(step)
    merged = engine.save_merged(run_dir) if cfg.lora_rank else None   # the adapter is in the checkpoint
    rows = metrics.read()
    summary = {**{f"{k}_before": v for k, v in before_means.items()},
               **{f"{k}_after": v for k, v in after_means.items()},
               "eval_problems": len(after),
               **({"paired_on": score_name(after_means), **paired_comparison(before, after)}
                  if evaluating and not unpaired else
                  {"paired_on": None, "gained": None, "lost": None, "sign_test_p": None,
                   "not_paired": unpaired or "eval_size=0: no held-out evaluation"}),
               "steps": step,
               "prompts_too_long": sum(r.get("prompts_too_long", 0) for r in rows),
               "eval_prompts_too_long": source.eval_too_long, "data": source.description,
               "train_seconds": sum(r.get("step_s", 0.0) for r in rows), "precision": engine.precision.name,
               "checkpoint": str(final),
               **({"merged_model": str(merged)} if merged else {}),
               "config": cfg.to_dict()}
    files.write_text(run_dir / "summary.json", json.dumps(guards.finite_or_none(summary), indent=2))
    plot_curves(rows, evals.read(), run_dir / "curves.png")
    if rows and not any(r.get("groups_kept") for r in rows):
        tqdm.write("warning: no step kept a group to learn from (every reward failed, or every group's rewards were "
                   "equal), so the policy was not updated; metrics.jsonl's groups_kept and the reward errors above "
                   "say why")
    if not evaluating:
        tqdm.write(f"trained {step} steps; no held-out evaluation (eval_size=0); results in {run_dir}")
    elif unpaired:
        tqdm.write(f"held-out {score_name(after_means)}: after {shown(after_means)} ({len(after)} prompts, greedy); "
                   f"before training {shown(before_means)} is not compared: {unpaired}; results in {run_dir}")
    else:
        tqdm.write(f"held-out {score_name(after_means)}: before {shown(before_means)}, after "
                   f"{shown(after_means)} ({len(after)} prompts, greedy; {summary['gained']} "
                   f"{'gained' if 'eval_accuracy' in after_means else 'better'}, {summary['lost']} "
                   f"{'lost' if 'eval_accuracy' in after_means else 'worse'}, sign-test p = "
                   f"{summary['sign_test_p']:.3g}); results in {run_dir}")
    return summary


def held_out_key(cfg: RunConfig, source: Source, rewards: RewardSet) -> str:
    """What the evaluation before training was of: the held-out prompts (their tokens and answers), the reward
    functions and what a reply is scored against. A resume whose key differs (allowed data or reward changes)
    cannot pair its final evaluation with the stored one prompt by prompt. (Not the whole row: a task's rows may
    hold objects whose text differs between processes.)"""
    return hashlib.sha256(json.dumps([[e.prompt_ids, nested(e.row, cfg.answer_key)] for e in source.eval_examples] +
                                     [rewards.names, rewards.weights, cfg.answer_key, cfg.eval_max_new_tokens],
                                     sort_keys=True, default=str).encode()).hexdigest()


def _changed_held_out(state: dict, key: str, source: Source, rewards: RewardSet) -> str | None:
    """Why a resumed run's held-out evaluation is no longer the one its stored 'before' scores are of, or None.
    Checkpoints older than the key: other data or other reward functions."""
    if state.get("eval_key") is not None:
        return None if state["eval_key"] == key else ("the held-out prompts, the reward functions or what they "
                                                     f"score against changed on resume at step {state['step']}")
    if state.get("data_fingerprint") not in (None, source.fingerprint) or \
            state.get("reward_names") not in (None, rewards.names):
        return f"the data or the reward functions changed on resume at step {state['step']}"
    return None


class _StopAfterStep:
    """First Ctrl-C: finish the current step, checkpoint, stop. Second Ctrl-C: stop at once."""

    def __init__(self, resume: str):
        self.requested, self.resume = False, resume

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        if self.requested:
            raise UserAbort(f"second Ctrl-C: aborted without saving this step; continue from the last checkpoint "
                            f"with: {self.resume}")
        self.requested = True
        tqdm.write("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again aborts without saving)")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


class _RolloutStream:
    """Rollouts step after step. `ahead` = 0: collected when asked (sync). `ahead` = k: up to k further steps
    are collected in one background thread while the learner works (async); the rollout workers apply each
    weight sync between generation calls, so a step's samples lag the learner by at most k versions."""

    def __init__(self, collect, next_problem: int, ahead: int, steps_left: int):
        self.collect, self.next_problem, self.ahead, self.left = collect, next_problem, ahead, steps_left
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if ahead else None
        self.pending: collections.deque = collections.deque()

    def _job(self):
        kept, sampled, self.next_problem, stats = self.collect(self.next_problem)
        return kept, sampled, self.next_problem, stats

    def next(self):
        """-> (kept, sampled, index of the next unused problem once this step is trained, reward statistics)."""
        if self.pool is None:
            return self._job()
        while self.left and len(self.pending) <= self.ahead:
            self.pending.append(self.pool.submit(self._job))
            self.left -= 1
        return self.pending.popleft().result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _token_slice(groups, part) -> torch.Tensor:
    """Bool mask [K] of the response tokens that belong to the groups with indices `part`."""
    sizes = torch.tensor([sum(len(r) for r in resps) for _, resps in groups])
    owner = torch.repeat_interleave(torch.arange(len(groups)), sizes)
    return torch.isin(owner, torch.as_tensor(part))


def _rollout_stats(sampled: list[Rollout], kept: list[Rollout]) -> dict:
    samples = [s for r in sampled for s in r.samples]
    return {
        "groups_sampled": len(sampled), "groups_kept": len(kept),
        "response_len_mean": float(np.mean([len(s.tokens) for s in samples])),
        "truncated_frac": float(np.mean([s.truncated for s in samples])),
        "sample_tokens": sum(len(r.prompt) * len(r.samples) + sum(len(s.tokens) for s in r.samples) for r in sampled),
    }


def _update_stats(stats, logprob_s: float, update_s: float) -> dict:
    packed = sum(s.packed_tokens for s in stats)
    standard = sum(s.standard_tokens for s in stats)
    n = len(stats)
    return {"loss": sum(s.loss for s in stats) / n, "policy_loss": sum(s.policy_loss for s in stats) / n,
            "kl": sum(s.kl for s in stats) / n, "clip_frac": sum(s.clip_frac for s in stats) / n,
            "entropy": sum(s.entropy for s in stats) / n, "grad_norm": guards.worst(s.grad_norm for s in stats),
            "packed_tokens": packed, "standard_tokens": standard, "rho": standard / packed if packed else None,
            "lr": next((s.lr for s in reversed(stats) if s.lr is not None), None),   # the step's last update's
            "logprob_s": logprob_s, "update_s": update_s}
