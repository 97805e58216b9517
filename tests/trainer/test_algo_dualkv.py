"""The registry's losses under DualKV (fp64): the trainer's layout (groups packed with one shared prompt, per-token
tensors [K], token weights with tool tokens and a left-out response at weight 0, two micro-batches) gives the
loss and parameter gradients of the plain layout (each [prompt, response] its own forward, padded [B, T] into
hetrl.algo.policy_loss). The sequence-level losses (GSPO, GMPO, SAPO) need per-response sums over tokens that
the packed stream keeps in another order; they must still agree to 1e-10."""

from __future__ import annotations

import copy

import pytest
import torch

from hetrl.algo import (
    loss_aggregation,
    packed_policy_loss,
    policy_loss,
    to_packed,
    to_padded,
    token_weights,
    weighted_sum,
)
from hetrl.dualkv import pack_groups, shared_prompt_logprobs
from hetrl.models import load_model

from ..dualkv.oracle import _use_float64_norms

OPTIONS = {"gspo": dict(clip_ratio_low=0.2, clip_ratio_high=0.28), "geo_mean": dict(clip_ratio=0.4),
           "sapo": dict(), "vanilla": dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
           "cispo": dict(clip_ratio_high=0.28)}


@pytest.fixture(scope="module")
def setup():
    model, _ = load_model("tiny", dtype=torch.float64, seed=3)
    _use_float64_norms(model)
    g = torch.Generator().manual_seed(1)
    groups = [(torch.randint(4, 90, (p,), generator=g).tolist(),
               [torch.randint(4, 90, (n,), generator=g).tolist() for n in lens])
              for p, lens in ((7, (5, 9, 3)), (4, (6, 2, 8)))]
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])
    loss_mask = torch.rand(int(lens.sum()), generator=g) > 0.25          # tool tokens: weight 0
    keep = torch.tensor([True, True, True, True, False, True])            # one response left out (overlong)
    k = int(lens.sum())
    noise = 0.3 * torch.randn(k, generator=g, dtype=torch.float64)
    adv = torch.repeat_interleave(torch.randn(len(lens), generator=g, dtype=torch.float64), lens)
    return model, groups, lens, loss_mask, keep, noise, adv


def _packed(model, groups, lens, weights, noise, adv, name):
    """The trainer's way: two micro-batches of whole groups, each a DualKV forward, summed."""
    model.zero_grad()
    total, offset = 0.0, 0
    for mb in (groups[:1], groups[1:]):
        batch = pack_groups(mb)
        logp = shared_prompt_logprobs(model, batch, impl="sdpa")
        sl = slice(offset, offset + logp.numel())
        offset += logp.numel()
        loss_tok, _ = packed_policy_loss(name, logp.detach() + noise[sl], logp, adv[sl], weights[sl],
                                         batch.response_lens, **OPTIONS[name])
        loss = weighted_sum(loss_tok, weights[sl])
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}


def _plain(model, groups, lens, mask, noise, adv, name, mode):
    """Each [prompt, response] its own forward, padded [B, T], one call of hetrl.algo.policy_loss."""
    model.zero_grad()
    logps = []
    for prompt, responses in groups:
        for r in responses:
            logits = model(input_ids=torch.tensor([prompt + r])).logits[0, len(prompt) - 1:-1]
            logps.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1))
    logp = to_padded(torch.cat(logps), lens)
    old = logp.detach() + to_padded(noise, lens)
    loss, _ = policy_loss(name, old, logp, to_padded(adv, lens), to_padded(mask.double(), lens), mode,
                          seq_len_eps=0.0, **OPTIONS[name])
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name,mode", [("gspo", "seq-mean-token-mean"), ("gspo", "token-mean"), ("geo_mean", None),
                                       ("sapo", None), ("vanilla", "seq-mean-token-sum"), ("cispo", "token-mean")])
def test_packed_equals_plain_layout(setup, name, mode):
    model, groups, lens, loss_mask, keep, noise, adv = setup
    mode = loss_aggregation(name, mode)
    weights = token_weights(lens, keep, mode, loss_mask)
    in_loss = weights != 0
    assert torch.equal(in_loss, loss_mask & torch.repeat_interleave(keep, lens))
    packed_loss, packed_grads = _packed(copy.deepcopy(model), groups, lens, weights, noise, adv, name)
    plain_loss, plain_grads = _plain(copy.deepcopy(model), groups, lens, in_loss, noise, adv, name, mode)
    assert packed_loss == pytest.approx(plain_loss, rel=1e-10, abs=1e-12)
    assert any(g.abs().sum() > 0 for g in plain_grads.values())
    for n, g in plain_grads.items():
        assert (packed_grads[n] - g).abs().max().item() <= 1e-10 * max(1.0, g.abs().max().item()), n


def test_to_padded_and_back_is_the_identity():
    lens = torch.tensor([3, 0, 2])
    x = torch.arange(5.0, requires_grad=True)
    padded = to_padded(x, lens)
    assert padded.tolist() == [[0.0, 1.0, 2.0], [0.0, 0.0, 0.0], [3.0, 4.0, 0.0]]
    assert torch.equal(to_packed(padded, lens), x.detach())
    (padded * torch.arange(9.0).view(3, 3)).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 2.0, 6.0, 7.0]
    with pytest.raises(ValueError, match="sum to 5, but there are 4 tokens"):
        to_padded(torch.zeros(4), lens)
