"""Packing of token sequences that share prefixes: every shared token is laid out (and later computed) once.

The general case is a forest of token trees (`pack_sequences`: agent trajectories that fork at a turn, several
samples of one prompt, sequences that are prefixes of others); shared prefixes are found with a trie. The
one-prompt-N-responses layout (`pack_groups`) is its depth-one case: a root segment (the prompt) with one child
segment per response, packed as given (no merging of equal prompts or response prefixes). Both build a
`TreeBatch` through one function, `_pack_runs`, and the engine (api.py, impl/) sees nothing else.

Layout. Tokens are laid out depth first: a tree's root segment, then each child's subtree in turn, so the subtree
of every token is one contiguous range of the stream. A token's position id is its depth (its index in any
sequence through it). Key t is visible to query q iff t <= q < visible_until[t] (the end of t's subtree): the
whole attention mask is one integer per token. A *segment* is a maximal chain of tokens without a branch; a child
segment hangs off the last token of its parent segment.

Why no extra tokens at branch points: a label is predicted from the row of the token before it, and that row is
looked up per label (`predict_index`), not stored next to the label in the stream. Where sequences diverge, the
first token of every branch is predicted from the shared parent row, which is computed once and feeds each
branch's label (its gradient is their sum). A layout that stores each row's next-token label in the row itself
(TRL's TreeRow: a trie keyed on (token, next token)) needs one more copy of the parent per extra child; this one
computes exactly the trie's nodes: `num_tokens` == the number of trie nodes.

All index tensors are built with vectorised torch ops; the only Python loops run over sequences, runs and
segments, never over tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
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
class TreeBatch:
    """A forest of token trees packed depth first: T stream tokens, S sequences, K labels (tokens whose log-prob
    is returned), U rows that predict a label.

    Tensors (int64 unless said):
      input_ids, position_ids (depth in the tree), visible_until: [T]. Key t is visible to query q iff
        t <= q < visible_until[t].
      labels: [K] the labelled tokens, sequence by sequence (input order), token by token.
      predict_index: [K] the stream row whose logits predict each label (the row of the token before it).
      logit_rows: [U] the distinct rows of `predict_index`, sorted; row_of_label: [K] with
        predict_index == logit_rows[row_of_label]. The LM head runs on U rows only.
      sequence_rows: [Σ L] the stream row of every token of every sequence, in input order.
      label_mask: [Σ L] bool, True where that token is a label (never a sequence's first token).
    Host-side (no device syncs in Python loops):
      tree_bounds: per tree (start, root segment length, end) in the stream.
      segments: per segment (start, end, parent segment index or -1), in stream order.
      sequence_lens: L per sequence; labels_per_sequence: labels per sequence; max_context: the longest L.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    visible_until: torch.Tensor
    labels: torch.Tensor
    predict_index: torch.Tensor
    logit_rows: torch.Tensor
    row_of_label: torch.Tensor
    sequence_rows: torch.Tensor
    label_mask: torch.Tensor
    tree_bounds: tuple[tuple[int, int, int], ...] = field(repr=False)
    segments: tuple[tuple[int, int, int], ...] = field(repr=False)
    sequence_lens: tuple[int, ...] = field(repr=False)
    labels_per_sequence: tuple[int, ...] = field(repr=False)
    max_context: int = field(repr=False)

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed stream: the tokens actually computed, each shared token once."""
        return int(self.input_ids.numel())

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lens)

    @property
    def num_standard_tokens(self) -> int:
        """Tokens when every sequence runs alone (the standard / linear layout): Σ L."""
        return sum(self.sequence_lens)

    @property
    def rho(self) -> float:
        """Token reduction of every per-token op: standard tokens / packed tokens."""
        return self.num_standard_tokens / self.num_tokens

    def to(self, device) -> TreeBatch:
        moved = {name: getattr(self, name).to(device) for name in self.__dataclass_fields__
                 if isinstance(getattr(self, name), torch.Tensor)}
        return dataclasses.replace(self, **moved)

    def split_sequences(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Split a per-label tensor [K, ...] into one tensor per sequence, in input order."""
        if x.shape[0] != self.labels.numel():
            raise ValueError(f"split_sequences expects {self.labels.numel()} rows (one per label), got {x.shape[0]}")
        return list(torch.split(x, list(self.labels_per_sequence)))

    def sequences(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every sequence back as (token ids [L], label mask [L]) on CPU: the input of running each alone."""
        ids = self.input_ids.cpu()[self.sequence_rows.cpu()]
        return list(zip(torch.split(ids, list(self.sequence_lens)),
                        torch.split(self.label_mask.cpu(), list(self.sequence_lens))))


def _pack_runs(input_ids: torch.Tensor, runs: list[tuple[int, int, int]], seq_rows: list[torch.Tensor],
               seq_masks: list[torch.Tensor]) -> dict:
    """The fields of a TreeBatch from a depth-first stream.

    input_ids [T]: the stream. runs: (start, length, attach row or -1) covering [0, T) in order; a run continues
    its sequence from the row `attach` (depth first: every run's subtree is contiguous and follows it).
    seq_rows: per sequence, its stream rows [L]; seq_masks: per sequence, bool [L], True where a token is a label
    (never index 0: nothing precedes it)."""
    n_tokens = input_ids.numel()
    rows = torch.cat(seq_rows) if seq_rows else torch.zeros(0, dtype=torch.long)
    position_ids = torch.zeros(n_tokens, dtype=torch.long)
    position_ids[rows] = torch.cat([torch.arange(r.numel()) for r in seq_rows])    # depth; shared rows agree

    # Segments: runs cut after every row another run attaches to (a branch point inside a run).
    run_start = {s: a for s, _, a in runs}
    cuts = sorted(set(run_start) | {a + 1 for _, _, a in runs if 0 <= a and a + 1 < n_tokens})
    segments = []
    for i, s in enumerate(cuts):
        attach = run_start.get(s, s - 1)      # a run's own attach row, or (a cut inside a run) the row before
        parent = bisect.bisect_right(cuts, attach) - 1 if attach >= 0 else -1
        segments.append((s, cuts[i + 1] if i + 1 < len(cuts) else n_tokens, parent))
    sub_end = [e for _, e, _ in segments]
    for i in range(len(segments) - 1, -1, -1):          # children follow their parent: one backward sweep
        parent = segments[i][2]
        if parent >= 0:
            sub_end[parent] = max(sub_end[parent], sub_end[i])
    seg_lens = torch.tensor([e - s for s, e, _ in segments], dtype=torch.long)
    visible_until = torch.repeat_interleave(torch.tensor(sub_end, dtype=torch.long), seg_lens)
    trees = tuple((s, e - s, sub_end[i]) for i, (s, e, p) in enumerate(segments) if p < 0)

    labels, predict = [], []
    for r, m in zip(seq_rows, seq_masks):
        labels.append(input_ids[r[1:][m[1:]]])
        predict.append(r[:-1][m[1:]])
    labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long)
    predict_index = torch.cat(predict) if predict else torch.zeros(0, dtype=torch.long)
    logit_rows, row_of_label = torch.unique(predict_index, sorted=True, return_inverse=True)
    return dict(
        input_ids=input_ids, position_ids=position_ids, visible_until=visible_until, labels=labels,
        predict_index=predict_index, logit_rows=logit_rows, row_of_label=row_of_label, sequence_rows=rows,
        label_mask=torch.cat(seq_masks) if seq_masks else torch.zeros(0, dtype=torch.bool),
        tree_bounds=trees, segments=tuple(segments), sequence_lens=tuple(r.numel() for r in seq_rows),
        labels_per_sequence=tuple(int(m[1:].sum()) for m in seq_masks),
        max_context=max((r.numel() for r in seq_rows), default=0))


def _as_mask(x, length: int, where: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.tensor(list(x)) if len(x) else torch.zeros(0, dtype=torch.bool)
    if t.dim() != 1 or t.numel() != length:
        raise ValueError(f"{where} must be 1-D with one entry per token ({length}), got shape {tuple(t.shape)}")
    if t.is_floating_point() or t.is_complex() or (t.numel() and not bool(((t == 0) | (t == 1)).all())):
        raise ValueError(f"{where} must hold booleans (or 0/1), got {t.dtype} values")
    t = t.to(device="cpu", dtype=torch.bool)
    if length and bool(t[0]):
        raise ValueError(f"{where} marks token 0 as a label, but nothing precedes the first token to predict it "
                         "from; set its first entry False")
    return t


def pack_sequences(sequences, loss_masks=None) -> TreeBatch:
    """Pack token sequences so that every prefix they share is laid out (and computed) once.

    Args:
      sequences: S token sequences (lists of ints or 1-D integer tensors, each at least 1 token), in any order;
        sequences may be equal or prefixes of each other. Sequences that share a first token share a tree.
      loss_masks: None (every token 1..L-1 is a label) or S masks of the sequences' lengths (bools or 0/1),
        True where a token's log-prob is wanted; a mask's first entry must be False.

    Returns a TreeBatch with `num_tokens` == the number of nodes of the sequences' trie. The labels (and the
    log-probs `sequence_logprobs` returns) run sequence by sequence in input order, token by token.
    """
    if isinstance(sequences, torch.Tensor):
        sequences = list(sequences) if sequences.dim() == 2 else [sequences]
    if not isinstance(sequences, Sequence) or isinstance(sequences, (str, bytes)) or len(sequences) == 0:
        raise ValueError("sequences must be a non-empty list of token sequences (lists of ints or 1-D LongTensors)")
    seqs = [_as_ids(s, f"sequence {i}") for i, s in enumerate(sequences)]
    for i, s in enumerate(seqs):
        if s.numel() == 0:
            raise ValueError(f"sequence {i} is empty; every sequence needs at least 1 token")
    if loss_masks is None:
        masks = [torch.arange(s.numel()) > 0 for s in seqs]
    else:
        if isinstance(loss_masks, (str, bytes)) or len(loss_masks) != len(seqs):
            raise ValueError(f"loss_masks must hold one mask per sequence ({len(seqs)}), got "
                             f"{len(loss_masks) if hasattr(loss_masks, '__len__') else type(loss_masks).__name__}")
        masks = [_as_mask(m, s.numel(), f"loss_masks[{i}]") for i, (m, s) in enumerate(zip(loss_masks, seqs))]

    # The trie, depth first: sorted lexicographically, each sequence adds the tokens after its longest common
    # prefix with the one before it (LCP); the sequences through any node are then consecutive, so every
    # subtree is one contiguous range of the stream.
    as_lists = [s.tolist() for s in seqs]
    order = sorted(range(len(seqs)), key=as_lists.__getitem__)
    rows: list[torch.Tensor] = [torch.zeros(0, dtype=torch.long)] * len(seqs)
    pieces, runs, used, prev = [], [], 0, None
    for i in order:
        s = seqs[i]
        lcp = 0
        if prev is not None:
            m = min(s.numel(), seqs[prev].numel())
            differ = torch.nonzero(s[:m] != seqs[prev][:m])
            lcp = int(differ[0, 0]) if differ.numel() else m
        new = s.numel() - lcp
        rows[i] = torch.cat([rows[prev][:lcp] if lcp else torch.zeros(0, dtype=torch.long),
                             torch.arange(used, used + new)])
        if new:
            pieces.append(s[lcp:])
            runs.append((used, new, int(rows[i][lcp - 1]) if lcp else -1))
        used += new
        prev = i
    return TreeBatch(**_pack_runs(torch.cat(pieces), runs, rows, masks))


def split_sequences_by_token_budget(sequences, max_tokens: int) -> list[list[int]]:
    """Cut sequences into micro-batches whose packed size (`pack_sequences(...).num_tokens`, the trie's nodes) is at
    most `max_tokens`; -> per micro-batch, the indices of its sequences (pack them with their loss masks).

    Sequences are taken in the trie's depth-first (lexicographic) order, so every micro-batch holds whole subtrees
    where it can; a tree too large for one micro-batch is cut between consecutive leaves, and each part carries its
    own copy of the prefix it shares with the other parts (exact, but that prefix is computed once per part). Every
    sequence lands in exactly one micro-batch.
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if isinstance(sequences, torch.Tensor):
        sequences = list(sequences) if sequences.dim() == 2 else [sequences]
    as_lists = [_as_ids(x, f"sequence {i}").tolist() for i, x in enumerate(sequences)]
    batches: list[list[int]] = []
    used, prev = 0, None
    for i in sorted(range(len(as_lists)), key=as_lists.__getitem__):
        s = as_lists[i]
        if len(s) > max_tokens:
            raise ValueError(f"sequence {i} alone has {len(s)} tokens > max_tokens ({max_tokens}); raise max_tokens "
                             f"to at least {len(s)} or truncate it")
        lcp = 0
        if prev is not None:
            while lcp < min(len(s), len(prev)) and s[lcp] == prev[lcp]:
                lcp += 1
        if prev is None or used + len(s) - lcp > max_tokens:
            batches.append([i])
            used = len(s)
        else:
            batches[-1].append(i)
            used += len(s) - lcp
        prev = s
    return batches


@dataclass(frozen=True)
class PackedBatch(TreeBatch):
    """The depth-one case: G groups, each one prompt (a root segment) and its responses (child segments), packed
    back to back as given: T = Σ_g (P_g + Σ_i R_gi) tokens, M responses (the sequences [prompt, response]),
    K response tokens (the labels).

    Group-view tensors (int64), besides TreeBatch's:
      group_ids, segment_ids: [T]. `segment_ids` is 0 on prompt tokens and i+1 on tokens of the group's i-th
        response.
      prompt_lens, group_starts: [G]; responses_per_group: [G]; response_lens: [M].
    """

    group_ids: torch.Tensor
    segment_ids: torch.Tensor
    prompt_lens: torch.Tensor
    group_starts: torch.Tensor
    responses_per_group: torch.Tensor
    response_lens: torch.Tensor

    @property
    def group_bounds(self) -> tuple[tuple[int, int, int], ...]:
        """Per group (start, P, end): its tree's bounds."""
        return self.tree_bounds

    @property
    def response_lens_list(self) -> tuple[int, ...]:
        return self.labels_per_sequence

    @property
    def num_groups(self) -> int:
        return len(self.group_bounds)

    @property
    def num_responses(self) -> int:
        return len(self.response_lens_list)

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


def pack_groups(groups, response_masks=None) -> PackedBatch:
    """Pack `[(prompt_ids, [resp_ids_1, ..., resp_ids_N]), ...]` into one shared-prompt stream.

    Ids are lists of ints or 1-D integer tensors. Responses may be ragged or empty (R=0
    adds no tokens); every prompt needs at least one token. Raises ValueError naming the
    group and field on bad input. `response_masks` (optional): per group, per response, a mask of the
    response's length, True on the tokens whose log-probs are wanted (e.g. the model's own tokens of a
    multi-turn response, not tool outputs); by default every response token.
    """
    norm = normalize_groups(groups)
    if response_masks is not None and len(response_masks) != len(norm):
        raise ValueError(f"response_masks must hold one list per group ({len(norm)}), got {len(response_masks)}")
    n_groups = len(norm)
    prompt_lens = torch.tensor([p.numel() for p, _ in norm], dtype=torch.long)
    per_group = torch.tensor([len(rs) for _, rs in norm], dtype=torch.long)
    resp_lens = torch.tensor([r.numel() for _, rs in norm for r in rs], dtype=torch.long)

    # Segments in stream order: [prompt_0, r_00, r_01, ..., prompt_1, r_10, ...].
    seg_lens = torch.tensor([n for p, rs in norm for n in (p.numel(), *(r.numel() for r in rs))], dtype=torch.long)
    seg_local = torch.cat([torch.arange(n + 1) for n in per_group.tolist()])  # 0 = prompt, i+1 = response i
    seg_group = torch.repeat_interleave(torch.arange(n_groups), per_group + 1)
    seg_starts = _exclusive_cumsum(seg_lens)
    input_ids = torch.cat([t for p, rs in norm for t in (p, *rs)])
    tok_seg = torch.repeat_interleave(torch.arange(seg_lens.numel()), seg_lens)
    group_tokens = prompt_lens + torch.zeros(n_groups, dtype=torch.long).index_add_(
        0, torch.repeat_interleave(torch.arange(n_groups), per_group), resp_lens)

    # The depth-one tree: each prompt a root run, each non-empty response a run attached to its prompt's last row.
    runs, seq_rows, seq_masks = [], [], []
    for g, ((p, rs), start, n) in enumerate(zip(norm, seg_starts[seg_local == 0].tolist(), per_group.tolist())):
        prompt_rows = torch.arange(start, start + p.numel())
        runs.append((start, p.numel(), -1))
        at = start + p.numel()
        if response_masks is not None and len(response_masks[g]) != len(rs):
            raise ValueError(f"response_masks[{g}] must hold one mask per response ({len(rs)}), got "
                             f"{len(response_masks[g])}")
        for i, r in enumerate(rs):
            if r.numel():
                runs.append((at, r.numel(), start + p.numel() - 1))
            seq_rows.append(torch.cat([prompt_rows, torch.arange(at, at + r.numel())]))
            mask = torch.ones(r.numel(), dtype=torch.bool) if response_masks is None else _as_mask(
                [False, *response_masks[g][i]], r.numel() + 1, f"response_masks[{g}][{i}] (with a leading False)")[1:]
            seq_masks.append(torch.cat([torch.zeros(p.numel(), dtype=torch.bool), mask]))
            at += r.numel()
    return PackedBatch(
        **_pack_runs(input_ids, runs, seq_rows, seq_masks),
        group_ids=seg_group[tok_seg],
        segment_ids=seg_local[tok_seg],
        prompt_lens=prompt_lens,
        group_starts=_exclusive_cumsum(group_tokens),
        responses_per_group=per_group,
        response_lens=resp_lens,
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
