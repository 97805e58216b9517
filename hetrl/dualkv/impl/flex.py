"""Shared-prompt attention with PyTorch FlexAttention: one call over the whole packed stream.

The block mask says: a query sees a key iff both are in the same group, the key is not after
the query, and the key is a prompt token or in the query's own response. Fully masked tiles
(other groups, other responses) are skipped by the block-sparse kernel. On CUDA the kernel is
compiled with automatic dynamic shapes: a kernel for the first packed length, then one kernel with a
symbolic length for every later one (each micro-batch packs to another length; a shape-specialised
compile recompiled per length and, past dynamo's recompile limit, fell back to eager flex, which
materialises the whole score matrix). On CPU torch runs flex forward only (it refuses the backward),
so the caller must not ask for gradients there.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..packing import PackedBatch


BLOCK = 128                         # flex's default tile (create_block_mask's BLOCK_SIZE)
_CHUNK_PAIRS = 1 << 26              # (query, key) pairs evaluated at once while classifying tiles


def build_block_mask(batch: PackedBatch) -> BlockMask:
    """The shared-prompt BlockMask of a packed batch (see `block_mask_from_ids`)."""
    return block_mask_from_ids(batch.group_ids, batch.segment_ids)


def block_mask_from_ids(group: torch.Tensor, seg: torch.Tensor) -> BlockMask:
    """The shared-prompt BlockMask over a stream of T tokens: token t is in group `group[t]` and in segment
    `seg[t]` of it (0: the prompt; i: response i). A query sees a key iff the key is not after it, in its group,
    and in the prompt or its own segment. (One sequence per group with every segment 0 is plain document-causal
    packing, the varlen layout.) Classified tile by tile in row chunks of bounded memory.

    `create_block_mask` evaluates the mask over all T x T pairs at once (about 11 bytes per pair measured on
    CPU: 2.9 GiB at T = 16K, ~50 GiB at the T = 67K of P = 32K with 32 responses), which would cost more memory
    than the attention it serves. Here each chunk of query rows is compared against every key in booleans only,
    reduced to its tiles (empty, partial or full, as create_block_mask classifies them), and the tiles are
    handed to the public `BlockMask.from_kv_blocks`. The mask is the same; tests compare both on CPU."""
    n, device = group.numel(), group.device
    blocks = -(-n // BLOCK)
    padded = blocks * BLOCK
    # padded tails: group -1 (never attended), so mask_mod may also be called on indices in [n, padded)
    group_p = torch.full((padded,), -1, dtype=group.dtype, device=device)
    seg_p = torch.full((padded,), -1, dtype=seg.dtype, device=device)
    group_p[:n], seg_p[:n] = group, seg

    def shared_prompt(b, h, q, kv):
        return (kv <= q) & (group_p[q] == group_p[kv]) & ((seg_p[kv] == 0) | (seg_p[kv] == seg_p[q]))

    kv = torch.arange(padded, device=device)[None]
    rows = max(1, _CHUNK_PAIRS // (BLOCK * padded)) * BLOCK
    partial, full = [], []
    for r0 in range(0, padded, rows):
        q = kv[0, r0:r0 + rows, None]
        allowed = shared_prompt(None, None, q, kv) & (group_p[q] >= 0)   # mask_mod broadcast over the chunk
        tiles = allowed.view(-1, BLOCK, blocks, BLOCK)
        some, every = tiles.any(3).any(1), tiles.all(3).all(1)
        partial.append(some & ~every)
        full.append(every)

    def ordered(dense: torch.Tensor):            # [Qb, Kb] bool -> (count [1, 1, Qb], indices [1, 1, Qb, Kb])
        dense = dense.to(torch.int32)
        indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
        return dense.sum(-1).to(torch.int32)[None, None], indices[None, None].contiguous()

    kv_num, kv_idx = ordered(torch.cat(partial))
    full_num, full_idx = ordered(torch.cat(full))
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=shared_prompt,
                                    seq_lengths=(n, n))


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=None)      # automatic dynamic: see the module docstring


def attend(query, key, value, block_mask: BlockMask, scale: float) -> torch.Tensor:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, H, T, d] over the packed stream."""
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
    with warnings.catch_warnings():  # eager flex is the intended CPU path (forward-only checks), not a mistake
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
