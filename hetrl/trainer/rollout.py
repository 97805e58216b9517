"""Rollout worker: batched sampling from a KV cache, prompt prefilled once per group, rows leaving at EOS.

Prompts are left-padded into batches of at most `batch_size` sequences; every prompt yields `n` continuations.
The prompt is prefilled once, not n times: all but its last token run through the model once per distinct
prompt, and that KV cache is repeated n times (`batch_repeat_interleave`; transformers' `num_return_sequences`
would copy the prompt n times before the prefill). The decoding loop is written here rather than left to
`generate` for two things `generate` does not do: a row that emits EOS leaves the batch (its cache rows are
dropped, so later steps run only the rows still decoding, where `generate` keeps running finished rows on
padding until the last one ends), and sampling draws one uniform number per row and inverts the softmax CDF,
where torch's CPU multinomial, which `generate` calls, draws an exponential for every vocabulary entry (about
0.1 s a step at 64 rows x 49k tokens on 2 cores). Temperature and top-p are transformers' own warpers, so the
distribution is `generate(do_sample=True, top_k=0)`'s; greedy decoding is token-identical to `generate`'s
(tests/trainer/test_rollout.py checks both against transformers). A continuation keeps its EOS token (its
log-prob is trained too); one that hit `max_new_tokens` without EOS is marked truncated (DAPO's overlong
filter drops those).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hetrl.dualkv.api import _token_logprobs as token_logprobs
from hetrl.dualkv.decode import SharedPrefixCache, Unsupported, decoding
from hetrl.trainer.config import logits_give_old_logprobs
from hetrl.trainer.precision import FP32, RunPrecision

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    text: str
    truncated: bool
    # `version`: the policy version that sampled it (set by the Ray executor's rollout actors). `logprobs`: its
    # tokens' log-probs under the weights that drew it, where the rollout gives them (fp32 sampling logits, vLLM,
    # or a Ray actor's scoring pass in async mode): the loop's one rule (loop._old_logprobs) says what they are for.
    version: int | None = None
    logprobs: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # A multi-turn episode (hetrl.trainer.episodes): True on the model's own tokens, False on tool tokens (context,
    # weight 0 in the loss); None: every token is the model's. `episode`: its state (environment, counts).
    loss_mask: tuple[bool, ...] | None = None
    episode: object | None = field(default=None, compare=False, repr=False)


class RolloutWorker:
    def __init__(self, model, tokenizer, batch_size: int = 64, precision: RunPrecision = FP32, top_k: int = 0):
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.top_k = top_k           # the run's (0: off), beside each call's temperature and top-p
        self.precision = precision   # the run's (precision.decide): prefill and decoding under bf16 autocast or not
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        # seconds spent so far in the shared prompt prefill and in decoding (generate from the prefilled cache,
        # which also runs each prompt's last token): the loop reports the split per step
        self.phase_seconds = {"prefill_s": 0.0, "decode_s": 0.0}
        # decode from a SharedPrefixCache (each prompt's cache read once per step by its n rows); switched off
        # for a model whose attention it does not support (then the prompt cache is repeated n times)
        self.shared_decode = True
        self._queued, self._queued_lock = None, threading.Lock()   # queue_weights

    def gives_logprobs(self, old_logprobs: str) -> bool:
        """Whether this worker's samples carry their old log-probs off its sampling logits under the run's
        `old_logprobs` (config.logits_give_old_logprobs: its logits are fp32, not under bf16 autocast)."""
        return logits_give_old_logprobs(old_logprobs, self.precision.autocast)

    def load_weights(self, state_dict: dict) -> None:
        """Weight sync from a learner that holds a separate copy of the policy (cast to this model's dtype)."""
        self.model.load_state_dict(state_dict)

    def queue_weights(self, state_dict: dict) -> None:
        """Weight sync applied at the start of the next generate call (episodes' too), never during one. `state_dict`
        must be a copy."""
        with self._queued_lock:
            self._queued = state_dict

    def apply_queued(self) -> None:
        """Load the weights `queue_weights` holds, if any (every generate call, episodes' too, starts here)."""
        with self._queued_lock:
            state, self._queued = self._queued, None
        if state is not None:
            with torch.no_grad():
                self.load_weights(state)

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, logprobs: bool = False) -> list[list[Sample]]:
        """prompts: lists of token ids -> for each prompt, n samples. `logprobs`: each sample also carries its
        tokens' log-probs under the sampling weights at `temperature` (no top-p: the distribution the learner's
        log-probs are of), from the very logits it was drawn from, in the logits' precision (fp32 at least)."""
        if logprobs and greedy:
            raise ValueError("logprobs are of a sampled continuation; greedy decoding has none to give")
        self.apply_queued()
        per_call = max(1, self.batch_size // n)
        out: list[list[Sample]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            for start in range(0, len(prompts), per_call):
                out += self._generate_batch(prompts[start : start + per_call], n, max_new_tokens, temperature,
                                            top_p, greedy, logprobs)
        finally:
            self.model.train(was_training)
        return out

    def _generate_batch(self, prompts, n, max_new_tokens, temperature, top_p, greedy, logprobs):
        device = self.model.get_input_embeddings().weight.device
        ids, mask = left_padded(prompts, self.pad)
        width = ids.shape[1]
        ids, mask = ids.to(device), mask.to(device)
        warp = None if greedy else warpers(temperature, top_p, self.top_k)
        scored = temperature if logprobs else None
        last, full_mask = ids[:, -1].repeat_interleave(n), mask.repeat_interleave(n, 0)
        with torch.no_grad(), self.precision.amp(self.model):
            rows = None
            if self.shared_decode and width > 1:
                t0 = time.perf_counter()
                prefill = self._prefill(ids, mask)
                t1 = time.perf_counter()
                self.phase_seconds["prefill_s"] += t1 - t0
                groups = torch.arange(len(prompts), device=device).repeat_interleave(n)
                try:
                    cache = SharedPrefixCache(prefill, mask[:, :-1], groups, max(1, max_new_tokens))
                    with decoding(self.model, cache):
                        rows, lps = self._decode(last, None, cache, max_new_tokens, warp, scored)
                except Unsupported as e:   # raised by the first layer's attention, before anything is sampled
                    log.info("%s: decoding with a repeated prompt cache instead (%s)", type(self.model).__name__, e)
                    self.shared_decode = False
                self.phase_seconds["decode_s"] += time.perf_counter() - t1
            if rows is None:
                t0 = time.perf_counter()
                cache = self._shared_prefill(ids, mask, n)
                t1 = time.perf_counter()
                self.phase_seconds["prefill_s"] += t1 - t0
                rows, lps = self._decode(last, full_mask, cache, max_new_tokens, warp, scored)
                self.phase_seconds["decode_s"] += time.perf_counter() - t1
        samples = []
        for row, lp in zip(rows, lps):
            truncated = not (row and row[-1] == self.eos)
            samples.append(Sample(row, self.tokenizer.decode(row, skip_special_tokens=True), truncated, logprobs=lp))
        return [samples[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _decode(self, last: torch.Tensor, mask: torch.Tensor | None, cache, max_new_tokens: int, warp,
                scored: float | None = None) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Continue every row from `cache` (all but the prompt's last token, `last` [B]) for up to
        `max_new_tokens` tokens: greedy when `warp` is None, else sampled from the warped distribution
        (`sample`). `mask` [B, W]: the left-padded prompts' attention mask for a transformers cache, None for
        a SharedPrefixCache (which holds it). A row that emits EOS keeps it and leaves the batch at once: its
        cache rows are dropped, so the later steps run only the rows still decoding. `scored`: a temperature,
        at which each drawn token's log-prob is read off the logits it was drawn from (log-softmax of
        logits / temperature, as hetrl.dualkv computes it). -> each row's tokens, and their log-probs [len]
        (None unless `scored`)."""
        rows: list[list[int]] = [[] for _ in range(last.shape[0])]
        lps: list[list[float]] = [[] for _ in range(last.shape[0])]
        dtype = torch.float32
        alive = list(range(last.shape[0]))           # the rows of `rows` still decoding, in batch order
        shared = mask is None
        widths = cache.prompt_mask.sum(-1)[cache.group_of_row] + 1 if shared else mask.sum(-1)
        positions = (widths - 1)[:, None]            # the position of `last` (prompts are left-padded)
        token = last[:, None]
        for _ in range(max_new_tokens):
            raw = self.model(input_ids=token, attention_mask=mask, position_ids=positions,
                             past_key_values=cache, use_cache=True).logits[:, -1]
            logits = raw.float()
            token = logits.argmax(-1) if warp is None else sample(warp(logits))
            finished = token == self.eos
            for r, t in zip(alive, token.tolist()):
                rows[r].append(t)
            if scored is not None:   # the learner's own log-softmax gather (hetrl.dualkv), on these logits
                lp = token_logprobs(raw, torch.arange(raw.shape[0], device=raw.device), token, scored, False)
                dtype = lp.dtype
                for r, v in zip(alive, lp.tolist()):
                    lps[r].append(v)
            keep = (~finished).nonzero().squeeze(-1)
            if keep.numel() == 0:
                break
            if shared:
                cache.advance()
            if keep.numel() < len(alive):
                if shared:
                    cache.keep(keep)
                else:
                    cache.batch_select_indices(keep)
                    mask = mask[keep]
                alive = [alive[i] for i in keep.tolist()]
                token, positions = token[keep], positions[keep]
            token = token[:, None]
            if not shared:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
            positions = positions + 1
        if scored is None:
            return rows, [None] * len(rows)
        return rows, [torch.tensor(lp, dtype=dtype) for lp in lps]

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """The KV cache of every prompt but its last token, once per prompt: [G, W] left-padded ids -> a
        transformers cache of G rows and W - 1 positions. Position ids as `generate` makes them from the mask.
        The decoder alone: no logits are needed. (Through the LM head with logits_to_keep=1, a bf16 model on the
        CPU multiplied the strided last-position slice by the head as a batched matmul that copied the head's
        weight once per row: 2.2 GB and ~6 s a prefill at Qwen2.5-0.5B's 151,936 words, 8 prompts.)"""
        pre_ids, pre_mask = ids[:, :-1], mask[:, :-1]
        positions = (pre_mask.long().cumsum(-1) - 1).masked_fill(pre_mask == 0, 0)
        out = self.model.get_decoder()(input_ids=pre_ids, attention_mask=pre_mask, position_ids=positions,
                                       use_cache=True)
        return out.past_key_values

    def _shared_prefill(self, ids: torch.Tensor, mask: torch.Tensor, n: int):
        """`_prefill`'s cache repeated n times (G * n rows; empty for one-token prompts): what a transformers
        cache needs to continue the n rows of each prompt, as `num_return_sequences=n` would on the same
        prompts. The plain decoding path; SharedPrefixCache keeps the prompt once instead."""
        if ids.shape[1] == 1:
            return DynamicCache(config=self.model.config)
        cache = self._prefill(ids, mask)
        cache.batch_repeat_interleave(n)
        return cache


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, attention mask) [len(prompts), longest], left-padded with `pad` (generate's layout)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def warpers(temperature: float, top_p: float, top_k: int = 0) -> "Warp":
    """transformers' own temperature, top-k and top-p warpers, in the order `generate(do_sample=True)` applies them
    (top_k 0: off)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); use greedy decoding instead")
    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        out.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p))
    return Warp(out)


class Warp:
    def __init__(self, processors: LogitsProcessorList):
        self.processors = processors

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.processors(None, logits)


def sample(scores: torch.Tensor, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of `scores` [B, V] (warped logits, -inf for excluded tokens), drawn from softmax(scores)
    by inverting its CDF at one uniform draw per row (`uniform` [B], else torch.rand): the same distribution
    as `torch.multinomial(softmax(scores), 1)`, which `generate` uses, for one random number per row instead
    of one per vocabulary entry (torch's CPU multinomial draws an exponential for every entry: ~0.1 s per
    step at 64 x 49k). A token of probability 0 is never drawn."""
    cdf = torch.softmax(scores, dim=-1).cumsum(-1)
    total = cdf[:, -1:].contiguous()
    u = torch.rand(scores.shape[0], device=scores.device) if uniform is None else uniform.to(scores.device)
    token = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * total, right=True)
    # u * total can round up to total: then the last token of positive probability (the first to reach total)
    return torch.minimum(token, torch.searchsorted(cdf, total)).squeeze(-1)
