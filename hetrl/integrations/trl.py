"""DualKV inside TRL: `GRPOTrainer`'s per-token log-probs (policy, old and reference) through the shared-prompt engine.

    from hetrl.integrations.trl import DualKVGRPOTrainer      # instead of trl.GRPOTrainer, same arguments

or, for a trainer class of your own that derives from GRPOTrainer, `with_dualkv(MyTrainer)`.

TRL 1.16 computes every log-prob pass in one method, `GRPOTrainer._get_per_token_logps_and_entropies(model,
input_ids, attention_mask, logits_to_keep, ...)`, on its own layout: left-padded prompts then right-padded
completions, `[B, P + C]`, log-probs returned as `[B, C]`. The subclass finds the rows that share a prompt (TRL
samples `num_generations` completions per prompt and may shuffle them across micro-batches, so rows are matched
by their prompt tokens, wherever they sit), packs each prompt once with its completions (hetrl.dualkv), and
writes the log-probs (and entropies) back into TRL's `[B, C]` layout, zeros at masked positions. The numbers
are the same as stock TRL's (fp64 test against GRPOTrainer's own loss and gradients); the prompt runs once per
group instead of once per completion.

What falls back to TRL's own pass, unchanged: multimodal inputs, MoE auxiliary losses, and completion masks
that are not one run of ones followed by padding (the layout DualKV packs). Written by hand because TRL has no
hook for a custom log-prob pass (its issue asking for shared-prompt log-probs is open); the override is one
method and follows its signature.
"""

from __future__ import annotations

import functools

import torch

from hetrl.dualkv import pack_groups, shared_prompt_logprobs

MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
              "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def shared_prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int):
    """TRL's layout -> (groups for pack_groups, the rows of each group, each row's completion length), or None
    when a completion mask is not ones-then-zeros."""
    width = input_ids.size(1) - logits_to_keep
    prompts, completions = input_ids[:, :width], input_ids[:, width:]
    pmask, cmask = attention_mask[:, :width].bool(), attention_mask[:, width:].bool()
    lens = cmask.sum(1)
    ones_first = torch.arange(logits_to_keep, device=cmask.device)[None, :] < lens[:, None]
    if not torch.equal(ones_first, cmask):
        return None
    rows_of: dict[tuple[int, ...], list[int]] = {}
    for b in range(input_ids.size(0)):
        rows_of.setdefault(tuple(prompts[b][pmask[b]].tolist()), []).append(b)
    groups, rows = [], []
    for prompt, members in rows_of.items():
        if not prompt:
            return None      # DualKV needs a prompt token to condition on
        groups.append((list(prompt), [completions[b, :lens[b]].tolist() for b in members]))
        rows.append(members)
    return groups, rows, lens


def _unwrap(trainer, model):
    model = trainer.accelerator.unwrap_model(model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def with_dualkv(trainer_cls):
    """A subclass of `trainer_cls` (GRPOTrainer or one derived from it) whose log-prob passes go through DualKV."""

    class DualKV(trainer_cls):
        dualkv_impl = "auto"     # hetrl.dualkv's attention path (auto: flex on CUDA, SDPA on the CPU)

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep,
                                               batch_size=None, compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):
            found = None
            if not compute_aux_loss and all(multimodal.get(k) is None for k in MULTIMODAL):
                found = shared_prompt_groups(input_ids, attention_mask, logits_to_keep)
            if found is None:
                return super()._get_per_token_logps_and_entropies(
                    model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                    **multimodal)
            groups, rows, lens = found
            with self.accelerator.autocast():
                logp, entropy = shared_prompt_logprobs(_unwrap(self, model), pack_groups(groups), impl=self.dualkv_impl,
                                                       temperature=self.temperature, return_entropy=True)
            order = torch.tensor([b for members in rows for b in members], device=input_ids.device)
            row_of_token = torch.repeat_interleave(order, lens[order])
            col_of_token = torch.cat([torch.arange(int(n), device=input_ids.device) for n in lens[order]])
            out = logp.new_zeros(input_ids.size(0), logits_to_keep)
            out = out.index_put((row_of_token, col_of_token), logp)   # out of place: autograd flows to logp
            ent = None
            if compute_entropy:
                ent = entropy.new_zeros(input_ids.size(0), logits_to_keep)
                ent[row_of_token, col_of_token] = entropy
            return out, ent, None

    DualKV.__name__ = DualKV.__qualname__ = f"DualKV{trainer_cls.__name__}"
    DualKV.__doc__ = (f"{trainer_cls.__name__} with its per-token log-probs computed by hetrl's DualKV engine "
                      "(hetrl.integrations.trl).")
    return DualKV


@functools.cache
def _grpo():
    from trl import GRPOTrainer

    return with_dualkv(GRPOTrainer)


def __getattr__(name):
    if name == "DualKVGRPOTrainer":      # made on first use: trl is an optional dependency
        return _grpo()
    raise AttributeError(name)
