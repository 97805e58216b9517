"""Activation checkpointing with DualKV: the backward re-runs each layer through the shared-prompt attention, so
log-probs and every gradient equal the run without checkpointing (fp64), and the checkpointed model's own calls
(a plain forward, generation) still use its own attention."""

import copy

import pytest
import torch

from hetrl.dualkv import pack_groups, shared_prompt_logprobs
from hetrl.dualkv.impl import sdpa

from .oracle import random_groups, tiny_model

GROUPS = dict(prompt_lens=[13, 1, 32], response_lens=[[5, 0, 9, 1], [12, 3], [4, 4, 7]])


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_checkpointed_logprobs_and_gradients_equal_the_run_without(family, reentrant, monkeypatch):
    groups = random_groups(2, **GROUPS)
    plain = tiny_model(family).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    calls = []
    attend = sdpa.attend
    monkeypatch.setattr(sdpa, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))

    want = shared_prompt_logprobs(plain, pack_groups(groups), impl="sdpa", temperature=0.8)
    forward_calls = len(calls)
    got = shared_prompt_logprobs(checkpointed, pack_groups(groups), impl="sdpa", temperature=0.8)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    weights = torch.linspace(0.5, 1.5, want.numel(), dtype=torch.float64)
    (want * weights).sum().backward()
    before_backward = len(calls)
    (got * weights).sum().backward()
    layers = plain.config.num_hidden_layers
    assert forward_calls == layers and before_backward == 2 * layers
    assert len(calls) - before_backward == layers     # the recompute went through the shared-prompt attention
    other = dict(checkpointed.named_parameters())
    for name, p in plain.named_parameters():
        assert torch.allclose(other[name].grad, p.grad, rtol=1e-10, atol=1e-13), name

    # the model's own calls after that: its own attention (left padding and a cache included)
    ids = torch.tensor([[0, 0, 5, 9, 14, 3], [7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    plain.eval(), checkpointed.eval()
    with torch.no_grad():
        assert torch.allclose(checkpointed(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits,
                              atol=1e-12)
        a = plain.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        b = checkpointed.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)
