"""Learner: log-prob passes and the policy update (any loss of hetrl.algo's registry, through its packed adapter),
and PPO's critic (values and the clipped value update), all through the DualKV shared-prompt engine.

Groups are cut into micro-batches by packed-token budget (`split_by_token_budget`, which keeps groups whole
and in order; for multi-turn episodes, whose samples share turns, one trie of sequences cut in the trie's order),
each micro-batch knowing where its labels sit in the per-token tensors. The mini-batch loss is a weighted sum of
per-token losses (weights from `token_weights`), hence gradient accumulation over micro-batches is exact.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hetrl.algo import clipped_value_loss, kl_penalty, packed_policy_loss, weighted_sum
from hetrl.dualkv import (
    TreeBatch,
    pack_groups,
    pack_sequences,
    shared_prompt_head,
    shared_prompt_logprobs,
    split_by_token_budget,
    split_sequences_by_token_budget,
)
from hetrl.trainer.precision import FP32, RunPrecision

Groups = list[tuple[list[int], list[list[int]]]]


@dataclass(frozen=True)
class UpdateStats:
    loss: float
    policy_loss: float
    kl: float
    clip_frac: float
    entropy: float
    grad_norm: float
    packed_tokens: int
    standard_tokens: int
    lr: float | None = None      # the learning rate the optimizer stepped at (its schedule's, or the config's)

    @classmethod
    def no_step(cls) -> UpdateStats:
        """Nothing to learn from (every loss weight 0, e.g. all responses overlong): no optimizer step."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)


def _finite_step(grad_norm: float, loss: float, shared_only: bool) -> bool:
    """Whether an optimizer step may be taken: its gradient norm (and, on a lone learner, its loss) finite."""
    return math.isfinite(grad_norm) and (shared_only or math.isfinite(loss))


def _micro_batches(groups: Groups, micro_batch_tokens: int, trie: bool = False
                   ) -> list[tuple[TreeBatch, torch.Tensor]]:
    """Micro-batches of `groups` within the packed-token budget, each with the positions [k] of its labels in the
    groups' per-token layout (group by group, response by response, token by token).

    trie off: each group a depth-one tree (pack_groups), groups whole and in order. trie on (multi-turn episodes,
    whose samples share turns, not just the prompt): every [prompt, response] a sequence of one trie
    (pack_sequences, the prompt context, the response labelled), cut in the trie's order
    (split_sequences_by_token_budget), so every shared turn is computed once; its labels are then in the trie's
    order, which the positions map back."""
    if not groups:
        return []
    if not trie:
        out, at = [], 0
        for mb in split_by_token_budget(groups, micro_batch_tokens):
            batch = pack_groups(mb)
            out.append((batch, torch.arange(at, at + batch.labels.numel())))
            at += batch.labels.numel()
        return out
    seqs, masks, starts = [], [], [0]
    for prompt, responses in groups:
        for r in responses:
            seqs.append([*prompt, *r])
            masks.append([False] * len(prompt) + [True] * len(r))
            starts.append(starts[-1] + len(r))
    out = []
    for part in split_sequences_by_token_budget(seqs, micro_batch_tokens):
        batch = pack_sequences([seqs[i] for i in part], [masks[i] for i in part])
        out.append((batch, torch.cat([torch.arange(starts[i], starts[i + 1]) for i in part])))
    return out


def _dummy_passes(n: int, sharded: bool) -> int:
    """Zero-weight passes this rank runs so that every sharded (FSDP2) rank runs as many passes: each pass
    all-gathers every layer's weights, a collective all ranks must join."""
    if not sharded:
        return 0
    from hetrl.trainer.sharding import common_count

    return common_count(n) - n


DUMMY = [([0], [[0]])]   # one prompt token, one response token: the smallest pass


class Scorer:
    """No-grad log-probs of sampled responses under a fixed model (the reference, or a rollout worker's
    behaviour policy), through the same DualKV path as the learner."""

    def __init__(self, model, *, impl: str = "auto", temperature: float = 1.0, micro_batch_tokens: int = 4096,
                 context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 sharded: bool = False, precision: RunPrecision = FP32, trie: bool = False):
        self.model, self.impl, self.temperature, self.micro_batch_tokens = model, impl, temperature, micro_batch_tokens
        self.trie = trie         # pack each mini-batch's samples as one trie (_micro_batches): multi-turn episodes
        self.precision = precision   # the run's (precision.decide): bf16 autocast or not
        self.context = context   # entered around every pass (a LoRA reference: the adapter off)
        self.sharded = sharded   # an FSDP2 rank: runs as many passes as the others (sharding.py)

    def logprobs(self, groups: Groups) -> torch.Tensor:
        """[K] log-probs of every response token of `groups`, group by group, response by response."""
        batches = _micro_batches(groups, self.micro_batch_tokens, self.trie)
        dummies = _dummy_passes(len(batches), self.sharded)   # agreed before any pass: it is a collective too
        with torch.no_grad(), self.context(), self.precision.amp(self.model):
            parts = [shared_prompt_logprobs(self.model, b, impl=self.impl, temperature=self.temperature).cpu()
                     for b, _ in batches]
            for _ in range(dummies):
                shared_prompt_logprobs(self.model, pack_groups(DUMMY), impl=self.impl, temperature=self.temperature)
        if not parts:
            return torch.zeros(0, dtype=self.model.dtype)
        out = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype)
        out[torch.cat([at for _, at in batches])] = torch.cat(parts)
        return out


class Learner:
    """The policy update. `grad_sync`, when given, is called on the trainable parameters after the backward
    passes and before clipping: data-parallel learners all-reduce their gradients there."""

    def __init__(self, model, optimizer: torch.optim.Optimizer, *, impl: str = "auto", temperature: float = 1.0,
                 micro_batch_tokens: int = 4096, kl_coef: float = 0.0, max_grad_norm: float = 1.0,
                 grad_sync: Callable[[list[torch.nn.Parameter]], None] | None = None, sharded: bool = False,
                 precision: RunPrecision = FP32, trie: bool = False, loss_mode: str = "vanilla",
                 loss_options: dict | None = None, kl_loss_type: str = "low_var_kl",
                 lr_at: Callable[[int], float] | None = None, entropy_coeff: float = 0.0):
        self.model, self.optimizer, self.precision, self.trie = model, optimizer, precision, trie
        self.impl, self.temperature, self.micro_batch_tokens = impl, temperature, micro_batch_tokens
        self.kl_coef, self.max_grad_norm, self.kl_loss_type = kl_coef, max_grad_norm, kl_loss_type
        # the policy loss (hetrl.algo.POLICY_LOSSES) and its options under verl's names (a run's: RunConfig's
        # clip_options and loss_options, build.learner); without options, the loss's own defaults (vanilla: the
        # clipped surrogate at 0.2 without dual-clip)
        self.loss_mode = loss_mode
        self.loss_options = dict(loss_options or {})
        self.lr_at = lr_at   # optimizer step -> learning rate (the run's schedule); None: the optimizer's own
        self.entropy_coeff = entropy_coeff   # loss -= entropy_coeff x entropy, aggregated as the policy loss (verl)
        self.grad_sync, self.sharded = grad_sync, sharded   # sharded: an FSDP2 rank (gradients summed by FSDP2)
        self.scorer = Scorer(model, impl=impl, temperature=temperature, micro_batch_tokens=micro_batch_tokens,
                             sharded=sharded, precision=precision, trie=trie)

    def logprobs(self, groups: Groups) -> torch.Tensor:
        """No-grad log-probs [K] of every response token of `groups` under the current policy."""
        out = self.scorer.logprobs(groups)
        if self.sharded:   # zero: 2 holds the weights these passes gathered; no backward follows to free them
            from hetrl.trainer.sharding import reshard
            reshard(self.model)
        return out

    def update(self, groups: Groups, advantages: torch.Tensor, weights: torch.Tensor, old_logp: torch.Tensor | None,
               ref_logp: torch.Tensor | None = None, lr_step: int | None = None,
               is_weights: torch.Tensor | None = None) -> UpdateStats:
        """One optimizer step on `groups`. Per-token tensors [K]: advantages, loss weights, old/ref log-probs.
        `lr_step`: this optimizer step's number in the run, which sets the learning rate where a schedule does.
        `old_logp` None: on-policy, the weights about to be updated are the ones that sampled `groups` (the first
        mini-batch of a sync step), so the old log-probs are this very forward's, detached (ratio 1, as TRL
        does), and no separate pass computes them. With `grad_sync` (or `sharded`) this rank takes part even with
        nothing to learn from (the others wait for it). `is_weights` [K]: the rollout correction's importance
        weights (hetrl.algo.rollout_correction), which multiply each token's policy loss as verl's losses do
        (not the KL or entropy terms)."""
        if float(weights.sum()) == 0 and self.grad_sync is None and not self.sharded:  # e.g. all overlong
            return UpdateStats.no_step()
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict(loss=0.0, policy=0.0, kl=0.0, clip=0.0, entropy=0.0)
        packed = standard = offset = 0
        # A data-parallel rank can get no group (DAPO's dynamic sampling may keep fewer groups than there are
        # ranks): it still joins the gradient all-reduce below with zero gradients.
        batches = [(b, at) for b, at in _micro_batches(groups, self.micro_batch_tokens, self.trie) if at.numel()]
        dummies = _dummy_passes(len(batches), self.sharded)   # agreed before any pass: it is a collective too
        for batch, sl in batches:     # sl: the micro-batch's positions in the per-token tensors
            offset += sl.numel()
            with self.precision.amp(self.model):   # the forward; its backward follows autocast's casts
                logp, entropy = shared_prompt_logprobs(self.model, batch, impl=self.impl,
                                                       temperature=self.temperature, return_entropy=True)
            device, dtype = logp.device, logp.dtype
            w = weights[sl].to(device, dtype)
            old = logp.detach() if old_logp is None else old_logp[sl].to(device, dtype)
            lens = torch.as_tensor(batch.labels_per_sequence)   # per [prompt, response] sequence, in label order
            pg, metrics = packed_policy_loss(self.loss_mode, old, logp, advantages[sl].to(device, dtype), w, lens,
                                             **self.loss_options)
            if is_weights is not None:
                pg = pg * is_weights[sl].to(device, dtype)
            loss_tok = pg
            if self.kl_coef > 0:
                kl = kl_penalty(logp, ref_logp[sl].to(device, dtype), self.kl_loss_type)
                loss_tok = pg + self.kl_coef * kl
                totals["kl"] += weighted_sum(kl, w).detach().item()
            if self.entropy_coeff > 0:
                loss_tok = loss_tok - self.entropy_coeff * entropy.to(dtype)
            loss = weighted_sum(loss_tok, w)
            loss.backward()
            with torch.no_grad():
                totals["loss"] += loss.item()
                totals["policy"] += weighted_sum(pg, w).item()
                if "pg_clipfrac" in metrics:
                    totals["clip"] += weighted_sum(metrics["pg_clipfrac"], w).item()
                totals["entropy"] += weighted_sum(entropy, w).item()
            packed += batch.num_tokens
            standard += batch.num_standard_tokens
        for _ in range(dummies):   # zero-weight passes: the gradients stay those of this rank's groups
            with self.precision.amp(self.model):
                logp = shared_prompt_logprobs(self.model, pack_groups(DUMMY), impl=self.impl,
                                              temperature=self.temperature)
            (0.0 * logp.sum()).backward()
        assert offset == weights.numel(), "micro-batches must cover every response token"
        grad_norm = _optimizer_step(self.optimizer, totals["loss"], self.max_grad_norm, self.grad_sync,
                                    (self.model,) if self.sharded else (),
                                    lr=self.lr_at(lr_step) if self.lr_at is not None and lr_step is not None else None)
        return UpdateStats(loss=totals["loss"], policy_loss=totals["policy"], kl=totals["kl"],
                           clip_frac=totals["clip"], entropy=totals["entropy"], grad_norm=grad_norm,
                           packed_tokens=packed, standard_tokens=standard, lr=self.optimizer.param_groups[0]["lr"])


def _optimizer_step(optimizer: torch.optim.Optimizer, loss: float, max_grad_norm: float | None, grad_sync=None,
                    sharded: tuple[torch.nn.Module, ...] = (), lr: float | None = None) -> float:
    """The end of every update, the policy's and the critic's: the gradients of the optimizer's parameters summed
    over data-parallel ranks (`grad_sync`; an FSDP2 rank's have been summed by its reduce-scatters; a ZeRO-1 rank's
    onto the rank that steps them, clipped by the norm over all of them), clipped, and
    the optimizer step taken (at `lr` when given) only when the step is finite; -> the gradient norm. `sharded`:
    this FSDP2 rank's sharded modules, whose gathered weights (zero: 2 holds them through the passes) are freed
    first, so that the step updates the shards the next pass gathers. A non-finite step is never taken
    (hetrl/trainer/guards.py); data-parallel ranks decide on the synced gradient norm alone, which they share, so
    they all step or all skip."""
    from hetrl.trainer import sharding

    if sharded:
        sharding.reshard(*sharded)
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if grad_sync is not None:
        grad_sync(params)
    if sharding.is_partitioned(optimizer):   # ZeRO-1: each rank holds its part's summed gradients (reduce_to_owners)
        grad_norm = sharding.partitioned_norm(params)
        torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm or float("inf"), grad_norm)
    else:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm or float("inf"))
    if sharded:
        grad_norm = sharding.full_value(grad_norm)
    if _finite_step(float(grad_norm), loss, shared_only=grad_sync is not None or sharded):
        if lr is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


@dataclass(frozen=True)
class CriticStats:
    value_loss: float
    vf_clip_frac: float
    grad_norm: float


class Critic:
    """PPO's critic: a causal LM's decoder with a scalar value head, its values read at the rows that predict
    response tokens (shared_prompt_head: the prompt once per group, exactly), trained with the clipped value
    loss by its own optimizer. The LM head of `model` is never run."""

    def __init__(self, model, head: torch.nn.Linear, optimizer: torch.optim.Optimizer, *, impl: str = "auto",
                 micro_batch_tokens: int = 4096, vf_clip: float | None = 0.2, max_grad_norm: float = 1.0,
                 grad_sync: Callable[[list[torch.nn.Parameter]], None] | None = None,
                 precision: RunPrecision = FP32, sharded: bool = False):
        self.model, self.head, self.optimizer, self.precision = model, head, optimizer, precision
        self.impl, self.micro_batch_tokens, self.vf_clip, self.max_grad_norm = impl, micro_batch_tokens, vf_clip, \
            max_grad_norm
        self.grad_sync = grad_sync   # data-parallel critics: gradients summed over the ranks, as the Learner's
        self.sharded = sharded       # an FSDP2 rank (model and head sharded): as many passes as the others

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in [*self.model.parameters(), *self.head.parameters()] if p.requires_grad]

    def _values(self, batch) -> torch.Tensor:
        with self.precision.amp(self.model):
            v = shared_prompt_head(self.model, batch, self.head, impl=self.impl).squeeze(-1)
        return v.to(self.head.weight.dtype)     # the value loss in the master dtype

    def values(self, groups: Groups) -> torch.Tensor:
        """No-grad values [K] of the state before every response token of `groups`."""
        batches = _micro_batches(groups, self.micro_batch_tokens)
        dummies = _dummy_passes(len(batches), self.sharded)
        with torch.no_grad():
            parts = [self._values(b) for b, _ in batches]
            for _ in range(dummies):
                self._values(pack_groups(DUMMY))
        if self.sharded:   # zero: 2 holds the weights these passes gathered; no backward follows to free them
            from hetrl.trainer.sharding import reshard
            reshard(self.model, self.head)
        return torch.cat(parts).detach().cpu() if parts else torch.zeros(0, dtype=self.head.weight.dtype)

    def update(self, groups: Groups, returns: torch.Tensor, old_values: torch.Tensor,
               weights: torch.Tensor) -> CriticStats:
        """One optimizer step of the clipped value loss, per-token `weights` as the policy loss's. With `grad_sync`
        this rank takes part even with nothing to learn from (the others wait for it)."""
        if float(weights.sum()) == 0 and self.grad_sync is None and not self.sharded:
            return CriticStats(0.0, 0.0, 0.0)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = clip_total = 0.0
        offset = 0
        batches = [(b, at) for b, at in _micro_batches(groups, self.micro_batch_tokens) if at.numel()]
        dummies = _dummy_passes(len(batches), self.sharded)
        for batch, sl in batches:
            offset += sl.numel()
            v = self._values(batch)
            w = weights[sl].to(v.device, v.dtype)
            loss_tok, clipped = clipped_value_loss(v, old_values[sl].to(v.device, v.dtype),
                                                   returns[sl].to(v.device, v.dtype), self.vf_clip)
            loss = (w * loss_tok).sum()
            loss.backward()
            loss_total += loss.item()
            clip_total += (w * clipped).sum().item()
        for _ in range(dummies):   # zero-weight passes: the gradients stay those of this rank's groups
            (0.0 * self._values(pack_groups(DUMMY)).sum()).backward()
        assert offset == weights.numel(), "micro-batches must cover every response token"
        grad_norm = _optimizer_step(self.optimizer, loss_total, self.max_grad_norm, self.grad_sync,
                                    (self.model, self.head) if self.sharded else ())
        return CriticStats(loss_total, clip_total, grad_norm)

    def _both(self) -> torch.nn.Module:
        """The decoder and the head as one module ("model.*", "head.*"), its parameters in self.parameters()'s
        order: what the sharded state's gather and load address."""
        return torch.nn.ModuleDict({"model": self.model, "head": self.head})

    def state(self) -> dict:
        """Everything a checkpoint keeps of the critic (tensors only: loaded back with weights_only=True). Sharded
        ranks gather the full states on rank 0 into the same form, and ZeRO-1 ranks their AdamW partitions (every
        rank must call it; the others get {})."""
        from hetrl.trainer import sharding

        if not self.sharded:
            if not sharding.consolidate(self.optimizer):
                return {}
            return {"model": self.model.state_dict(), "head": self.head.state_dict(),
                    "optimizer": self.optimizer.state_dict()}
        both = self._both()
        full, optimizer = sharding.full_state(both), sharding.full_optimizer_state(both, self.optimizer)
        if not full:
            return {}
        return {"model": {k.removeprefix("model."): v for k, v in full.items() if k.startswith("model.")},
                "head": {k.removeprefix("head."): v for k, v in full.items() if k.startswith("head.")},
                "optimizer": optimizer}

    def load_state(self, state: dict) -> None:
        """A checkpoint's critic state (state()'s form, from replicas or shards) into this critic."""
        from hetrl.trainer import sharding

        if not self.sharded:
            self.model.load_state_dict(state["model"])
            self.head.load_state_dict(state["head"])
            sharding.load_optimizer(self.optimizer, state["optimizer"])
            return
        both = self._both()
        sharding.load_full_state(both, {**{f"model.{k}": v for k, v in state["model"].items()},
                                        **{f"head.{k}": v for k, v in state["head"].items()}})
        sharding.load_optimizer_state(both, self.optimizer, state["optimizer"])
