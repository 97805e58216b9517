"""Both response-attention strategies of the sdpa path equal dense masked attention, forward and backward (fp64)."""

import pytest
import torch
import torch.nn.functional as F

from hetrl.dualkv import pack_groups
from hetrl.dualkv.impl import sdpa

from .oracle import random_groups


def _dense(q, k, v, batch, scale):
    """The shared-prompt mask written out over the whole stream: same group, not after, prompt or own response."""
    g, seg = batch.group_ids, batch.segment_ids
    t = torch.arange(g.numel())
    mask = (t[None] <= t[:, None]) & (g[None] == g[:, None]) & ((seg[None] == 0) | (seg[None] == seg[:, None]))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


@pytest.mark.parametrize("strategy", ["stream", "batched", "auto"])
def test_strategy_equals_dense_mask(strategy):
    groups = random_groups(4, [1, 33, 7], [[5, 0, 1, 12], [3], [0, 9, 9, 2]])
    batch = pack_groups(groups)
    torch.manual_seed(0)
    q = torch.randn(1, 4, batch.num_tokens, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, batch.num_tokens, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, batch.num_tokens, 8, dtype=torch.float64, requires_grad=True)
    plans = sdpa.build_masks(batch, strategy)
    if strategy != "auto":
        assert all(p is None or type(p).__name__.lower().lstrip("_") == strategy for p in plans)
    out = sdpa.attend(q, k, v, plans, batch.group_bounds, 0.35)
    want = _dense(q, k, v, batch, 0.35)
    assert (out - want).abs().max() < 1e-12
    w = torch.randn_like(out)
    got_grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(got_grads, want_grads):
        assert (a - b).abs().max() < 1e-12
