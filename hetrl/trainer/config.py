"""RunConfig: every knob of `hetrl train`, validated once; YAML and `key=value` overrides are a thin layer on top.

Algorithm presets fill the knobs left unset (None): GRPO = symmetric clip 0.2, no KL (`kl_coef=0.001` adds verl's
k3), per-sequence token-mean loss; DAPO = clip-higher 0.2/0.28, token-level loss, no KL, dynamic
sampling and overlong filtering; the others are in docs/algorithms.md. verl's and TRL's names for the
same knobs are accepted (ALIASES, resolve_aliases). Prompts come from `task` (a reasoning-gym
generator) unless `data` names the user's rows, which then replace the task (README "Your data and reward").
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import os
import pathlib
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from hetrl.algo import ADVANTAGE_ESTIMATORS, KL_PENALTIES, LOSS_AGGREGATIONS, POLICY_LOSSES, loss_aggregation
from hetrl.algo.advantages import check_options, options_of
from hetrl.algo.losses import from_trl
from hetrl.planner.spec import check_group_size, check_max_leaves
from hetrl.schema import NUMBER, PYTHON, InputError, bounded, check, read_yaml, rule, unknown_keys_error

ALGORITHMS = ("grpo", "dapo", "ppo", "gspo", "dr_grpo", "rloo", "reinforce_pp", "cispo")
LR_SCHEDULES = ("constant", "linear", "cosine")   # transformers' get_scheduler names (with warmup)
# Built-in reward names (hetrl.data): verifier and partial are a reasoning-gym task's own check; exact_match and
# math_verify compare with the answer column (answer_key); format: the reply is exactly its final answer.
BUILTIN_REWARDS = ("verifier", "partial", "exact_match", "math_verify", "format")
TASK_REWARDS = ("verifier", "partial")


def from_python(cfg) -> list[str]:
    """hetrl.train's arguments a run was given from Python (its config records them as `<python>`): a resume has
    to pass them again, from Python."""
    def has(value) -> bool:
        items = value if isinstance(value, (list, tuple)) else [value]
        return any(isinstance(v, str) and v.startswith(PYTHON) for v in items)

    return [arg for field, arg in (("data", "train_dataset"), ("eval_data", "eval_dataset"), ("reward", "reward_funcs"),
                                   ("tools", "tools"), ("environment", "environment_factory"))
            if has(getattr(cfg, field))]
REPORT_TO = ("none", "tensorboard", "wandb")
DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
DTYPES = ("float32", "bfloat16", "float64")
PRECISIONS = ("auto", "fp32", "bf16-mixed")
EXECUTORS = ("local", "ray")
MODES = ("sync", "async")

# 2-term + and - with numbers up to 99: SmolLM2-135M answers 13% of these right within 16 tokens
# (greedy), mostly because it explains instead of answering; see benchmarks/results/train_default.
DEFAULT_TASK_CONFIG = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, operators=["+", "-"],
                           allow_negation=False, allow_parentheses=False)

_PLAIN = dict(adv_estimator="grpo", loss_mode="vanilla", clip_low=0.2, clip_high=0.2, kl_loss_type="low_var_kl",
              scale_advantages=True, dynamic_sampling=False, overlong_filter=False)
_PRESETS = {   # docs/algorithms.md: each one's paper and its verl / TRL settings
    # GRPO as TRL's GRPOConfig (beta 0.0) and verl's actor defaults (use_kl_loss false) run it: no KL, so no
    # reference model. verl's GRPO example adds the KL: kl_coef=0.001 (low_var_kl). Chosen over the KL for the
    # default job by held-out accuracy over 3 seeds at fp32 and bf16-mixed (benchmarks/results/default_recipe.md).
    "grpo": _PLAIN | dict(kl_coef=0.0, loss_agg="seq-mean-token-mean"),
    "dapo": _PLAIN | dict(clip_high=0.28, kl_coef=0.0, loss_agg="token-mean", dynamic_sampling=True,
                          overlong_filter=True),
    # PPO: per-token advantages from a critic (GAE); k3 KL 0.001 to the reference
    "ppo": _PLAIN | dict(adv_estimator="gae", kl_coef=0.001, loss_agg="token-mean"),
    # GSPO: the sequence ratio, clipped at 3e-4 / 4e-4 as the paper (and verl's recipe)
    "gspo": _PLAIN | dict(loss_mode="gspo", clip_low=0.0003, clip_high=0.0004, kl_coef=0.0,
                          loss_agg="seq-mean-token-mean"),
    # Dr. GRPO: no std in the advantage, token sums over a constant (max_new_tokens), no KL
    "dr_grpo": _PLAIN | dict(scale_advantages=False, kl_coef=0.0, loss_agg="seq-mean-token-sum-norm"),
    "rloo": _PLAIN | dict(adv_estimator="rloo", kl_coef=0.001, loss_agg="token-mean"),
    # REINFORCE++: whitened returns-to-go, its KL (k2) in the loss as verl's example
    "reinforce_pp": _PLAIN | dict(adv_estimator="reinforce_plus_plus", kl_coef=0.001, kl_loss_type="k2",
                                  loss_agg="token-mean"),
    # CISPO: the ratio capped at 5 (TRL's epsilon_high), no lower clip, token-level loss
    "cispo": _PLAIN | dict(loss_mode="cispo", clip_low=1.0, clip_high=4.0, kl_coef=0.0, loss_agg="token-mean"),
}
CRITIC_ALGORITHMS = ("ppo",)


@dataclass(frozen=True)
class RunConfig:
    # what to train
    # "smollm2-135m" (embedded), "tiny", "config:NAME" (random weights), a local HF dir
    model: str = "smollm2-135m"
    dtype: str = rule("float32", choices=DTYPES)
    task: str | None = "basic_arithmetic"  # a reasoning-gym generator name (None when `data` is given)
    task_config: dict = field(default_factory=lambda: dict(DEFAULT_TASK_CONFIG))
    data: str | None = None               # your rows: JSONL / JSON / Parquet / CSV / save_to_disk dir (replaces task)
    eval_data: str | None = None          # held-out rows (default: eval_size rows drawn out of data by seed)
    prompt_key: str = "prompt"            # the column holding the prompt (a string or chat messages)
    answer_key: str = "answer"            # exact_match / math_verify compare with it (dotted: a.b.c)
    max_prompt_tokens: int = rule(512, ge=1)  # longer prompts are skipped and counted, never truncated
    prompt_suffix: str = ""               # appended to each prompt (the last user message); "" leaves the format to RL
    response_prefix: str = ""             # every reply starts with it: a last assistant message continued (TRL's rule)
    # built-ins (BUILTIN_REWARDS) or your functions FILE.py:NAME / package.module:NAME (TRL or verl convention)
    reward: str | tuple[str, ...] = "verifier"
    reward_weights: tuple[float, ...] | None = None   # one per reward (default 1 each)
    reward_workers: int = rule(0, ge=0)   # processes for your reward functions (0: in this process)
    # a reward function that raises, exits or (in a worker) dies or hangs: stop the run with one line naming it
    # and the row, or skip: drop the groups of the rows it failed on (docs/train_failures.md)
    reward_errors: str = rule("stop", choices=("stop", "skip"))
    reward_timeout_s: float | None = rule(None, gt=0)   # a reward call in a worker taking longer fails (workers only)
    # silent zeros (a reward None / 0 / constant for every row of the first step, a verl scorer without
    # ground_truth, answer_key missing in the rows): a warning, or with strict an error
    strict: bool = False
    format_reward: float = rule(0.0, ge=0)  # bonus when the reply is exactly the extracted answer (built-in format)
    # tools and environments in TRL's conventions (docs/agents.md): each rollout is a multi-turn tool-use episode
    tools: str | tuple[str, ...] = ()     # FILE.py:f1,f2 or package.module:NAME; type hints and a Google docstring each
    environment: str | None = None        # FILE.py:Class: one instance per rollout (reset, tool methods, get_reward)
    max_tool_calls: int = rule(4, ge=1)   # tool-calling turns per episode (TRL's max_tool_calling_iterations)
    tool_timeout_s: float = rule(10.0, gt=0)  # a call still running then is answered with a timeout error
    # process: each function tool call in a tool process, killed at the timeout, its os._exit or crash answered as
    # an error (an environment's methods stay in threads: their state lives with the instance); thread: all in threads
    tool_isolation: str = rule("process", choices=("process", "thread"))
    # tree-shaped sampling (docs/agents.md): after a tool result an episode forks into `branches` continuations
    # that share its cache, while its task has at most max_leaves leaves (default responses_per_prompt x branches)
    branches: int = rule(1, ge=1)
    max_leaves: int | None = rule(None, ge=1)
    tree_advantage: str = rule("leaves", choices=("leaves", "subtree"))   # GRPO over a task's leaves, or per subtree
    # LoRA through peft (0: full fine-tuning); the reference is the base model with the adapter off
    lora_rank: int = rule(0, ge=0)
    lora_alpha: float = rule(16.0, gt=0)
    lora_dropout: float = rule(0.0, ge=0, lt=1)
    lora_target_modules: str | tuple[str, ...] = "all-linear"   # peft's names, or all-linear (every Linear but lm_head)
    # algorithm
    algorithm: str = rule("grpo", choices=ALGORITHMS)
    steps: int = rule(16, ge=1)
    prompts_per_step: int = rule(8, ge=1)
    responses_per_prompt: int = rule(8, ge=1)
    mini_batches: int = rule(2, ge=1)     # optimizer steps per rollout batch (disjoint groups each)
    # the sampling policy's log-probs that mini-batches after the first take their ratio against (sync):
    # rollout: read off the logits each token was drawn from (no extra pass); recompute: a no-grad DualKV pass;
    # auto: rollout where the rollout's logits are fp32 (the local executor without bf16 autocast: the two agree
    # to fp32 rounding), else recompute
    old_logprobs: str = rule("auto", choices=("auto", "rollout", "recompute"))
    lr: float = rule(2e-5, gt=0)
    weight_decay: float = rule(0.0, ge=0)
    max_grad_norm: float = rule(1.0, ge=0)
    # the knobs below, by verl's names (docs/algorithms.md); unset (None) ones come from the algorithm's preset
    adv_estimator: str | None = rule(None, choices=tuple(ADVANTAGE_ESTIMATORS))
    loss_mode: str | None = rule(None, choices=tuple(POLICY_LOSSES))
    clip_low: float | None = rule(None, ge=0, le=1)      # verl clip_ratio_low, TRL epsilon
    clip_high: float | None = rule(None, ge=0)           # verl clip_ratio_high, TRL epsilon_high
    clip_ratio_c: float | None = rule(None, gt=1)        # dual-clip bound for A < 0 (verl's 3.0); null: none
    loss_options: dict = field(default_factory=dict)     # the loss's own: tau_pos, tau_neg, clip_cov_*, kl_cov_ratio
    kl_coef: float | None = rule(None, ge=0)             # verl kl_loss_coef (kl_ctrl.kl_coef in the reward), TRL beta
    kl_loss_type: str | None = rule(None, choices=KL_PENALTIES)   # the KL estimator (k3 = low_var_kl)
    use_kl_in_reward: bool = False                       # the KL as a per-token reward penalty instead of a loss term
    kl_ctrl: str = rule("fixed", choices=("fixed", "adaptive"))   # adaptive: kl_coef follows kl_target (Ziegler)
    kl_target: float = rule(0.1, gt=0)                   # verl kl_ctrl.target_kl
    kl_horizon: int = rule(10000, ge=1)                  # verl kl_ctrl.horizon (samples)
    entropy_coeff: float = rule(0.0, ge=0)               # the loss subtracts entropy_coeff x the mean entropy
    loss_agg: str | None = rule(None, choices=LOSS_AGGREGATIONS)   # verl loss_agg_mode
    loss_scale_factor: float | None = rule(None, gt=0)   # seq-mean-token-sum-norm's constant (default max_new_tokens)
    scale_advantages: bool | None = None                 # verl norm_adv_by_std_in_grpo, TRL scale_rewards
    lr_scheduler_type: str = rule("constant", choices=LR_SCHEDULES)   # over steps x mini_batches optimizer steps
    warmup_steps: int = rule(0, ge=0)                    # optimizer steps of linear warmup (TRL's)
    warmup_ratio: float = rule(0.0, ge=0, lt=1)          # or this share of all optimizer steps
    dynamic_sampling: bool | None = None
    max_sampling_rounds: int = rule(3, ge=1)
    overlong_filter: bool | None = None
    # PPO (algorithm=ppo): the critic and GAE
    gamma: float = rule(1.0, ge=0, le=1)          # GAE discount
    lam: float = rule(0.95, ge=0, le=1)           # GAE lambda
    whiten_advantages: bool = True                # normalise the batch's advantages to mean 0, std 1
    vf_clip: float | None = rule(0.2, gt=0)       # value-loss clipping around the old values (null: none)
    critic_lr: float = rule(5e-5, gt=0)
    critic_warmup_steps: int = rule(0, ge=0)      # steps that train only the critic (the policy waits)
    critic_model: str | None = None               # a local HF causal-LM directory; default: the policy's weights
    # sampling
    max_new_tokens: int = rule(16, ge=1)
    temperature: float = rule(0.7, gt=0)
    top_p: float = rule(1.0, gt=0, le=1)
    top_k: int = rule(0, ge=0)            # sample among the k most likely tokens (0: off)
    rollout_batch_size: int = rule(64, ge=1)   # sequences per generate() call
    # the rollout engine (docs/vllm.md): hf (hetrl's decoding loop), vllm (vLLM's offline LLM; install.sh --vllm);
    # auto: vllm where it is installed and the device is CUDA, else hf
    rollout_engine: str = rule("auto", choices=("auto", "hf", "vllm"))
    # the rollout engine's log-probs vs the trainer's, corrected by verl's algorithm.rollout_correction (docs/vllm.md):
    # importance weights per token or sequence, truncated at rollout_is_threshold (a float: TIS) or masked outside
    # "lo_hi" (IcePop); auto: token-level TIS where the rollout is another engine (vllm), none with hf
    rollout_is: str | None = rule("auto", choices=("auto", "token", "sequence", None))
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None                 # rejection by verl's estimators (token_k1 ... seq_mean_k3, a,b)
    rollout_rs_threshold: float | str | None = None
    bypass_mode: bool = False                     # verl's: the rollout's log-probs are the old ones (no recompute)
    # engine
    device: str = "auto"                  # auto (CUDA when present, else CPU) | cpu | cuda | cuda:N (local executor)
    # bf16-mixed: fp32 weights and optimizer, bf16 autocast around the rollout, log-prob, value and update passes
    # (log-softmax in fp32). Pays off where bf16 matmuls are fast (GPUs; CPUs with AVX512-BF16 or AMX), README.
    # auto: bf16-mixed on CUDA (and TF32 for what stays fp32) and on CPUs with bf16 instructions, else fp32
    precision: str = rule("auto", choices=PRECISIONS)
    impl: str = rule("auto", choices=("auto", "sdpa", "flex", "reference"))  # DualKV attention
    micro_batch_tokens: int = rule(2048, ge=1)   # packed tokens per forward/backward
    gradient_checkpointing: bool = False  # recompute each layer in the backward: 1 layer's activations, 1/3 more FLOPs
    memory_limit_gib: float | None = rule(None, gt=0)  # default: the machine's available memory
    # evaluation and output
    eval_size: int = rule(100, ge=0)    # 0: no held-out evaluation (no eval before or after training)
    eval_every: int = rule(0, ge=0)       # 0: only before and after training
    eval_max_new_tokens: int = rule(16, ge=1)
    checkpoint_every: int = rule(8, ge=0)
    keep_checkpoints: int = rule(0, ge=0)  # 0: keep every checkpoint; N: the newest N (older ones deleted as they go)
    profile_step: int = rule(0, ge=0)     # >0: that step under torch.profiler (out_dir/profile_step_N.*; local only)
    out_dir: str = "runs/default"
    report_to: str = rule("none", choices=REPORT_TO)   # metrics.jsonl's rows also to TensorBoard or wandb (offline)
    # a non-finite reward total, advantage, loss or gradient norm (hetrl/trainer/guards.py): stop the run before
    # the step's checkpoint, or skip what it poisons (the step's update, or one optimizer step) and log it
    nonfinite: str = rule("stop", choices=("stop", "skip"))
    seed: int = rule(0, ge=0)
    # execution (README "hetrl train on Ray"); the local executor runs every role in this process
    executor: str = rule("local", choices=EXECUTORS)
    mode: str = rule("sync", choices=MODES)   # async: generation of step t+1 overlaps the update of step t
    max_staleness: int = rule(1, ge=1)    # async: policy versions a sample may lag the learner by
    plan: str | None = None               # ray: a plan from `hetrl plan --out` (else planned on the fly)
    cluster: str | None = None            # ray: the cluster YAML of the running Ray cluster at ray_address
    emulate_cluster: str | None = None    # ray: start a local Ray that declares this cluster's GPUs
    ray_address: str = "auto"             # ray with cluster=: the Ray cluster to join
    ray_temp_dir: str | None = None       # ray with emulate_cluster=: Ray's session files (default: out_dir/ray)
    # ray: how each update's weights reach the rollout actors: collective (a torch.distributed broadcast from learner
    # rank 0, NCCL on GPUs / gloo on CPU), object_store (Ray's); auto: collective on GPUs in sync mode, else
    # object_store (faster than gloo on CPU actors: benchmarks/results/weight_sync.md)
    weight_sync: str = rule("auto", choices=("auto", "collective", "object_store"))

    def __post_init__(self):
        fixed = POLICY_LOSSES[self.loss_mode].aggregation if self.loss_mode in POLICY_LOSSES else None
        if fixed is not None and self.loss_agg is None:   # sapo, geo_mean: their own, not the preset's
            object.__setattr__(self, "loss_agg", fixed)
        if self.algorithm in _PRESETS:
            preset = _PRESETS[self.algorithm]
            if (self.loss_mode not in (None, preset["loss_mode"]) and self.clip_low is None and self.clip_high is None
                    and (preset["clip_low"], preset["clip_high"]) != (_PLAIN["clip_low"], _PLAIN["clip_high"])
                    and self.loss_mode in POLICY_LOSSES   # sapo, gpg, kl_cov take no clip range
                    and "clip_ratio_low" in options_of(POLICY_LOSSES[self.loss_mode].fn)):
                raise ValueError(f"loss_mode={self.loss_mode} with algorithm={self.algorithm} would take "
                                 f"{self.algorithm}'s clip range ({preset['clip_low']:g}, {preset['clip_high']:g}), "
                                 f"made for loss_mode={preset['loss_mode']}; set clip_low and clip_high, or use "
                                 f"algorithm=grpo loss_mode={self.loss_mode}")
            for name, value in preset.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)
        check(self)
        self._check_algorithm()
        self._check_no_effect()
        self._check_data_and_rewards()
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(
                f"mini_batches ({self.mini_batches}) cannot exceed prompts_per_step ({self.prompts_per_step}): "
                "groups are never split across mini-batches; lower mini_batches or raise prompts_per_step")
        sequence = self.max_prompt_tokens + self.max_new_tokens   # with tools too: tool results share max_new_tokens
        if self.micro_batch_tokens < sequence:
            raise ValueError(f"micro_batch_tokens ({self.micro_batch_tokens}) is below one sequence: a prompt of up "
                             f"to max_prompt_tokens ({self.max_prompt_tokens}) with its reply of up to max_new_tokens "
                             f"({self.max_new_tokens}) is {sequence} tokens, and a micro-batch never splits a "
                             f"sequence; raise micro_batch_tokens to {sequence} or more, or lower max_prompt_tokens")
        if self.precision == "bf16-mixed" and self.dtype != "float32":
            raise ValueError(f"precision=bf16-mixed keeps fp32 master weights and autocasts to bf16; it needs "
                             f"dtype=float32, got dtype={self.dtype} (dtype=bfloat16 alone is pure bf16)")
        if not self.has_critic and (self.critic_model is not None or self.critic_warmup_steps):
            raise ValueError(f"critic_model and critic_warmup_steps are PPO's; algorithm={self.algorithm} has no "
                             "critic")
        check_group_size(self.responses_per_prompt, self.has_critic)
        if self.multi_turn:
            self._check_tools()
        self._check_branches()
        if self.algorithm == "dapo" and self.kl_coef > 0:
            raise ValueError(f"DAPO has no KL term, but kl_coef is {self.kl_coef}; set kl_coef=0 or algorithm=grpo")
        if not self.out_dir.strip():
            raise ValueError("out_dir is empty; give the directory the run writes to (e.g. out_dir=runs/exp1)")
        if not DEVICE.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.executor == "ray" and self.device != "auto":
            raise ValueError(f"device={self.device} is for the local executor; on Ray the plan puts each role on its "
                             "GPUs (or CPU cores): leave device=auto")
        if self.executor == "ray" and self.profile_step:
            raise ValueError("profile_step profiles this process, and on Ray the step runs in other processes: use it "
                             "with executor=local (or profile a Ray actor with Ray's own tools)")
        if self.profile_step > self.steps:
            raise ValueError(f"profile_step={self.profile_step} is after the last step (steps={self.steps}); "
                             f"give a step from 1 to {self.steps}, or 0 for none")
        self._check_rollout_correction()
        if self.executor == "local":
            given = [k for k in ("plan", "cluster", "emulate_cluster") if getattr(self, k) is not None]
            if given:
                one = len(given) == 1
                raise ValueError(f"{', '.join(given)} place{'s' if one else ''} the run's roles on Ray and "
                                 f"need{'s' if one else ''} executor=ray; for a local run leave "
                                 f"{'it' if one else 'them'} out ({' '.join(f'{k}=null' for k in given)})")
            if self.weight_sync != "auto":
                raise ValueError(f"weight_sync={self.weight_sync} is how Ray's rollout actors get the weights; the "
                                 "local executor loads them in-process: leave weight_sync=auto or use executor=ray")
            if self.mode == "async":
                raise ValueError("mode=async overlaps generation and the update in separate processes; "
                                 "it needs executor=ray (e.g. executor=ray "
                                 "emulate_cluster=examples/clusters/cpu-2x2.yaml)")
        elif self.weight_sync == "collective" and self.mode == "async":
            raise ValueError("weight_sync=collective holds the learner in a broadcast until every rollout actor's "
                             "generation chunk ends, which mode=async exists to avoid: use weight_sync=auto "
                             "(object_store in async mode) or mode=sync")
        elif self.old_logprobs == "rollout":
            raise ValueError("old_logprobs=rollout reads the log-probs off the local rollout's logits; on Ray the "
                             "rollout runs in other processes and the learner recomputes them: use old_logprobs=auto "
                             "or recompute with executor=ray")
        elif (self.cluster is None) == (self.emulate_cluster is None):
            raise ValueError("executor=ray needs exactly one of cluster=C.yaml (a running Ray cluster at ray_address) "
                             "or emulate_cluster=C.yaml (a local Ray declaring C's GPUs, e.g. "
                             "examples/clusters/cpu-2x2.yaml); plan=PLAN.json is optional")

    def _check_rollout_correction(self) -> None:
        """verl's rollout-correction knobs checked by the function that applies them (hetrl.algo.rollout_correction);
        bypass_mode is old_logprobs=rollout by verl's name."""
        if self.rollout_engine == "vllm" and self.dtype == "float64":   # auto picks hf for it (vllm_engine.choose)
            raise ValueError("rollout_engine=vllm does not run with dtype=float64 (vLLM samples in fp32 or bf16; use "
                             "dtype=float32)")
        if self.bypass_mode:
            if self.old_logprobs == "recompute":
                raise ValueError("bypass_mode=true takes the rollout's log-probs as the old ones; old_logprobs="
                                 "recompute asks for the trainer's: set one of them")
            object.__setattr__(self, "old_logprobs", "rollout")
        asked = [f"{k}={getattr(self, k)}" for k, off in (("rollout_is", ("auto", None)), ("rollout_rs", (None,)))
                 if getattr(self, k) not in off]
        if self.old_logprobs == "rollout" and asked:
            said = "bypass_mode=true" if self.bypass_mode else "old_logprobs=rollout"
            raise ValueError(f"{said} takes the rollout's log-probs as the old ones, so there is no mismatch to "
                             f"correct and {', '.join(asked)} would do nothing; leave them out, or let the trainer "
                             "recompute the old log-probs (old_logprobs=auto or recompute)")
        if self.rollout_is is None and self.rollout_rs is None:
            return
        import torch

        from hetrl.algo import rollout_correction

        one = torch.zeros(1, 1, dtype=torch.float64)   # the function's own checks, on one token
        rollout_correction(one, one, torch.ones(1, 1), **self.rollout_correction_options())

    def rollout_correction_options(self) -> dict:
        """hetrl.algo.rollout_correction's keyword arguments for a rollout by another engine (vLLM), with
        rollout_is=auto resolved to its default there, token-level."""
        return dict(rollout_is="token" if self.rollout_is == "auto" else self.rollout_is,
                    rollout_is_threshold=self.rollout_is_threshold,
                    rollout_is_batch_normalize=self.rollout_is_batch_normalize, rollout_rs=self.rollout_rs,
                    rollout_rs_threshold=self.rollout_rs_threshold)

    def _check_algorithm(self) -> None:
        """The estimator, loss and their options fit together (each refusal names the valid choices)."""
        critic = self.has_critic
        if (self.adv_estimator == "gae") != critic:
            raise ValueError(f"adv_estimator={self.adv_estimator} with algorithm={self.algorithm}: gae needs the "
                             "critic of algorithm=ppo, and algorithm=ppo takes gae; the critic-free estimators: "
                             f"{', '.join(n for n in ADVANTAGE_ESTIMATORS if n != 'gae')}")
        loss_aggregation(self.loss_mode, self.loss_agg)
        clips = sorted(set(self.loss_options) & {"clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c"})
        if clips:
            raise ValueError(f"loss_options {', '.join(clips)}: the clip range is clip_low, clip_high and clip_ratio_c")
        fn = POLICY_LOSSES[self.loss_mode].fn
        check_options("loss_mode", self.loss_mode, fn, {**self.loss_options, **self.clip_options})
        if self.clip_ratio_c is not None and self.loss_mode != "vanilla":
            raise ValueError(f"clip_ratio_c (dual-clip) is loss_mode=vanilla's; loss_mode={self.loss_mode} has none")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("give warmup_steps or warmup_ratio, not both")
        if self.warmup_steps > self.steps * self.mini_batches:
            raise ValueError(f"warmup_steps ({self.warmup_steps}) exceeds the run's {self.steps * self.mini_batches} "
                             f"optimizer steps (steps x mini_batches): the learning rate would never reach lr; use "
                             f"at most {self.steps * self.mini_batches}, or warmup_ratio")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):   # verl's clip_num / top-k count: this share of the tokens
            value = self.loss_options.get(name)
            if name in self.loss_options and (isinstance(value, bool) or not isinstance(value, (int, float))
                                              or not 0 < value <= 1):
                raise ValueError(f"loss_options {name} is the share of the tokens the loss picks, in (0, 1] (verl's "
                                 f"0.0002), got {value!r}")
        if self.loss_mode == "clip_cov":
            bounds = {k: self.loss_options.get(k, inspect.signature(fn).parameters[k].default)
                      for k in ("clip_cov_lb", "clip_cov_ub")}
            if not bounds["clip_cov_lb"] < bounds["clip_cov_ub"]:
                raise ValueError(f"loss_options clip_cov_lb ({bounds['clip_cov_lb']}) must be below clip_cov_ub "
                                 f"({bounds['clip_cov_ub']}): clip_cov picks tokens whose covariance lies between "
                                 "them, and none would be picked (the loss would be vanilla's)")
        for name in ("tau_pos", "tau_neg"):   # SAPO's temperatures divide the ratio's log
            if name in self.loss_options and not self.loss_options[name] > 0:
                raise ValueError(f"loss_options {name} must be > 0 (SAPO's gate temperature), got "
                                 f"{self.loss_options[name]!r}")
        if self.use_kl_in_reward and not self.kl_coef:
            raise ValueError("use_kl_in_reward=true subtracts kl_coef x the KL from the reward, and kl_coef is 0 "
                             f"(algorithm={self.algorithm}'s default): give kl_coef > 0 (verl's kl_ctrl.kl_coef, "
                             "0.001 by default there), or leave use_kl_in_reward out")
        if not self.use_kl_in_reward and (self.kl_ctrl != "fixed"):
            raise ValueError(f"kl_ctrl={self.kl_ctrl} adapts the KL coefficient in the reward (verl's "
                             "algorithm.kl_ctrl); it needs use_kl_in_reward=true (the KL loss term's coefficient is "
                             "fixed)")

    def _check_no_effect(self) -> None:
        """A knob set away from its default (the dataclass's, or for a preset's knob the algorithm's value) where the
        run has no use for it is refused, naming it and how to make it count: ignored, it would read as if it had
        worked. A preset's own value is never refused (a saved run_config.yaml holds every value resolved)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)} | _PRESETS[self.algorithm]
        loss_takes = options_of(POLICY_LOSSES[self.loss_mode].fn)
        estimator_takes = options_of(ADVANTAGE_ESTIMATORS[self.adv_estimator])
        clipping = ", ".join(n for n, loss in POLICY_LOSSES.items() if "clip_ratio_low" in options_of(loss.fn))
        rules = (   # (knobs, when they do nothing, why, how to make them count)
            (("kl_loss_type",), not self.kl_coef, "it is the estimator of the KL to the reference, and kl_coef is 0 "
             "(no KL term)", "give kl_coef > 0 (0.001 is verl's)"),
            (("loss_scale_factor",), self.aggregation != "seq-mean-token-sum-norm",
             f"it divides seq-mean-token-sum-norm's sums, and the loss aggregates by {self.aggregation}",
             "set loss_agg=seq-mean-token-sum-norm"),
            (("clip_low", "clip_high"), "clip_ratio_low" not in loss_takes,
             f"loss_mode={self.loss_mode} does not clip the ratio", f"use a clipping loss_mode ({clipping})"),
            (("lam", "whiten_advantages", "vf_clip", "critic_lr"), not self.has_critic,
             f"GAE and the critic are algorithm=ppo's, and algorithm={self.algorithm} has no critic",
             "use algorithm=ppo"),
            (("gamma",), "gamma" not in estimator_takes,
             f"it discounts rewards over tokens, and adv_estimator={self.adv_estimator} does not (gae and "
             "reinforce_plus_plus do)", "use algorithm=ppo or reinforce_pp"),
            (("scale_advantages",), "norm_adv_by_std_in_grpo" not in estimator_takes,
             f"it divides GRPO's group advantages by their std, and adv_estimator={self.adv_estimator} has none to "
             "divide", "use adv_estimator=grpo or grpo_passk" + (" (PPO's is whiten_advantages)" if self.has_critic
                                                                 else "")),
            (("max_sampling_rounds",), not self.dynamic_sampling,
             "it bounds dynamic sampling's rounds per step, and dynamic_sampling is off",
             "set dynamic_sampling=true (algorithm=dapo's)"),
            (("eval_data", "eval_every"), self.eval_size == 0,
             "eval_size=0 runs no held-out evaluation", "set eval_size >= 1 (a task's or data's held-out count)"),
            (("kl_target", "kl_horizon"), self.kl_ctrl == "fixed",
             "kl_target and kl_horizon steer the adaptive KL controller, and kl_ctrl is fixed",
             "set kl_ctrl=adaptive (with use_kl_in_reward=true)"),
        )
        for names, idle, why, fix in rules:
            given = [("eval_dataset (from Python)" if k == "eval_data" and getattr(self, k) == PYTHON else
                      f"{k}={getattr(self, k)}") for k in names if getattr(self, k) != defaults[k]]
            if idle and given:
                one = len(given) == 1
                raise ValueError(f"{', '.join(given)} {'has' if one else 'have'} no effect in this run: {why}; "
                                 f"{fix}, or leave {'it' if one else 'them'} out")

    @property
    def clip_options(self) -> dict:
        """clip_low / clip_high under verl's names, for the losses that clip (none for sapo, gpg, kl_cov)."""
        takes = set(options_of(POLICY_LOSSES[self.loss_mode].fn))
        return {k: v for k, v in (("clip_ratio_low", self.clip_low), ("clip_ratio_high", self.clip_high),
                                  ("clip_ratio_c", self.clip_ratio_c)) if k in takes}

    @property
    def aggregation(self) -> str:
        """The aggregation the run's loss uses (sapo and geo_mean fix theirs)."""
        return loss_aggregation(self.loss_mode, self.loss_agg)

    def _check_data_and_rewards(self) -> None:
        if self.data is not None and self.task is not None:
            object.__setattr__(self, "task", None)   # data= replaces the task (README "Your data and reward")
        if self.data is None and self.task is None:
            raise ValueError("give task=NAME (a reasoning-gym generator) or data=PATH (your rows)")
        if self.eval_data is not None and self.data is None:
            raise ValueError("eval_data is the held-out part of your data; it needs data=PATH (a task holds out "
                             "eval_size problems of its own)")
        rewards = self.rewards
        if not rewards:
            raise ValueError("reward is empty; give a built-in (" + ", ".join(BUILTIN_REWARDS) + ") or FILE.py:NAME")
        for r in rewards:
            if not isinstance(r, str) or not r.strip():
                raise ValueError(f"reward entries must be names or FILE.py:NAME specs, got {r!r}")
            if ":" not in r and r not in BUILTIN_REWARDS:
                close = difflib.get_close_matches(r, BUILTIN_REWARDS, n=1)
                raise ValueError(f"reward {r!r} is not a built-in ({', '.join(BUILTIN_REWARDS)})"
                                 + (f" (did you mean {close[0]!r}?)" if close else "")
                                 + "; a function of yours is given as FILE.py:NAME or package.module:NAME")
            if r in TASK_REWARDS and self.task is None:
                missing = "" if pathlib.Path(str(self.data)).exists() else " (and that path does not exist)"
                raise ValueError(f"reward {r!r} is a reasoning-gym task's own check, and this run trains on "
                                 f"data={self.data}{missing}; use exact_match or math_verify (on answer_key="
                                 f"{self.answer_key}) or your own function FILE.py:NAME")
        if not isinstance(self.lora_target_modules, str) and not self.lora_target_modules:
            raise ValueError("lora_target_modules is empty; name the modules to adapt (e.g. [q_proj, v_proj]) or "
                             "use all-linear (every Linear but the LM head)")
        if self.reward_timeout_s is not None and not self.reward_workers:
            raise ValueError(f"reward_timeout_s={self.reward_timeout_s:g} needs reward_workers >= 1: a function "
                             "running in the trainer's process cannot be stopped; set reward_workers=1 (or more)")
        if self.reward_weights is not None and len(self.reward_weights) != len(rewards):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for {len(rewards)} rewards "
                             f"({', '.join(rewards)}); give one weight per reward")

    def _check_tools(self) -> None:
        if self.max_tool_calls > self.max_new_tokens:
            raise ValueError(f"max_tool_calls ({self.max_tool_calls}) exceeds max_new_tokens ({self.max_new_tokens}), "
                             "an episode's budget of model tokens: every call takes tokens of its own; use at most "
                             f"{self.max_new_tokens}")
        if self.has_critic:
            raise ValueError("tools with algorithm=ppo: the critic would value tool tokens the loss leaves out; use "
                             "algorithm=grpo or dapo")
        if self.environment is not None and self.reward_workers:
            raise ValueError(f"environment={self.environment} hands each rollout's instance to the reward functions "
                             f"(TRL's environments=), which cannot go to reward_workers={self.reward_workers} "
                             "processes; set reward_workers=0")

    def _check_branches(self) -> None:
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unused = [f"{k}={getattr(self, k)}" for k in ("max_tool_calls", "tool_timeout_s", "tool_isolation")
                  if getattr(self, k) != defaults[k]]
        if unused and not self.multi_turn:
            raise ValueError(f"{', '.join(unused)} shape{'s' if len(unused) == 1 else ''} tool calls, and the run has "
                             "no tools: give tools=FILE.py:NAME or environment=FILE.py:Class, or leave "
                             f"{'it' if len(unused) == 1 else 'them'} out")
        if self.branches > 1 and not self.multi_turn:
            raise ValueError(f"branches={self.branches} forks an episode after a tool result; it needs "
                             "tools=FILE.py:NAME or environment=FILE.py:Class (or use branches=1)")
        check_max_leaves(self.max_leaves, self.responses_per_prompt)
        if self.branches > 1 and (self.adv_estimator != "grpo" or self.use_kl_in_reward):
            raise ValueError(f"branches={self.branches} scores a task's leaves with GRPO over the leaves "
                             f"(tree_advantage); adv_estimator={self.adv_estimator}"
                             f"{' with use_kl_in_reward' if self.use_kl_in_reward else ''} is not defined on trees "
                             "yet; use adv_estimator=grpo without use_kl_in_reward, or branches=1")
        unused = [f"{k}={getattr(self, k)}" for k, default in (("max_leaves", None), ("tree_advantage", "leaves"))
                  if getattr(self, k) != default]
        if self.branches == 1 and unused:
            raise ValueError(f"{', '.join(unused)} shape the trees of branches >= 2, and branches is 1 (no forks); "
                             "set branches=2 (or more), or leave them out")

    @property
    def torch_dtype(self):
        """The weights' torch dtype (`dtype`)."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def has_reference(self) -> bool:
        """Whether the run scores a frozen reference: the KL to it, as a loss term or a reward penalty (kl_coef > 0)."""
        return self.kl_coef > 0

    @property
    def has_critic(self) -> bool:
        """Whether the run trains a critic (PPO's GAE needs values)."""
        return self.algorithm in CRITIC_ALGORITHMS

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are multi-turn tool-use episodes (tools or an environment): the update then packs each
        task's samples as a trie (hetrl.dualkv.pack_sequences), every shared turn computed once."""
        return bool(self.tools) or self.environment is not None

    @property
    def tool_specs(self) -> tuple[str, ...]:
        return (self.tools,) if isinstance(self.tools, str) else tuple(self.tools)

    @property
    def rewards(self) -> tuple[str, ...]:
        return (self.reward,) if isinstance(self.reward, str) else tuple(self.reward)

    def to_dict(self) -> dict:
        """Plain YAML-able values (tuples as lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


FIELDS = tuple(f.name for f in dataclasses.fields(RunConfig))
# verl's and TRL's names for knobs that exist here (docs/algorithms.md); resolve_aliases maps them
ALIASES = {"loss_agg_mode": "loss_agg", "clip_ratio_low": "clip_low", "clip_ratio_high": "clip_high",
           "kl_loss_coef": "kl_coef", "norm_adv_by_std_in_grpo": "scale_advantages", "kl_penalty": "kl_loss_type",
           "entropy_coef": "entropy_coeff", "beta": "kl_coef", "epsilon": "clip_low", "epsilon_high": "clip_high",
           "vllm_importance_sampling_cap": "rollout_is_threshold", "num_generations": "responses_per_prompt",
           "max_completion_length": "max_new_tokens"}
TRL_OPTIONS = {"sapo_temperature_pos": "tau_pos", "sapo_temperature_neg": "tau_neg"}   # into loss_options
TRL_KEYS = ("loss_type", "importance_sampling_level", "scale_rewards")
ALIAS_KEYS = (*ALIASES, *TRL_OPTIONS, *TRL_KEYS)


def resolve_aliases(data: dict[str, Any]) -> dict[str, Any]:
    """Config keys by verl's or TRL's names -> this config's fields (a name given twice must agree). TRL's
    loss_type picks loss_mode and loss_agg (from_trl), importance_sampling_level=sequence is GSPO, scale_rewards
    group / none is scale_advantages true / false; what has no counterpart is refused with the valid values."""
    out = dict(data)

    def put(field_name: str, value, given_as: str) -> None:
        if field_name in out and out[field_name] is not None and out[field_name] != value:
            raise InputError(f"{given_as} sets {field_name} to {value!r}, but {field_name} is also given as "
                             f"{out[field_name]!r}; give one of them")
        out[field_name] = value

    loss_type, level = out.pop("loss_type", None), out.pop("importance_sampling_level", None)
    if loss_type is not None:
        if loss_type == "cispo" and "epsilon_high" not in out:
            raise InputError("loss_type=cispo caps the ratio at TRL's epsilon_high; give it (5.0 is TRL's advice) "
                             "or use algorithm=cispo")
        names = from_trl(loss_type, level or "token", out.get("epsilon", 0.2), out.get("epsilon_high"))
        if names["loss_mode"] == "cispo":   # TRL's epsilon_high is the cap itself, not 1 + clip_high
            out.pop("epsilon", None), out.pop("epsilon_high")
            put("clip_low", names["clip_ratio_low"], "loss_type=cispo")
            put("clip_high", names["clip_ratio_high"], "loss_type=cispo with epsilon_high")
        put("loss_mode", names["loss_mode"], f"loss_type={loss_type}")
        put("loss_agg", names["loss_agg_mode"], f"loss_type={loss_type}")
    elif level is not None:
        if level not in ("token", "sequence"):
            raise InputError(f"importance_sampling_level must be token or sequence, got {level!r}")
        if level == "sequence":
            if out.get("loss_mode") not in (None, "gspo"):
                raise InputError(f"importance_sampling_level=sequence is GSPO, the clipped loss with the sequence's "
                                 f"ratio; it does not apply to loss_mode={out['loss_mode']}")
            out["loss_mode"] = "gspo"
    if "scale_rewards" in out:
        value = out.pop("scale_rewards")
        scaled = {True: True, "group": True, False: False, "none": False}.get(value)
        if scaled is None:
            raise InputError(f"scale_rewards={value} has no counterpart here (batch: PPO-Lite's std over the batch); "
                             "valid: group, none, true, false")
        put("scale_advantages", scaled, f"scale_rewards={value}")
    if "epsilon" in out and "epsilon_high" not in out and "clip_high" not in out and "clip_ratio_high" not in out:
        out["epsilon_high"] = out["epsilon"]   # TRL: epsilon_high defaults to epsilon (a symmetric clip)
    for alias, field_name in ALIASES.items():
        if alias in out:
            put(field_name, out.pop(alias), alias)
    for alias, option in TRL_OPTIONS.items():
        if alias in out:
            out["loss_options"] = {**out.get("loss_options", {}), option: out.pop(alias)}
    return out
_TYPES = typing.get_type_hints(RunConfig)
# Fields a resumed run may change without changing what it computes: how long it runs, where it writes, how
# often it saves, and where its roles run. Any other difference from the checkpoint's config is refused on
# --resume unless the user says --allow-config-change (the change is then logged in out_dir/resumes.jsonl).
RESUMABLE_CHANGES = ("steps", "out_dir", "checkpoint_every", "keep_checkpoints", "profile_step", "memory_limit_gib",
                     "executor", "plan", "cluster", "emulate_cluster", "ray_address", "ray_temp_dir", "reward_workers",
                     "report_to", "device", "nonfinite", "reward_errors", "reward_timeout_s", "strict",
                     "eval_every")   # when held-out evaluations run between steps: not what the run computes


def check_keys(keys, where: str) -> None:
    """Refuse keys that are neither RunConfig fields nor verl's / TRL's names for them (did you mean ...)."""
    unknown = set(keys) - set(FIELDS) - set(ALIAS_KEYS)
    if unknown:
        raise unknown_keys_error(unknown, FIELDS, where, what="config key")


def _is_text(name: str) -> bool:
    """A field that holds text (str or str | None): an override's value is taken as written."""
    tp = _TYPES.get(name)
    return tp is str or tp == (str | None)


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """["steps=5", "task_config.max_digits=2"] -> {"steps": 5, "task_config": {"max_digits": 2}}.
    Values are YAML (numbers, true/false, lists), except for text fields, which take the text as written
    (out_dir=2024 is the directory '2024'); `key=null` unsets an optional field."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            hint = (f"; a run YAML is given with --config {item}" if not sep and item.endswith((".yaml", ".yml"))
                    else "")
            raise InputError(f"override {item!r} must look like key=value (e.g. steps=5){hint}")
        head, _, sub = key.partition(".")
        if not sub and _is_text(key) and raw not in ("null", "~"):
            value = raw
        else:
            try:
                value = bounded(yaml.safe_load(raw), f"the override {key}") if raw else ""
                if isinstance(value, str) and NUMBER.match(value):
                    value = float(value)    # YAML 1.1 reads 2e-5 (no dot) as a string
                if isinstance(value, dict) and not sub and str in typing.get_args(_TYPES.get(key)):
                    value = raw   # tools=file.py: (a spec, its name missing) is text, not YAML's {file.py: null}
            except yaml.YAMLError as e:
                raise InputError(f"override {item!r}: the value is not valid YAML ({str(e).splitlines()[0]})") from None
        if sub:
            out.setdefault(head, {})[sub] = value
        else:
            out[key] = value
    return out


FILE_KEYS = ("data", "eval_data", "plan", "cluster", "emulate_cluster", "model", "reward", "tools", "environment")


RAN_IN = "# hetrl train ran in "   # the first line of a run's run_config.yaml: where its relative paths are from


def _ran_in(path: str) -> list[pathlib.Path]:
    """The directory a run's saved run_config.yaml says the run was started in (none for other configs)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            first = f.readline().rstrip("\n")
    except OSError:
        return []
    return [pathlib.Path(first[len(RAN_IN):])] if first.startswith(RAN_IN) else []


def _paths_from_here(loaded: dict, path: str) -> None:
    """Paths in a run config are read from the current directory, as on the command line. One that is missing
    from here but exists from the directory a saved run started in, or from the config's folder or one above it
    (the config was written to be run from there, as examples/ is from the repository root) is refused with that
    said, instead of a bare "no such file"."""
    folders = [*_ran_in(path), pathlib.Path(path).resolve().parent, *pathlib.Path(path).resolve().parent.parents]
    for key in FILE_KEYS:
        values = loaded.get(key)
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if not isinstance(value, str) or os.path.isabs(value):
                continue
            file = value.partition(":")[0] if key in ("reward", "tools", "environment") else value
            if not file or os.path.exists(file):
                continue
            found = next((d for d in folders if (d / file).exists()), None)
            if found is not None:
                raise InputError(f"{path}: {key}: {file} is not found from the current directory ({os.getcwd()}); "
                                 "a run config's paths are read from where hetrl runs, as on the command line, and "
                                 f"this one is found from {found}: run hetrl there, or write the path from here",
                                 located=True)


def config_data(path: str | None = None, overrides: list[str] = ()) -> dict[str, Any]:
    """The run config as a mapping: the YAML at `path` (optional) with `key=value` overrides applied."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml(path, "run config")
        check_keys(loaded, path)
        _paths_from_here(loaded, path)
        data.update(loaded)
    extra = parse_overrides(list(overrides))
    check_keys(extra, "the command line")
    if "algorithm" in extra and extra["algorithm"] != data.get("algorithm", RunConfig.algorithm):
        data = _without_preset(data)   # the file's own algorithm's values go with it (a saved run_config.yaml)
    for key in extra:   # the command line wins over the YAML's value of a field under another name (beta, kl_coef)
        field = ALIASES.get(key, key)
        for other in [k for k in data if k != key and ALIASES.get(k, k) == field]:
            del data[other]
    for key, value in extra.items():
        if key == "task_config" and isinstance(value, dict) and isinstance(data.get("task_config"), dict):
            data["task_config"] = {**data["task_config"], **value}
        else:
            data[key] = value
    return resolve_aliases(data)


def _without_preset(fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` without the values their algorithm's preset (and their loss's own aggregation) gives, so that a config
    built from them with another `algorithm` (or loss_mode) takes that one's: a resolved config (a RunConfig, a saved
    run_config.yaml) would otherwise carry grpo's loss and clip range into any algorithm set over it."""
    preset = _PRESETS.get(fields.get("algorithm", RunConfig.algorithm), {})
    loss = POLICY_LOSSES.get(fields.get("loss_mode"))
    fixed = loss.aggregation if loss is not None else None
    return {k: v for k, v in fields.items()
            if not ((k in preset and v == preset[k]) or (k == "loss_agg" and fixed is not None and v == fixed))}


def as_given(cfg: RunConfig) -> dict[str, Any]:
    """`cfg`'s fields as a config to build another from (hetrl.train(cfg, algorithm=...)): `_without_preset`."""
    return _without_preset(cfg.to_dict())


def python_config(config=None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """hetrl.train's config as fields for RunConfig: `config` a RunConfig, a mapping of its fields, a run YAML path
    or None (the defaults), with `overrides` (fields, or verl's / TRL's names for them) over it. What a preset sets
    is left to the preset, as for the same YAML with the same `key=value` on the command line."""
    overrides = dict(overrides or {})
    if isinstance(config, RunConfig):
        fields = as_given(config)
    elif config is None or isinstance(config, str):
        load_config(config)   # its errors name the file and the key
        fields = config_data(config)
    elif isinstance(config, dict):
        check_keys(config, "hetrl.train's config")
        fields = resolve_aliases(dict(config))
    else:
        raise TypeError(f"config must be a RunConfig, a dict of its fields or a YAML path, got {type(config).__name__}")
    check_keys(overrides, "hetrl.train's keyword arguments")   # an unknown one: the valid keys, did you mean
    for key in overrides:   # a keyword wins over the config's value of the same field under another name
        field_name = ALIASES.get(key, key)
        for other in [k for k in fields if k != key and ALIASES.get(k, k) == field_name]:
            del fields[other]
    return fields | resolve_aliases(overrides)   # verl's and TRL's names (loss_type=dr_grpo, beta=...) too


def load_config(path: str | None = None, overrides: list[str] = ()) -> RunConfig:
    """Read a run YAML (optional) and apply `key=value` overrides; unknown keys and bad values are errors that
    name the file (or the command line) and the key."""
    data = config_data(path, overrides)
    typed = {item.partition("=")[0].partition(".")[0] for item in overrides}   # the keys the command line set
    as_typed = {ALIASES[k]: k for k in typed if k in ALIASES}    # a field the user set by verl's or TRL's name
    given = typed | set(as_typed)
    try:
        return RunConfig(**data)
    except InputError as e:
        if e.located:
            raise
        if e.field is None:   # a rule between fields (max_leaves against responses_per_prompt): where both came from
            raise InputError(f"{_where_rule(path, given)}: {e}", located=True) from None
        from_cli = path is None or e.field in given
        said = str(e)
        if from_cli and e.field in as_typed and said.startswith(e.field):   # said under the name the user typed
            said = f"{as_typed[e.field]} ({e.field}){said[len(e.field):]}"
        raise InputError(f"{'the command line' if from_cli else path}: {said}", located=True) from None
    except ValueError as e:   # a rule between fields
        raise InputError(f"{_where_rule(path, given)}: {e}", located=True) from None


def _where_rule(path: str | None, given: set[str]) -> str:
    """Where a rule between fields was broken: the run YAML, the command line, or both."""
    return path + " with the command line" if path and given else path or "the command line"


def config_changes(saved: dict, cfg: RunConfig) -> dict[str, tuple[Any, Any]]:
    """Fields that change what the run computes, whose value in `cfg` differs from the `saved` config
    (a checkpoint's run_config.yaml): field -> (saved, now)."""
    now = cfg.to_dict()
    return {k: (saved.get(k), now[k]) for k in FIELDS
            if k not in RESUMABLE_CHANGES and k in saved and saved.get(k) != now[k]}


def logits_give_old_logprobs(old_logprobs: str, mixed_precision: bool) -> bool:
    """Whether a sample's old (behaviour) log-probs are read off the very logits the rollout drew it from
    (`old_logprobs`): "rollout" always; "auto" where those logits are fp32 (the rollout not under bf16 autocast),
    where they equal a recomputing pass to fp32 rounding (tests/trainer/test_rollout.py); "recompute" never. The
    one rule for the local loop, Ray's rollout workers and the planner's workload (placement.run_workload)."""
    return old_logprobs == "rollout" or (old_logprobs == "auto" and not mixed_precision)
