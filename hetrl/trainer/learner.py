"""Learner: log-prob passes and the clipped policy update, all through the DualKV shared-prompt engine.

Groups are cut into micro-batches by packed-token budget (`split_by_token_budget`, which keeps
groups whole and response order intact), so the per-token tensors of a mini-batch line up with
the concatenated micro-batch outputs. The mini-batch loss is a weighted sum of per-token losses
(weights from `token_weights`), hence gradient accumulation over micro-batches is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hetrl.algo import clipped_policy_loss, kl_k3
from hetrl.dualkv import pack_groups, shared_prompt_logprobs, split_by_token_budget

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


class Learner:
    def __init__(self, model, optimizer: torch.optim.Optimizer, *, impl: str = "auto", temperature: float = 1.0,
                 micro_batch_tokens: int = 4096, clip_low: float = 0.2, clip_high: float = 0.2,
                 kl_coef: float = 0.0, max_grad_norm: float = 1.0):
        self.model, self.optimizer = model, optimizer
        self.impl, self.temperature, self.micro_batch_tokens = impl, temperature, micro_batch_tokens
        self.clip_low, self.clip_high, self.kl_coef, self.max_grad_norm = clip_low, clip_high, kl_coef, max_grad_norm

    def _micro_batches(self, groups: Groups):
        return [pack_groups(mb) for mb in split_by_token_budget(groups, self.micro_batch_tokens)]

    def logprobs(self, groups: Groups, model=None) -> torch.Tensor:
        """No-grad log-probs [K] of every response token of `groups` under `model` (default: the policy)."""
        model = model if model is not None else self.model
        with torch.no_grad():
            parts = [shared_prompt_logprobs(model, b, impl=self.impl, temperature=self.temperature)
                     for b in self._micro_batches(groups)]
        return torch.cat(parts).detach().cpu()

    def update(self, groups: Groups, advantages: torch.Tensor, weights: torch.Tensor, old_logp: torch.Tensor,
               ref_logp: torch.Tensor | None = None) -> UpdateStats:
        """One optimizer step on `groups`. Per-token tensors [K]: advantages, loss weights, old/ref log-probs."""
        if float(weights.sum()) == 0:  # every response left out (e.g. all overlong): nothing to learn from
            return UpdateStats(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 0)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals = dict(loss=0.0, policy=0.0, kl=0.0, clip=0.0, entropy=0.0)
        packed = standard = offset = 0
        for batch in self._micro_batches(groups):
            k = batch.labels.numel()
            if k == 0:
                continue
            sl = slice(offset, offset + k)
            offset += k
            logp, entropy = shared_prompt_logprobs(self.model, batch, impl=self.impl, temperature=self.temperature,
                                                   return_entropy=True)
            device, dtype = logp.device, logp.dtype
            w = weights[sl].to(device, dtype)
            pg, clipped = clipped_policy_loss(logp, old_logp[sl].to(device, dtype), advantages[sl].to(device, dtype),
                                              self.clip_low, self.clip_high)
            loss_tok = pg
            if self.kl_coef > 0:
                kl = kl_k3(logp, ref_logp[sl].to(device, dtype))
                loss_tok = pg + self.kl_coef * kl
                totals["kl"] += (w * kl).detach().sum().item()
            loss = (w * loss_tok).sum()
            loss.backward()
            with torch.no_grad():
                totals["loss"] += loss.item()
                totals["policy"] += (w * pg).sum().item()
                totals["clip"] += (w * clipped).sum().item()
                totals["entropy"] += (w * entropy).sum().item()
            packed += batch.num_tokens
            standard += batch.num_standard_tokens
        assert offset == weights.numel(), "micro-batches must cover every response token"
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return UpdateStats(loss=totals["loss"], policy_loss=totals["policy"], kl=totals["kl"],
                           clip_frac=totals["clip"], entropy=totals["entropy"], grad_norm=float(grad_norm),
                           packed_tokens=packed, standard_tokens=standard)
