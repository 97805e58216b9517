"""DualKV: exact shared-prefix packing, attention and log-probs for Hugging Face causal LMs.

    batch = pack_sequences(sequences, loss_masks=None)   # any sequences; shared prefixes (a trie) computed once
    per_seq = sequence_logprobs(model, batch)            # per sequence: log p(tok_t | tok_<t), t = 1..L-1
    batch = pack_groups([(prompt_ids, [resp_ids_1, ..., resp_ids_N]), ...])   # the depth-one case
    logp = shared_prompt_logprobs(model, batch, impl="auto", temperature=1.0)
    per_response = batch.split_responses(logp)
    values = shared_prompt_head(critic, batch, value_head).squeeze(-1)   # any head on the same rows (PPO)
"""

from .api import IMPLS, sequence_logprobs, shared_prompt_head, shared_prompt_logprobs
from .packing import (
    PackedBatch,
    TreeBatch,
    pack_groups,
    pack_sequences,
    split_by_token_budget,
    split_sequences_by_token_budget,
)

__all__ = ["IMPLS", "PackedBatch", "TreeBatch", "pack_groups", "pack_sequences", "sequence_logprobs",
           "shared_prompt_head", "shared_prompt_logprobs", "split_by_token_budget", "split_sequences_by_token_budget"]
