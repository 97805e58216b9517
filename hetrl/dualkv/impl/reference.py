"""The readable oracle: the standard layout, with the prompt duplicated once per response.

Every non-empty response becomes its own row [prompt, response] (right-padded, so valid
tokens never attend to padding), and the model runs with its own attention implementation.
Logits are kept only at the rows that predict response tokens.
"""

from __future__ import annotations

import torch

from ..packing import PackedBatch


def _one_per_row(batch: PackedBatch):
    """Each [prompt, response] as its own right-padded row: (ids, attention mask, rows that predict a label)."""
    rows = [torch.cat([prompt, r]) for prompt, resps in batch.groups() for r in resps if r.numel() > 0]
    prompt_lens = [prompt.numel() for prompt, resps in batch.groups() for r in resps if r.numel() > 0]
    width = max(r.numel() for r in rows)
    device = batch.input_ids.device
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    keep = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        ids[i, : row.numel()] = row
        attention_mask[i, : row.numel()] = 1
        keep[i, p - 1 : row.numel() - 1] = True  # row j predicts token j+1
    return ids.to(device), attention_mask.to(device), keep.to(device)


def standard_logits(model, batch: PackedBatch) -> torch.Tensor:
    """-> logits [K, V], one row per response token, in label order."""
    ids, attention_mask, keep = _one_per_row(batch)
    out = model(input_ids=ids, attention_mask=attention_mask, logits_to_keep=keep, use_cache=False)
    return out.logits.reshape(-1, out.logits.shape[-1])


def standard_hidden(model, batch: PackedBatch) -> torch.Tensor:
    """-> the decoder's last hidden state [K, D] at each row that predicts a response token, in label order,
    each [prompt, response] run alone (right-padded, with its attention mask)."""
    ids, attention_mask, keep = _one_per_row(batch)
    out = model.get_decoder()(input_ids=ids, attention_mask=attention_mask, use_cache=False)
    return out.last_hidden_state[keep]
