"""Multi-turn episodes (hetrl.trainer.episodes): a scripted tiny model calls a tool; every model token's log-prob
from the rollout's continued KV cache equals a plain forward of the whole conversation (fp64); tool tokens are
masked out of the loss, and the masked loss is the loss over the model's tokens alone."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from hetrl.algo import token_weights
from hetrl.data import Example
from hetrl.data.tools import ToolCall, run_calls, tool_suffix_ids
from hetrl.models import load_model
from hetrl.trainer.episodes import episode_metrics, generate_episodes, loss_mask, make_agent
from hetrl.trainer.learner import Learner

from ..dualkv.oracle import _use_float64_norms

BIAS = 16.0   # strong enough that sampling follows the script, weak enough that the model's own logits still count


def mul(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a * b


def _scripted(model, script: dict[int, int]):
    """`model` with BIAS added, at each position q - 1, to the logit of the token the script puts at position q:
    the bias depends only on the position id, so the rollout and a whole-sequence forward see the same model."""
    table = torch.zeros(max(script) + 1, model.config.vocab_size, dtype=model.dtype)
    for q, tok in script.items():
        table[q - 1, tok] = BIAS
    forward = model.forward

    def biased(*args, position_ids=None, logits_to_keep=0, **kwargs):
        out = forward(*args, position_ids=position_ids, logits_to_keep=logits_to_keep, **kwargs)
        kept = position_ids if isinstance(logits_to_keep, int) else position_ids[:, logits_to_keep]
        assert isinstance(logits_to_keep, torch.Tensor) or logits_to_keep == 0
        out.logits = out.logits + table[kept.clamp(max=table.shape[0] - 1)] * (kept < table.shape[0])[..., None]
        return out

    model.forward = biased
    return model


def _setup(max_tool_calls=2):
    model, tok = load_model("tiny", dtype=torch.float64, seed=2)
    _use_float64_norms(model)
    agent = make_agent(tok, [mul], None, max_tool_calls=max_tool_calls, tool_timeout_s=5.0)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    eos = tok.eos_token_id
    P = 12
    # absolute positions: episodes of prompt length P start with "ab", of P + 2 straight at the call, of P + 5
    # inside it (no valid call: that episode ends after one turn). Both calls end at the same position E.
    turn1 = enc('ab<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>') + [eos]
    E = P + len(turn1) - 1
    suffix1 = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "42"}], agent.template)
    bad = ToolCall("mul", {"a": 1})
    (res,) = run_calls([({"mul": mul}, bad)], 1.0)
    turn2 = enc('<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>') + [eos]
    Q2 = E + 1 + len(suffix1)
    suffix2 = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": res.content}], agent.template)
    Q3 = Q2 + len(turn2) + len(suffix2)
    turn3 = enc("42") + [eos]
    script = {P + i: t for i, t in enumerate(turn1)} | {Q2 + i: t for i, t in enumerate(turn2)} | \
        {Q3 + i: t for i, t in enumerate(turn3)}
    model = _scripted(model, script)
    g = torch.Generator().manual_seed(0)
    row = {"prompt": [{"role": "user", "content": "q"}]}
    examples = [Example(row, torch.randint(4, 90, (p,), generator=g).tolist()) for p in (P, P + 2, P + 5)]
    return model, tok, agent, examples, Q3 + len(turn3)


def _plain_logprobs(model, prompt, tokens):
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
    lp = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1)
    return lp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def test_episodes_continue_from_their_cache_exactly():
    model, tok, agent, examples, end = _setup()
    torch.manual_seed(0)
    out = generate_episodes(model, tok, agent, examples, 2, end + 4, temperature=1.0, logprobs=True, batch_size=6)
    turns = [[s.episode.turns for s in g] for g in out]
    assert turns == [[3, 3], [3, 3], [1, 1]], turns          # the third prompt's episodes leave after one turn
    assert [[s.episode.calls for s in g] for g in out] == [[2, 2], [2, 2], [0, 0]]
    assert [[s.episode.errors for s in g] for g in out] == [[1, 1], [1, 1], [0, 0]]   # the call without b
    for g, example in zip(out, examples):
        for s in g:
            want = _plain_logprobs(model, example.prompt_ids, s.tokens)
            mask = torch.tensor(s.loss_mask if s.loss_mask is not None else [True] * len(s.tokens))
            assert s.logprobs.dtype == torch.float64
            assert (s.logprobs[mask] - want[mask]).abs().max().item() < 1e-10
            assert (s.logprobs[~mask] == 0).all()
            if s.episode.calls:
                assert s.text == "42" and not s.truncated
                text = tok.decode(s.tokens)
                assert "<tool_response>\n42\n</tool_response>" in text and "bad arguments for mul" in text
    m = episode_metrics([s for g in out for s in g])
    assert m["tool_calls"] == 8 and m["tool_errors"] == 4 and m["tokens_tool"] > 0 and m["tool_calls_unanswered"] == 0
    assert m["tokens_model"] + m["tokens_tool"] == sum(len(s.tokens) for g in out for s in g)


def test_max_tool_calls_and_the_budget_end_an_episode():
    model, tok, agent, examples, end = _setup(max_tool_calls=1)
    out = generate_episodes(model, tok, agent, examples[:1], 1, end + 4, greedy=True)
    (s,), = out
    assert s.episode.calls == 1 and s.episode.turns == 2 and not s.truncated   # its second call is not run
    model, tok, agent, examples, end = _setup()
    (s,), = generate_episodes(model, tok, agent, examples[:1], 1, 70, greedy=True)
    assert s.truncated and len(s.tokens) <= 70
    # a budget the first call fits in but not its result: the call ran, counted as made and as never answered
    (full,), = generate_episodes(model, tok, agent, examples[:1], 1, end + 4, greedy=True)
    first_turn = full.loss_mask.index(False)
    (s,), = generate_episodes(model, tok, agent, examples[:1], 1, first_turn + 2, greedy=True)
    assert s.tokens == full.tokens[:first_turn] and s.truncated
    assert s.episode.calls == 1 and s.episode.unanswered == 1 and episode_metrics([s])["tool_calls_unanswered"] == 1
    assert full.episode.unanswered == 0


def test_a_masked_loss_is_the_loss_over_the_models_tokens():
    """fp64: the learner's step on responses with tool tokens (weight 0) equals a step whose loss is computed by
    hand from plain forwards over the model's tokens only (seq-mean-token-mean over model tokens)."""
    model, _ = load_model("tiny", dtype=torch.float64, seed=1)
    _use_float64_norms(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(4, 90, (9,), generator=g).tolist()
    resps = [torch.randint(4, 90, (n,), generator=g).tolist() for n in (11, 7)]
    masks = [[True] * 3 + [False] * 5 + [True] * 3, [True] * 2 + [False] * 2 + [True] * 3]
    adv = torch.tensor([0.7, -1.3], dtype=torch.float64)
    lens = torch.tensor([len(r) for r in resps])
    flat_mask = torch.tensor([m for ms in masks for m in ms])
    weights = token_weights(lens, torch.ones(2, dtype=torch.bool), "seq-mean-token-mean", flat_mask)
    per_token_adv = torch.repeat_interleave(adv, lens)
    m1 = copy.deepcopy(model)
    learner = Learner(m1, torch.optim.SGD(m1.parameters(), lr=1.0), impl="sdpa", temperature=1.0, kl_coef=0.0,
                      max_grad_norm=None)
    stats = learner.update([(prompt, resps)], per_token_adv, weights, None)

    m2 = copy.deepcopy(model)
    opt = torch.optim.SGD(m2.parameters(), lr=1.0)
    loss = 0.0
    for r, ms, a in zip(resps, masks, adv):
        logits = m2(input_ids=torch.tensor([prompt + r])).logits[0, len(prompt) - 1:-1]
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(r)[:, None]).squeeze(-1)
        own = lp[torch.tensor(ms)]
        loss = loss + (-(a * torch.exp(own - own.detach()))).mean() / len(resps)
    loss.backward()
    opt.step()
    assert stats.loss == pytest.approx(loss.item(), rel=1e-10, abs=1e-12)
    for (name, p1), p2 in zip(m1.named_parameters(), m2.parameters()):
        assert (p1 - p2).abs().max().item() <= 1e-10 * max(1.0, p2.abs().max().item()), name
    assert loss_mask([]) is None


class Counter:
    """reset() returns a string of its own per instance: each rollout's prompt differs after the user's text."""

    made = 0

    def reset(self, **row):
        Counter.made += 1
        return f" (try {Counter.made})"

    def peek(self, k: int) -> str:
        """Peek.

        Args:
            k: Which.
        """
        return str(k)


def test_reset_strings_become_context_of_their_own_sample():
    from hetrl.data.sources import prompt_ids
    from hetrl.trainer.episodes import group_prompt

    model, tok = load_model("tiny", dtype=torch.float64, seed=2)
    _use_float64_norms(model)
    agent = make_agent(tok, [], Counter, max_tool_calls=1, tool_timeout_s=5.0)
    row = {"prompt": [{"role": "user", "content": "hello"}]}
    example = Example(row, prompt_ids(agent.render_tokenizer(tok), row["prompt"]))
    torch.manual_seed(0)
    (group,) = generate_episodes(model, tok, agent, [example], 3, 6, logprobs=True)
    base = group_prompt(example, group).prompt_ids
    assert base == example.prompt_ids[:len(base)] and len(base) < len(example.prompt_ids)
    for s in group:
        ep = s.episode
        assert base + s.tokens == ep.prompt + ep.tokens
        tail = len(ep.prompt) - len(base)
        assert s.loss_mask == tuple([False] * tail + [True] * len(ep.tokens))
        assert f"(try {ep.environment.__class__.made - 3 + 1 + group.index(s)})" in tok.decode(s.tokens[:tail])
        want = _plain_logprobs(model, base, s.tokens)
        mask = torch.tensor(s.loss_mask)
        assert (s.logprobs[mask] - want[mask]).abs().max().item() < 1e-10


def test_episodes_train_through_the_loops_update():
    """The loop's update on multi-turn groups: tool tokens weigh 0, each response's model tokens share its weight
    (seq-mean-token-mean), and the step runs on the rollout's own log-probs (the later mini-batch's old ones)."""
    import math
    import pathlib

    from hetrl.trainer import loop
    from hetrl.trainer.config import load_config
    from hetrl.trainer.episodes import group_prompt

    model, tok, agent, examples, end = _setup()
    torch.manual_seed(0)
    out = generate_episodes(model, tok, agent, examples, 2, end + 4, temperature=1.0, logprobs=True)
    kept = [loop.Rollout(group_prompt(e, g), g, [float(i), float(i) + 1.0])
            for i, (e, g) in enumerate(zip(examples, out))]
    cfg = load_config(str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml"),
                      ["mini_batches=2", "kl_coef=0", "micro_batch_tokens=4096"])
    weights = loop._weights(kept, cfg)
    mask = loss_mask([s for r in kept for s in r.samples])
    assert mask is not None and (~mask).sum() > 0 and (weights[~mask] == 0).all()
    assert math.isclose(float(weights.sum()), 1.0, rel_tol=1e-12)
    plain, _ = load_model("tiny", dtype=torch.float64, seed=2)   # the same weights, without the script
    learner = Learner(plain, torch.optim.SGD(plain.parameters(), lr=0.1), impl="sdpa", kl_coef=0.0)
    before = [p.clone() for p in plain.parameters()]
    row = loop.update_policy(cfg, learner, kept, None)
    assert math.isfinite(row["loss"]) and any(not torch.equal(a, b) for a, b in zip(before, plain.parameters()))


class Ragged:
    """Each instance answers with a result of its own length: the rows' tool chunks differ in length."""

    made = 0

    def reset(self, **row):
        Ragged.made += 1
        self.k = Ragged.made % 4

    def mul(self, a: int, b: int) -> str:
        """Multiply.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return str(a * b) + "!" * (7 * self.k)


def test_tool_results_of_different_lengths_feed_in_one_forward():
    model, tok, _, examples, end = _setup()
    agent = make_agent(tok, [], Ragged, max_tool_calls=1, tool_timeout_s=5.0)
    torch.manual_seed(1)
    out = generate_episodes(model, tok, agent, examples[:2], 3, end, temperature=1.0, logprobs=True)
    samples = [s for g in out for s in g]
    assert all(s.episode.calls == 1 for s in samples)
    assert len({s.episode.stats()["tool_tokens"] for s in samples}) > 1
    for g, example in zip(out, examples):
        for s in g:
            want = _plain_logprobs(model, example.prompt_ids, s.tokens)
            mask = torch.tensor(s.loss_mask)
            assert (s.logprobs[mask] - want[mask]).abs().max().item() < 1e-10


def test_episodes_sample_from_the_weights_a_sync_queued():
    """A bf16 rollout copy's weight sync (LocalEngine.sync_weights -> RolloutWorker.queue_weights) lands before the
    episodes of the next step sample, as it does before single-turn generation: episodes after a sync equal
    episodes of a model loaded with the new weights, under the same seed."""
    from hetrl.trainer.episodes import EpisodeWorker
    from hetrl.trainer.rollout import RolloutWorker

    model, tok, agent, examples, end = _setup()
    new = {k: v + 0.05 * torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    worker = RolloutWorker(model, tok, batch_size=6)
    worker.queue_weights(new)
    torch.manual_seed(3)
    got = EpisodeWorker(worker, agent).generate(examples, 2, end + 4)
    assert all(torch.equal(p, new[k]) for k, p in model.state_dict().items())
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(new)
    torch.manual_seed(3)
    want = generate_episodes(fresh, tok, agent, examples, 2, end + 4, batch_size=6)
    assert [s.tokens for g in got for s in g] == [s.tokens for g in want for s in g]


def test_a_prompt_that_opens_the_call_is_continued_and_its_call_parsed():
    """response_prefix / a last assistant message (TRL's continue_final_message): the prompt ends inside the
    assistant turn, after "<tool_call>"; the model's first turn writes the rest of the call, and the call is parsed
    with the opening the prompt gave it, run, and answered."""
    from hetrl.data.sources import prompt_ids, shaped_prompt

    model, tok = load_model("tiny", dtype=torch.float64, seed=2)
    _use_float64_norms(model)
    agent = make_agent(tok, [mul], None, max_tool_calls=2, tool_timeout_s=5.0)
    render = agent.render_tokenizer(tok)
    messages = shaped_prompt([{"role": "user", "content": "q"}], " go", "<tool_call>")
    assert messages[-1] == {"role": "assistant", "content": "<tool_call>"} and messages[0]["content"] == "q go"
    ids = prompt_ids(render, messages)
    fresh = prompt_ids(render, messages[:-1])
    assert ids[:len(fresh)] == fresh and tok.decode(ids[len(fresh):]) == "<tool_call>"   # no end of turn after it
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    eos, P = tok.eos_token_id, len(ids)
    turn1 = enc('{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>') + [eos]
    suffix = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "42"}], agent.template)
    Q = P + len(turn1) + len(suffix)
    turn2 = enc("42") + [eos]
    model = _scripted(model, {P + i: t for i, t in enumerate(turn1)} | {Q + i: t for i, t in enumerate(turn2)})
    (s,), = generate_episodes(model, tok, agent, [Example({"prompt": messages}, ids)], 1, Q - P + len(turn2) + 4,
                              greedy=True)
    assert s.tokens == turn1 + suffix + turn2 and s.episode.calls == 1 and s.episode.errors == 0
    assert s.text == "42" and not s.truncated


class InitBoom:
    def __init__(self):
        raise ValueError("init boom")

    def reset(self, **row):
        return None

    def peek(self, k: int) -> str:
        """Peek.

        Args:
            k: Which.
        """
        return str(k)


class ResetBoom(Counter):
    def reset(self, **row):
        raise KeyError("no such row")


class Flood(Counter):
    def reset(self, **row):
        return "x" * 100_000


def test_an_environments_own_errors_are_one_line_with_class_file_and_line():
    """__init__ and reset() raising, and a reset() string no prompt can hold: each one InputError naming the
    environment, the exception's class and where in the user's file (never a raw traceback, never a hang)."""
    from hetrl.data.sources import prompt_ids
    from hetrl.schema import InputError

    model, tok = load_model("tiny", seed=2)
    with pytest.raises(InputError, match=r"environment InitBoom\(\) raised ValueError: init boom \(.*test_episodes"):
        make_agent(tok, [], InitBoom, max_tool_calls=1, tool_timeout_s=5.0)
    row = {"prompt": [{"role": "user", "content": "hello"}]}
    for env, needle in ((ResetBoom, r"environment ResetBoom: reset\(\) raised KeyError: 'no such row' "
                                    r"\(.*test_episodes"),
                        (Flood, r"environment Flood: reset\(\) returned 100000 characters, more than "
                                r"max_prompt_tokens \(64\)")):
        agent = dataclasses.replace(make_agent(tok, [], env, max_tool_calls=1, tool_timeout_s=5.0),
                                    max_prompt_tokens=64)
        example = Example(row, prompt_ids(agent.render_tokenizer(tok), row["prompt"]))
        with pytest.raises(InputError, match=needle):
            generate_episodes(model, tok, agent, [example], 2, 4)


def test_an_environment_ray_cannot_pickle_is_refused_up_front():
    import threading as th

    from hetrl.schema import InputError
    from hetrl.trainer.ray_executor import check_picklable

    model, tok = load_model("tiny", seed=2)
    agent = make_agent(tok, [], Counter, max_tool_calls=1, tool_timeout_s=5.0)
    check_picklable(agent)
    lock = th.Lock()

    def factory():   # a closure over a lock: fine in this process, not across it
        with lock:
            return Counter()

    with pytest.raises(InputError, match="factory cannot be sent to Ray's rollout actors"):
        check_picklable(dataclasses.replace(agent, environment_factory=factory))


def test_a_huge_tool_result_is_cut_and_the_cut_said(caplog):
    from hetrl.data.tools import TOOL_RESULT_MAX_CHARS

    def flood(n: int) -> str:
        """Flood.

        Args:
            n: How many.
        """
        return "y" * n

    (small, big) = run_calls([({"flood": flood}, ToolCall("flood", {"n": 10})),
                              ({"flood": flood}, ToolCall("flood", {"n": 10_000_000}))], 5.0)
    assert small.content == "y" * 10 and not small.error
    assert big.content.startswith("y" * TOOL_RESULT_MAX_CHARS) and big.content.endswith(
        f"[cut: {10_000_000 - TOOL_RESULT_MAX_CHARS} more characters]")
    assert any("returned 10000000 characters; cut to" in r.getMessage() for r in caplog.records)


class PlainTurns:
    """A stand-in for VllmWorker.turns (rollout_engine=vllm's side of the episodes): each turn decoded by whole-
    sequence forwards of the conversation so far, no cache, as vLLM is handed it (the real engine:
    tests/trainer/test_vllm.py)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer, self.phase_seconds, self.calls = model, tokenizer, {"generate_s": 0.0}, []

    def turns(self, contexts, max_tokens, temperature=1.0, top_p=1.0, greedy=False, logprobs=False):
        self.calls.append(len(contexts))
        out = []
        for ctx, budget in zip(contexts, max_tokens):
            ids, lps = list(ctx), []
            while len(ids) - len(ctx) < budget:
                with torch.no_grad():
                    logits = self.model(input_ids=torch.tensor([ids]),
                                        position_ids=torch.arange(len(ids))[None]).logits[0, -1]
                lp = torch.log_softmax(logits / (1.0 if greedy else temperature), -1)
                t = int(lp.argmax()) if greedy else int(torch.multinomial(lp.exp(), 1))
                ids.append(t)
                lps.append(float(lp[t]))
                if t == self.tokenizer.eos_token_id:
                    break
            out.append((ids[len(ctx):], lps if logprobs else None))
        return out


def test_episodes_on_another_engine_take_the_same_turns_tools_and_forks():
    """generate_episodes(vllm=worker): the rounds (tool calls, budget, masks, forks) are the local loop's; only the
    turns come from the engine. Greedy: every episode equals the KV-cache loop's; sampled with forks: the same
    tree, and each model token's log-prob is the plain forward's (fp64), tool tokens 0."""
    model, tok, agent, examples, end = _setup()
    want = generate_episodes(model, tok, agent, examples, 2, end + 4, greedy=True)
    engine = PlainTurns(model, tok)
    clock = {}
    got = generate_episodes(None, tok, agent, examples, 2, end + 4, greedy=True, vllm=engine, clock=clock)
    key = lambda s: (s.tokens, s.loss_mask, s.text, s.truncated, s.episode.turns, s.episode.calls,   # noqa: E731
                     s.episode.errors)
    assert [[key(s) for s in g] for g in got] == [[key(s) for s in g] for g in want]
    assert [[s.episode.calls for s in g] for g in got] == [[2, 2], [2, 2], [0, 0]]
    assert engine.calls == [6, 4, 4] and set(clock) == {"tool_s"}   # a round is one call over the live episodes

    forked = dataclasses.replace(agent, branches=2)
    torch.manual_seed(0)
    want = generate_episodes(model, tok, forked, examples, 2, end + 4, temperature=1.0, logprobs=True)
    torch.manual_seed(0)
    got = generate_episodes(None, tok, forked, examples, 2, end + 4, temperature=1.0, logprobs=True,
                            vllm=PlainTurns(model, tok))
    assert [[(s.episode.path, s.episode.fork_at, s.episode.calls) for s in g] for g in got] == \
        [[(s.episode.path, s.episode.fork_at, s.episode.calls) for s in g] for g in want]
    assert sum(len(g) for g in got) > 6                               # forks happened
    for g, example in zip(got, examples):
        for s in g:
            mask = torch.tensor(s.loss_mask if s.loss_mask is not None else [True] * len(s.tokens))
            plain = _plain_logprobs(model, example.prompt_ids, s.tokens)
            assert s.logprobs.dtype == torch.float32
            assert (s.logprobs.double()[mask] - plain[mask]).abs().max().item() < 1e-6
            assert (s.logprobs[~mask] == 0).all()
