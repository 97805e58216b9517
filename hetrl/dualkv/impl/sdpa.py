"""Shared-prompt attention with torch SDPA: exact, autograd-native, the CPU default.

Per group and layer, the prompt's queries attend to the prompt's keys (plain causal SDPA on a view),
then the responses' queries attend to [prompt keys, own earlier response keys] in one of two ways,
whichever scores fewer (query, key) pairs for the group's shape:

  stream   all N responses' queries at once against the contiguous key range [prompt, resp_1..resp_N]
           with a boolean mask (no copy of anything); scores Sum(R) x (P + Sum(R)) pairs, of which the
           cross-response block Sum(R)^2 - Sum(R_i^2) is masked-out work.
  batched  the responses as a batch of N rows, each against [prompt keys, its own keys], padded to the
           longest response; scores N x R_max x (P + R_max) pairs. The prompt's K/V are broadcast into
           the batch (one copy of P x H_kv x d per response and layer, small next to the scores).
Either way autograd sums the N responses' contributions into the prompt's dK/dV, exactly as the
standard layout's N prompt copies would. Masks and index tensors are built once per forward.

Where the time goes (torch.profiler, CPU, 2 threads; Qwen3-shaped 4 layers, hidden 512, vocab 32,000;
one update = forward + GRPO loss + backward at N=16, P=1024, R=64: 2,048 packed tokens against 17,408
in the standard layout; `batched` is chosen, 1.1M scored pairs per head and layer against 2.1M for `stream`):
  ~55%  matmuls: the decoder's linear layers on the 2,048 tokens (~0.75 s) and the LM head on the 1,009
        rows that predict response tokens (forward + 2 backward GEMMs, ~0.42 s); nothing else to cut
        without changing the model.
  ~18%  attention: the responses' batch against [prompt, own keys] (forward 55 ms, backward 150 ms over 4
        layers) and the prompt's causal block (31 + 77 ms). The N broadcast copies of the prompt's K/V
        that `batched` builds cost ~20 ms (aten::cat) per update: measured, so left as they are.
  ~10%  element-wise passes over the [1,009 x 32,000] logits: autograd through logsumexp + indexing
        took ~8 passes in the backward; api._GatheredLogSoftmax does it in 3, and since works through
        cache-sized row chunks (benchmarks/results/logsoftmax_chunks.md).
  rest  RMSNorm / SwiGLU / RoPE element-wise ops, index_put of the responses' rows in the backward
        (~20 ms); the Python loop over groups and layers does not show at one group (batches of many
        small groups were not profiled).
Above 256 MB of logits (e.g. N=16, P=2048, R=256) the LM head runs in recomputed row chunks instead
(api._ChunkedLogProbs): the update's peak RSS increase there fell from 4.2 GB to 1.8 GB (packed: 8.7 GB)
for ~12% more time (benchmarks/results/dualkv_cpu_memory_case.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..packing import PackedBatch


@dataclass
class _Stream:
    mask: torch.Tensor          # [Sum(R), P + Sum(R)] bool, True = attend


@dataclass
class _Batched:
    own_index: torch.Tensor     # [n, R_max] stream rows of each response's tokens (padding -> a valid row)
    mask: torch.Tensor          # [n, 1, R_max, P + R_max] bool
    valid: torch.Tensor         # [Sum(R)] positions in the flattened [n * R_max] batch, in stream order


def _plan_group(batch: PackedBatch, s: int, p: int, e: int, lens: list[int], strategy: str):
    lens = [r for r in lens if r > 0]
    total = sum(lens)
    if total == 0:
        return None
    device = batch.segment_ids.device
    n, r_max = len(lens), max(lens)
    batched = n * r_max * (p + r_max) < total * (p + total) if strategy == "auto" else strategy == "batched"
    if batched:
        starts = torch.tensor([0, *lens[:-1]], device=device).cumsum(0) + s + p
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
    k_seg = batch.segment_ids[s:e]
    q_seg = k_seg[p:]
    k_pos = torch.arange(e - s, device=device)
    q_pos = k_pos[p:]
    same_resp_causal = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])
    return _Stream(same_resp_causal | (k_seg == 0)[None, :])


def build_masks(batch: PackedBatch, strategy: str = "auto") -> list:
    """Per group: how its responses attend (`_Stream` or `_Batched`), or None if it has no response tokens.
    `strategy` "auto" picks per group the one scoring fewer pairs; "stream" / "batched" force one (tests)."""
    plans, r = [], 0
    counts = batch.responses_per_group.tolist()
    for (s, p, e), n in zip(batch.group_bounds, counts):
        plans.append(_plan_group(batch, s, p, e, list(batch.response_lens_list[r:r + n]), strategy))
        r += n
    return plans


def attend(query, key, value, plans, bounds, scale: float) -> torch.Tensor:
    """query [1, H, T, d], key/value [1, H_kv, T, d] -> [1, H, T, d] over the packed stream."""
    gqa = query.shape[1] != key.shape[1]
    out = []
    for (s, p, e), plan in zip(bounds, plans):
        out.append(F.scaled_dot_product_attention(
            query[:, :, s:s + p], key[:, :, s:s + p], value[:, :, s:s + p], is_causal=True, scale=scale,
            enable_gqa=gqa))
        if isinstance(plan, _Stream):
            out.append(F.scaled_dot_product_attention(
                query[:, :, s + p:e], key[:, :, s:e], value[:, :, s:e], attn_mask=plan.mask, scale=scale,
                enable_gqa=gqa))
        elif isinstance(plan, _Batched):
            out.append(_batched(query, key, value, s, p, plan, scale, gqa))
    return torch.cat(out, dim=2)


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
