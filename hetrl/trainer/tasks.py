"""Tasks and rewards: reasoning-gym generators (procedural, offline) and verifiable answer checks.

Training problems are a deterministic stream (problem k is the same in every run with the same
seed); the held-out evaluation set comes from a different seed, and any training problem whose
question also appears in it is skipped, so evaluation never sees a trained question.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def extract_answer(text: str) -> str:
    """The final answer of a reply: the content of <answer>...</answer> if present, else its last number."""
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    if tagged:
        return tagged[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else ""


@dataclass(frozen=True)
class Score:
    reward: float
    correct: bool
    formatted: bool


class Task:
    """A reasoning-gym generator with a prompt format and a reward."""

    def __init__(self, name: str, options: dict, seed: int, eval_size: int, reward: str = "verifier",
                 format_reward: float = 0.0, prompt_suffix: str = ""):
        import reasoning_gym

        known = set(reasoning_gym.factory.DATASETS)
        if name not in known:
            raise ValueError(f"unknown task {name!r}; reasoning-gym has: {', '.join(sorted(known))}")
        self.name, self.options, self.seed = name, dict(options), seed
        self.reward_kind, self.format_reward, self.prompt_suffix = reward, format_reward, prompt_suffix
        try:
            self._eval = reasoning_gym.create_dataset(name, size=eval_size, seed=seed + 1_000_003, **self.options)
        except TypeError as e:
            raise ValueError(f"bad task_config for {name!r}: {e}") from None
        self._train_size = 1_000_000
        self._train = reasoning_gym.create_dataset(name, size=self._train_size, seed=seed, **self.options)
        self.eval_problems = [self._eval[i] for i in range(eval_size)]
        self._eval_questions = {p["question"] for p in self.eval_problems}

    def train_problems(self, start: int, count: int) -> tuple[list[dict], int]:
        """`count` training problems from stream index `start` -> (problems, next index)."""
        out, k = [], start
        while len(out) < count:
            if k >= self._train_size:
                raise ValueError(f"task {self.name!r} ran out of distinct training problems after {k}")
            problem = self._train[k]
            k += 1
            if problem["question"] not in self._eval_questions:
                out.append(problem)
        return out, k

    def messages(self, problem: dict) -> list[dict]:
        return [{"role": "user", "content": problem["question"] + self.prompt_suffix}]

    def score(self, problem: dict, reply: str) -> Score:
        answer = extract_answer(reply)
        if self.reward_kind == "math_verify":
            from math_verify import parse, verify

            correct = bool(answer) and bool(verify(parse(problem["answer"]), parse(reply)))
            graded = float(correct)
        else:
            graded = float(self._train.score_answer(answer, problem))
            correct = graded >= 1.0
        formatted = bool(answer) and reply.strip() == answer
        base = graded if self.reward_kind == "partial" else float(correct)
        return Score(reward=base + self.format_reward * formatted, correct=correct, formatted=formatted)
