"""Shared-prompt attention with PyTorch FlexAttention: one call over the whole packed stream.

The block mask says: a query sees a key iff both are in the same group, the key is not after
the query, and the key is a prompt token or in the query's own response. Fully masked tiles
(other groups, other responses) are skipped by the block-sparse kernel. On CUDA the kernel is
compiled once per process; on CPU torch runs flex forward only (it refuses the backward), so
the caller must not ask for gradients there.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from ..packing import PackedBatch


def build_block_mask(batch: PackedBatch) -> BlockMask:
    group, seg = batch.group_ids, batch.segment_ids

    def shared_prompt(b, h, q, kv):
        return (kv <= q) & (group[q] == group[kv]) & ((seg[kv] == 0) | (seg[kv] == seg[q]))

    n = batch.num_tokens
    return create_block_mask(shared_prompt, B=None, H=None, Q_LEN=n, KV_LEN=n, device=group.device)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def attend(query, key, value, block_mask: BlockMask, scale: float) -> torch.Tensor:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, H, T, d] over the packed stream."""
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # eager flex is the intended CPU path (forward-only checks), not a mistake
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
