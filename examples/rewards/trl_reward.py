"""Example reward functions in TRL's convention: `f(completions, **kwargs) -> list[float | None]`.

Called once per batch. `completions[i]` is the i-th reply (chat prompts give [{"role": "assistant", "content": ...}]),
and every dataset column arrives by name as a list with the row's value at position i (here `answer`); `prompts` and
`completion_ids` come too. `None` means "does not apply to this row" and is left out of the weighted sum.

    hetrl train data=examples/data/arithmetic_chat.jsonl reward=examples/rewards/trl_reward.py:correct_answer
"""

import re


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[-1]["content"]


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the reply's last number is the row's `answer`, else 0.0."""
    out = []
    for completion, gold in zip(completions, answer):
        numbers = re.findall(r"-?\d+", _text(completion))
        out.append(1.0 if numbers and numbers[-1] == str(gold).strip() else 0.0)
    return out


def brevity(completions, completion_ids, num_terms, **kwargs) -> list[float | None]:
    """A small bonus for short replies to short sums: 1 - length/32, for 2-term problems only (None otherwise)."""
    return [max(0.0, 1.0 - len(ids) / 32) if n == 2 else None for ids, n in zip(completion_ids, num_terms)]
