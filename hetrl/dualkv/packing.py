"""Shared-prompt packing: N responses of one prompt become one stream [prompt, resp_1, ..., resp_N].

A *group* is one prompt of P tokens with N responses of lengths R_1..R_N. The standard
layout holds N rows of P+R_i tokens; the packed layout holds P+ΣR_i tokens, several groups
back to back. Response i keeps the position ids it has in the standard layout
(P, P+1, ..., P+R_i-1), so every per-token op sees the same inputs in both layouts.

All index tensors are built with vectorised torch ops (cumsum / repeat_interleave), never a
per-token Python loop; the only Python loops run over groups and responses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

Group = tuple[torch.Tensor, list[torch.Tensor]]


def _as_ids(x, where: str) -> torch.Tensor:
    """One token-id sequence (list of ints or 1-D integer tensor) -> 1-D int64 CPU tensor."""
    if isinstance(x, torch.Tensor):
        t = x
    else:
        if isinstance(x, (str, bytes)) or not isinstance(x, Sequence):
            raise ValueError(f"{where} must be a list of ints or a 1-D LongTensor, got {type(x).__name__}")
        if len(x) == 0:
            t = torch.zeros(0, dtype=torch.long)
        else:
            try:
                t = torch.tensor(x)
            except (TypeError, ValueError, RuntimeError) as e:
                raise ValueError(
                    f"{where} must be a flat list of ints; it could not be read as one ({e})"
                ) from None
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        raise ValueError(f"{where} must hold integer token ids, got dtype {t.dtype}")
    if t.dim() != 1:
        raise ValueError(
            f"{where} must be 1-D (one sequence of token ids), got shape {tuple(t.shape)}; "
            "pass each response as its own list"
        )
    if t.numel() and int(t.min()) < 0:
        raise ValueError(f"{where} holds a negative token id ({int(t.min())}); token ids are >= 0")
    return t.to(device="cpu", dtype=torch.long)


def normalize_groups(groups) -> list[Group]:
    """Validate `[(prompt_ids, [resp_ids, ...]), ...]` and return it as 1-D LongTensors."""
    if isinstance(groups, torch.Tensor) or not isinstance(groups, Sequence) or len(groups) == 0:
        raise ValueError("groups must be a non-empty list of (prompt_ids, [response_ids, ...]) pairs")
    out = []
    for g, group in enumerate(groups):
        if not isinstance(group, Sequence) or isinstance(group, (str, torch.Tensor)) or len(group) != 2:
            raise ValueError(f"group {g} must be a pair (prompt_ids, [response_ids, ...])")
        prompt = _as_ids(group[0], f"group {g} prompt")
        if prompt.numel() == 0:
            raise ValueError(f"group {g} prompt is empty; a group needs a prompt of at least 1 token")
        resps = group[1]
        if isinstance(resps, torch.Tensor) and resps.dim() != 2:
            raise ValueError(
                f"group {g} responses must be a list of 1-D sequences (or a 2-D tensor), "
                f"got a tensor of shape {tuple(resps.shape)}"
            )
        if not isinstance(resps, (Sequence, torch.Tensor)) or isinstance(resps, str) or len(resps) == 0:
            raise ValueError(f"group {g} has no responses; give at least one (an empty response is allowed)")
        out.append((prompt, [_as_ids(r, f"group {g} response {i}") for i, r in enumerate(resps)]))
    return out


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


@dataclass(frozen=True)
class PackedBatch:
    """Several groups packed back to back. T = Σ_g (P_g + Σ_i R_gi) tokens, M responses, K response tokens.

    Tensors (all int64):
      input_ids, position_ids, group_ids, segment_ids: [T]. `segment_ids` is 0 on prompt
        tokens and i+1 on tokens of the group's i-th response.
      prompt_lens, group_starts: [G]; responses_per_group: [G]; response_lens: [M].
      labels: [K] the response tokens, group by group, response by response.
      predict_index: [K] the stream row whose logits predict each label (the prompt's last
        row for the first token of every response).
      logit_rows: [U] the distinct rows of `predict_index`, sorted; row_of_label: [K] with
        predict_index == logit_rows[row_of_label]. The LM head runs on U rows only.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    group_ids: torch.Tensor
    segment_ids: torch.Tensor
    prompt_lens: torch.Tensor
    group_starts: torch.Tensor
    responses_per_group: torch.Tensor
    response_lens: torch.Tensor
    labels: torch.Tensor
    predict_index: torch.Tensor
    logit_rows: torch.Tensor
    row_of_label: torch.Tensor
    # Host-side copies for Python-level loops (no device syncs): per group (start, P, end).
    group_bounds: tuple[tuple[int, int, int], ...] = field(repr=False)
    response_lens_list: tuple[int, ...] = field(repr=False)

    @property
    def num_groups(self) -> int:
        return len(self.group_bounds)

    @property
    def num_responses(self) -> int:
        return len(self.response_lens_list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed layout: Σ_g (P_g + Σ_i R_gi)."""
        return int(self.input_ids.numel())

    @property
    def num_standard_tokens(self) -> int:
        """Tokens in the standard layout: Σ_g Σ_i (P_g + R_gi)."""
        per_group = [n * p for (_, p, _), n in zip(self.group_bounds, self.responses_per_group.tolist())]
        return sum(per_group) + sum(self.response_lens_list)

    @property
    def rho(self) -> float:
        """Token reduction of every per-token op: standard tokens / packed tokens."""
        return self.num_standard_tokens / self.num_tokens

    @property
    def max_context(self) -> int:
        """Longest sequence of the standard layout, max_g (P_g + max_i R_gi): the span attention covers."""
        spans, r = [], 0
        for (_, p, _), n in zip(self.group_bounds, self.responses_per_group.tolist()):
            spans.append(p + max(self.response_lens_list[r : r + n]))
            r += n
        return max(spans)

    def to(self, device) -> PackedBatch:
        moved = {
            name: getattr(self, name).to(device)
            for name in self.__dataclass_fields__
            if isinstance(getattr(self, name), torch.Tensor)
        }
        return PackedBatch(**moved, group_bounds=self.group_bounds, response_lens_list=self.response_lens_list)

    def split_responses(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-label tensor [K, ...] into one tensor per response, in input order."""
        if x.shape[0] != self.labels.numel():
            raise ValueError(
                f"split_responses expects {self.labels.numel()} rows (one per response token), got {x.shape[0]}"
            )
        return list(torch.split(x, list(self.response_lens_list)))

    def groups(self) -> list[Group]:
        """The groups back as (prompt_ids, [response_ids, ...]) on CPU (standard layout input)."""
        ids = self.input_ids.cpu()
        out, r = [], 0
        for (s, p, e), n in zip(self.group_bounds, self.responses_per_group.tolist()):
            lens = list(self.response_lens_list[r : r + n])
            out.append((ids[s : s + p], list(torch.split(ids[s + p : e], lens))))
            r += n
        return out


def pack_groups(groups) -> PackedBatch:
    """Pack `[(prompt_ids, [resp_ids_1, ..., resp_ids_N]), ...]` into one shared-prompt stream.

    Ids are lists of ints or 1-D integer tensors. Responses may be ragged or empty (R=0
    adds no tokens); every prompt needs at least one token. Raises ValueError naming the
    group and field on bad input.
    """
    norm = normalize_groups(groups)
    n_groups = len(norm)
    prompt_lens = torch.tensor([p.numel() for p, _ in norm], dtype=torch.long)
    per_group = torch.tensor([len(rs) for _, rs in norm], dtype=torch.long)
    resp_lens = torch.tensor([r.numel() for _, rs in norm for r in rs], dtype=torch.long)

    # Segments in stream order: [prompt_0, r_00, r_01, ..., prompt_1, r_10, ...].
    seg_lens = torch.tensor([n for p, rs in norm for n in (p.numel(), *(r.numel() for r in rs))], dtype=torch.long)
    seg_local = torch.cat([torch.arange(n + 1) for n in per_group.tolist()])  # 0 = prompt, i+1 = response i
    seg_group = torch.repeat_interleave(torch.arange(n_groups), per_group + 1)
    seg_first_pos = torch.where(seg_local == 0, 0, prompt_lens[seg_group])  # position id of a segment's 1st token
    seg_starts = _exclusive_cumsum(seg_lens)

    input_ids = torch.cat([t for p, rs in norm for t in (p, *rs)])
    n_tokens = input_ids.numel()
    tok_seg = torch.repeat_interleave(torch.arange(seg_lens.numel()), seg_lens)
    position_ids = torch.arange(n_tokens) - seg_starts[tok_seg] + seg_first_pos[tok_seg]
    group_ids = seg_group[tok_seg]
    segment_ids = seg_local[tok_seg]

    group_tokens = prompt_lens + torch.zeros(n_groups, dtype=torch.long).index_add_(
        0, torch.repeat_interleave(torch.arange(n_groups), per_group), resp_lens)
    group_starts = _exclusive_cumsum(group_tokens)

    is_resp = segment_ids > 0
    labels = input_ids[is_resp]
    predict_index = torch.nonzero(is_resp).squeeze(1) - 1
    # The first token of each non-empty response is predicted by its group's last prompt row.
    resp_group = torch.repeat_interleave(torch.arange(n_groups), per_group)
    first_label = _exclusive_cumsum(resp_lens)[resp_lens > 0]
    nonempty_group = resp_group[resp_lens > 0]
    predict_index[first_label] = group_starts[nonempty_group] + prompt_lens[nonempty_group] - 1
    logit_rows, row_of_label = torch.unique(predict_index, sorted=True, return_inverse=True)

    bounds = tuple(
        (s, p, s + n) for s, p, n in zip(group_starts.tolist(), prompt_lens.tolist(), group_tokens.tolist())
    )
    return PackedBatch(
        input_ids=input_ids,
        position_ids=position_ids,
        group_ids=group_ids,
        segment_ids=segment_ids,
        prompt_lens=prompt_lens,
        group_starts=group_starts,
        responses_per_group=per_group,
        response_lens=resp_lens,
        labels=labels,
        predict_index=predict_index,
        logit_rows=logit_rows,
        row_of_label=row_of_label,
        group_bounds=bounds,
        response_lens_list=tuple(resp_lens.tolist()),
    )


def split_by_token_budget(groups, max_tokens: int) -> list[list[Group]]:
    """Cut groups into micro-batches whose packed size (Σ P + Σ R) is at most `max_tokens`.

    Groups keep their order and are never split unless a group alone exceeds the budget;
    such a group is cut into sub-groups of consecutive responses, each carrying its own
    copy of the prompt. That stays exact (every sub-group is a valid group) but gives up
    part of the saving: a group cut into k sub-groups runs its prompt k times instead of
    once, so its ρ falls from N(P+R)/(P+NR) towards (N/k)(P+R)/(P+(N/k)R). Raise the budget
    where memory allows. Concatenating the responses of all micro-batches in order gives the
    input's responses in their original order.

    Returns a list of micro-batches, each a list of (prompt_ids, [response_ids, ...]).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    batches: list[list[Group]] = []
    current: list[Group] = []
    used = 0
    for g, (prompt, resps) in enumerate(normalize_groups(groups)):
        p = prompt.numel()
        size = p + sum(r.numel() for r in resps)
        if size <= max_tokens:
            if used + size > max_tokens:
                batches.append(current)
                current, used = [], 0
            current.append((prompt, resps))
            used += size
            continue
        longest = max(r.numel() for r in resps)
        if p + longest > max_tokens:
            raise ValueError(
                f"group {g} cannot fit the token budget: its prompt ({p} tokens) plus its longest response "
                f"({longest} tokens) is {p + longest} > max_tokens ({max_tokens}); raise max_tokens to at "
                f"least {p + longest} or truncate the prompt/responses"
            )
        # Too big alone: cut into sub-groups, each filling a fresh micro-batch.
        if current:
            batches.append(current)
            current, used = [], 0
        chunk: list[torch.Tensor] = []
        chunk_size = p
        for r in resps:
            if chunk and chunk_size + r.numel() > max_tokens:
                batches.append([(prompt, chunk)])
                chunk, chunk_size = [], p
            chunk.append(r)
            chunk_size += r.numel()
        current, used = [(prompt, chunk)], chunk_size
    if current:
        batches.append(current)
    return batches
