"""Shared-prompt attention with torch SDPA: exact, autograd-native, the CPU default.

Per group and layer, two SDPA calls on views of the packed stream (no copy of the prompt's K/V):
  1. the prompt's queries against the prompt's keys, plain causal;
  2. all N responses' queries at once against the contiguous key range [prompt, resp_1..resp_N]
     with a boolean mask: every prompt key is visible, and a response key only to queries of
     the same response at or after it.
Autograd sums the N responses' contributions into the prompt's dK/dV because call 2 reads the
same prompt K/V rows for every response. The masked-out cross-response block of call 2 costs
FLOPs (ΣR x ΣR per group), the price of one GEMM for all responses; see issue on CPU speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..packing import PackedBatch


def build_masks(batch: PackedBatch) -> list[torch.Tensor | None]:
    """Per group: bool [ΣR, P+ΣR] (True = attend) for the responses' queries, or None if ΣR = 0."""
    masks = []
    for s, p, e in batch.group_bounds:
        if e == s + p:
            masks.append(None)
            continue
        k_seg = batch.segment_ids[s:e]
        q_seg = k_seg[p:]
        k_pos = torch.arange(e - s, device=k_seg.device)
        q_pos = k_pos[p:]
        same_resp_causal = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])
        masks.append(same_resp_causal | (k_seg == 0)[None, :])
    return masks


def attend(query, key, value, masks, bounds, scale: float) -> torch.Tensor:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, H, T, d] over the packed stream."""
    gqa = query.shape[1] != key.shape[1]
    out = []
    for (s, p, e), mask in zip(bounds, masks):
        out.append(F.scaled_dot_product_attention(
            query[:, :, s : s + p], key[:, :, s : s + p], value[:, :, s : s + p],
            is_causal=True, scale=scale, enable_gqa=gqa))
        if mask is not None:
            out.append(F.scaled_dot_product_attention(
                query[:, :, s + p : e], key[:, :, s:e], value[:, :, s:e],
                attn_mask=mask, scale=scale, enable_gqa=gqa))
    return torch.cat(out, dim=2)
