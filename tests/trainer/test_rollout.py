"""The rollout prefills each prompt once and decodes its N continuations from that cache: the same continuations
as transformers' `generate(num_return_sequences=N)` (greedy: token-identical; sampled: every token drawn from the
logits a full forward of the sequence gives, fp32 within 1e-5, by a sampler that draws exactly what softmax's CDF
says)."""

import pytest
import torch

from hetrl.data import prompt_ids
from hetrl.models import load_model
from hetrl.trainer.rollout import RolloutWorker, left_padded, sample, warpers

PROMPTS = [[5, 9, 14, 3, 22, 7, 30], [40], [11, 12, 13, 14], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70]]


def _padded(worker, prompts):
    return left_padded(prompts, worker.pad)


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


def _hf_greedy(model, worker, prompts, max_new_tokens):
    ids, mask = _padded(worker, prompts)
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=worker.pad, eos_token_id=worker.eos)
    rows = out[:, ids.shape[1]:].tolist()
    return [row[:row.index(worker.eos) + 1] if worker.eos in row else row for row in rows]


def _frequent_token(worker, prompts, n, max_new_tokens, greedy=False, seed=0, temperature=1.0):
    """A token that some rows emit early and others never: used as EOS, rows finish at different steps and leave
    the batch (the decode loop's compaction runs)."""
    torch.manual_seed(seed)   # the same draws as the run that follows, up to the first row that finishes
    rows = [s.tokens for g in worker.generate(prompts, n, max_new_tokens, temperature=temperature, greedy=greedy)
            for s in g]
    early = [set(r[: max_new_tokens // 2]) for r in rows]
    anywhere = [set(r) for r in rows]
    return max({t for r in early for t in r},
               key=lambda t: (0 < sum(t in r for r in anywhere) < len(rows), sum(t in r for r in early)))


@pytest.mark.parametrize("shared", [True, False], ids=["prompt-cache-once", "prompt-cache-repeated"])
def test_the_worker_decodes_greedily_token_identical_to_generate(shared):
    model, tokenizer = load_model("tiny", seed=1)
    worker = RolloutWorker(model, tokenizer, batch_size=8)
    worker.shared_decode = shared
    worker.eos = _frequent_token(worker, PROMPTS, 1, 10, greedy=True)
    got = [g[0].tokens for g in worker.generate(PROMPTS, 1, 10, greedy=True)]
    want = _hf_greedy(model, worker, PROMPTS, 10)
    assert got == want
    assert any(len(r) < 10 for r in got) and any(len(r) == 10 for r in got)   # some rows left the batch early
    # n > 1: the shared prefill, n identical greedy continuations of each prompt
    assert [[s.tokens for s in g] for g in worker.generate(PROMPTS, 3, 10, greedy=True)] == [[r] * 3 for r in want]
    assert worker.shared_decode == shared      # no fallback


class _Recorder:
    """A warp that records the logits and the rows it is given (the decode loop's batch shrinks as rows finish)."""

    def __init__(self, warp):
        self.warp, self.steps = warp, []

    def __call__(self, logits):
        self.steps.append(logits.clone())
        return self.warp(logits)


@pytest.mark.parametrize("shared", [True, False], ids=["prompt-cache-once", "prompt-cache-repeated"])
def test_sampled_tokens_are_drawn_from_the_full_forward_logits(monkeypatch, shared):
    """Every sampled token's distribution comes from the logits the model gives the whole sequence (no cache) at
    that position, fp32 within 1e-5, also after other rows have finished and left the batch; tokens marked
    truncated exactly when no EOS ended them."""
    import hetrl.trainer.rollout as rollout

    model, tokenizer = load_model("tiny", seed=1)
    worker = RolloutWorker(model, tokenizer, batch_size=12)
    worker.shared_decode = shared
    n, new = 3, 10
    worker.eos = _frequent_token(worker, PROMPTS, n, new, seed=5, temperature=0.8)
    recorders = []
    monkeypatch.setattr(rollout, "warpers",
                        lambda t, p, k=0: recorders.append(_Recorder(warpers(t, p, k))) or recorders[-1])
    torch.manual_seed(5)
    groups = worker.generate(PROMPTS, n, new, temperature=0.8)
    (rec,) = recorders
    flat = [(p, s) for p, g in zip(PROMPTS, groups) for s in g]
    lengths = [len(s.tokens) for _, s in flat]
    assert min(lengths) < new and max(lengths) == new
    for prompt, s in flat:
        assert s.truncated == (s.tokens[-1] != worker.eos)
    alive = list(range(len(flat)))
    with torch.no_grad():
        full = [model(torch.tensor([p + s.tokens])).logits[0].float() for p, s in flat]
    for step, logits in enumerate(rec.steps):
        assert logits.shape[0] == len(alive)
        for row, r in enumerate(alive):
            prompt, s = flat[r]
            want = full[r][len(prompt) - 1 + step]
            assert torch.allclose(logits[row], want, rtol=0, atol=1e-5), (logits[row] - want).abs().max()
        alive = [r for r in alive if len(flat[r][1].tokens) > step + 1]
    assert not alive
    assert worker.shared_decode == shared


def test_an_unsupported_attention_decodes_the_plain_way(monkeypatch):
    """A model whose attention shared-prefix decoding does not support (here: told it has a sliding window)
    falls back to the repeated prompt cache, with the same continuations."""
    import hetrl.dualkv.decode as decode

    model, tokenizer = load_model("tiny", seed=1)
    want = [g[0].tokens for g in RolloutWorker(model, tokenizer).generate(PROMPTS, 2, 8, greedy=True)]
    plain = decode._attention
    monkeypatch.setitem(decode.AttentionInterface._global_mapping, decode.DECODE_ATTENTION,
                        lambda *a, **k: plain(*a, **{**k, "sliding_window": 4}))
    worker = RolloutWorker(model, tokenizer)
    assert [g[0].tokens for g in worker.generate(PROMPTS, 2, 8, greedy=True)] == want
    assert not worker.shared_decode


def test_sample_inverts_the_cdf_exactly():
    torch.manual_seed(0)
    scores = torch.randn(6, 50) * 2
    scores[:, ::3] = float("-inf")                   # excluded tokens (top-p's mask)
    scores[5, -1] = float("-inf")
    probs = torch.softmax(scores.double(), -1)
    u = torch.tensor([0.0, 0.1, 0.5, 0.9, 0.999999, 1 - 2 ** -24])
    got = sample(scores, u)
    for row in range(6):
        cdf = probs[row].cumsum(0)
        want = int((cdf > u[row].double() * cdf[-1]).nonzero()[0]) if u[row] < 0.9999 else int(probs[row].nonzero()[-1])
        assert int(got[row]) == want, row
        assert probs[row, got[row]] > 0


def test_sample_draws_the_softmax_distribution():
    torch.manual_seed(1)
    logits = torch.tensor([[2.0, 0.0, float("-inf"), 1.0, -1.0]])
    draws = torch.cat([sample(logits.expand(1000, -1)) for _ in range(20)])
    freq = torch.bincount(draws, minlength=5).double() / draws.numel()
    p = torch.softmax(logits[0].double(), -1)
    assert freq[2] == 0
    assert torch.all((freq - p).abs() <= 4 * (p * (1 - p) / draws.numel()).sqrt() + 1e-12), (freq, p)


def test_warpers_are_transformers_own():
    """Temperature and top-p as `generate` applies them: the processed scores of generate's own first step."""
    model, tokenizer = load_model("tiny", seed=2)
    worker = RolloutWorker(model, tokenizer)
    ids, mask = _padded(worker, PROMPTS)
    with torch.no_grad():
        out = model.eval().generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=True,
                                    temperature=0.7, top_p=0.8, top_k=0, output_scores=True, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=worker.pad)
    assert torch.equal(warpers(0.7, 0.8)(out.logits[0]), out.scores[0])
    with pytest.raises(ValueError, match="temperature"):
        warpers(0.0, 1.0)


@pytest.mark.slow
def test_shared_prefill_on_smollm2():
    model, tokenizer = load_model("smollm2-135m")
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": q}])
               for q in ("Calculate 95 - 76.", "What is 3 + 4?", "Name a colour.")]
    for sampling in (dict(do_sample=False), dict(do_sample=True, temperature=0.7, top_k=0)):
        plain, shared = _both(model, tokenizer, prompts, 4, sampling)
        assert torch.equal(plain.sequences, shared.sequences)
        # fp32 through 30 layers by different GEMM shapes (G prompt rows vs G x N): rounding, relative to the logits'
        # scale (~40 here; AVX512 kernels gave 2.5e-6 of it, AVX2 ones under 1e-4 / 40); exactness is the fp64 tests'
        scale = max(a.abs().max().item() for a in plain.logits)
        assert max((a - b).abs().max().item() for a, b in zip(plain.logits, shared.logits)) <= 1e-5 * scale
    worker = RolloutWorker(model, tokenizer)
    assert [g[0].tokens for g in worker.generate(prompts, 1, 24, greedy=True)] == _hf_greedy(model, worker, prompts, 24)


@pytest.mark.parametrize("shared", [True, False], ids=["prompt-cache-once", "prompt-cache-repeated"])
def test_rollout_logprobs_equal_the_learners(shared):
    """The log-probs a sample carries (read off the logits it was drawn from, at the run's temperature) are the
    learner's DualKV log-probs of the same tokens: fp64 within 1e-10, rows leaving the batch included."""
    from hetrl.trainer.learner import Scorer

    from ..dualkv.oracle import _use_float64_norms

    model, tokenizer = load_model("tiny", torch.float64, seed=1)
    _use_float64_norms(model)           # transformers' RMSNorm computes in fp32
    worker = RolloutWorker(model, tokenizer, batch_size=12)
    worker.shared_decode = shared
    n, new = 3, 10
    worker.eos = _frequent_token(worker, PROMPTS, n, new, seed=2, temperature=0.9)
    torch.manual_seed(2)
    groups = worker.generate(PROMPTS, n, new, temperature=0.9, logprobs=True)
    assert len({len(s.tokens) for g in groups for s in g}) > 1
    got = torch.cat([s.logprobs for g in groups for s in g])
    assert got.dtype == torch.float64
    want = Scorer(model, impl="sdpa", temperature=0.9).logprobs([(p, [s.tokens for s in g])
                                                                 for p, g in zip(PROMPTS, groups)])
    assert torch.allclose(got, want, rtol=0, atol=1e-10), (got - want).abs().max()
    with pytest.raises(ValueError, match="greedy"):
        worker.generate(PROMPTS, 1, 4, greedy=True, logprobs=True)
