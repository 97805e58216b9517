"""Finiteness guards: a run never trains on, saves or logs a non-finite number.

Huge but finite rewards (a reward returning 1e308) overflow in the group mean or spread and poison every weight
through one optimizer step; the checkpoint written after it would be the run's only one, all NaN. So each step
checks, in order, the rewards' weighted totals, the advantages (and the group spread they divide by), then each
optimizer step's loss and gradient norm, which the learner checks itself before it steps (Learner.update: a
non-finite one leaves the weights as they were). `nonfinite=stop` (the default) ends the run on the first
non-finite quantity with one line naming it and the rows, before that step's checkpoint; `nonfinite=skip` drops
what is poisoned (the step's update, or one optimizer step) and logs it in metrics.jsonl (`skipped`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from hetrl.schema import InputError


class NonFiniteError(InputError):
    """A non-finite reward total, advantage, loss or gradient norm, with the rows it came from."""


def finite_or_none(value):
    """A metrics value with every non-finite float (at any depth) as None: metrics.jsonl stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def mean(values) -> float:
    """The mean of a step's rewards; huge ones give inf (logged as null), without numpy's overflow warning."""
    with np.errstate(over="ignore", invalid="ignore"):
        return float(np.mean(values))


def _rows(bad: list[tuple[int, int]], show: int = 4) -> str:
    """[(group, sample)] -> 'group 0 sample 1, group 2 sample 0 (and 3 more)'."""
    text = ", ".join(f"prompt {g} sample {s}" for g, s in bad[:show])
    return text + (f" (and {len(bad) - show} more)" if len(bad) > show else "")


def _prompt(example_row: dict) -> str:
    prompt = example_row.get("prompt")
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""
    return repr(text[:60] + ("..." if len(text) > 60 else ""))


def check_rewards(step: int, groups) -> str | None:
    """`groups`: the step's rollouts (each with `.rewards` and `.example`). -> None when every reward total and
    every group's mean and spread are finite, else the one-line reason (quantity, rows, prompt)."""
    bad = [(g, s) for g, r in enumerate(groups) for s, v in enumerate(r.rewards) if not math.isfinite(v)]
    if bad:
        g = bad[0][0]
        return (f"step {step}: non-finite reward total at {_rows(bad)} "
                f"(first prompt {_prompt(groups[g].example.row)}): "
                "the weighted sum of the reward functions overflows; keep rewards in a sane range (e.g. [-10, 10])")
    for g, r in enumerate(groups):
        values = torch.tensor(r.rewards, dtype=torch.float64)
        if len(values) > 1 and not (torch.isfinite(values.mean()) and torch.isfinite(values.std())):
            return (f"step {step}: non-finite advantages for prompt {g} ({_prompt(r.example.row)}): its rewards "
                    f"{[float(v) for v in values[:4]]}{'...' if len(values) > 4 else ''} overflow the group mean "
                    "or spread in float64; keep rewards in a sane range (e.g. [-10, 10])")
    return None


def check_advantages(step: int, advantages: torch.Tensor, sizes: list[int], what: str = "advantages") -> str | None:
    """advantages (or PPO's returns) [K] for groups of `sizes` tokens each -> None or the one-line reason."""
    bad_at = torch.nonzero(~torch.isfinite(advantages)).flatten().tolist()
    if not bad_at:
        return None
    bounds = torch.cumsum(torch.tensor(sizes), 0).tolist()
    groups = sorted({next(g for g, b in enumerate(bounds) if i < b) for i in bad_at})
    return (f"step {step}: {len(bad_at)} non-finite {what} in prompt(s) {', '.join(map(str, groups[:8]))}"
            f"{' ...' if len(groups) > 8 else ''}; keep rewards in a sane range (e.g. [-10, 10])")


def check_update(step: int, what: str, minibatch: int, loss: float, grad_norm: float) -> str | None:
    """One optimizer step's loss and gradient norm (the learner skipped the step if either is non-finite)."""
    bad = [f"{name} {value}" for name, value in (("loss", loss), ("gradient norm", grad_norm))
           if not math.isfinite(value)]
    if not bad:
        return None
    return (f"step {step}: {what} mini-batch {minibatch}: non-finite {' and '.join(bad)}; the optimizer step was "
            "not taken (the weights are as before it); lower lr, check the rewards' scale, or set precision=fp32")


def worst(values) -> float:
    """The largest of `values`, non-finite first (Python's max() drops a NaN that is not first)."""
    values = list(values)
    return next((v for v in values if not math.isfinite(v)), max(values))


def act(policy: str, reason: str | None, skipped: list[str]) -> bool:
    """Apply the run's `nonfinite` policy to a check's result: raise (stop) or record it (skip).
    -> True when something was skipped."""
    if reason is None:
        return False
    if policy == "stop":
        raise NonFiniteError(f"{reason}; no checkpoint was written for this step (the last one is intact); "
                             "nonfinite=skip drops such steps instead of stopping")
    skipped.append(reason)
    return True
