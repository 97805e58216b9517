"""Write the example datasets of examples/data/ from reasoning-gym problems (deterministic; run from the repo root):

- arithmetic_chat.jsonl: TRL's conversational form: `prompt` (chat messages), `answer`, and two extra columns a
  reward may read (`num_terms`, `source`); 600 rows.
- arithmetic_verl.parquet: verl's RL form: `prompt` (chat messages), `data_source`, `ability`,
  `reward_model: {style, ground_truth}`, `extra_info: {split, index}`; the same 600 problems.

    python scripts/make_example_data.py
"""

from __future__ import annotations

import json
import pathlib

import datasets
import reasoning_gym

OUT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "data"
# The default run's task (2-term + and -, numbers up to 99): results compare with benchmarks/results/train_default.
OPTIONS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"], allow_negation=False,
               allow_parentheses=False)
ROWS, SEED = 600, 20261123


def main() -> None:
    problems = reasoning_gym.create_dataset("basic_arithmetic", size=ROWS, seed=SEED, **OPTIONS)
    chat, verl = [], []
    for i in range(ROWS):
        p = problems[i]
        messages = [{"role": "user", "content": p["question"]}]
        chat.append({"prompt": messages, "answer": p["answer"], "num_terms": p["metadata"]["num_terms"],
                     "source": "reasoning-gym/basic_arithmetic"})
        verl.append({"prompt": messages, "data_source": "reasoning_gym/basic_arithmetic", "ability": "math",
                     "reward_model": {"style": "rule", "ground_truth": p["answer"]},
                     "extra_info": {"split": "train", "index": i}})
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "arithmetic_chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat))
    datasets.Dataset.from_list(verl).to_parquet(str(OUT / "arithmetic_verl.parquet"))
    print(f"wrote {OUT / 'arithmetic_chat.jsonl'} and {OUT / 'arithmetic_verl.parquet'} ({ROWS} rows each)")


if __name__ == "__main__":
    main()
