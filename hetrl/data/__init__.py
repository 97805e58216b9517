"""Where prompts and rewards come from: reasoning-gym tasks, a user's rows, chat rendering, reward functions.

No torch model code here, and no import of hetrl.trainer, dualkv, planner, algo or ray (tests/test_layering.py).
"""

from .rewards import RewardSet, Scores, builtin_rewards, convention, extract_answer, load_reward
from .sources import Example, RowSource, Source, TaskSource, as_rows, load_rows, prompt_ids

__all__ = ["Example", "RewardSet", "RowSource", "Scores", "Source", "TaskSource", "as_rows", "builtin_rewards",
           "convention", "extract_answer", "load_reward", "load_rows", "prompt_ids"]
