"""Tree-shaped sampling (branches=K): episodes fork after a tool result. A scripted tiny model calls a tool twice,
then writes freely; with branches=2 each task's episodes fork into a tree of leaves. The log-probs of every model
token from the forked cache equal a plain forward of the leaf's whole conversation, no fork prefills again, and the
update through the trie packing equals a loss computed leaf by leaf from plain forwards (fp64)."""

from __future__ import annotations

import copy
import json
import math
import pathlib

import pytest
import torch

from hetrl.data import Example
from hetrl.data.tools import ToolCall, run_calls, tool_suffix_ids
from hetrl.dualkv import pack_sequences
from hetrl.models import load_model
from hetrl.trainer.episodes import episode_metrics, generate_episodes, group_prompt, make_agent

from ..dualkv.oracle import _use_float64_norms
from .test_episodes import _plain_logprobs, _scripted, mul

ROOT = pathlib.Path(__file__).parents[2]


def _setup(max_leaves=6):
    """Two tasks whose episodes call `mul` at turns 1 and 2 (the second call without b) and then write freely until
    the budget; a third whose episodes never call (their prompt puts the script inside a call)."""
    model, tok = load_model("tiny", dtype=torch.float64, seed=2)
    _use_float64_norms(model)
    agent = make_agent(tok, [mul], None, max_tool_calls=2, tool_timeout_s=5.0, branches=2, max_leaves=max_leaves)
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]   # noqa: E731
    eos = tok.eos_token_id
    P = 12
    turn1 = enc('<tool_call>{"name": "mul", "arguments": {"a": 6, "b": 7}}</tool_call>') + [eos]
    suffix1 = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": "42"}], agent.template)
    (res,) = run_calls([({"mul": mul}, ToolCall("mul", {"a": 1}))], 1.0)
    Q2 = P + len(turn1) + len(suffix1)
    turn2 = enc('<tool_call>{"name": "mul", "arguments": {"a": 1}}</tool_call>') + [eos]
    suffix2 = tool_suffix_ids(tok, [{"role": "tool", "name": "mul", "content": res.content}], agent.template)
    Q3 = Q2 + len(turn2) + len(suffix2)
    script = {P + i: t for i, t in enumerate(turn1)} | {Q2 + i: t for i, t in enumerate(turn2)}
    model = _scripted(model, script)
    g = torch.Generator().manual_seed(0)
    row = {"prompt": [{"role": "user", "content": "q"}]}
    examples = [Example(row, torch.randint(4, 90, (p,), generator=g).tolist()) for p in (P, P, P + 3)]
    return model, tok, agent, examples, Q3 - P + 6     # room for 6 free model tokens after the second result


def _rollout(max_leaves=6, seed=0):
    model, tok, agent, examples, budget = _setup(max_leaves)
    shapes = []
    forward = model.forward

    def recording(*args, input_ids=None, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return forward(*args, input_ids=input_ids, **kwargs)

    model.forward = recording
    torch.manual_seed(seed)
    out = generate_episodes(model, tok, agent, examples, 2, budget, temperature=1.0, logprobs=True, batch_size=12)
    model.forward = forward
    return model, tok, examples, out, shapes


def test_forked_episodes_continue_from_the_shared_cache_exactly():
    model, tok, examples, out, shapes = _rollout()
    # each calling task: both rollouts fork at the first result (4 leaves), then the first two leaves at the second
    # (6 = max_leaves); the third task never calls, never forks
    assert [[s.episode.path for s in g] for g in out] == [
        [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0), (1, 1)]] * 2 + [[(0,), (1,)]]
    for g, example in zip(out, examples):
        for s in g:
            ep = s.episode
            want = _plain_logprobs(model, example.prompt_ids, s.tokens)
            mask = torch.tensor(s.loss_mask if s.loss_mask is not None else [True] * len(s.tokens))
            assert (s.logprobs[mask] - want[mask]).abs().max().item() < 1e-10
            assert (s.logprobs[~mask] == 0).all()
            for d, at in enumerate(ep.fork_at):    # siblings share every token before their fork, then differ
                sib = [t for t in g if t.episode.path[:d + 1] == ep.path[:d + 1]]
                assert all(t.tokens[:at] == s.tokens[:at] for t in sib)
                assert not s.loss_mask[at - 1] and s.loss_mask[at]     # a fork follows a tool result
    assert all(len({tuple(s.tokens) for s in g}) == len(g) for g in out[:2])   # the leaves' free turns differ
    # no prefill after the prompts: every forward feeds one token per row, or a turn's end and its tool results
    results = [len(run) for g in out[:2] for s in g for run in "".join("tm"[m] for m in s.loss_mask).split("m")]
    assert max(n for _, n in shapes) == 1 + max(results)
    assert max(rows for rows, _ in shapes) == 12     # two tasks per batch (batch_size 12 / max_leaves 6), forks grown
    m = episode_metrics([s for g in out for s in g])
    assert m["leaves_per_task"] == pytest.approx(14 / 3)
    # calls made: per calling task 2 first calls and 4 second ones (each rollout's two leaves); 2 along every leaf
    assert m["tool_calls"] == 12 and m["tool_errors"] == 8 and m["tool_calls_per_episode"] == pytest.approx(24 / 14)
    trees = [pack_sequences([list(e.prompt_ids) + s.tokens for s in g]) for e, g in zip(examples, out)]
    assert m["unique_token_ratio"] == pytest.approx(sum(t.num_tokens for t in trees)
                                                    / sum(t.num_standard_tokens for t in trees))
    assert m["unique_token_ratio"] < 0.5


def test_greedy_and_max_leaves_bound_the_forks():
    model, tok, agent, examples, budget = _setup(max_leaves=2)
    out = generate_episodes(model, tok, agent, examples, 2, budget, temperature=1.0)
    assert [len(g) for g in out] == [2, 2, 2]      # max_leaves = n: no room to fork
    model, tok, agent, examples, budget = _setup()
    out = generate_episodes(model, tok, agent, examples, 1, budget, greedy=True)
    assert [len(g) for g in out] == [1, 1, 1]      # greedy copies would be equal: evaluation never forks
    with pytest.raises(ValueError, match="max_leaves"):
        generate_episodes(model, tok, agent, examples, 8, budget)


class Tally:
    """State that forks must copy: each instance counts its own calls."""

    def reset(self, **row):
        self.calls = 0

    def mul(self, a: int, b: int) -> str:
        """Multiply.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return str(a * b)


def test_an_environment_is_copied_at_each_fork():
    model, tok, _, examples, budget = _setup()
    agent = make_agent(tok, [], Tally, max_tool_calls=2, tool_timeout_s=5.0, branches=2, max_leaves=6)
    torch.manual_seed(0)
    out = generate_episodes(model, tok, agent, examples[:1], 2, budget, temperature=1.0)
    envs = [s.episode.environment for s in out[0]]
    assert len({id(e) for e in envs}) == 6
    # the first call ran before the forks (each copy remembers it); the second lacks b and never reaches mul
    assert [e.calls for e in envs] == [1] * 6 and [s.episode.calls for s in out[0]] == [2] * 6


@pytest.mark.parametrize("micro_batch_tokens", [4096, 400])
def test_the_trie_update_equals_a_loss_computed_leaf_by_leaf(micro_batch_tokens):
    """fp64: Learner(trie=True) on the forked leaves (several micro-batches with the small budget, whose labels
    come back in the trie's order) takes the step that a clipped loss from plain forwards of every leaf gives,
    each leaf with its own per-token advantages (per-subtree baseline) and its own clipping."""
    from hetrl.algo import per_token_policy_loss
    from hetrl.trainer import loop
    from hetrl.trainer.config import load_config
    from hetrl.trainer.learner import Learner, Scorer, _micro_batches

    _, _, examples, out, _ = _rollout()
    kept = [loop.Rollout(group_prompt(e, g), g, [float((3 * i + j) % 5) for j in range(len(g))])
            for i, (e, g) in enumerate(zip(examples, out))]
    cfg = load_config(str(ROOT / "examples" / "runs" / "tiny.yaml"),
                      [f"tools={ROOT}/examples/tools/calculator.py:multiply", "branches=2", "tree_advantage=subtree",
                       "kl_coef=0", "responses_per_prompt=2"])
    adv, _ = loop._per_token(kept, cfg)
    weights = loop._weights(kept, cfg)
    groups = [(r.prompt, [s.tokens for s in r.samples]) for r in kept]
    g = torch.Generator().manual_seed(3)
    old = torch.cat([s.logprobs for r in kept for s in r.samples])
    old = old + 0.4 * torch.randn(old.shape, generator=g, dtype=old.dtype)    # some ratios clip
    base, _ = load_model("tiny", dtype=torch.float64, seed=2)
    _use_float64_norms(base)

    m1 = copy.deepcopy(base)
    learner = Learner(m1, torch.optim.SGD(m1.parameters(), lr=1.0), impl="sdpa", kl_coef=0.0, max_grad_norm=None,
                      micro_batch_tokens=micro_batch_tokens, trie=True)
    stats = learner.update(groups, adv, weights, old)
    assert (len(_micro_batches(groups, micro_batch_tokens, trie=True)) > 1) == (micro_batch_tokens == 400)
    # the no-grad passes (reference, old log-probs) put the trie's labels back in the groups' order
    tree = Scorer(base, impl="sdpa", micro_batch_tokens=micro_batch_tokens, trie=True).logprobs(groups)
    plain = Scorer(base, impl="sdpa", micro_batch_tokens=4096).logprobs(groups)
    assert (tree - plain).abs().max().item() < 1e-10

    m2 = copy.deepcopy(base)
    opt = torch.optim.SGD(m2.parameters(), lr=1.0)
    loss, at, clipped = 0.0, 0, 0.0
    for prompt, leaves in groups:
        for tokens in leaves:
            sl = slice(at, at + len(tokens))
            at += len(tokens)
            logits = m2(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)
            pg, metrics = per_token_policy_loss("vanilla", old[sl][None], lp[None], adv[sl][None],
                                                torch.ones(1, len(tokens), dtype=lp.dtype),
                                                clip_ratio_low=cfg.clip_low, clip_ratio_high=cfg.clip_high,
                                                clip_ratio_c=None)
            pg, c = pg[0], metrics["pg_clipfrac"][0]
            loss = loss + (weights[sl] * pg).sum()
            clipped += float((weights[sl] * c).sum())
    loss.backward()
    opt.step()
    n_seqs = sum(len(leaves) for _, leaves in groups)
    assert stats.packed_tokens < stats.standard_tokens == sum(len(p) + len(t) for p, ls in groups for t in ls)
    if micro_batch_tokens == 4096:   # one micro-batch: every shared token once
        assert stats.packed_tokens == pack_sequences([p + t for p, ls in groups for t in ls]).num_tokens
    assert n_seqs == 14 and 0 < clipped
    assert stats.loss == pytest.approx(loss.item(), rel=1e-10, abs=1e-12)
    assert stats.clip_frac == pytest.approx(clipped, rel=1e-10, abs=1e-12)
    scale = max(p.abs().max().item() for p in m2.parameters())
    for (name, p1), p2, p0 in zip(m1.named_parameters(), m2.parameters(), base.parameters()):
        assert (p1 - p2).abs().max().item() <= 1e-8 * max((p2 - p0).abs().max().item(), 1e-30) + 1e-12 * scale, name


def test_train_with_branches_logs_the_tree_metrics(tmp_path):
    from hetrl.cli import main

    out = tmp_path / "b"
    assert main(["train", "--config", str(ROOT / "examples" / "runs" / "tiny.yaml"),
                 f"tools={ROOT}/examples/tools/calculator.py:multiply", "branches=2", "steps=2", f"out_dir={out}",
                 "eval_size=4"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert 4 <= r["leaves_per_task"] <= 8 and 0 < r["unique_token_ratio"] < 1 and math.isfinite(r["loss"])


def test_branch_knobs_are_checked():
    from hetrl.trainer.config import load_config

    tiny = str(ROOT / "examples" / "runs" / "tiny.yaml")
    calc = f"tools={ROOT}/examples/tools/calculator.py:multiply"
    with pytest.raises(ValueError, match="needs tools=FILE.py:NAME"):
        load_config(tiny, ["branches=2"])
    with pytest.raises(ValueError, match="branches is 1"):
        load_config(tiny, [calc, "tree_advantage=subtree"])
    with pytest.raises(ValueError, match="use at least 4"):
        load_config(tiny, [calc, "branches=2", "max_leaves=3"])
    with pytest.raises(ValueError, match="tree_advantage"):
        load_config(tiny, [calc, "branches=2", "tree_advantage=nodes"])
    with pytest.raises(ValueError, match="not defined on trees"):
        load_config(tiny, [calc, "branches=2", "adv_estimator=rloo"])
    with pytest.raises(ValueError, match="not defined on trees"):
        load_config(tiny, [calc, "branches=2", "use_kl_in_reward=true", "kl_coef=0.01"])
