"""The run's entry: `hetrl train` and `hetrl.train()` up to the first step, and what resumes it.

Config (and what was given from Python) -> one run per out_dir (a lock) -> the checkpoint to resume from, with
the checks that keep a run from being lost or silently changed -> the user's tools, data and rewards checked before
the model loads -> model, prompts, rewards, engine -> the step loop (hetrl/trainer/loop.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import random

import numpy as np
import torch
import yaml
from tqdm import tqdm

from hetrl.data import RewardSet, RowSource, Source, TaskSource
from hetrl.data.sources import (
    check_plain_text,
    held_out_data,
    held_out_label,
    input_problems,
)
from hetrl.data.tools import environment_reward
from hetrl.models import load_model
from hetrl.schema import InputError
from hetrl.trainer import allocator, build, checkpoint, episodes, files, loop, memory, vllm_engine
from hetrl.trainer.checkpoint import resume_command
from hetrl.trainer.config import (
    PYTHON,
    RAN_IN,
    RunConfig,
    config_changes,
    config_data,
    from_python,
    load_config,
)
from hetrl.trainer.engine import Engine, make_engine
from hetrl.trainer.metrics import MetricsLog, plot_curves, tracker
from hetrl.trainer.precision import decide, driver_device

log = logging.getLogger(__name__)

RUN_CONFIG = "run_config.yaml"


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


def train(cfg: RunConfig, resume: bool = False, allow_config_change: bool = False, *, train_dataset=None,
          eval_dataset=None, reward_funcs=None, tools=None, environment_factory=None) -> dict:
    """Run (or with `resume`, continue) the training run `cfg` describes. From Python, `train_dataset` /
    `eval_dataset` (a datasets.Dataset or a list of dicts), `reward_funcs` (callables, built-in names or
    FILE.py:NAME specs), `tools` (functions) and `environment_factory` (a class or factory) stand in for the
    config's data, reward, tools and environment."""
    changes = python_fields(cfg.data, cfg.eval_data, train_dataset, eval_dataset, reward_funcs, tools,
                            environment_factory)
    if any(getattr(cfg, k) != v for k, v in changes.items()):
        cfg = dataclasses.replace(cfg, **changes)
    run_dir = pathlib.Path(cfg.out_dir)
    passed = dict(train_dataset=train_dataset, eval_dataset=eval_dataset, reward_funcs=reward_funcs, tools=tools,
                  environment_factory=environment_factory)
    missing = [a for a in from_python(cfg) if passed[a] is None]
    if resume and missing:   # before anything loads: a reward recorded as <python>:NAME cannot be imported
        raise InputError(f"this run was given {', '.join(missing)} from Python; resume it from Python with the same: "
                         f"hetrl.train(..., {', '.join(f'{a}=...' for a in missing)}, resume=True)")
    if cfg.has_critic and cfg.critic_warmup_steps >= cfg.steps:   # legitimate as the first part of a longer run
        log.warning("warning: critic_warmup_steps (%d) covers all %d steps of this run: only the critic is trained "
                    "(resume with more steps to train the policy)", cfg.critic_warmup_steps, cfg.steps)
    if resume and not run_dir.is_dir():   # before prepare_out_dir would create it
        raise InputError(f"--resume: {run_dir} does not exist, so there is no run to resume; check out_dir=..., or "
                         "start a new run without --resume")
    files.prepare_out_dir(run_dir)
    with _run_lock(run_dir):
        metrics = MetricsLog(run_dir / "metrics.jsonl")
        evals = MetricsLog(run_dir / "eval.jsonl")
        ckpt, changed = _resume_point(cfg, run_dir, metrics, evals, resume, allow_config_change)
        summary = _summary_at(run_dir, cfg.steps) if ckpt is not None and checkpoint.step_of(ckpt) == cfg.steps \
            else None
        if summary is not None:
            return _already_finished(run_dir, metrics, evals, summary)

        def record(more: tuple[dict, ...] = ()) -> None:
            """What a run that goes ahead writes: its config (where it ran: what its relative paths are read from)
            and, on a resume, the changes it was allowed (resumes.jsonl). Written once the run's checks passed (a
            new run's data and rewards; a resume's data, rewards and checkpoint): a refused resume left
            run_config.yaml saying what it was refused for, and the next plain --resume was then refused as a
            change."""
            files.write_text(run_dir / RUN_CONFIG,
                             f"{RAN_IN}{os.getcwd()}\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=False))
            for entry in (*changed, *more):
                MetricsLog(run_dir / "resumes.jsonl").write(entry)

        metrics.tracker = evals.tracker = tracker(cfg.report_to, run_dir, cfg.to_dict())
        try:
            # the driver computes on the CPU unless a local run is on a GPU: its large tensors reuse freed memory
            on_cpu = driver_device(cfg).type == "cpu"
            with allocator.freed_memory_kept(on_cpu):
                return _prepare_and_run(cfg, run_dir, metrics, evals, ckpt, train_dataset, eval_dataset, reward_funcs,
                                        tools, environment_factory, allow_config_change, record)
        finally:
            if metrics.tracker is not None:
                metrics.tracker.close()


def decide_run(cfg):
    """What a run decides once, before its data and model (hetrl train and hetrl diagnose start here): the seeds,
    the driver's device, the precision (every role, the plan, the log and summary.json carry it) and the rollout
    engine, checked against the config (the engine and its correction carry it). -> (device, precision, engine)"""
    random.seed(cfg.seed), np.random.seed(cfg.seed), torch.manual_seed(cfg.seed)
    device = driver_device(cfg)
    precision = decide(cfg)
    if device.type == "cuda":
        build.fast_fp32_matmuls(precision)
    rollout_engine = vllm_engine.choose(cfg, device)
    return device, precision, rollout_engine


def load_policy(cfg, device):
    """The run's model (its torch_dtype, seeded) on the driver's device, and its tokenizer."""
    model, tokenizer = load_model(cfg.model, cfg.torch_dtype, seed=cfg.seed)
    return model.to(device), tokenizer


def _prepare_and_run(cfg, run_dir, metrics, evals, ckpt, train_dataset, eval_dataset, reward_funcs, tools=None,
                     environment_factory=None, allow_config_change: bool = False, record=None) -> dict:
    device, precision, rollout_engine = decide_run(cfg)
    tools, environment_factory = episodes.resolve_tools(cfg, tools, environment_factory)
    train_dataset, eval_dataset = up_front(cfg, train_dataset, eval_dataset, reward_funcs)   # before the model
    if ckpt is None:   # a new run that passed its checks (a resume records itself once its own checks passed)
        record()
    model, tokenizer = load_policy(cfg, device)
    agent = episodes.agent_from_config(cfg, tokenizer, tools, environment_factory)
    source = build_source(cfg, agent.render_tokenizer(tokenizer) if agent else tokenizer, train_dataset, eval_dataset,
                          model.config)
    rewards = build_rewards(cfg, source, reward_funcs, agent)
    if isinstance(source, RowSource) and len(source.train_rows) < cfg.prompts_per_step:
        log.warning("warning: %d training rows for prompts_per_step=%d: each step repeats prompts (an epoch is "
                    "less than a step); lower prompts_per_step or give more rows", len(source.train_rows),
                    cfg.prompts_per_step)
    if agent is not None:
        tqdm.write(f"tools: {', '.join(s['function']['name'] for s in agent.schemas)}; chat template: "
                   + ("the model's" if agent.template is None else "hetrl's Qwen2.5-style ChatML (the model's "
                      "renders no tools)"))
    tqdm.write(f"prompts: {source.description}; rewards: "
               + ", ".join(f"{n} x{w:g}" for n, w in zip(rewards.names, rewards.weights))
               + f"; precision: {precision}"
               + (f"; rollout: {vllm_engine.describe(cfg, rollout_engine)}" if rollout_engine != "hf" else ""))
    first, _, _ = source.train_examples(0, min(64, cfg.prompts_per_step * 4))
    prompt_len = max(len(e.prompt_ids) for e in source.eval_examples + first)
    limit = int(cfg.memory_limit_gib * memory.GIB) if cfg.memory_limit_gib else memory.available_bytes(device)
    mem = memory.check_fits(cfg, model, prompt_len, precision, limit)
    log.info("memory estimate %.2f GiB", sum(mem.values()) / memory.GIB)
    try:
        engine = make_engine(cfg, model, tokenizer, prompt_len, precision, agent, rollout_engine)
        del model  # the engine holds what it needs (the Ray engine: only actors)
        try:
            resumed = None if ckpt is None else (ckpt, _resume(engine, ckpt, source, rewards, metrics, evals,
                                                               allow_config_change, record))
            return loop.run_steps(cfg, engine, source, rewards, run_dir, metrics, evals, resumed)
        finally:
            engine.close()
    finally:
        rewards.close()


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
                  allow_config_change: bool) -> tuple[pathlib.Path | None, list[dict]]:
    """The checkpoint to continue from (None: start at step 0) and the changes to log in resumes.jsonl once the
    resume goes ahead, after the checks that keep a run from being lost (an existing run is never overwritten)
    or silently changed (a resume keeps its config, or the changes resumes.jsonl says it was allowed before: a
    resume that falls back past a damaged checkpoint to one saved before such a change is the run's own)."""
    if not resume:
        if checkpoint.any_saved(run_dir):
            raise InputError(f"{run_dir} already holds a run with checkpoints; continue it with: "
                             f"{resume_command(cfg)}, or choose another out_dir=... to start a new one")
        if metrics.exists() or evals.exists():
            _start_over(run_dir, metrics, evals, "the run there stopped before its first checkpoint")
        return None, []
    ckpt = checkpoint.latest(run_dir, say=tqdm.write)
    if ckpt is None:
        if not (metrics.exists() or evals.exists() or (run_dir / RUN_CONFIG).is_file()):
            raise InputError(f"--resume: {run_dir} holds no run to resume (no checkpoint, no metrics); check "
                             "out_dir, or start a new run there without --resume")
        _start_over(run_dir, metrics, evals, "--resume: no intact checkpoint to resume from")
        return None, []
    step = checkpoint.step_of(ckpt)
    if step > cfg.steps:
        raise InputError(f"--resume: the newest checkpoint ({ckpt.name}) is at step {step}, past steps={cfg.steps}; "
                         f"resume with steps >= {step}, or start a new run in another out_dir")
    changes = config_changes(checkpoint.saved_config(ckpt), cfg)
    fixed = {k: v for k, v in changes.items() if k in FIXED_ON_RESUME}
    if fixed:   # the checkpoint's weights are for the old value: loading them would fail (or fit nothing)
        raise InputError(f"--resume: {', '.join(f'{k} {a!r} -> {b!r}' for k, (a, b) in fixed.items())} cannot "
                         f"change on a resume, even with --allow-config-change: {ckpt.name} holds weights for the "
                         "old value. Resume with it, or start a new run in another out_dir")
    allowed_before = _allowed_before(run_dir)
    if changes and all(k in allowed_before and allowed_before[k] == b for k, (_, b) in changes.items()):
        tqdm.write(f"--resume: {ckpt.name} was saved before changes this run was allowed later (resumes.jsonl): "
                   + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items()))
        return ckpt, []
    if changes:
        listed = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
        if not allow_config_change:
            raise InputError(f"--resume: the config differs from the checkpoint's ({ckpt.name}) in what the run "
                             f"computes: {listed}. Resume with the run's own config ({resume_command(cfg)}), start "
                             "a new run in another out_dir, or pass --allow-config-change (from Python: "
                             "hetrl.train(..., resume=True, allow_config_change=True)) to continue with the new values")
        tqdm.write(f"--allow-config-change: resuming {ckpt.name} with {listed} (logged in {run_dir / 'resumes.jsonl'})")
        return ckpt, [{"checkpoint": ckpt.name, "changed": {k: [a, b] for k, (a, b) in changes.items()}}]
    return ckpt, []


def _allowed_before(run_dir: pathlib.Path) -> dict:
    """Field -> the value an earlier resume of this run was allowed to change it to (resumes.jsonl), the latest."""
    out = {}
    for entry in MetricsLog(run_dir / "resumes.jsonl").read():
        for k, change in (entry.get("changed") or {}).items():
            if isinstance(change, list) and len(change) == 2:
                out[k] = change[1]
    return out


FIXED_ON_RESUME = ("model", "lora_rank", "lora_target_modules", "critic_model")   # what a checkpoint's weights are


def _already_finished(run_dir: pathlib.Path, metrics: MetricsLog, evals: MetricsLog, summary: dict) -> dict:
    """--resume of a run that ended (summary.json written after its final evaluation): nothing is trained or
    evaluated again (a second final row would land in eval.jsonl); the plot, the one file written after the
    summary, is drawn again in case the run was stopped while drawing it. -> the run's summary."""
    plot_curves(metrics.read(), evals.read(), run_dir / "curves.png")
    steps = summary["steps"]
    tqdm.write(f"{run_dir}: the run already finished its {steps} steps and its final evaluation (summary.json); "
               f"nothing to resume. To train further, resume with steps=N above {steps}")
    return summary


def _summary_at(run_dir: pathlib.Path, step: int) -> dict | None:
    """The run's summary.json (written after the final evaluation) when it says the run ended at `step`."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == step else None


def _resume(engine: Engine, ckpt: pathlib.Path, source: Source, rewards: RewardSet, metrics: MetricsLog,
            evals: MetricsLog, allow_config_change: bool, record) -> dict:
    """The engine restored from `ckpt`, the logs cut back to its step, the run's config and allowed changes
    written (`record`, once every check passed); -> its trainer state."""
    state = engine.load(ckpt)
    record(_check_same_data(state, source, rewards, ckpt, allow_config_change))
    metrics.truncate_after(state["step"])
    evals.truncate_after(state["step"])
    tqdm.write(f"resumed from {ckpt} (step {state['step']})")
    return state


def _check_same_data(state: dict, source: Source, rewards: RewardSet, ckpt: pathlib.Path,
                     allow_config_change: bool = False) -> tuple[dict, ...]:
    """A checkpoint continues only on the data and rewards it was trained with (a path's file may have changed,
    and data or rewards from Python have no path to compare), unless the user allows the change (data that was
    fixed after a run stopped on it; other reward functions), which is logged in resumes.jsonl: -> its entries."""
    allow = ("--allow-config-change (hetrl.train(..., resume=True, allow_config_change=True)) to continue with "
             "the change (logged; the held-out comparison is then not paired)")
    out = []
    if state.get("data_fingerprint") not in (None, source.fingerprint):
        if not allow_config_change:
            raise InputError(f"--resume: {ckpt} was trained on other data than {source.description} (its rows, the "
                             f"held-out split or the prompt columns differ); resume with the run's own data, pass "
                             f"{allow}, or start a new run in another out_dir")
        tqdm.write(f"--allow-config-change: resuming {ckpt.name} on changed data ({source.description})")
        out.append({"checkpoint": ckpt.name, "changed": {
            "data_fingerprint": [state["data_fingerprint"], source.fingerprint]}})
    if state.get("reward_names") not in (None, rewards.names):
        if not allow_config_change:
            raise InputError(f"--resume: {ckpt} was trained with rewards {', '.join(state['reward_names'])}, now "
                             f"{', '.join(rewards.names)}; pass the same reward functions, or pass {allow}")
        tqdm.write(f"--allow-config-change: resuming {ckpt.name} with rewards {', '.join(rewards.names)} (was "
                   f"{', '.join(state['reward_names'])})")
        out.append({"checkpoint": ckpt.name, "changed": {"reward_names": [state["reward_names"], rewards.names]}})
    return tuple(out)


def prompt_cap(cfg: RunConfig, model_config) -> int:
    """The longest prompt the run keeps: max_prompt_tokens, or less where the model's context
    (max_position_embeddings) minus the longest reply (max_new_tokens, eval_max_new_tokens) is less, said in the
    log; refused where a reply alone fills the context (past it a model's positions are not ones it was trained on,
    and the replies are garbage without an error)."""
    context = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(context, int) or context <= 0:
        return cfg.max_prompt_tokens
    knob, reply = max((("max_new_tokens", cfg.max_new_tokens), ("eval_max_new_tokens", cfg.eval_max_new_tokens)),
                      key=lambda kv: kv[1])
    if reply >= context:
        raise InputError(f"{knob}={reply} fills model {cfg.model}'s context of {context} tokens "
                         f"(max_position_embeddings) and leaves no room for a prompt; use less than {context}")
    if context - reply < cfg.max_prompt_tokens:
        log.warning("model %s's context is %d tokens and replies take up to %d (%s): prompts longer than %d tokens "
                    "are skipped as too long (max_prompt_tokens=%d asks for more)", cfg.model, context, reply, knob,
                    context - reply, cfg.max_prompt_tokens)
        return context - reply
    return cfg.max_prompt_tokens


def build_source(cfg: RunConfig, tokenizer, train_dataset=None, eval_dataset=None, model_config=None) -> Source:
    """The run's prompts: the user's rows (`data=` or a dataset from Python) or the reasoning-gym task; prompts
    longer than `prompt_cap` (max_prompt_tokens within the model's context) are skipped and counted."""
    cap = prompt_cap(cfg, model_config)
    if cfg.data is None and eval_dataset is not None:
        raise InputError("eval_dataset is the held-out part of train_dataset; pass train_dataset too")
    check_plain_text(tokenizer, prompt_suffix=cfg.prompt_suffix, response_prefix=cfg.response_prefix)
    if cfg.data is None:
        return TaskSource(cfg.task, cfg.task_config, cfg.seed, cfg.eval_size, tokenizer, cap,
                          cfg.prompt_suffix, cfg.response_prefix)
    if cfg.data == PYTHON and train_dataset is None:
        raise InputError("this run's data was passed from Python (hetrl.train(..., train_dataset=...)); resume it "
                         "from Python with the same dataset: hetrl.train(..., train_dataset=..., resume=True)")
    data = train_dataset if train_dataset is not None else cfg.data
    evals = eval_dataset if eval_dataset is not None else held_out_data(cfg.data, cfg.eval_data, cfg.eval_size)
    if evals == PYTHON:
        raise InputError("this run's eval data was passed from Python; pass it again: "
                         "hetrl.train(..., eval_dataset=...)")
    return RowSource(data, evals, eval_size=cfg.eval_size, seed=cfg.seed, tokenizer=tokenizer,
                     prompt_key=cfg.prompt_key, max_prompt_tokens=cap,
                     prompt_suffix=cfg.prompt_suffix, name=None if cfg.data == PYTHON else cfg.data,
                     response_prefix=cfg.response_prefix, eval_label=held_out_label(cfg.data, cfg.eval_data))


def up_front(cfg: RunConfig, train_dataset, eval_dataset, reward_funcs):
    """What can fail in the user's data and reward code, found before the model loads (sources.input_problems,
    which hetrl validate runs too; all problems said together): the rows read and checked (then handed on as rows,
    so they are read once), each reward function imported and its signature checked. -> (train rows, eval rows)
    for build_source (what was given where nothing was read)."""
    if cfg.critic_model is not None:
        build.critic_model_problem(cfg)
    problems, rows = input_problems(cfg, run_rewards(cfg, reward_funcs), train_dataset, eval_dataset)
    if problems:
        raise InputError("; ".join(problems))
    return rows.get("data", train_dataset), rows.get("eval_data", eval_dataset)


def build_rewards(cfg: RunConfig, source: Source, reward_funcs=None, agent: episodes.Agent | None = None) -> RewardSet:
    """The run's reward functions (the config's, or those passed from Python), plus the format bonus, plus an
    environment's get_reward() (weight 1, as TRL)."""
    funcs = run_rewards(cfg, reward_funcs)
    weights = list(cfg.reward_weights) if cfg.reward_weights is not None else [1.0] * len(funcs)
    if agent is not None and agent.env_reward:
        funcs.append(environment_reward(agent.environment_factory))
        weights.append(1.0)
    if cfg.format_reward > 0:
        funcs.append("format")
        weights.append(cfg.format_reward)
    return RewardSet(funcs, weights, workers=cfg.reward_workers, builtins=source.builtin_rewards(cfg.answer_key),
                     errors=cfg.reward_errors, timeout_s=cfg.reward_timeout_s, strict=cfg.strict)


def run_rewards(cfg: RunConfig, reward_funcs=None) -> list:
    """The run's reward functions: those passed from Python (reward_list), else the config's names."""
    return reward_list(reward_funcs) if reward_funcs is not None else list(cfg.rewards)


def reward_list(reward_funcs) -> list:
    """reward_funcs from Python: a list, or one reward (a name, spec or callable) as TRL's reward_funcs takes it."""
    return [reward_funcs] if isinstance(reward_funcs, str) or callable(reward_funcs) else list(reward_funcs)


def python_fields(cfg_data, cfg_eval_data, train_dataset, eval_dataset, reward_funcs, tools=None,
                  environment_factory=None, cfg_reward=None) -> dict:
    """The config fields recorded for data, rewards, tools or an environment given from Python: `<python>` where no
    path names them. `cfg_reward`: a reward given in the same call (hetrl.train's reward=), refused beside
    reward_funcs (a config file's reward is what reward_funcs stands in for)."""
    changes = {}
    if tools is not None:
        changes["tools"] = tuple(f"{PYTHON}:{getattr(t, '__name__', type(t).__name__)}" for t in tools)
    if environment_factory is not None:
        changes["environment"] = f"{PYTHON}:{getattr(environment_factory, '__name__', 'environment_factory')}"
    reward_funcs = None if reward_funcs is None else reward_list(reward_funcs)
    if train_dataset is not None:
        if cfg_data not in (None, PYTHON):
            raise InputError(f"give the data once: data={cfg_data} in the config and train_dataset from Python")
        changes["data"] = PYTHON
        if eval_dataset is not None:
            if cfg_eval_data not in (None, PYTHON):
                raise InputError(f"give the eval data once: eval_data={cfg_eval_data} in the config and eval_dataset "
                                 "from Python")
            changes["eval_data"] = PYTHON
    if reward_funcs is not None:
        if not reward_funcs:
            raise InputError("reward_funcs is empty; give at least one reward function")
        changes["reward"] = tuple(f if isinstance(f, str) else f"{PYTHON}:{getattr(f, '__name__', type(f).__name__)}"
                                  for f in reward_funcs)
        said = (cfg_reward,) if isinstance(cfg_reward, str) else tuple(cfg_reward or ())
        if said and said != changes["reward"]:
            raise InputError(f"give the reward once: reward={', '.join(said)} and reward_funcs from Python; "
                             "reward_funcs takes names and FILE.py:NAME specs too")
    return changes
