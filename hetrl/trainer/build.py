"""One builder for the roles of a run (policy, optimizer, learner, scorers), used by the local and the Ray engines.

`Policy` is what every role needs of the trained model: `module`, the Hugging Face model that generation and the
DualKV passes run (with LoRA, peft's adapter layers sit inside it), the parameters to train, the state that weight
sync moves (with LoRA only the adapter: the other side already holds the base weights), what a checkpoint saves,
and a context that switches the adapter off, which is how the reference model is the base model without a second
copy. LoRA goes through peft (`get_peft_model`, `disable_adapter`, `merge_and_unload`).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import logging
import math
import pathlib
import warnings
from collections.abc import Callable

import torch

from hetrl.schema import InputError
from hetrl.trainer.config import RunConfig
from hetrl.trainer.learner import Critic, Learner, Scorer
from hetrl.trainer.precision import RunPrecision
from hetrl.trainer.rollout import RolloutWorker

log = logging.getLogger(__name__)


class Policy:
    def __init__(self, model, peft_model=None):
        self.module = model                  # a transformers PreTrainedModel (LoRA layers injected when on)
        self.peft = peft_model               # the peft wrapper, or None for full fine-tuning

    @property
    def lora(self) -> bool:
        return self.peft is not None

    @property
    def saved(self):
        """What checkpoints save with save_pretrained: the adapter (peft's format) or the whole model."""
        return self.peft if self.peft is not None else self.module

    def trainable(self) -> list[torch.nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def base_off(self):
        """A context in which `module` computes the base model's outputs (the adapter off); LoRA only."""
        assert self.peft is not None, "only a LoRA policy has a base model inside it"
        return self.peft.disable_adapter()

    def sync_state(self) -> dict[str, torch.Tensor]:
        """What weight sync sends: with LoRA the adapter's tensors, else the whole state dict."""
        if self.peft is None:
            return self.module.state_dict()
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.peft)

    def load_sync_state(self, state: dict[str, torch.Tensor], partial: bool = False) -> None:
        """Load what weight sync sent (each tensor copied into this policy's, in this policy's dtype); `partial`:
        some of the tensors (a bucket), the others left as they are."""
        if self.peft is None:
            result = self.module.load_state_dict(state, strict=not partial)
            if result.unexpected_keys:
                raise ValueError(f"weight sync: tensors this model does not have: {result.unexpected_keys[:4]}")
            return
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.peft, state)
        if getattr(result, "unexpected_keys", None):
            raise ValueError(f"adapter state does not match this model: unexpected {result.unexpected_keys[:4]}")

    def merged_weights(self):
        """(name, tensor) of the plain model's state dict, with a LoRA adapter merged in (W + its delta, computed
        one weight at a time and never written back, so the trained base weights stay bit-identical): what an
        engine without the adapter (vLLM) loads. Full fine-tuning: the state dict itself."""
        if self.peft is None:
            yield from self.module.state_dict().items()
            return
        from peft.tuners.lora import LoraLayer

        layers = {name: m for name, m in self.module.named_modules() if isinstance(m, LoraLayer)}
        with torch.no_grad():
            for name, tensor in self.module.state_dict().items():
                if ".lora_" in name:
                    continue
                owner, _, leaf = name.rpartition(".base_layer.")
                if owner and owner in layers:
                    name = f"{owner}.{leaf}"
                    if leaf == "weight":
                        adapter = layers[owner].active_adapters[0]
                        tensor = tensor + layers[owner].get_delta_weight(adapter)
                yield name, tensor

    def merged(self):
        """A plain transformers model with the adapter merged in (a copy; this policy is unchanged)."""
        return copy.deepcopy(self.peft).merge_and_unload()


def recompute(model) -> None:
    """Activation checkpointing on `model`: each layer recomputed in the backward. DualKV keeps its attention
    through the recompute (hetrl/dualkv/api.py)."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def policy(cfg: RunConfig, model) -> Policy:
    """The trained policy for `cfg`: `model` itself, or `model` with a fresh LoRA adapter when lora_rank > 0 (the
    adapter's initial weights are drawn from the run's seed, so every process builds the same one); activation
    checkpointing on when `gradient_checkpointing`."""
    if cfg.gradient_checkpointing:
        recompute(model)
    if cfg.lora_rank == 0:
        return Policy(model)
    from peft import LoraConfig, get_peft_model

    targets = cfg.lora_target_modules if isinstance(cfg.lora_target_modules, str) else list(cfg.lora_target_modules)
    if not isinstance(targets, str):   # peft skips a listed name that matches nothing when another one matches
        modules = [n for n, _ in model.named_modules()]
        unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in modules)]
        if unmatched:
            _no_such_target(model, unmatched)
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=targets, task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(), warnings.catch_warnings():
            # peft 0.21 asks transformers 5 for a renamed attribute; the warning says nothing to a user
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            torch.manual_seed(cfg.seed)
            peft_model = get_peft_model(model, lora)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "Target modules" not in str(e):
            raise
        _no_such_target(model, [targets] if isinstance(targets, str) else targets)
    return Policy(peft_model.get_base_model(), peft_model)


def _no_such_target(model, wanted: list[str]):
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
    close = [c for t in wanted for c in difflib.get_close_matches(t, names, n=1)]
    raise InputError(f"lora_target_modules {wanted} match no module of {type(model).__name__}; its Linear "
                     f"modules are named {', '.join(names)} (or use all-linear)"
                     + (f"; did you mean {close[0]!r}?" if close else "")) from None


def optimizer(cfg: RunConfig, pol: Policy, partition: bool = False) -> torch.optim.Optimizer:
    return adamw(pol.trainable(), lr=cfg.lr, weight_decay=cfg.weight_decay, partition=partition)


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float,
          partition: bool = False) -> torch.optim.Optimizer:
    """torch's AdamW, its fused kernel (one pass over each parameter's state) where every parameter is a plain
    floating tensor on the CPU or a GPU, as TRL's default adamw_torch_fused; else (FSDP2's sharded DTensors) the
    foreach kernel. The update is AdamW's either way. On the CPU its states are made now (`states_now`); elsewhere
    by its first step (a GPU's caching allocator was not measured, and vLLM sizes its cache by the memory free when
    it starts). `partition`: ZeRO-1 over the default process group, each rank holding the states of its part of
    `params` only (hetrl.trainer.sharding.partitioned)."""
    fused = all(type(p.data) is torch.Tensor and p.is_floating_point() and p.device.type in ("cpu", "cuda")
                for p in params) and bool(params)
    if partition:
        from hetrl.trainer import sharding

        opt = sharding.partitioned(params, torch.optim.AdamW, lr=lr, weight_decay=weight_decay, fused=fused or None)
        local = sharding.local_optimizer(opt)
    else:
        opt = local = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    if fused and all(p.device.type == "cpu" for p in params):
        states_now(local)
    return opt


def states_now(opt: torch.optim.AdamW) -> None:
    """The fused AdamW's per-parameter states made now, as its first step would make them (torch's
    Adam._init_group: a float32 step count on the parameter's device, zero moments; tests/trainer/test_train.py
    checks them against torch's own). Made by the first step, 2 x the trainable parameters' bytes land in the
    heap (hetrl/trainer/allocator.py keeps freed memory in it) among that update's freed activations, which the
    next micro-batch then cannot reuse whole: the default job peaked at 4.57 GB of RSS at fp32 against 4.44 GB with
    the states made before it, every number bit-identical (benchmarks/results/memory_default_job_fp32.md)."""
    assert not any(g["amsgrad"] for g in opt.param_groups) and all(g["fused"] for g in opt.param_groups)
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {"step": torch.zeros((), dtype=torch.float32, device=p.device),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}


def shards(zero: int, world: int) -> bool:
    """Whether data-parallel ranks are FSDP2 shards: the plan's zero 2 or 3 over more than one rank (zero 1 over
    several splits the AdamW states only: ZeRO-1)."""
    return zero in (2, 3) and world > 1


def data_parallel_learner(cfg: RunConfig, pol: Policy, precision: RunPrecision, zero: int = 1, world: int = 1,
                          offload: bool = False) -> tuple[torch.optim.Optimizer, Learner]:
    """The optimizer and learner of one of `world` data-parallel ranks by the plan's `zero` for actor_train (the
    default process group is up when world > 1; hetrl.trainer.sharding): zero 2 or 3 shard `pol`'s model with
    FSDP2 first (`offload`: its CPU offload), zero 1 splits the AdamW states (ZeRO-1, its gradient sync reducing
    each part onto the rank that steps it). One rank: the plain optimizer and learner. What the Ray executor's
    learners and benchmarks/learner_sharding.py both run."""
    if world == 1:
        opt = optimizer(cfg, pol)
        return opt, learner(cfg, pol, opt, precision)
    from hetrl.trainer import sharding

    if shards(zero, world):
        sharding.shard(pol.module, offload=offload, zero=zero)
        opt = optimizer(cfg, pol)
        return opt, learner(cfg, pol, opt, precision, sharded=True)
    opt = optimizer(cfg, pol, partition=True)
    return opt, learner(cfg, pol, opt, precision, grad_sync=sharding.reduce_to_owners(opt))


def learner(cfg: RunConfig, pol: Policy, opt: torch.optim.Optimizer, precision: RunPrecision, grad_sync=None,
            sharded: bool = False) -> Learner:
    return Learner(pol.module, opt, impl=cfg.impl, temperature=cfg.temperature,
                   micro_batch_tokens=cfg.micro_batch_tokens, kl_coef=0.0 if cfg.use_kl_in_reward else cfg.kl_coef,
                   max_grad_norm=cfg.max_grad_norm, grad_sync=grad_sync, sharded=sharded, precision=precision,
                   trie=cfg.multi_turn, loss_mode=cfg.loss_mode, loss_options={**cfg.clip_options, **cfg.loss_options},
                   kl_loss_type=cfg.kl_loss_type, lr_at=lr_schedule(cfg), entropy_coeff=cfg.entropy_coeff)


def lr_schedule(cfg: RunConfig) -> Callable[[int], float] | None:
    """Optimizer step (0, 1, ...) -> learning rate, by transformers' scheduler `lr_scheduler_type` with its
    warmup over the run's steps x mini_batches optimizer steps; None for a constant rate without warmup."""
    total = cfg.steps * cfg.mini_batches
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total)
    if cfg.lr_scheduler_type == "constant" and not warmup:
        return None
    from transformers import get_scheduler

    name = "constant_with_warmup" if cfg.lr_scheduler_type == "constant" else cfg.lr_scheduler_type
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)   # the schedule's factor, read off
    factor = get_scheduler(name, probe, num_warmup_steps=warmup, num_training_steps=total).lr_lambdas[0]
    return lambda step: cfg.lr * factor(step)


def fast_fp32_matmuls(precision: RunPrecision) -> None:
    """On CUDA, unless the run is fp32: TF32 for the matmuls that stay fp32 (outside autocast)."""
    if precision.name != "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def rollout_worker(cfg: RunConfig, model, tokenizer, precision: RunPrecision) -> RolloutWorker:
    return RolloutWorker(model, tokenizer, cfg.rollout_batch_size, precision=precision, top_k=cfg.top_k)


def vllm_worker(cfg: RunConfig, pol: Policy, tokenizer, precision: RunPrecision, tp: int = 1,
                model_dir: pathlib.Path | None = None):
    """vLLM's engine in this process, loaded with the policy's weights (merged with its LoRA adapter; saved to
    `model_dir`, by default out_dir/.vllm_model, while the run lasts), long enough for the longest prompt the run
    keeps and the longest reply it asks for."""
    from hetrl.trainer.vllm_engine import VllmWorker

    longest = cfg.max_prompt_tokens + max(cfg.max_new_tokens, cfg.eval_max_new_tokens)
    limit = getattr(pol.module.config, "max_position_embeddings", None) or longest
    return VllmWorker(pol.module, tokenizer, precision, model_dir or pathlib.Path(cfg.out_dir) / ".vllm_model",
                      min(longest, limit), cfg.rollout_batch_size, cfg.seed, tp=tp, top_k=cfg.top_k,
                      weights=dict(pol.merged_weights()) if pol.lora else None)


def bf16_copy(model):
    """A frozen bf16 copy of `model` for sampling, made parameter by parameter (no transient second fp32 copy of
    the weights, which copy.deepcopy(model).to(bf16) would hold); tied weights stay tied."""
    memo = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False) for p in model.parameters()}
    return copy.deepcopy(model, memo).to(torch.bfloat16).eval()


def bf16_weights_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A bf16 copy of a state dict's floating tensors, the rest copied as they are (what a rollout that samples
    from bf16 weights loads after each update; precision.samples_in_bf16)."""
    with torch.no_grad():
        return {k: v.detach().to(torch.bfloat16, copy=True) if v.is_floating_point() else v.detach().clone()
                for k, v in state.items()}


def scorer(cfg: RunConfig, model, precision: RunPrecision, context=contextlib.nullcontext) -> Scorer:
    """No-grad log-probs of `model` through the DualKV path, inside `context` (the adapter off for the reference)."""
    return Scorer(model, impl=cfg.impl, temperature=cfg.temperature, micro_batch_tokens=cfg.micro_batch_tokens,
                  context=context, precision=precision, trie=cfg.multi_turn)


def reference(cfg: RunConfig, pol: Policy, load_base, precision: RunPrecision) -> Scorer | None:
    """The KL reference: with LoRA, the policy's own base weights with the adapter off (no second copy); else a
    frozen copy of the initial model, from `load_base()`, held in bf16 where the run is bf16-mixed (it is never
    trained, so it needs no fp32 master copy: half the memory, as verl's and the planner's reference). None when
    kl_coef is 0."""
    if not cfg.has_reference:
        return None
    if pol.lora:
        return scorer(cfg, pol.module, precision, pol.base_off)
    return scorer(cfg, frozen(load_base(), precision), precision)


def frozen(model, precision: RunPrecision):
    """`model` as a frozen scorer's copy: eval, no gradients; where the run autocasts to bf16, its matmul weights
    (every Linear's, except one tied to the input embeddings) held in bf16 and the rest (embeddings, norms) in fp32.
    Autocast casts an fp32 Linear weight to exactly these bf16 values before its matmul, so under the same autocast
    the copy computes what the fp32 policy computes, to the bit: the KL to an untrained policy reads 0. A copy all
    in bf16 would run its residual stream in bf16 instead (k3 0.0014 at step 1 on SmolLM2-135M,
    benchmarks/results/reference_precision.md). Never trained, it needs no fp32 master copy of its matmul weights:
    about half an fp32 copy's memory (`frozen_bytes`)."""
    model = model.eval().requires_grad_(False)
    if precision.autocast and next(model.parameters()).dtype == torch.float32:
        for p in _matmul_parameters(model):
            p.data = p.data.to(torch.bfloat16)
    return model


def _matmul_parameters(model) -> list[torch.nn.Parameter]:
    """What `frozen` holds in bf16: every Linear's weight and bias, except a weight tied to the input embeddings."""
    tied = model.get_input_embeddings().weight
    return [p for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight is not tied
            for p in (m.weight, m.bias) if p is not None]


def frozen_bytes(model, precision: RunPrecision) -> int:
    """Bytes of `frozen(model, precision)`'s weights, from `model` as it is (fp32 or already frozen)."""
    if not (precision.autocast and next(model.parameters()).dtype in (torch.float32, torch.bfloat16)):
        return sum(p.numel() * p.element_size() for p in model.parameters())
    matmul = {id(p) for p in _matmul_parameters(model)}
    return sum(p.numel() * (2 if id(p) in matmul else 4) for p in model.parameters())


def critic_model_problem(cfg: RunConfig) -> None:
    """A critic_model that cannot be loaded, said as critic_model's problem (not the policy's `model`)."""
    from hetrl.models import unknown_model

    why = unknown_model(cfg.critic_model) if cfg.critic_model is not None else None
    if why:
        raise InputError(f"critic_model={cfg.critic_model}: {why}")


def critic_model(cfg: RunConfig, policy_model=None):
    """The critic's decoder: critic_model's weights when given, else the initial policy's (a copy of
    `policy_model`, or loaded again from cfg.model), on the device and in the dtype of the policy."""
    from hetrl.models import load_model

    critic_model_problem(cfg)
    if cfg.critic_model is None and policy_model is not None:
        return copy.deepcopy(policy_model)
    dtype = policy_model.get_input_embeddings().weight.dtype if policy_model is not None else cfg.torch_dtype
    model, _ = load_model(cfg.critic_model or cfg.model, dtype, seed=cfg.seed)
    return model if policy_model is None else model.to(policy_model.get_input_embeddings().weight.device)


def critic(cfg: RunConfig, model, precision: RunPrecision, zero: int = 1, world: int = 1,
           offload: bool = False) -> Critic | None:
    """PPO's critic: `model` (critic_model()) with a scalar value head initialised to zero (values start at 0), its
    own AdamW at critic_lr; one of `world` data-parallel ranks by the plan's `zero` for critic_train, as
    data_parallel_learner: 2 or 3 shard the decoder and the head over the default process group before the
    optimizer is made (hetrl.trainer.sharding; `offload`: FSDP2's CPU offload), 1 splits the AdamW states
    (ZeRO-1). None unless algorithm=ppo."""
    if not cfg.has_critic:
        return None
    if cfg.gradient_checkpointing:
        recompute(model)
    dtype = model.get_input_embeddings().weight.dtype
    hidden = model.config.get_text_config().hidden_size
    head = torch.nn.Linear(hidden, 1, dtype=dtype, device=model.get_input_embeddings().weight.device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    sharded = shards(zero, world)
    partition = world > 1 and not sharded   # ZeRO-1
    if world > 1:
        from hetrl.trainer import sharding
    if sharded:
        sharding.shard(model, offload=offload, zero=zero, decoder_only=True)
        sharding.shard_module(head, offload=offload, zero=zero)
    params = [p for p in [*model.parameters(), *head.parameters()] if p.requires_grad]
    opt = adamw(params, lr=cfg.critic_lr, weight_decay=cfg.weight_decay, partition=partition)
    # ZeRO-1: each part's gradients summed onto the rank that steps it
    grad_sync = sharding.reduce_to_owners(opt) if partition else None
    return Critic(model, head, opt, impl=cfg.impl, micro_batch_tokens=cfg.micro_batch_tokens, vf_clip=cfg.vf_clip,
                  max_grad_norm=cfg.max_grad_norm, grad_sync=grad_sync, precision=precision, sharded=sharded)
