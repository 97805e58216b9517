"""Rollout worker: batched sampling with transformers `generate` (KV cache), cut at EOS.

Prompts are left-padded into batches of at most `batch_size` sequences; every prompt yields
`n` continuations. The prompt is prefilled once, not n times: all but its last token run through
the model once per distinct prompt, that KV cache is repeated n times (`batch_repeat_interleave`),
and `generate` continues all n rows from it (transformers' `num_return_sequences` would copy the
prompt n times before the prefill). A continuation keeps its EOS token (its log-prob is trained
too); one that hit `max_new_tokens` without EOS is marked truncated (DAPO's overlong filter drops
those).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hetrl.trainer.learner import amp


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    text: str
    truncated: bool
    # Set by the Ray executor: the policy version that sampled it and, in async mode, its tokens' log-probs
    # under that (behaviour) policy, which the importance ratio is taken against.
    version: int | None = None
    logprobs: torch.Tensor | None = field(default=None, compare=False, repr=False)


class RolloutWorker:
    def __init__(self, model, tokenizer, batch_size: int = 64, precision: str = "fp32"):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.precision = precision   # bf16-mixed (or auto on CUDA): prefill and decoding under bf16 autocast
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        # seconds spent so far in the shared prompt prefill and in decoding (generate from the prefilled cache,
        # which also runs each prompt's last token): the loop reports the split per step
        self.phase_seconds = {"prefill_s": 0.0, "decode_s": 0.0}

    def load_weights(self, state_dict: dict) -> None:
        """Weight sync from a learner that holds a separate copy of the policy."""
        self.model.load_state_dict(state_dict)

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False) -> list[list[Sample]]:
        """prompts: lists of token ids -> for each prompt, n samples."""
        per_call = max(1, self.batch_size // n)
        out: list[list[Sample]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), per_call):
                out += self._generate_batch(prompts[start : start + per_call], n, max_new_tokens, temperature,
                                            top_p, greedy)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, prompts, n, max_new_tokens, temperature, top_p, greedy):
        width = max(len(p) for p in prompts)
        device = self.model.get_input_embeddings().weight.device
        ids = torch.full((len(prompts), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        sampling = {} if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad(), amp(self.model, self.precision):
            t0 = time.perf_counter()
            cache = self._shared_prefill(ids, mask, n) if n > 1 and width > 1 else None
            t1 = time.perf_counter()
            self.phase_seconds["prefill_s"] += t1 - t0
            if cache is not None:
                ids, mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)
            generated = self.model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=max_new_tokens,
                num_return_sequences=1 if cache is not None else n, pad_token_id=self.pad, eos_token_id=self.eos,
                **({"do_sample": False} if greedy else sampling))
            self.phase_seconds["decode_s"] += time.perf_counter() - t1
        rows = generated[:, width:].tolist()
        samples = []
        for row in rows:
            if self.eos in row:
                tokens, truncated = row[: row.index(self.eos) + 1], False
            else:
                tokens, truncated = row, True
            samples.append(Sample(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True), truncated))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int):
        """The KV cache of every prompt but its last token, computed once per prompt and repeated n times:
        [G, W] left-padded ids -> a cache of G * n rows and W - 1 positions. Position ids as `generate` makes
        them from the mask, so the continuation matches `num_return_sequences=n` on the same prompts."""
        pre_ids, pre_mask = ids[:, :-1], mask[:, :-1]
        positions = (pre_mask.long().cumsum(-1) - 1).masked_fill(pre_mask == 0, 0)
        out = self.model(input_ids=pre_ids, attention_mask=pre_mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1)
        cache = out.past_key_values
        cache.batch_repeat_interleave(n)
        return cache
