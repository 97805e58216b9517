"""DualKV: exact shared-prompt packing, attention and log-probs for Hugging Face causal LMs.

    batch = pack_groups([(prompt_ids, [resp_ids_1, ..., resp_ids_N]), ...])
    logp = shared_prompt_logprobs(model, batch, impl="auto", temperature=1.0)
    per_response = batch.split_responses(logp)
    values = shared_prompt_head(critic, batch, value_head).squeeze(-1)   # any head on the same rows (PPO)
"""

from .api import IMPLS, shared_prompt_head, shared_prompt_logprobs
from .packing import PackedBatch, pack_groups, split_by_token_budget

__all__ = ["IMPLS", "PackedBatch", "pack_groups", "shared_prompt_head", "shared_prompt_logprobs", "split_by_token_budget"]
