"""Scoring samples with the run's rewards, and the held-out evaluation with its paired sign test.

`replies` samples a batch (multi-turn episodes in a run with tools); `score_groups` scores a step's groups and the
held-out replies alike (every reward function once per batch, TRL's convention), and ReMax's greedy baselines
(`greedy_rewards`); `evaluate` writes each greedy held-out reply with its scores; `paired_comparison` says whether
the change between two evaluations on the same prompts is more than evaluation noise.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib

import numpy as np

from hetrl.data import Example, RewardSet, Scores, Source
from hetrl.data.rewards import nested
from hetrl.trainer import episodes, files, guards
from hetrl.trainer.config import RunConfig
from hetrl.trainer.engine import Episodes, Generator
from hetrl.trainer.rollout import Sample

log = logging.getLogger(__name__)


def replies(worker: Generator, episode_worker: Episodes | None, examples: list[Example], n: int,
            max_new_tokens: int, **sampling) -> list[list[Sample]]:
    """`n` samples for each example: multi-turn episodes through `episode_worker` in a run with tools or an environment,
    else `worker`'s replies to the prompt ids. `sampling`: temperature, top_p, greedy, logprobs (Generator's)."""
    if episode_worker is not None:
        return episode_worker.generate(examples, n, max_new_tokens, **sampling)
    return worker.generate([e.prompt_ids for e in examples], n, max_new_tokens, **sampling)


def score_groups(rewards: RewardSet, examples: list[Example], outputs: list[list[Sample]], check: bool = False
                 ) -> Scores:
    """Every sample of every group in one call of each reward function (TRL's batch convention). `check`: the
    first training step's rewards are looked at for silent zeros (RewardSet.check_silent_zeros)."""
    rows = [e.row if s.episode is None or s.episode.environment is None else {**e.row, "environments":
            s.episode.environment} for e, samples in zip(examples, outputs) for s in samples]   # TRL's environments=
    return rewards.score(rows, [r["prompt"] for r in rows], [s.text for g in outputs for s in g],
                         [s.tokens for g in outputs for s in g], check=check)


def evaluate(cfg: RunConfig, source: Source, rewards: RewardSet, worker: Generator,
             path: pathlib.Path, episode_worker: Episodes | None = None) -> tuple[list[float], dict]:
    """Greedy replies to every held-out prompt, scored by every reward function; each reply is written to `path`
    (JSONL). -> (each prompt's score for the paired test: correct or not where a built-in check defines
    correctness, else the weighted reward; the means for eval.jsonl)."""
    examples = source.eval_examples
    outputs = replies(worker, episode_worker, examples, 1, cfg.eval_max_new_tokens, greedy=True)
    scores = score_groups(rewards, examples, outputs)
    failed = set(scores.failed)   # rows no function scored (all failed or returned None) have no reward, not 0
    scored = [i not in failed and any(v[i] is not None for v in scores.per_function.values())
              for i in range(len(examples))]
    total = [t if ok else None for t, ok in zip(scores.total, scored)]
    rows = []
    for i, (example, (sample,)) in enumerate(zip(examples, outputs)):
        row = {"prompt": example.row["prompt"]}
        answer = nested(example.row, cfg.answer_key)
        if answer is not None:
            row["answer"] = answer
        row |= {"reply": sample.text, "reward": total[i],
                "rewards": {name: values[i] for name, values in scores.per_function.items()}}
        if scores.correct is not None:
            row["correct"] = scores.correct[i]
        rows.append(row)
    files.write_text(path, "".join(json.dumps(r, default=str, ensure_ascii=False) + "\n" for r in rows))   # UTF-8
    values = [t for t in total if t is not None]
    means = {"eval_reward": guards.mean(values) if values else math.nan}   # NaN: logged as null
    if scores.correct is not None:   # over the replies the check judged (a row without an answer is not)
        judged = [c for c in scores.correct if c is not None]
        means["eval_accuracy"] = float(np.mean(judged)) if judged else math.nan
        if len(judged) < len(scores.correct):
            means["eval_not_judged"] = len(scores.correct) - len(judged)
            log.warning("%d of %d held-out replies were not judged by %s (their rows have no %s to check against): "
                        "eval_accuracy is over the other %d", len(scores.correct) - len(judged), len(scores.correct),
                        rewards.correctness, cfg.answer_key, len(judged))
    means |= {f"eval_{k}": v for k, v in scores.means().items()}
    means |= episodes.episode_metrics([s for g in outputs for s in g], prefix="eval_")
    if len(values) < len(total):
        means["eval_unscored"] = len(total) - len(values)
    return paired_scores(rows), means


def paired_scores(rows: list[dict]) -> list[float]:
    """Each held-out prompt's score for the paired test, from the rows `evaluate` writes (eval_step_N.jsonl):
    correct or not where a built-in check judged the replies (a row it could not judge: NaN), else the weighted
    reward (NaN where none scored it)."""
    key = "correct" if any("correct" in r for r in rows) else "reward"
    return [math.nan if r.get(key) is None else float(r[key]) for r in rows]


def greedy_rewards(cfg: RunConfig, rewards: RewardSet, worker, episode_worker, examples: list[Example]) -> list[float]:
    """ReMax's baselines: each prompt's greedy response (one more rollout), scored by the run's rewards."""
    outputs = replies(worker, episode_worker, examples, 1, cfg.max_new_tokens, greedy=True)
    return list(score_groups(rewards, examples, outputs).total)


def paired_comparison(before: list[float], after: list[float]) -> dict:
    """Same prompts before and after: how many got better and how many worse, and the exact two-sided sign-test
    p-value on those (for correct/incorrect this is McNemar's exact test). Small p: the change is more than
    evaluation noise. A prompt either side has no score for (NaN: no reward function scored it) is left out."""
    pairs = [(b, a) for b, a in zip(before, after) if not (math.isnan(a) or math.isnan(b))]   # both scored
    gained = sum(a > b for b, a in pairs)
    lost = sum(b > a for b, a in pairs)
    n, k = gained + lost, min(gained, lost)
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2**n) if n else 1.0
    return {"gained": gained, "lost": lost, "sign_test_p": p}


def score_name(means: dict) -> str:
    return "accuracy" if "eval_accuracy" in means else "reward"


def headline(means: dict) -> float:
    return means.get("eval_accuracy", means["eval_reward"])


def shown(means: dict) -> str:
    """The headline score as printed: 3 decimals, or why there is none."""
    v = headline(means)
    return decimals(v, 3) if math.isfinite(v) else "none (no reward function scored any held-out reply)"


def decimals(v: float, places: int) -> str:
    """A score as printed: `places` decimals, or 4 significant digits where it is a million or more (a reward of
    1e30 printed 31 digits and a fraction)."""
    if v is None:
        return "none"
    return f"{v:.{places}f}" if not math.isfinite(v) or abs(v) < 1e6 else f"{v:.4g}"
