"""RunConfig: every knob of `hetrl train`, validated once; YAML and `key=value` overrides are a thin layer on top.

Algorithm presets fill the knobs left unset (None): GRPO = symmetric clip 0.2, KL (k3) 0.001,
per-sequence token-mean loss; DAPO = clip-higher 0.2/0.28, token-level loss, no KL, dynamic
sampling and overlong filtering.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from hetrl.algo.losses import LOSS_AGGREGATIONS

ALGORITHMS = ("grpo", "dapo")
REWARDS = ("verifier", "partial", "math_verify")
DTYPES = ("float32", "bfloat16", "float64")
EXECUTORS = ("local", "ray")
MODES = ("sync", "async")

# 2-term + and - with numbers up to 99: SmolLM2-135M answers 13% of these right within 16 tokens
# (greedy), mostly because it explains instead of answering; see benchmarks/results/train_default.
DEFAULT_TASK_CONFIG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"],
                           allow_negation=False, allow_parentheses=False)

_PRESETS = {
    "grpo": dict(clip_low=0.2, clip_high=0.2, kl_coef=0.001, loss_agg="seq-mean-token-mean",
                 dynamic_sampling=False, overlong_filter=False),
    "dapo": dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, loss_agg="token-mean",
                 dynamic_sampling=True, overlong_filter=True),
}


@dataclass(frozen=True)
class RunConfig:
    # what to train
    model: str = "smollm2-135m"           # "smollm2-135m" (embedded), "tiny" (config-built), or a local HF dir
    dtype: str = "float32"
    task: str = "basic_arithmetic"        # a reasoning-gym generator name
    task_config: dict = field(default_factory=lambda: dict(DEFAULT_TASK_CONFIG))
    prompt_suffix: str = ""               # appended to each question; the default leaves the format to RL
    reward: str = "verifier"              # verifier: exact match by the task's verifier; partial: its graded score
    format_reward: float = 0.0            # bonus when the reply is exactly the extracted answer
    # algorithm
    algorithm: str = "grpo"
    steps: int = 16
    prompts_per_step: int = 8
    responses_per_prompt: int = 8
    mini_batches: int = 2                 # optimizer steps per rollout batch (disjoint groups each)
    lr: float = 2e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_low: float | None = None
    clip_high: float | None = None
    kl_coef: float | None = None
    loss_agg: str | None = None
    scale_advantages: bool = True
    dynamic_sampling: bool | None = None
    max_sampling_rounds: int = 3
    overlong_filter: bool | None = None
    # sampling
    max_new_tokens: int = 16
    temperature: float = 0.7
    top_p: float = 1.0
    rollout_batch_size: int = 64          # sequences per generate() call
    # engine
    impl: str = "auto"                    # DualKV attention: auto | sdpa | flex | reference
    micro_batch_tokens: int = 2048        # packed tokens per forward/backward
    memory_limit_gib: float | None = None  # default: the machine's available memory
    # evaluation and output
    eval_size: int = 100
    eval_every: int = 0                   # 0: only before and after training
    eval_max_new_tokens: int = 16
    checkpoint_every: int = 8
    out_dir: str = "runs/default"
    seed: int = 0
    # execution (README "hetrl train on Ray"); the local executor runs every role in this process
    executor: str = "local"               # local | ray
    mode: str = "sync"                    # sync | async (generation of step t+1 overlaps the update of step t)
    max_staleness: int = 1                # async: policy versions a sample may lag the learner by
    plan: str | None = None               # ray: a plan from `hetrl plan --out` (else planned on the fly)
    cluster: str | None = None            # ray: the cluster YAML of the running Ray cluster at ray_address
    emulate_cluster: str | None = None    # ray: start a local Ray that declares this cluster's GPUs
    ray_address: str = "auto"             # ray with cluster=: the Ray cluster to join

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        for name, value in _PRESETS[self.algorithm].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        _choice("reward", self.reward, REWARDS)
        _choice("dtype", self.dtype, DTYPES)
        _choice("loss_agg", self.loss_agg, LOSS_AGGREGATIONS)
        _choice("impl", self.impl, ("auto", "sdpa", "flex", "reference"))
        for name in ("steps", "prompts_per_step", "responses_per_prompt", "mini_batches", "max_new_tokens",
                     "rollout_batch_size", "micro_batch_tokens", "eval_size", "eval_max_new_tokens",
                     "max_sampling_rounds"):
            _positive_int(name, getattr(self, name))
        for name in ("eval_every", "checkpoint_every", "seed"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int) \
                    or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(
                f"mini_batches ({self.mini_batches}) cannot exceed prompts_per_step ({self.prompts_per_step}): "
                "groups are never split across mini-batches; lower mini_batches or raise prompts_per_step")
        if self.responses_per_prompt < 2:
            raise ValueError(f"responses_per_prompt ({self.responses_per_prompt}) must be >= 2: group-relative "
                             "advantages compare a prompt's responses with each other")
        for name in ("lr", "temperature"):
            if not _number(getattr(self, name)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a number > 0, got {getattr(self, name)!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        for name in ("clip_low", "clip_high", "kl_coef", "weight_decay", "max_grad_norm", "format_reward"):
            if not _number(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be a number >= 0, got {getattr(self, name)!r}")
        if self.clip_low >= 1:
            raise ValueError(f"clip_low ({self.clip_low}) must be < 1: the ratio is clipped to [1 - clip_low, ...]")
        if self.algorithm == "dapo" and self.kl_coef > 0:
            raise ValueError(f"DAPO has no KL term, but kl_coef is {self.kl_coef}; set kl_coef=0 or algorithm=grpo")
        if self.memory_limit_gib is not None and (not _number(self.memory_limit_gib) or self.memory_limit_gib <= 0):
            raise ValueError(f"memory_limit_gib must be a number > 0, got {self.memory_limit_gib!r}")
        _choice("executor", self.executor, EXECUTORS)
        _choice("mode", self.mode, MODES)
        _positive_int("max_staleness", self.max_staleness)
        if self.executor == "local":
            given = [k for k in ("plan", "cluster", "emulate_cluster") if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} place roles on Ray and need executor=ray")
            if self.mode == "async":
                raise ValueError("mode=async overlaps generation and the update in separate processes; "
                                 "it needs executor=ray (e.g. executor=ray emulate_cluster=examples/clusters/cpu-2x2.yaml)")
        elif (self.cluster is None) == (self.emulate_cluster is None):
            raise ValueError("executor=ray needs exactly one of cluster=C.yaml (a running Ray cluster at ray_address) "
                             "or emulate_cluster=C.yaml (a local Ray declaring C's GPUs, e.g. "
                             "examples/clusters/cpu-2x2.yaml); plan=PLAN.json is optional")
        if not isinstance(self.task_config, dict):
            raise ValueError(f"task_config must be a mapping of reasoning-gym options, got {self.task_config!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _choice(name, value, valid):
    if value not in valid:
        raise ValueError(f"{name} must be one of {tuple(valid)}, got {value!r}")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))


def _check_keys(keys, where: str) -> None:
    unknown = sorted(set(keys) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown} in {where}; valid keys: {', '.join(FIELDS)}")


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _yaml_value(raw: str):
    """YAML 1.1 reads `2e-5` as a string; users mean the number."""
    value = yaml.safe_load(raw) if raw else ""
    return float(value) if isinstance(value, str) and _FLOAT.match(value) else value


def _coerce_numbers(data: dict) -> dict:
    return {k: (float(v) if isinstance(v, str) and _FLOAT.match(v) else v) for k, v in data.items()}


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """["steps=5", "task_config.max_digits=2"] -> {"steps": 5, "task_config": {"max_digits": 2}}."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value (e.g. steps=5)")
        value = _yaml_value(raw)
        head, _, sub = key.partition(".")
        if sub:
            out.setdefault(head, {})[sub] = value
        else:
            out[key] = value
    return out


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a run YAML (optional) and apply `key=value` overrides; unknown keys are an error."""
    data: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path} must hold a mapping of config keys, got {type(loaded).__name__}")
        _check_keys(loaded, path)
        data.update(_coerce_numbers(loaded))
    extra = parse_overrides(list(overrides))
    _check_keys(extra, "the command line")
    for key, value in extra.items():
        if key == "task_config" and isinstance(value, dict):
            data["task_config"] = {**data.get("task_config", {}), **value}
        else:
            data[key] = value
    return RunConfig(**data)
