"""Tree attention with torch SDPA: exact, autograd-native, the CPU default.

Per tree (see packing.py: depth-first stream, key t visible to query q iff t <= q < visible_until[t]) and layer,
the root segment's queries attend to the root's keys (plain causal SDPA on a view); the rest of the tree's queries
attend to their ancestors' keys and their own segment's past in one of three ways:

  tree     each segment's keys once, no mask and no copy: for every segment a, the queries of its whole subtree
           below it (one contiguous range, depth first) against a's keys, plus a's own causal block; a query's
           blocks are merged by their log-sum-exps (the online softmax of flash attention, across calls). Scores
           exactly the (query, ancestor key) pairs: Σ over tokens of their depth. Forward and backward run
           torch's CPU flash-attention kernel per block (the backward with the merged output and log-sum-exp,
           which gives each block's exact share of dQ, dK, dV); see `_TreeAttention`. The default for trees
           deeper than one level on the CPU (the kernel is torch's CPU one; on CUDA `auto` takes `stream`).
  stream   all the tree's non-root queries at once against the tree's contiguous key range with a boolean
           ancestry mask (no copy of anything); scores (T - root) x T pairs, of which the non-ancestor pairs are
           masked-out work.
  batched  depth-one trees (one prompt, N responses) only: the responses as a batch of N rows, each against
           [prompt keys, its own keys], padded to the longest response; scores N x R_max x (P + R_max) pairs.
           The prompt's K/V are broadcast into the batch (one copy of P x H_kv x d per response and layer).
For depth-one trees (pack_groups) "auto" picks between stream and batched, whichever scores fewer pairs; deeper
trees take `tree`. Either way autograd (or _TreeAttention's backward) sums every
descendant's contribution into a shared token's dK/dV, exactly as the standard layout's copies would.
Masks, blocks and index tensors are built once per forward.

Where an update's time goes (matmuls, attention, the logits' passes) was profiled: benchmarks/README.md,
"Numbers behind constants in the code".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..packing import TreeBatch

STRATEGIES = ("auto", "tree", "stream", "batched")


@dataclass
class _Stream:
    mask: torch.Tensor          # [T_tree - root, T_tree] bool, True = attend


@dataclass
class _Batched:
    own_index: torch.Tensor     # [n, R_max] stream rows of each response's tokens (padding -> a valid row)
    mask: torch.Tensor          # [n, 1, R_max, P + R_max] bool
    valid: torch.Tensor         # [Sum(R)] positions in the flattened [n * R_max] batch, in stream order


@dataclass
class _Tree:
    blocks: tuple               # (q0, q1, k0, k1, causal) relative to the tree's start; q0 >= the root's length


def _plan_tree(batch: TreeBatch, s: int, p: int, e: int, segments: list, strategy: str):
    """segments: the tree's (start, end, parent) with absolute rows and parents as indices into `segments`."""
    if e == s + p:
        return None
    depth_one = all(parent == 0 for _, _, parent in segments[1:])
    if strategy == "batched" and not depth_one:
        raise ValueError("strategy 'batched' needs depth-one trees (one prompt, N responses); this tree branches "
                         "below its first level; use 'tree', 'stream' or 'auto'")
    if strategy == "auto":
        if depth_one:
            lens = [b - a for a, b, _ in segments[1:]]
            n, r_max, total = len(lens), max(lens), sum(lens)
            strategy = "batched" if n * r_max * (p + r_max) < total * (p + total) else "stream"
        else:       # the tree blocks call torch's CPU flash kernel; elsewhere (impl="sdpa" on CUDA) the masked call
            strategy = "tree" if batch.input_ids.device.type == "cpu" else "stream"
    device = batch.input_ids.device
    if strategy == "tree" and device.type != "cpu":
        raise ValueError(f"strategy 'tree' runs torch's CPU flash-attention kernel, and this batch is on {device}; "
                         "use impl='flex' (the CUDA default) or the 'stream' strategy")
    if strategy == "tree":
        sub_end = [b for _, b, _ in segments]
        for i in range(len(segments) - 1, 0, -1):
            parent = segments[i][2]
            sub_end[parent] = max(sub_end[parent], sub_end[i])
        blocks = []
        for i, (a, b, _) in enumerate(segments):
            if i:
                blocks.append((a - s, b - s, a - s, b - s, True))          # its own past
            if sub_end[i] > b:
                blocks.append((b - s, sub_end[i] - s, a - s, b - s, False))  # everything below it sees all of it
        return _Tree(tuple(blocks))
    if strategy == "batched":
        lens = [b - a for a, b, _ in segments[1:]]
        n, r_max = len(lens), max(lens)
        starts = torch.tensor([a for a, _, _ in segments[1:]], device=device)
        t = torch.arange(r_max, device=device)
        length = torch.tensor(lens, device=device)
        in_resp = t[None, :] < length[:, None]                                  # [n, R_max]
        own_index = torch.where(in_resp, starts[:, None] + t[None, :], s + p)
        causal = t[None, :] <= t[:, None]                                        # [R_max, R_max]
        own_mask = causal[None] & in_resp[:, None, :]                            # keys must be real tokens
        prompt_mask = torch.ones(n, r_max, p, dtype=torch.bool, device=device)
        mask = torch.cat([prompt_mask, own_mask], dim=2)[:, None]
        valid = torch.nonzero(in_resp.flatten()).squeeze(1)
        return _Batched(own_index, mask, valid)
    k = torch.arange(s, e, device=device)
    q = k[p:]
    return _Stream((k[None, :] <= q[:, None]) & (q[:, None] < batch.visible_until[s:e][None, :]))


def build_masks(batch: TreeBatch, strategy: str = "auto") -> list:
    """Per tree: how its non-root tokens attend (`_Tree`, `_Stream` or `_Batched`), or None if it has none.
    `strategy` "auto": `tree` for trees deeper than one level (`stream` off the CPU), and for depth-one trees
    whichever of stream and batched scores fewer pairs; "tree" / "stream" / "batched" force one (tests)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    plans, i = [], 0
    for s, p, e in batch.tree_bounds:
        assert batch.segments[i][0] == s and batch.segments[i][2] < 0
        j = i + 1
        while j < len(batch.segments) and batch.segments[j][0] < e:
            j += 1
        local = [(a, b, parent - i if parent >= 0 else -1) for a, b, parent in batch.segments[i:j]]
        plans.append(_plan_tree(batch, s, p, e, local, strategy))
        i = j
    return plans


def attend(query, key, value, plans, bounds, scale: float) -> torch.Tensor:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, H, T, d] over the packed stream; `bounds` per tree
    (start, root length, end)."""
    gqa = query.shape[1] != key.shape[1]
    out = []
    for (s, p, e), plan in zip(bounds, plans):
        out.append(F.scaled_dot_product_attention(
            query[:, :, s:s + p], key[:, :, s:s + p], value[:, :, s:s + p], is_causal=True, scale=scale,
            enable_gqa=gqa))
        if isinstance(plan, _Tree):
            q, k, v = _same_dtype(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e])
            out.append(_TreeAttention.apply(q, k, v, plan.blocks, p, scale))
        elif isinstance(plan, _Stream):
            out.append(F.scaled_dot_product_attention(
                query[:, :, s + p:e], key[:, :, s:e], value[:, :, s:e], attn_mask=plan.mask, scale=scale,
                enable_gqa=gqa))
        elif isinstance(plan, _Batched):
            out.append(_batched(query, key, value, s, p, plan, scale, gqa))
    return torch.cat(out, dim=2)


def _same_dtype(q, k, v):
    """q, k, v in the one dtype the flash kernel needs, as F.scaled_dot_product_attention would get them: under
    autocast its dtype (SDPA is on autocast's lower-precision list; a custom autograd Function is not cast by it,
    and under CPU bf16 autocast RoPE can leave q and k fp32 beside a bf16 v), else their promoted dtype."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if q.dtype == torch.float64:     # autocast never casts fp64 values
            dtype = torch.float64
    else:
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _batched(query, key, value, s, p, plan: _Batched, scale, gqa) -> torch.Tensor:
    n, r_max = plan.own_index.shape
    idx = plan.own_index.flatten()

    def rows(x):                                   # [1, h, T, d] -> [n, h, R_max, d]
        return x[0][:, idx].unflatten(1, (n, r_max)).transpose(0, 1)

    def with_prompt(x):                            # [n, h, P + R_max, d]
        prompt = x[0][:, s:s + p].unsqueeze(0).expand(n, -1, -1, -1)
        return torch.cat([prompt, rows(x)], dim=2)

    o = F.scaled_dot_product_attention(rows(query), with_prompt(key), with_prompt(value), attn_mask=plan.mask,
                                       scale=scale, enable_gqa=gqa)               # [n, H, R_max, d]
    return o.transpose(0, 1).flatten(1, 2)[:, plan.valid].unsqueeze(0)           # [1, H, Sum(R), d]


# torch's CPU flash-attention kernel with its log-sum-exp (forward) and with a given output and log-sum-exp
# (backward): what F.scaled_dot_product_attention runs on CPU, called directly because the public function returns
# neither. Handles GQA (H_kv dividing H) itself.
_flash_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TreeAttention(torch.autograd.Function):
    """The non-root queries of one tree against their ancestors' keys and their own segment's past, block by block.

    q [1, H, n, d], k/v [1, H_kv, n, d]: the tree's rows; blocks (q0, q1, k0, k1, causal) in tree rows, every query
    row in [root, n) covered by the blocks of its ancestors and itself. -> [1, H, n - root, d].
    Forward: each block through the flash kernel, merged per row by log-sum-exp (fp32 at least). Backward: each
    block's flash backward given the merged output and log-sum-exp, so its softmax is the row's whole softmax and
    its dQ, dK, dV are that block's exact share (the ring-attention identity); the shares are summed.
    """

    @staticmethod
    def forward(ctx, q, k, v, blocks, root: int, scale: float):
        n_q = q.shape[2] - root
        work = torch.promote_types(q.dtype, torch.float32)
        out = torch.zeros(q.shape[0], q.shape[1], n_q, q.shape[3], dtype=work, device=q.device)
        lse = torch.full(out.shape[:3], float("-inf"), dtype=work, device=q.device)
        for q0, q1, k0, k1, causal in blocks:
            o, block_lse = _flash_fwd(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], 0.0, causal, scale=scale)
            r0, r1 = q0 - root, q1 - root
            new = torch.logaddexp(lse[:, :, r0:r1], block_lse)
            acc = out[:, :, r0:r1]
            acc.mul_((lse[:, :, r0:r1] - new).exp_()[..., None]).add_(o * (block_lse - new).exp()[..., None])
            lse[:, :, r0:r1] = new
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.blocks, ctx.root, ctx.scale = blocks, root, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        root, scale = ctx.root, ctx.scale
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for q0, q1, k0, k1, causal in ctx.blocks:
            r0, r1 = q0 - root, q1 - root
            gq, gk, gv = _flash_bwd(grad_out[:, :, r0:r1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                    out[:, :, r0:r1], lse[:, :, r0:r1].contiguous(), 0.0, causal, scale=scale)
            dq[:, :, q0:q1] += gq
            dk[:, :, k0:k1] += gk
            dv[:, :, k0:k1] += gv
        return dq, dk, dv, None, None, None
