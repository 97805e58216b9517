"""The readable oracle: every sequence run alone, shared prefixes copied once per sequence.

Every sequence with at least one label becomes its own row (for pack_groups: [prompt, response], the standard
layout; right-padded, so valid tokens never attend to padding), and the model runs with its own attention
implementation. Logits are kept only at the rows that predict labels.
"""

from __future__ import annotations

import torch

from ..packing import TreeBatch
from ..support import decoder_of, takes


def _one_per_row(batch: TreeBatch):
    """Each sequence as its own right-padded row: (ids, attention mask, rows that predict a label)."""
    seqs = [(ids, mask) for ids, mask in batch.sequences() if bool(mask.any())]
    width = max(ids.numel() for ids, _ in seqs)
    device = batch.input_ids.device
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attention_mask = torch.zeros(len(seqs), width, dtype=torch.long)
    keep = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (row, mask) in enumerate(seqs):
        ids[i, : row.numel()] = row
        attention_mask[i, : row.numel()] = 1
        keep[i, : row.numel() - 1] = mask[1:]  # row j predicts token j+1
    return ids.to(device), attention_mask.to(device), keep.to(device)


def standard_logits(model, batch: TreeBatch) -> torch.Tensor:
    """-> logits [K, V], one row per label, in label order."""
    ids, attention_mask, keep = _one_per_row(batch)
    if not takes(type(model), "logits_to_keep"):     # every row's logits, then the kept
        return model(input_ids=ids, attention_mask=attention_mask, use_cache=False).logits[keep]
    out = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False)
    return out.logits.reshape(-1, out.logits.shape[-1])


def standard_hidden(model, batch: TreeBatch) -> torch.Tensor:
    """-> the decoder's last hidden state [K, D] at each row that predicts a label, in label order, each sequence
    run alone (right-padded, with its attention mask)."""
    ids, attention_mask, keep = _one_per_row(batch)
    out = decoder_of(model)(input_ids=ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state[keep]
