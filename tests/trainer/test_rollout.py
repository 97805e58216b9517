"""The rollout prefills each prompt once and decodes its N continuations from that cache: the same continuations
as transformers' `generate(num_return_sequences=N)` (greedy: token-identical; sampled with the same seed: the same
tokens drawn from the same logits, fp32 within 1e-5)."""

import pytest
import torch

from hetrl.data import prompt_ids
from hetrl.models import load_model
from hetrl.trainer.rollout import RolloutWorker

PROMPTS = [[5, 9, 14, 3, 22, 7, 30], [40], [11, 12, 13, 14], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


def _padded(worker, prompts):
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), worker.pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = torch.tensor(p), 1
    return ids, mask


def _both(model, tokenizer, prompts, n, sampling):
    """(transformers' own num_return_sequences, the worker's shared prefill): sequences and per-step logits."""
    worker = RolloutWorker(model.eval(), tokenizer)
    ids, mask = _padded(worker, prompts)
    common = dict(max_new_tokens=12, pad_token_id=worker.pad, eos_token_id=worker.eos, output_logits=True,
                  return_dict_in_generate=True, **sampling)
    greedy = not sampling.get("do_sample")   # transformers refuses greedy with num_return_sequences > 1: its n
    with torch.no_grad():                     # continuations are the one greedy continuation, n times
        torch.manual_seed(0)
        plain = model.generate(input_ids=ids, attention_mask=mask, num_return_sequences=1 if greedy else n, **common)
        if greedy:
            plain.sequences = plain.sequences.repeat_interleave(n, 0)
            plain.logits = tuple(x.repeat_interleave(n, 0) for x in plain.logits)
        torch.manual_seed(0)
        cache = worker._shared_prefill(ids, mask, n)
        shared = model.generate(input_ids=ids.repeat_interleave(n, 0), attention_mask=mask.repeat_interleave(n, 0),
                                past_key_values=cache, **common)
    return plain, shared


@pytest.mark.parametrize("sampling", [dict(do_sample=False), dict(do_sample=True, temperature=0.9, top_k=0)],
                         ids=["greedy", "sampled"])
def test_shared_prefill_continues_exactly_like_num_return_sequences(sampling):
    model, tokenizer = load_model("tiny", seed=0)
    plain, shared = _both(model, tokenizer, PROMPTS, 3, sampling)
    assert torch.equal(plain.sequences, shared.sequences)
    assert len(plain.logits) == len(shared.logits)
    for a, b in zip(plain.logits, shared.logits):
        assert torch.allclose(a, b, rtol=0, atol=1e-5), (a - b).abs().max()


def test_the_worker_gives_the_same_samples_as_before():
    """RolloutWorker.generate (shared prefill) against transformers' expansion, end to end, sampled and seeded."""
    model, tokenizer = load_model("tiny", seed=1)
    worker = RolloutWorker(model, tokenizer, batch_size=8)
    torch.manual_seed(3)
    got = worker.generate(PROMPTS[:2], 4, 10, temperature=0.8)
    ids, mask = _padded(worker, PROMPTS[:2])
    torch.manual_seed(3)
    with torch.no_grad():
        want = model.eval().generate(input_ids=ids, attention_mask=mask, num_return_sequences=4, max_new_tokens=10,
                                     do_sample=True, temperature=0.8, top_p=1.0, top_k=0, pad_token_id=worker.pad,
                                     eos_token_id=worker.eos)[:, ids.shape[1]:].tolist()
    flat = [s for group in got for s in group]
    for sample, row in zip(flat, want):
        assert sample.tokens == (row[:row.index(worker.eos) + 1] if worker.eos in row else row)


@pytest.mark.slow
def test_shared_prefill_on_smollm2():
    model, tokenizer = load_model("smollm2-135m")
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}])
               for q in ("Calculate 95 - 76.", "What is 3 + 4?", "Name a colour.")]
    for sampling in (dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=0)):
        plain, shared = _both(model, tokenizer, prompts, 4, sampling)
        assert torch.equal(plain.sequences, shared.sequences)
        assert max((a - b).abs().max().item() for a, b in zip(plain.logits, shared.logits)) <= 1e-4
