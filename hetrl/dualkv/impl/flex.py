"""Tree attention with PyTorch FlexAttention: one call over the whole packed stream.

The block mask says: a query sees a key iff the key is not after it and the query lies in the key's subtree
(q < visible_until[key]: the stream is depth first, see packing.py), i.e. the key is an ancestor of the query or
an earlier token of its own segment. For one prompt and N responses that is: same group, and the key a prompt
token or in the query's own response. Fully masked tiles (other trees, other branches) are skipped by the
block-sparse kernel. On CUDA the kernel is
compiled with automatic dynamic shapes: a kernel for the first packed length, then one kernel with a
symbolic length for every later one (each micro-batch packs to another length; a shape-specialised
compile recompiled per length and, past dynamo's recompile limit, fell back to eager flex, which
materialises the whole score matrix). The kernel is flex's standard Triton one at every length: left to
choose, flex sends a stream under 128 tokens to its decoding kernel, which has no config for a training
pass at small head dims (measured on an H200, torch 2.11: a 98-token bf16 stream at head dim 16 failed to
compile with NoValidChoicesError; benchmarks/results/gpu/h100-2026-11-28/README.md). On CPU torch runs flex forward only
(it refuses the backward), so the caller must not ask for gradients there.
"""

from __future__ import annotations

import functools
import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ..packing import TreeBatch

BLOCK = 128                         # flex's default tile (create_block_mask's BLOCK_SIZE)
_CHUNK_PAIRS = 1 << 26              # (query, key) pairs evaluated at once while classifying tiles


def build_block_mask(batch: TreeBatch) -> BlockMask:
    """The tree BlockMask of a packed batch (see `block_mask_from_visibility`)."""
    return block_mask_from_visibility(batch.visible_until)


def block_mask_from_ids(group: torch.Tensor, seg: torch.Tensor) -> BlockMask:
    """The shared-prompt BlockMask over a stream of T tokens: token t is in group `group[t]` and in segment
    `seg[t]` of it (0: the prompt; i: response i), each group [prompt, response_1, ...] contiguous. A query sees a
    key iff the key is not after it, in its group, and in the prompt or its own segment. (One sequence per group
    with every segment 0 is plain document-causal packing, the varlen layout.)"""
    n = group.numel()
    idx = torch.arange(n, device=group.device)
    new_group = torch.ones(n, dtype=torch.bool, device=group.device)
    new_group[1:] = group[1:] != group[:-1]
    new_run = new_group.clone()
    new_run[1:] |= seg[1:] != seg[:-1]
    # the end of each token's group, and of its run of equal segment ids: prompt keys are visible to the whole
    # group, response keys to the rest of their response
    group_end = _run_ends(new_group, idx, n)
    run_end = _run_ends(new_run, idx, n)
    return block_mask_from_visibility(torch.where(seg == 0, group_end, run_end))


def _run_ends(starts: torch.Tensor, idx: torch.Tensor, n: int) -> torch.Tensor:
    """starts [T] bool (True where a run begins) -> the exclusive end of each token's run."""
    first = idx[starts]
    ends = torch.cat([first[1:], torch.tensor([n], device=idx.device)])
    return ends[torch.cumsum(starts.long(), 0) - 1]


def block_mask_from_visibility(visible_until: torch.Tensor) -> BlockMask:
    """The BlockMask over a stream of T tokens where key t is visible to query q iff t <= q < visible_until[t].
    Classified tile by tile in row chunks of bounded memory.

    `create_block_mask` evaluates the mask over all T x T pairs at once, which at long prompts costs more memory
    than the attention it serves (measured: benchmarks/README.md, "Numbers behind constants in the code"). Here
    each chunk of query rows is compared against every key in booleans only, reduced to its tiles (empty, partial
    or full, as create_block_mask classifies them), and the tiles are handed to the public
    `BlockMask.from_kv_blocks`. The mask is the same; tests compare both on CPU."""
    n, device = visible_until.numel(), visible_until.device
    blocks = -(-n // BLOCK)
    padded = blocks * BLOCK
    # padded tails: visible to no query, so mask_mod may also be called on indices in [n, padded); padded
    # queries (q >= n >= every visible_until) see nothing either
    vis_p = torch.full((padded,), -1, dtype=visible_until.dtype, device=device)
    vis_p[:n] = visible_until
    # the query's index read from a tensor, not used as a value: inductor's CPU flex template (torch 2.13)
    # emits C++ that does not compile when the index itself is compared with a loaded value
    row_p = torch.arange(padded, dtype=visible_until.dtype, device=device)

    def tree(b, h, q, kv):
        return (kv <= q) & (row_p[q] < vis_p[kv])

    kv = torch.arange(padded, device=device)[None]
    rows = max(1, _CHUNK_PAIRS // (BLOCK * padded)) * BLOCK
    partial, full = [], []
    for r0 in range(0, padded, rows):
        q = kv[0, r0:r0 + rows, None]
        allowed = tree(None, None, q, kv)                                # mask_mod broadcast over the chunk
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
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=BLOCK, mask_mod=tree,
                                    seq_lengths=(n, n))


def _kernel_options() -> dict:
    """flex's standard Triton kernel at every length, never its decoding kernel (see the module docstring):
    `BACKEND` where this torch has it, the older `FORCE_USE_FLEX_ATTENTION` knob otherwise."""
    from torch.nn.attention.flex_attention import FlexKernelOptions

    if "BACKEND" in getattr(FlexKernelOptions, "__annotations__", {}):
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=None)      # automatic dynamic: see the module docstring


def attend(query, key, value, block_mask: BlockMask, scale: float) -> torch.Tensor:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, H, T, d] over the packed stream."""
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda:
        return _compiled_flex()(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                kernel_options=_kernel_options())
    with warnings.catch_warnings():  # eager flex is the intended CPU path (forward-only checks), not a mistake
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa)
