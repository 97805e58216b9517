"""`hetrl train`: the whole RL loop in one function you can read top to bottom.

sample N responses per prompt -> verifiable reward -> group-relative advantages -> pack groups
(DualKV) -> old and reference log-probs -> clipped policy update in `mini_batches` optimizer
steps -> weight sync to the rollout workers -> log. Where the roles run is the engine's business:
`LocalEngine` keeps them in this process on one shared policy (the weight sync is a no-op);
`hetrl.trainer.ray_executor.RayEngine` places them as Ray actors following a planner plan. In
async mode (Ray only) the next steps' rollouts are collected in a background thread while the
learner updates, at most `max_staleness` policy versions behind.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import fcntl
import json
import os
import logging
import math
import pathlib
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import yaml
from tqdm import tqdm

from hetrl.algo import group_advantages, token_weights
from hetrl.models import load_model
from hetrl.schema import InputError
from hetrl.trainer import checkpoint, files, memory
from hetrl.trainer.config import RunConfig, config_changes, config_data, load_config
from hetrl.trainer.learner import Learner, Scorer
from hetrl.trainer.metrics import MetricsLog, plot_curves
from hetrl.trainer.rollout import RolloutWorker, Sample, chat_prompt_ids
from hetrl.trainer.tasks import Score, Task

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Rollout:
    """One prompt with its N samples and their scores."""

    problem: dict
    prompt: list[int]
    samples: list[Sample]
    scores: list[Score]


def collect_rollouts(cfg: RunConfig, task: Task, worker: RolloutWorker, tokenizer, next_problem: int):
    """Sample groups until `prompts_per_step` are kept. DAPO's dynamic sampling drops groups whose rewards
    are all equal (no learning signal) and samples more prompts, for at most `max_sampling_rounds` rounds."""
    kept: list[Rollout] = []
    sampled: list[Rollout] = []
    rounds = cfg.max_sampling_rounds if cfg.dynamic_sampling else 1
    for _ in range(rounds):
        if len(kept) >= cfg.prompts_per_step:
            break
        problems, next_problem = task.train_problems(next_problem, cfg.prompts_per_step - len(kept))
        prompts = [chat_prompt_ids(tokenizer, task.messages(p)) for p in problems]
        outputs = worker.generate(prompts, cfg.responses_per_prompt, cfg.max_new_tokens, cfg.temperature, cfg.top_p)
        for problem, prompt, samples in zip(problems, prompts, outputs):
            r = Rollout(problem, prompt, samples, [task.score(problem, s.text) for s in samples])
            sampled.append(r)
            if not cfg.dynamic_sampling or len({s.reward for s in r.scores}) > 1:
                kept.append(r)
    return kept, sampled, next_problem


def evaluate(task: Task, worker: RolloutWorker, tokenizer, max_new_tokens: int, path: pathlib.Path) -> list[bool]:
    """Greedy correctness on each held-out problem; every reply is written to `path` (JSONL) for inspection."""
    prompts = [chat_prompt_ids(tokenizer, task.messages(p)) for p in task.eval_problems]
    outputs = worker.generate(prompts, 1, max_new_tokens, greedy=True)
    rows = []
    for problem, (sample,) in zip(task.eval_problems, outputs):
        score = task.score(problem, sample.text)
        rows.append({"question": problem["question"], "answer": problem["answer"], "reply": sample.text,
                     "correct": score.correct})
    files.write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return [r["correct"] for r in rows]


def paired_comparison(before: list[bool], after: list[bool]) -> dict:
    """Same problems before and after: how many flipped each way, and the exact two-sided sign-test
    p-value on the flips (McNemar's exact test). Small p: the change is more than evaluation noise."""
    gained = sum(a and not b for b, a in zip(before, after))
    lost = sum(b and not a for b, a in zip(before, after))
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"gained": gained, "lost": lost, "sign_test_p": p}


def _per_token(rollouts: list[Rollout], cfg: RunConfig):
    """Per-token advantages and loss weights [K], in the order of the packed responses."""
    rewards = torch.tensor([[s.reward for s in r.scores] for r in rollouts], dtype=torch.float64)
    adv = group_advantages(rewards, scale=cfg.scale_advantages).flatten()
    lens = torch.tensor([len(s.tokens) for r in rollouts for s in r.samples])
    keep = torch.tensor([not (cfg.overlong_filter and s.truncated) for r in rollouts for s in r.samples])
    return torch.repeat_interleave(adv, lens), token_weights(lens, keep, cfg.loss_agg)


def update_policy(cfg: RunConfig, learner, kept: list[Rollout], reference) -> dict:
    """Old (and reference) log-probs of the kept groups, then one optimizer step per mini-batch of groups.
    Async: the importance ratio is taken against the behaviour policy that sampled each response (its
    log-probs come with the samples), not the learner's current weights."""
    t0 = time.perf_counter()
    groups = [(r.prompt, [s.tokens for s in r.samples]) for r in kept]
    if cfg.mode == "async":
        old_logp = torch.cat([s.logprobs for r in kept for s in r.samples])
    else:
        old_logp = learner.logprobs(groups)
    ref_logp = reference.logprobs(groups) if reference is not None else None
    t_update = time.perf_counter()
    stats = []
    for part in np.array_split(np.arange(len(groups)), min(cfg.mini_batches, len(groups))):
        tok = _token_slice(groups, part)
        advantages, weights = _per_token([kept[i] for i in part], cfg)
        stats.append(learner.update([groups[i] for i in part], advantages, weights, old_logp[tok],
                                    None if ref_logp is None else ref_logp[tok]))
    return _update_stats(stats, t_update - t0, time.perf_counter() - t_update)


class _StopAfterStep:
    """First Ctrl-C: finish the current step, checkpoint, stop. Second Ctrl-C: stop at once."""

    def __init__(self):
        self.requested = False

    def __enter__(self):
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, *_):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        tqdm.write("Ctrl-C: finishing this step, then saving a checkpoint (Ctrl-C again aborts without saving)")

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._previous)


class LocalEngine:
    """Every role in this process: the rollout worker and the learner share one policy (no weight sync)."""

    def __init__(self, cfg: RunConfig, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.reference = (Scorer(copy.deepcopy(model).eval().requires_grad_(False), impl=cfg.impl,
                                 temperature=cfg.temperature, micro_batch_tokens=cfg.micro_batch_tokens)
                          if cfg.kl_coef > 0 else None)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.learner = Learner(model, self.optimizer, impl=cfg.impl, temperature=cfg.temperature,
                               micro_batch_tokens=cfg.micro_batch_tokens, clip_low=cfg.clip_low,
                               clip_high=cfg.clip_high, kl_coef=cfg.kl_coef, max_grad_norm=cfg.max_grad_norm)
        self.worker = RolloutWorker(model, tokenizer, cfg.rollout_batch_size)

    def sync_weights(self, version: int) -> dict:
        return {}

    def save(self, run_dir: pathlib.Path, step: int, extra: dict, config: dict) -> pathlib.Path:
        return checkpoint.save(run_dir, step, self.model, self.tokenizer, self.optimizer, extra, config)

    def load(self, path: pathlib.Path) -> dict:
        return checkpoint.load(path, self.model, self.optimizer)

    def close(self) -> None:
        pass


class _RolloutStream:
    """Rollouts step after step. `ahead` = 0: collected when asked (sync). `ahead` = k: up to k further steps
    are collected in one background thread while the learner works (async); the rollout workers apply each
    weight sync between generation calls, so a step's samples lag the learner by at most k versions."""

    def __init__(self, collect, next_problem: int, ahead: int, steps_left: int):
        self.collect, self.next_problem, self.ahead, self.left = collect, next_problem, ahead, steps_left
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if ahead else None
        self.pending: collections.deque = collections.deque()

    def _job(self):
        kept, sampled, self.next_problem = self.collect(self.next_problem)
        return kept, sampled, self.next_problem

    def next(self):
        """-> (kept, sampled, index of the next unused problem once this step is trained)."""
        if self.pool is None:
            return self._job()
        while self.left and len(self.pending) <= self.ahead:
            self.pending.append(self.pool.submit(self._job))
            self.left -= 1
        return self.pending.popleft().result()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def _engine(cfg: RunConfig, model, tokenizer, prompt_len: int):
    if cfg.executor == "local":
        return LocalEngine(cfg, model, tokenizer)
    from hetrl.trainer.ray_executor import RayEngine  # ray is imported only when asked for

    return RayEngine(cfg, model.config, tokenizer, prompt_len)


def train_command(config_path: str | None, overrides: list[str], *, resume: bool = False,
                  allow_config_change: bool = False, default_config: str | None = None) -> dict:
    """`hetrl train [--config RUN.yaml] [key=value ...] [--resume]`. On --resume without --config, the run's own
    config (out_dir/run_config.yaml, written when it started) is the base, so `hetrl train --resume
    out_dir=DIR` continues exactly the run in DIR."""
    if resume and config_path is None:
        out_dir = config_data(default_config, overrides).get("out_dir", RunConfig.out_dir)
        saved = pathlib.Path(str(out_dir)) / RUN_CONFIG
        config_path = str(saved) if saved.is_file() else default_config
    return train(load_config(config_path, overrides), resume=resume, allow_config_change=allow_config_change)


RUN_CONFIG = "run_config.yaml"


def resume_command(cfg: RunConfig) -> str:
    return f"hetrl train --resume out_dir={cfg.out_dir}"


@contextlib.contextmanager
def _run_lock(run_dir: pathlib.Path):
    """One run at a time in an out_dir: two would overwrite each other's checkpoints and metrics."""
    fd = os.open(run_dir / ".hetrl.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InputError(f"another hetrl run is using out_dir {run_dir}; wait for it to end or choose another "
                             "out_dir") from None
        yield
    finally:
        os.close(fd)


def _start_over(run_dir: pathlib.Path, metrics: MetricsLog, evals: MetricsLog, why: str) -> None:
    """A run with nothing to resume from (it stopped before its first checkpoint): its rows are dropped."""
    tqdm.write(f"{run_dir}: {why}; starting the run from step 0")
    for log_ in (metrics, evals):
        if os.path.lexists(log_.path):
            os.unlink(log_.path)


def _resume_point(cfg: RunConfig, run_dir: pathlib.Path, metrics, evals, resume: bool,
                  allow_config_change: bool) -> pathlib.Path | None:
    """The checkpoint to continue from (None: start at step 0), after the checks that keep a run from being
    lost (an existing run is never overwritten) or silently changed (a resume keeps its config)."""
    if not resume:
        if checkpoint.any_saved(run_dir):
            raise InputError(f"{run_dir} already holds a run with checkpoints; continue it with: "
                             f"{resume_command(cfg)}, or choose another out_dir=... to start a new one")
        if metrics.exists() or evals.exists():
            _start_over(run_dir, metrics, evals, "the run there stopped before its first checkpoint")
        return None
    ckpt = checkpoint.latest(run_dir, say=tqdm.write)
    if ckpt is None:
        if not (metrics.exists() or evals.exists() or (run_dir / RUN_CONFIG).is_file()):
            raise InputError(f"--resume: {run_dir} holds no run to resume (no checkpoint, no metrics); check "
                             "out_dir, or start a new run there without --resume")
        _start_over(run_dir, metrics, evals, "--resume: no intact checkpoint to resume from")
        return None
    changes = config_changes(checkpoint.saved_config(ckpt), cfg)
    if changes:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        if not allow_config_change:
            raise InputError(f"--resume: the config differs from the checkpoint's ({ckpt.name}) in what the run "
                             f"computes: {listed}. Resume with the run's own config ({resume_command(cfg)}), start "
                             "a new run in another out_dir, or pass --allow-config-change to continue with the new values")
        tqdm.write(f"--allow-config-change: resuming {ckpt.name} with {listed} (logged in {run_dir / 'resumes.jsonl'})")
        MetricsLog(run_dir / "resumes.jsonl").write({"checkpoint": ckpt.name, "changed": {
            k: [a, b] for k, (a, b) in changes.items()}})
    return ckpt


def train(cfg: RunConfig, resume: bool = False, allow_config_change: bool = False) -> dict:
    run_dir = pathlib.Path(cfg.out_dir)
    files.prepare_out_dir(run_dir)
    with _run_lock(run_dir):
        metrics = MetricsLog(run_dir / "metrics.jsonl")
        evals = MetricsLog(run_dir / "eval.jsonl")
        ckpt = _resume_point(cfg, run_dir, metrics, evals, resume, allow_config_change)
        files.write_text(run_dir / RUN_CONFIG, yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
        model, tokenizer = load_model(cfg.model, DTYPES[cfg.dtype], seed=cfg.seed)
        task = Task(cfg.task, cfg.task_config, cfg.seed, cfg.eval_size, cfg.reward, cfg.format_reward,
                    cfg.prompt_suffix)
        prompt_len = max(len(chat_prompt_ids(tokenizer, task.messages(p))) for p in task.eval_problems)
        limit = int(cfg.memory_limit_gib * memory.GIB) if cfg.memory_limit_gib else None
        mem = memory.check_fits(cfg, model, prompt_len, limit)
        log.info("memory estimate %.2f GiB", sum(mem.values()) / memory.GIB)
        engine = _engine(cfg, model, tokenizer, prompt_len)
        del model  # the engine holds what it needs (the Ray engine: only actors)
        try:
            return _run(cfg, engine, task, tokenizer, run_dir, metrics, evals, ckpt)
        finally:
            engine.close()


def _run(cfg, engine, task, tokenizer, run_dir, metrics, evals, ckpt) -> dict:
    step, next_problem, before, version = 0, 0, None, 0
    last_saved: pathlib.Path | None = None
    if ckpt is not None:
        state = engine.load(ckpt)
        step, next_problem, before = state["step"], state["next_problem"], state["eval_before"]
        version, last_saved = step, ckpt
        metrics.truncate_after(step)
        evals.truncate_after(step)
        tqdm.write(f"resumed from {ckpt} (step {step})")
    if before is None:
        before = evaluate(task, engine.worker, tokenizer, cfg.eval_max_new_tokens, run_dir / "eval_step_0.jsonl")
        evals.write({"step": 0, "eval_accuracy": _mean(before)})
        tqdm.write(f"held-out accuracy before training: {_mean(before):.3f} ({len(before)} problems, greedy)")

    def save(at_step):
        nonlocal last_saved
        last_saved = engine.save(run_dir, at_step, {"next_problem": next_problem, "eval_before": before},
                                 cfg.to_dict())
        return last_saved

    stream = _RolloutStream(lambda start: collect_rollouts(cfg, task, engine.worker, tokenizer, start), next_problem,
                            cfg.max_staleness if cfg.mode == "async" else 0, cfg.steps - step)
    bar = tqdm(total=cfg.steps, initial=step, desc="train", unit="step")
    with _StopAfterStep() as stop:
        while step < cfg.steps and not stop.requested:
            t0 = time.perf_counter()
            kept, sampled, next_problem = stream.next()
            t_gen = time.perf_counter() - t0  # async: only the wait for rollouts the update did not hide
            row = {"step": step + 1, **_rollout_stats(sampled, kept), "gen_s": t_gen}
            versions = [s.version for r in kept for s in r.samples if s.version is not None]
            if versions:
                row["staleness"] = version - min(versions)
                assert row["staleness"] <= (cfg.max_staleness if cfg.mode == "async" else 0), row
            if kept:
                row |= update_policy(cfg, engine.learner, kept, engine.reference)
                version += 1
                row |= engine.sync_weights(version)
            step += 1
            row["step_s"] = time.perf_counter() - t0
            row["tokens_per_s"] = row["sample_tokens"] / row["step_s"]
            metrics.write(row)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                correct = evaluate(task, engine.worker, tokenizer, cfg.eval_max_new_tokens,
                                   run_dir / f"eval_step_{step}.jsonl")
                evals.write({"step": step, "eval_accuracy": _mean(correct)})
            if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or stop.requested:
                save(step)
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.2f}", acc=f"{row['accuracy']:.2f}",
                            tok_s=f"{row['tokens_per_s']:.0f}")
    bar.close()
    stream.close()
    if stop.requested and step < cfg.steps:
        tqdm.write(f"stopped at step {step}; continue with: {resume_command(cfg)}")
        return {"stopped_at_step": step, "interrupted": True}

    after = evaluate(task, engine.worker, tokenizer, cfg.eval_max_new_tokens, run_dir / f"eval_step_{step}.jsonl")
    evals.write({"step": step, "eval_accuracy": _mean(after)})
    final = last_saved if last_saved is not None and last_saved.name == f"step_{step:06d}" else save(step)
    rows = metrics.read()
    summary = {"eval_accuracy_before": _mean(before), "eval_accuracy_after": _mean(after),
               "eval_problems": len(after), **paired_comparison(before, after), "steps": step,
               "train_seconds": sum(r.get("step_s", 0.0) for r in rows), "checkpoint": str(final),
               "config": cfg.to_dict()}
    files.write_text(run_dir / "summary.json", json.dumps(summary, indent=2))
    plot_curves(rows, evals.read(), run_dir / "curves.png")
    tqdm.write(f"held-out accuracy: before {summary['eval_accuracy_before']:.3f}, after "
               f"{summary['eval_accuracy_after']:.3f} ({len(after)} problems, greedy; {summary['gained']} gained, "
               f"{summary['lost']} lost, sign-test p = {summary['sign_test_p']:.3g}); results in {run_dir}")
    return summary


def _mean(flags: list[bool]) -> float:
    return sum(flags) / len(flags)


def _token_slice(groups, part) -> torch.Tensor:
    """Bool mask [K] of the response tokens that belong to the groups with indices `part`."""
    sizes = torch.tensor([sum(len(r) for r in resps) for _, resps in groups])
    owner = torch.repeat_interleave(torch.arange(len(groups)), sizes)
    return torch.isin(owner, torch.as_tensor(part))


def _rollout_stats(sampled: list[Rollout], kept: list[Rollout]) -> dict:
    scores = [s for r in sampled for s in r.scores]
    samples = [s for r in sampled for s in r.samples]
    return {
        "reward_mean": float(np.mean([s.reward for s in scores])),
        "accuracy": float(np.mean([s.correct for s in scores])),
        "format_rate": float(np.mean([s.formatted for s in scores])),
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
            "entropy": sum(s.entropy for s in stats) / n, "grad_norm": max(s.grad_norm for s in stats),
            "packed_tokens": packed, "standard_tokens": standard, "rho": standard / packed if packed else None,
            "logprob_s": logprob_s, "update_s": update_s}
