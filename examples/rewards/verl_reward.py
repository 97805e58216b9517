"""An example reward in verl's convention: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`.

Called once per row with the row's `data_source`, `reward_model.ground_truth` and `extra_info` (verl's Parquet
columns). A dict's `score` is the reward; its other keys are logged (metrics.jsonl: reward/compute_score/acc).

    hetrl train data=examples/data/arithmetic_verl.parquet reward=examples/rewards/verl_reward.py:compute_score
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    numbers = re.findall(r"-?\d+", solution_str)
    correct = bool(numbers) and numbers[-1] == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": float(correct)}
