"""Shared-prompt decoding: N continuations of one prompt read that prompt's KV cache once, not N times.

`SharedPrefixCache` holds each group's prompt keys/values once ([G, H_kv, P, d] per layer) and every row's own
continuation in a buffer allocated once for the whole decode ([B, H_kv, T, d]: written in place, where
transformers' DynamicCache concatenates, copying the whole cache every step). Its attention, registered under
`DECODE_ATTENTION` in transformers' AttentionInterface, scores a row's query against its group's prompt (one
batched matmul per layer with the group's rows as the query axis: the prompt's keys are read once per group)
and against its own continuation, and takes one softmax over both, which is exactly the attention over the
concatenation [prompt, continuation] that the repeated cache gives (up to fp32 rounding). With prompts of P
tokens and N continuations of t, a decode step reads P + N t cached positions per group instead of N (P + t).

Written by hand: transformers' caches store every row's whole context, and the shared-prefix ("cascade")
attention kernels that exist (FlashInfer, vLLM prefix caching) are CUDA-only inference engines, not a cache a
transformers model can decode from on the CPU. Only plain causal attention is supported (no sliding window,
softcapping or attention sinks): `Unsupported` is raised at the first layer otherwise, before anything is
sampled, and the caller decodes that model the plain way.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface

DECODE_ATTENTION = "hetrl_shared_prefix_decode"


class Unsupported(RuntimeError):
    """The model's attention is not plain causal attention: decode it with a transformers cache instead."""


class SharedPrefixCache:
    """Per layer: the G prompts' keys/values once (from a prefill of the G prompts) and B = rows continuation
    buffers of `max_new` positions. Rows are grouped by `group_of_row` [B]; `keep(rows)` drops finished rows.
    Use through `decoding(model, cache)`; call `advance()` after each forward."""

    def __init__(self, prefill_cache, prompt_mask: torch.Tensor, group_of_row: torch.Tensor, max_new: int):
        layers = getattr(prefill_cache, "layers", None)
        if not layers or any(not isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
            raise Unsupported(f"{type(prefill_cache).__name__} does not hold plain per-layer keys and values")
        self.prompt_k = [layer.keys for layer in layers]          # [G, H_kv, P, d]
        self.prompt_v = [layer.values for layer in layers]
        self.prompt_mask = prompt_mask.bool()                      # [G, P] (left padding is False)
        rows = group_of_row.numel()
        k0 = self.prompt_k[0]
        self.own_k = [k0.new_empty(rows, k.shape[1], max_new, k.shape[3]) for k in self.prompt_k]
        self.own_v = [v.new_empty(rows, v.shape[1], max_new, v.shape[3]) for v in self.prompt_v]
        self.length, self.max_new = 0, max_new
        self._set_rows(group_of_row)

    def _set_rows(self, group_of_row: torch.Tensor) -> None:
        """The gather that puts rows (batch order, grouped) into a [G, m] grid, m = most rows of a group."""
        self.group_of_row = group_of_row
        groups = self.prompt_mask.shape[0]
        counts = torch.bincount(group_of_row, minlength=groups)
        self.m = max(1, int(counts.max()))
        order = torch.argsort(group_of_row, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device) - starts[group_of_row[order]]
        self.flat = group_of_row * self.m + slot                    # row -> its place in the [G * m] grid
        grid = torch.zeros(groups * self.m, dtype=torch.long, device=order.device)   # empty places: row 0
        grid[self.flat] = torch.arange(order.numel(), device=order.device)
        self.grid = grid.view(groups, self.m)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' Cache.update: this step's key/value [B, H_kv, 1, d] -> the row's continuation so far."""
        if key.shape[2] != 1:
            raise ValueError(f"SharedPrefixCache decodes one token per row per step, got {key.shape[2]}")
        if self.length >= self.max_new:
            raise ValueError(f"SharedPrefixCache holds {self.max_new} decoded positions; all are used")
        self.own_k[layer_idx][:, :, self.length] = key[:, :, 0]
        self.own_v[layer_idx][:, :, self.length] = value[:, :, 0]
        return self.own_k[layer_idx][:, :, : self.length + 1], self.own_v[layer_idx][:, :, : self.length + 1]

    def advance(self) -> None:
        self.length += 1

    def keep(self, rows: torch.Tensor) -> None:
        """Only `rows` (indices into the current batch, ascending) decode on."""
        self.own_k = [k[rows] for k in self.own_k]
        self.own_v = [v[rows] for v in self.own_v]
        self._set_rows(self.group_of_row[rows])

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prompt_k[layer_idx].shape[2] + self.length


_ACTIVE: contextvars.ContextVar[SharedPrefixCache | None] = contextvars.ContextVar("hetrl_decode", default=None)


@contextlib.contextmanager
def decoding(model, cache: SharedPrefixCache):
    """`model` on the shared-prefix attention reading `cache`, for the duration."""
    from .api import _attention_implementation

    token = _ACTIVE.set(cache)
    try:
        with _attention_implementation(model, DECODE_ATTENTION):
            yield
    finally:
        _ACTIVE.reset(token)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """query [B, H, 1, d]; key/value the rows' own continuation [B, H_kv, t, d] -> ([B, 1, H, d], None)."""
    cache = _ACTIVE.get()
    if cache is None:
        raise RuntimeError(f"{DECODE_ATTENTION} runs only inside hetrl.dualkv.decode.decoding()")
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise Unsupported(f"shared-prefix decoding supports plain causal attention only ({name} is set)")
    if not getattr(module, "is_causal", True) or (dropout and module.training):
        raise Unsupported("shared-prefix decoding supports causal attention without dropout only")
    rows, heads, q_len, d = query.shape
    if q_len != 1:
        raise ValueError(f"shared-prefix decoding takes one query per row, got {q_len}")
    layer = module.layer_idx
    pk, pv = cache.prompt_k[layer], cache.prompt_v[layer]
    groups, kv_heads, prompt_len, _ = pk.shape
    rep, m = heads // kv_heads, cache.m
    scale = scaling if scaling is not None else d ** -0.5
    q = query.reshape(rows, kv_heads, rep, d)
    # the prompt: a group's rows (and each kv head's query heads) are the query axis of one matmul
    qg = q[cache.grid].permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, m * rep, d)
    s_prompt = torch.matmul(qg, pk.transpose(-1, -2)).mul_(scale)                      # [G, H_kv, m rep, P]
    s_prompt.masked_fill_(~cache.prompt_mask[:, None, None, :], float("-inf"))
    s_prompt = s_prompt.view(groups, kv_heads, m, rep, prompt_len).transpose(1, 2)
    s_prompt = s_prompt.reshape(groups * m, kv_heads, rep, prompt_len)[cache.flat]    # [B, H_kv, rep, P]
    s_own = torch.matmul(q, key.transpose(-1, -2)).mul_(scale)                         # [B, H_kv, rep, t]
    scores = torch.cat([s_prompt, s_own], dim=-1)
    w = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(value.dtype)
    out = torch.matmul(w[..., prompt_len:], value)                                     # [B, H_kv, rep, d]
    wg = w[..., :prompt_len][cache.grid].permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, m * rep, prompt_len)
    out_prompt = torch.matmul(wg, pv).view(groups, kv_heads, m, rep, d).transpose(1, 2)
    out = out + out_prompt.reshape(groups * m, kv_heads, rep, d)[cache.flat]
    return out.reshape(rows, 1, heads, d), None


AttentionInterface.register(DECODE_ATTENTION, _attention)
