"""hetrl: RL post-training of LLMs on heterogeneous hardware (HetRL planning + DualKV training)."""

from __future__ import annotations

__version__ = "0.1.0"


def train(config=None, *, train_dataset=None, eval_dataset=None, reward_funcs=None, tools=None,
          environment_factory=None, resume: bool = False, allow_config_change: bool = False, **overrides) -> dict:
    """`hetrl train` from Python.

    config: a RunConfig, a mapping of its fields, a run YAML path, or None (the built-in defaults); `overrides`
      are more fields (`hetrl.train("run.yaml", steps=5)`).
    train_dataset / eval_dataset: a `datasets.Dataset`, a list of dicts, or a path (JSONL, JSON, Parquet, CSV, a
      save_to_disk directory); the prompt is in column `prompt_key` (default "prompt").
    reward_funcs: callables in TRL's `f(completions, **columns) -> list[float | None]` or verl's
      `compute_score(data_source, solution_str, ground_truth, extra_info=None)` convention, built-in names
      ("exact_match", "math_verify", ...) or "FILE.py:NAME" specs; weighted by the config's `reward_weights`.
    tools / environment_factory: TRL's conventions (docs/agents.md): functions with type hints and a Google
      docstring; a class whose instances (one per rollout) have reset(), tool methods and optionally get_reward().
    resume / allow_config_change: as `hetrl train --resume --allow-config-change` (a changed config or changed
      data is accepted on resume and logged in out_dir/resumes.jsonl).
    Returns the run's summary (as summary.json).
    """
    from hetrl.trainer.config import RunConfig, python_config
    from hetrl.trainer.run import python_fields
    from hetrl.trainer.run import train as _train

    fields = python_config(config, overrides)
    fields |= python_fields(fields.get("data"), fields.get("eval_data"), train_dataset, eval_dataset, reward_funcs,
                            tools, environment_factory, overrides.get("reward"))
    from hetrl.cli import warnings_beside_bars

    with warnings_beside_bars():   # a warning during the progress bar gets a line of its own, not the bar's end
        return _train(RunConfig(**fields), resume=resume, allow_config_change=allow_config_change,
                      train_dataset=train_dataset, eval_dataset=eval_dataset, reward_funcs=reward_funcs, tools=tools,
                      environment_factory=environment_factory)
