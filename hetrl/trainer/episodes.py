"""Multi-turn tool-use rollouts: every episode continues from its own KV cache across turns, tools run between.

A round is: feed each live row its pending tokens (the prompt's last token, or the tool results and the next
assistant header) in one forward over [rows, longest chunk], then decode until every row has ended its turn (EOS or
the token budget); then parse each ended turn's calls, run the calls of all episodes at once
(hetrl.data.tools.run_calls: a tool process or a thread per call, `tool_timeout_s`), and drop the rows whose episode
is over from the cache. The conversation is never prefilled again: the cache grows by the tool tokens only. Each
distinct prompt is prefilled once and its K/V given to its N rows (`batch_select_indices`), as the single-turn
worker's plain path does. Rows that ended their turn while others still decode ride along on a masked pad token (the
2-D attention mask holds those holes, position ids count real tokens only), so the cache stays one batch.

Budget: `max_new_tokens` bounds the whole completion, model and tool tokens (TRL's `max_completion_length`); a
tool result that would not leave room for one more model token ends the episode as truncated (TRL drops it too).
`max_tool_calls` bounds the tool-calling turns of an episode (TRL's `max_tool_calling_iterations`). A sample's
`loss_mask` is True on the model's own tokens only; the learner weights tool tokens 0 (they are context).

Tree-shaped sampling (`branches` K > 1): once an episode's tool results are fed, it forks into K continuations
whose cache rows repeat its row (no prefill; the tool tokens computed once), while its task has at most
`max_leaves` leaves. Every leaf is a sample of its task; `path` and `fork_at` say where it forked.

On Ray the same code runs inside each rollout actor (ray_executor.RolloutActor.episodes): tools run there. With
rollout_engine=vllm the rounds are the same and vLLM samples each turn (`_run_vllm`), the conversation so far as its
prompt (its prefix cache keeps the computed turns).

Not here yet: the shared-prefix decode attention (hetrl.dualkv.decode reads a prompt's K/V once per step for
its N rows) handles one token per row per step without holes, so episodes (and forks) decode from repeated
cache rows.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from transformers import DynamicCache

from hetrl.algo import tree_advantages
from hetrl.data.containment import name_of, user_call
from hetrl.data.sources import prompt_ids, reply_prefix
from hetrl.data.tools import (
    ToolTokenizer,
    check_environment,
    environment_tools,
    parse_tool_calls,
    run_calls,
    tool_schema,
    tool_suffix_ids,
    tool_template,
)
from hetrl.dualkv import pack_sequences
from hetrl.planner.spec import check_max_leaves, leaf_cap
from hetrl.schema import InputError
from hetrl.trainer.precision import FP32, RunPrecision
from hetrl.trainer.rollout import Sample, left_padded, sample, token_logprobs, warpers


@dataclass(frozen=True)
class Agent:
    """What a run with tools decided once: the tools, the environment factory, the chat template that renders
    them (None: the model's own) and the limits."""

    tools: tuple[Callable, ...]
    environment_factory: Callable | None
    schemas: tuple[dict, ...]       # every tool's schema: the standalone tools', then the environment's methods'
    template: str | None
    max_tool_calls: int
    tool_timeout_s: float
    env_reward: bool                # the environment defines get_reward()
    tool_isolation: str = "process"   # run_calls': function tools in tool processes, or everything in threads
    branches: int = 1               # continuations an episode forks into after a tool result (1: none)
    max_leaves: int | None = None   # leaves per task at most (None: n x branches for n rollouts per task)
    max_prompt_tokens: int | None = None   # an episode's prompt at most (with its environment's reset() string)

    def render_tokenizer(self, tokenizer) -> ToolTokenizer:
        """The tokenizer a data source renders prompts with: the tools in the system message."""
        return ToolTokenizer(tokenizer, list(self.schemas), self.template)


def make_agent(tokenizer, tools=(), environment_factory=None, max_tool_calls: int = 4,
               tool_timeout_s: float = 10.0, branches: int = 1, max_leaves: int | None = None,
               tool_isolation: str = "process") -> Agent:
    """Check the tools and environment (one probe instance, as TRL does) and choose the template."""
    if isinstance(branches, bool) or not isinstance(branches, int) or branches < 1:
        raise InputError(f"branches must be an int >= 1 (continuations per fork; 1: no forks), got {branches!r}")
    check_max_leaves(max_leaves)
    tools = tuple(tools)
    schemas = [tool_schema(t) for t in tools]
    env_reward = False
    if environment_factory is not None:
        env_schemas, env_reward = check_environment(environment_factory)
        schemas += env_schemas
    if not schemas:
        raise InputError("tools: neither tools nor the environment define a tool; give tools=FILE.py:NAME or an "
                         "environment class with public methods")
    names = [s["function"]["name"] for s in schemas]
    if len(set(names)) != len(names):
        raise InputError(f"tools: two tools share a name ({', '.join(names)}); the model calls them by name")
    return Agent(tools, environment_factory, tuple(schemas), tool_template(tokenizer), max_tool_calls,
                 tool_timeout_s, env_reward, tool_isolation, branches, max_leaves)


@dataclass
class Episode:
    """One rollout's state; `stats()` is what it logs."""

    prompt: list[int]
    tools: dict[str, Callable]
    environment: object | None
    tokens: list[int] = field(default_factory=list)
    model_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)   # tokens to feed before the next model token
    turn_start: int = 0
    turns: int = 0
    tool_turns: int = 0
    calls: int = 0
    errors: int = 0
    unanswered: int = 0         # of `calls`, those whose results did not fit the token budget (never shown)
    opening: str = ""           # the text the prompt starts the first turn with (response_prefix), parsed with it
    truncated: bool = False
    last_text: str = ""
    group_prompt_len: int = 0   # the prompt tokens its group shares (the rest of `prompt` starts its sample)
    task: object = None         # its task's key (one object per example of a generate call), shared by its leaves
    path: tuple[int, ...] = (0,)    # its rollout's index in the task, then its child index at every fork
    fork_at: tuple[int, ...] = ()   # len(tokens) at every fork: its tokens before that are its siblings' too
    fork: bool = False          # forks after its pending tool result is fed
    shared_calls: int = 0       # of `calls` / `errors`, those run before a fork and counted in an earlier sibling
    shared_errors: int = 0

    def stats(self) -> dict:
        model = sum(self.model_mask)
        return {"turns": self.turns, "tool_calls": self.calls, "tool_errors": self.errors,
                "model_tokens": model, "tool_tokens": len(self.tokens) - model, "prompt_tokens": len(self.prompt)}


MAX_CHARS_PER_TOKEN = 16   # no tokenizer packs more characters into a token on text: a longer string cannot fit


def _start(agent: Agent, example, tokenizer) -> Episode:
    """A new environment instance per rollout; reset(**row)'s string goes at the end of the last user message."""
    env, tools = None, {t.__name__: t for t in agent.tools}
    prompt = list(example.prompt_ids)
    opening = reply_prefix(example.row.get("prompt")) or ""
    if agent.environment_factory is not None:
        env = user_call(agent.environment_factory, f"environment {name_of(agent.environment_factory)}()")
        name = type(env).__name__
        tools |= {m.__name__: m for m in environment_tools(env)}
        observation = user_call(lambda: env.reset(**example.row), f"environment {name}: reset()")
        if observation is not None:
            messages = example.row["prompt"]
            if not isinstance(messages, list) or not isinstance(observation, str):
                raise InputError(f"environment {name}: reset() returned {type(observation).__name__} "
                                 "for a prompt that is not chat messages; it may return None, or a string for chat "
                                 "prompts")
            cap = agent.max_prompt_tokens
            if cap is not None and len(observation) > MAX_CHARS_PER_TOKEN * cap:   # before tokenizing it whole
                raise InputError(f"environment {name}: reset() returned {len(observation)} characters, more than "
                                 f"max_prompt_tokens ({cap}) can hold; return less, or raise max_prompt_tokens")
            last = max(i for i, m in enumerate(messages) if m["role"] == "user")
            messages = [{**m, "content": m["content"] + observation} if i == last else m
                        for i, m in enumerate(messages)]
            prompt = prompt_ids(agent.render_tokenizer(tokenizer), messages)
            if cap is not None and len(prompt) > cap:
                raise InputError(f"environment {name}: with reset()'s string a prompt is {len(prompt)} tokens, over "
                                 f"max_prompt_tokens ({cap}); return less, or raise max_prompt_tokens")
    return Episode(prompt=prompt, tools=tools, environment=env, pending=[prompt[-1]], opening=opening)


def generate_episodes(model, tokenizer, agent: Agent, examples, n: int, max_new_tokens: int, *,
                      temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, logprobs: bool = False,
                      batch_size: int = 64, precision: RunPrecision = FP32, clock: dict | None = None,
                      top_k: int = 0, vllm=None) -> list[list[Sample]]:
    """examples (hetrl.data Example: prompt ids rendered with the tools, the row) -> n episodes each, as Samples
    whose `loss_mask` marks the model's tokens and whose `episode` holds the Episode (environment, counts).
    `clock`: seconds are added to its prefill_s (the prompts), decode_s (turns and tool tokens) and tool_s.
    `vllm`: a VllmWorker that samples the turns instead of `model` (None there; its sampling settings are the
    worker's and the arguments'; its seconds go to the worker's generate_s, the tools' to tool_s)."""
    clock = clock if clock is not None else {}
    for k in ("tool_s",) if vllm is not None else ("prefill_s", "decode_s", "tool_s"):
        clock.setdefault(k, 0.0)
    if logprobs and greedy:
        raise ValueError("logprobs are of a sampled continuation; greedy decoding has none to give")
    check_max_leaves(agent.max_leaves, n)
    for e in examples:
        if not isinstance(e.row.get("prompt"), list):
            raise InputError("tools need chat prompts (a list of messages): the tools are described in the chat "
                             f"template's system turn; got a {type(e.row.get('prompt')).__name__} prompt")
    tasks = [object() for _ in examples]
    episodes = []
    for task, e in zip(tasks, examples):
        for j in range(n):
            episodes.append(_start(agent, e, tokenizer))
            episodes[-1].task, episodes[-1].path = task, (j,)
    branches = 1 if greedy else agent.branches    # greedy continuations of one state would all be equal
    cap = leaf_cap(agent.max_leaves, n, agent.branches)
    # forks grow a batch up to `cap` leaves per task: whole tasks per batch, as many as fit batch_size leaves
    per_batch = max(1, batch_size) if branches == 1 else max(1, batch_size // cap) * n
    leaves: dict[object, list[Episode]] = {}
    if vllm is not None:
        for ep in _run_vllm(vllm, tokenizer, agent, episodes, max_new_tokens, temperature, top_p, greedy, logprobs,
                            clock, branches, cap):
            leaves.setdefault(ep.task, []).append(ep)
        dtype = torch.float32
    else:
        warp = None if greedy else warpers(temperature, top_p, top_k)
        was_training = model.training
        model.eval()
        try:
            for s in range(0, len(episodes), per_batch):
                for ep in _run_batch(model, tokenizer, agent, episodes[s:s + per_batch], max_new_tokens, warp,
                                     temperature if logprobs else None, precision, clock, branches, cap):
                    leaves.setdefault(ep.task, []).append(ep)
        finally:
            model.train(was_training)
        dtype = torch.promote_types(next(model.parameters()).dtype, torch.float32)   # the logits' log-softmax dtype
    out = []
    for task, example in zip(tasks, examples):
        group = sorted(leaves[task], key=lambda ep: ep.path)    # depth first: a fork's leaves side by side
        # reset() strings make a rollout's prompt its own: the group's samples continue the prompts' common
        # prefix, and each one's own prompt tail is context (weight 0) at the start of its sample
        base = _common_prefix([example.prompt_ids] + [ep.prompt for ep in group])
        samples = []
        for ep in group:
            ep.group_prompt_len = base
            tail = ep.prompt[base:]
            mask = tuple([False] * len(tail) + ep.model_mask)
            samples.append(Sample(tail + ep.tokens, ep.last_text, ep.truncated,
                                  logprobs=torch.tensor([0.0] * len(tail) + ep.logprobs, dtype=dtype)
                                  if logprobs else None,
                                  loss_mask=None if all(mask) else mask, episode=ep))
        out.append(samples)
    return out


def _common_prefix(seqs: list[list[int]]) -> int:
    n = min(len(s) for s in seqs)
    for j in range(n):
        if any(s[j] != seqs[0][j] for s in seqs):
            return j
    return n


def group_prompt(example, samples: list[Sample]):
    """The Example whose prompt the group's samples continue (hetrl.data Example; its prompt shortened to the common
    prefix where the environment's reset() gave rollouts prompts of their own)."""
    ep = samples[0].episode if samples else None
    if ep is None or ep.group_prompt_len == len(example.prompt_ids):
        return example
    return dataclasses.replace(example, prompt_ids=list(example.prompt_ids[:ep.group_prompt_len]))


def _run_batch(model, tokenizer, agent: Agent, episodes: list[Episode], max_new_tokens: int, warp,
               scored: float | None, precision: RunPrecision, clock: dict, branches: int = 1,
               cap: int = 0) -> list[Episode]:
    """Roll out `episodes` (whole tasks where branches > 1) -> every leaf: the episodes and their forks' copies.
    An episode whose turn ends in tool calls forks into `branches` continuations while its task has at most `cap`
    leaves: after its tool results are fed, its cache row is repeated (no prefill), and each copy samples its own
    next turn from the same logits."""
    t0, tool_before = time.perf_counter(), clock["tool_s"]
    device = model.get_input_embeddings().weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    distinct: dict[tuple[int, ...], int] = {}
    prompt_of = [distinct.setdefault(tuple(ep.prompt), len(distinct)) for ep in episodes]
    ids, pmask = left_padded([list(p) for p in distinct], pad)
    ids, pmask = ids.to(device), pmask.to(device)
    rows = torch.tensor(prompt_of, device=device)
    with torch.no_grad(), precision.amp(model):
        if ids.shape[1] > 1:   # each distinct prompt but its last token, once; then its K/V given to its rows
            pre = pmask[:, :-1]
            positions = (pre.long().cumsum(-1) - 1).masked_fill(pre == 0, 0)
            cache = model.get_decoder()(input_ids=ids[:, :-1], attention_mask=pre, position_ids=positions,
                                        use_cache=True).past_key_values
            cache.batch_select_indices(rows)
        else:
            cache = DynamicCache(config=model.config)
        attn = pmask[rows, :-1]
        t1 = time.perf_counter()
        clock["prefill_s"] += t1 - t0
        pos = torch.tensor([len(ep.prompt) - 1 for ep in episodes], device=device)
        leaves = list(episodes)
        count = collections.Counter(ep.task for ep in episodes)   # leaves per task
        eps = list(episodes)      # batch row -> episode
        while eps:
            # 1. feed every row's pending chunk; the logits after its last token give the turn's first token
            k = max(len(ep.pending) for ep in eps)
            chunk = torch.full((len(eps), k), pad, dtype=torch.long, device=device)
            real = torch.zeros((len(eps), k), dtype=attn.dtype, device=device)
            for r, ep in enumerate(eps):
                chunk[r, :len(ep.pending)] = torch.tensor(ep.pending, device=device)
                real[r, :len(ep.pending)] = 1
            attn = torch.cat([attn, real], dim=1)
            positions = pos[:, None] + torch.arange(k, device=device)[None]
            lens = real.sum(1).long()
            # logits only where some row's chunk ends (not [rows, k, vocab]: 0.75 GB at 64 rows x 60 x 49k)
            ends = torch.unique(lens - 1)
            logits = model(input_ids=chunk, attention_mask=attn, position_ids=positions, past_key_values=cache,
                           use_cache=True, logits_to_keep=ends).logits
            raw = logits[torch.arange(len(eps), device=device), torch.searchsorted(ends, lens - 1)]
            pos = pos + lens
            for ep in eps:
                ep.pending, ep.turn_start = [], len(ep.tokens)
                ep.turns += 1
            if any(ep.fork for ep in eps):    # every copy continues from the fed tool results' cache row
                index, grown = [], []
                for r, ep in enumerate(eps):
                    kids = _fork(agent, ep, branches) if ep.fork else [ep]
                    index += [r] * len(kids)
                    grown += kids
                    leaves += kids[1:]
                index = torch.tensor(index, device=device)
                cache.batch_select_indices(index)
                attn, pos, raw, eps = attn[index], pos[index], raw[index], grown
            # 2. decode until every row has ended its turn (EOS or the budget); ended rows ride on masked pads
            active = torch.ones(len(eps), dtype=torch.bool, device=device)
            while True:
                logits = raw.float()
                token = logits.argmax(-1) if warp is None else sample(warp(logits))
                lp = token_logprobs(raw, torch.arange(raw.shape[0], device=device), token, scored, False) \
                    if scored is not None else None
                for r in active.nonzero().flatten().tolist():
                    ep, t = eps[r], int(token[r])
                    ep.tokens.append(t)
                    ep.model_mask.append(True)
                    if lp is not None:
                        ep.logprobs.append(float(lp[r]))
                    if t == eos or len(ep.tokens) >= max_new_tokens:
                        active[r] = False
                if not bool(active.any()):
                    break
                step = torch.where(active, token, torch.full_like(token, pad))[:, None]
                attn = torch.cat([attn, active[:, None].to(attn.dtype)], dim=1)
                raw = model(input_ids=step, attention_mask=attn, position_ids=pos[:, None], past_key_values=cache,
                            use_cache=True).logits[:, -1]
                pos = pos + active.long()
            # 3. the turns' tool calls, every episode's at once; rows whose episode is over leave the cache
            t2 = time.perf_counter()
            _answer(tokenizer, agent, eps, eos, max_new_tokens)
            clock["tool_s"] += time.perf_counter() - t2
            _mark_forks(eps, branches, count, cap)
            keep = [r for r, ep in enumerate(eps) if ep.pending]
            if len(keep) < len(eps):
                index = torch.tensor(keep, device=device, dtype=torch.long)
                if keep:
                    cache.batch_select_indices(index)
                attn, pos = attn[index], pos[index]
            eps = [eps[r] for r in keep]
    clock["decode_s"] += time.perf_counter() - t1 - clock["tool_s"] + tool_before
    return leaves


def _run_vllm(worker, tokenizer, agent: Agent, episodes: list[Episode], max_new_tokens: int, temperature: float,
              top_p: float, greedy: bool, logprobs: bool, clock: dict, branches: int, cap: int) -> list[Episode]:
    """`_run_batch` on vLLM: a round is one `worker.turns` call over every live episode, each request the episode's
    whole conversation so far (vLLM's prefix cache holds what earlier rounds computed, the prompt once per group),
    then the same tool calls, budget and forks (`_answer`, `_fork`); a fork's copies are requests of their own,
    each sampling its own next turn. -> every leaf."""
    leaves = list(episodes)
    count = collections.Counter(ep.task for ep in episodes)   # leaves per task
    eps = list(episodes)
    while eps:
        if any(ep.fork for ep in eps):
            grown = []
            for ep in eps:
                kids = _fork(agent, ep, branches) if ep.fork else [ep]
                grown += kids
                leaves += kids[1:]
            eps = grown
        for ep in eps:
            ep.pending, ep.turn_start = [], len(ep.tokens)
            ep.turns += 1
        turns = worker.turns([ep.prompt + ep.tokens for ep in eps], [max_new_tokens - len(ep.tokens) for ep in eps],
                             temperature, top_p, greedy, logprobs)
        for ep, (tokens, lps) in zip(eps, turns):
            ep.tokens += tokens
            ep.model_mask += [True] * len(tokens)
            if logprobs:
                ep.logprobs += lps
        t0 = time.perf_counter()
        _answer(tokenizer, agent, eps, tokenizer.eos_token_id, max_new_tokens)
        clock["tool_s"] += time.perf_counter() - t0
        _mark_forks(eps, branches, count, cap)
        eps = [ep for ep in eps if ep.pending]
    return leaves


def _mark_forks(eps: list[Episode], branches: int, count: collections.Counter, cap: int) -> None:
    """After a round's tool calls: the episodes that go on fork into `branches` while their task has at most `cap`
    leaves (`count`: leaves per task), in order, so a task's first episodes to call a tool fork first."""
    for ep in eps:
        if branches > 1 and ep.pending and count[ep.task] + branches - 1 <= cap:
            ep.fork = True
            count[ep.task] += branches - 1


def _fork(agent: Agent, ep: Episode, k: int) -> list[Episode]:
    """`ep` and k - 1 copies of it, each a child of the fork: the token lists copied, the environment deep-copied
    (each continuation changes its own state from here; its methods are the copy's tools)."""
    at = len(ep.tokens)
    kids = []
    for c in range(1, k):
        env, tools = None, {t.__name__: t for t in agent.tools}
        if ep.environment is not None:
            try:
                env = copy.deepcopy(ep.environment)
            except Exception as e:   # whatever the class's state refuses to copy (locks, sockets, ...)
                raise InputError(f"branches={k}: environment {type(ep.environment).__name__} cannot be copied "
                                 f"for a fork (copy.deepcopy: {type(e).__name__}: {e}); make its state copyable "
                                 "(or define __deepcopy__), or use branches=1") from None
            tools |= {m.__name__: m for m in environment_tools(env)}
        kids.append(dataclasses.replace(ep, tools=tools, environment=env, tokens=list(ep.tokens),
                                        model_mask=list(ep.model_mask), logprobs=list(ep.logprobs),
                                        path=ep.path + (c,), fork_at=ep.fork_at + (at,), fork=False,
                                        shared_calls=ep.calls, shared_errors=ep.errors))
    ep.path, ep.fork_at, ep.fork = ep.path + (0,), ep.fork_at + (at,), False
    return [ep, *kids]


def _answer(tokenizer, agent: Agent, eps: list[Episode], eos: int, max_new_tokens: int) -> None:
    """Parse each ended turn; give the rows that go on their tool results as `pending` tokens (context, not
    trained); mark the others finished (pending stays empty)."""
    jobs, owners = [], []
    for ep in eps:
        turn = ep.tokens[ep.turn_start:]
        ep.last_text = tokenizer.decode(turn, skip_special_tokens=True)
        ended = bool(turn) and turn[-1] == eos
        if not ended:
            ep.truncated = True
            continue
        opening = ep.opening if ep.turn_start == 0 else ""     # a first turn the prompt began: its calls' start
        calls = parse_tool_calls(opening + tokenizer.decode(turn, skip_special_tokens=False), tokenizer,
                                 ep.prompt + ep.tokens[:ep.turn_start], list(agent.schemas))
        if not calls or ep.tool_turns >= agent.max_tool_calls:
            continue
        ep.tool_turns += 1
        for call in calls:
            jobs.append((ep.tools, call))
            owners.append(ep)
    results = run_calls(jobs, agent.tool_timeout_s, agent.tool_isolation) if jobs else []
    answered: dict[int, list] = {}
    for ep, res in zip(owners, results):
        answered.setdefault(id(ep), []).append(res)
        ep.calls += 1
        ep.errors += int(res.error)
    for ep in eps:
        got = answered.get(id(ep))
        if not got:
            continue
        suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": r.name, "content": r.content} for r in got],
                                 agent.template)
        if len(ep.tokens) + len(suffix) >= max_new_tokens:   # no room left for the model to answer: TRL drops it
            ep.truncated = True
            ep.unanswered += len(got)
            continue
        ep.tokens += suffix
        ep.model_mask += [False] * len(suffix)
        ep.logprobs += [0.0] * len(suffix)   # never trained (weight 0); finite, so weight x value stays 0
        ep.pending = [ep.tokens[len(ep.tokens) - len(suffix) - 1]] + suffix   # the turn's EOS is not in the cache yet


def leaf_advantages(samples: list[Sample], rewards: list[float], subtree: bool, scale: bool) -> torch.Tensor:
    """One task's leaves (its group's samples, depth first) -> advantages [Σ len(tokens)] of their tokens:
    hetrl.algo.tree_advantages over the leaves' paths, fork positions counted in the samples' tokens."""
    eps = [s.episode for s in samples]
    tails = [len(ep.prompt) - ep.group_prompt_len for ep in eps]    # the sample's own prompt tail comes first
    return tree_advantages(torch.tensor(rewards, dtype=torch.float64), [ep.path for ep in eps],
                           [tuple(t + at for at in ep.fork_at) for ep, t in zip(eps, tails)],
                           [len(s.tokens) for s in samples], subtree=subtree, scale=scale)


def episode_metrics(samples: list[Sample], prefix: str = "") -> dict:
    """Per-step means over episodes (leaves, where episodes fork): turns, the calls made (each once, however many
    leaves share it) and per leaf, tool errors; the calls made whose results did not fit the token budget (the
    episode ended there, the model never saw them: a call that ends a leaf is never shared); the step's tokens by
    source (per leaf, as trained); leaves per task and unique / linearized tokens (prompt included: what the
    trie-packed update computes of what running every leaf alone would)."""
    eps = [s.episode for s in samples if s.episode is not None]
    if not eps:
        return {}
    tasks: dict[object, list[Episode]] = {}
    for e in eps:
        tasks.setdefault(e.task, []).append(e)
    trees = [pack_sequences([e.prompt + e.tokens for e in leaves]) for leaves in tasks.values()]
    st = [e.stats() for e in eps]
    calls = sum(e.calls - e.shared_calls for e in eps)
    errors = sum(e.errors - e.shared_errors for e in eps)
    out = {"turns_mean": float(np.mean([s["turns"] for s in st])),
           "tool_calls": calls, "tool_calls_per_episode": sum(s["tool_calls"] for s in st) / len(st),
           "tool_errors": errors, "tool_error_frac": errors / calls if calls else 0.0,
           "tool_calls_unanswered": sum(e.unanswered for e in eps),
           "tokens_model": sum(s["model_tokens"] for s in st), "tokens_tool": sum(s["tool_tokens"] for s in st),
           "tokens_prompt": sum(s["prompt_tokens"] for s in st),
           "leaves_per_task": len(eps) / len(tasks),
           "unique_token_ratio": sum(t.num_tokens for t in trees) / sum(t.num_standard_tokens for t in trees)}
    return {f"{prefix}{k}": v for k, v in out.items()}


def loss_mask(samples: list[Sample]) -> torch.Tensor | None:
    """[K] bool over the samples' tokens in order: True where the model's own token is (None: all are)."""
    if all(s.loss_mask is None for s in samples):
        return None
    return torch.tensor([m for s in samples for m in (s.loss_mask or [True] * len(s.tokens))], dtype=torch.bool)



class EpisodeWorker:
    """A local RolloutWorker's model and settings, rolling out episodes with `agent` (what the loop calls when the
    run has tools)."""

    def __init__(self, worker, agent: Agent):
        self.worker, self.agent = worker, agent
        worker.phase_seconds.setdefault("tool_s", 0.0)   # reported per step beside prefill_s and decode_s

    def generate(self, examples, n: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                 greedy: bool = False, logprobs: bool = False) -> list[list[Sample]]:
        w = self.worker
        if hasattr(w, "turns"):    # rollout_engine=vllm (hetrl.trainer.vllm_engine.VllmWorker)
            return generate_episodes(None, w.tokenizer, self.agent, examples, n, max_new_tokens,
                                     temperature=temperature, top_p=top_p, greedy=greedy, logprobs=logprobs,
                                     clock=w.phase_seconds, vllm=w)
        w.apply_queued()   # a bf16 rollout copy's weight sync (LocalEngine.sync_weights) lands before sampling
        return generate_episodes(w.model, w.tokenizer, self.agent, examples, n, max_new_tokens,
                                 temperature=temperature, top_p=top_p, greedy=greedy, logprobs=logprobs,
                                 batch_size=w.batch_size, precision=w.precision, clock=w.phase_seconds,
                                 top_k=w.top_k)

def resolve_tools(cfg, tools=None, environment_factory=None) -> tuple[list[Callable], Callable | None]:
    """The run's tools and environment factory from `tools=` / `environment=` (or as given from Python), loaded and
    checked before anything heavy is (a bad spec is one line, before the model loads)."""
    from hetrl.data.tools import load_environment, load_tools
    from hetrl.trainer.config import PYTHON

    if tools is None:
        if any(s.startswith(PYTHON) for s in cfg.tool_specs):
            raise InputError("this run's tools were passed from Python; pass them again: hetrl.train(..., tools=[...])")
        tools = [t for spec in cfg.tool_specs for t in load_tools(spec)]
    if environment_factory is None and cfg.environment is not None:
        if cfg.environment.startswith(PYTHON):
            raise InputError("this run's environment was passed from Python; pass it again: "
                             "hetrl.train(..., environment_factory=...)")
        environment_factory = load_environment(cfg.environment)
    if environment_factory is not None:
        check_environment(environment_factory)
    for t in tools:
        tool_schema(t)
    return list(tools), environment_factory


def agent_from_config(cfg, tokenizer, tools, environment_factory) -> Agent | None:
    """The run's Agent (None without tools or an environment), from `resolve_tools`' result."""
    if not tools and environment_factory is None:
        return None
    agent = make_agent(tokenizer, tools, environment_factory, cfg.max_tool_calls, cfg.tool_timeout_s, cfg.branches,
                       cfg.max_leaves, cfg.tool_isolation)
    return dataclasses.replace(agent, max_prompt_tokens=cfg.max_prompt_tokens)

__all__ = ["Agent", "Episode", "EpisodeWorker", "agent_from_config", "episode_metrics", "generate_episodes",
           "group_prompt", "leaf_advantages", "loss_mask", "make_agent", "resolve_tools"]
