"""`hetrl bench tree`: one policy-update micro-step on synthetic agentic trees, the tree engine against the layouts a
user would otherwise run.

A tree: a prompt (context), then `turns` turns, each a model turn (trained) and, except after the last, a tool output
(context); at the first turn boundaries (after the prompt and after each tool output) every branch forks into K
continuations, while the leaves stay within `max_leaves`. Every root-to-leaf path is one trajectory (sequence); the
loss is GRPO's clipped surrogate on the model's tokens, one advantage per trajectory. Layouts:

  linear     each trajectory packed linearly (verl's `use_remove_padding`): one row of Σ L tokens, causal
             attention per trajectory (SDPA on each slice: the CPU stand-in for flash-attn varlen)
  prompt     DualKV sharing the prompt only (`pack_groups`: one prompt, one response per trajectory)
  treerow    TRL's TreeRow layout rebuilt on the CPU: a prefix trie keyed on (token, next token), so the parent token
             is repeated once per extra child; each segment's queries attend to its root-to-segment path, whose K/V
             are gathered (`index_select`, copied per segment), with SDPA
  tree       hetrl's tree engine (`pack_sequences` + `sequence_logprobs`, impl="sdpa")
The LM head runs only on the rows that predict trained tokens in every layout. `linear` and `treerow` take
the log-softmax over their [rows, vocab] logits whole (as `hetrl bench dualkv`'s baselines do); `prompt` and
`tree` go through hetrl's head, which above 256 MB of logits runs in row chunks recomputed in the backward
(more time, far less memory: api.CHUNK_LOGITS_ABOVE_BYTES), so at the grid's largest trees the memory
columns compare that head as much as the layouts. Times: median of interleaved rounds after a warm-up
(hetrl.bench.harness.median_times); memory: peak RSS increase of the update in a fresh process per layout (VmHWM
reset just before the step: hetrl.bench.harness.peak_rss_increase, as `hetrl bench dualkv` measures it). The FLOP
ratio is linear / tree: the body's parameters x tokens, the LM head x predicting rows, attention x (query, key)
pairs; `tree` is expected at >= 0.85 of it.
"""

from __future__ import annotations

import contextvars
import json
import random
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hetrl.bench.harness import child_results, machine, median_times, peak_rss_increase
from hetrl.dualkv import pack_groups, pack_sequences, sequence_logprobs, shared_prompt_logprobs

LAYOUTS = ("linear", "prompt", "treerow", "tree")
BASELINES = ("linear", "prompt", "treerow")


@dataclass(frozen=True)
class TreeCase:
    turns: int
    branches: int                   # K at each branching turn boundary
    prompt: int = 512
    turn_tokens: tuple = (32, 128)  # a model turn's length, uniform in [lo, hi]
    tool_tokens: tuple = (32, 128)
    max_leaves: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.turns < 1 or self.branches < 1 or self.prompt < 1 or self.max_leaves < 1:
            raise ValueError(f"turns ({self.turns}), branches ({self.branches}), prompt ({self.prompt}) and "
                             f"max_leaves ({self.max_leaves}) must be >= 1")

    @property
    def name(self) -> str:
        return f"{self.turns}turns_K{self.branches}_P{self.prompt}"


GRID = [TreeCase(t, k) for t in (3, 6) for k in (1, 2, 4)]
QUICK = [TreeCase(3, 2, prompt=64, turn_tokens=(8, 24), tool_tokens=(8, 24), max_leaves=4),
         TreeCase(2, 1, prompt=64, turn_tokens=(8, 24), tool_tokens=(8, 24), max_leaves=4)]


def make_tree(case: TreeCase, vocab: int) -> tuple[list[list[int]], list[list[bool]]]:
    """-> (trajectories, loss masks: True on the model's tokens)."""
    rng = random.Random(case.seed * 1_000_003 + case.turns * 101 + case.branches)
    tokens = lambda n: [rng.randrange(vocab) for _ in range(n)]         # noqa: E731
    paths = [(tokens(case.prompt), [False] * case.prompt)]
    for turn in range(case.turns):
        k = case.branches if len(paths) * case.branches <= case.max_leaves else 1
        nxt = []
        for ids, mask in paths:
            for _ in range(k):
                n = rng.randint(*case.turn_tokens)
                ids2, mask2 = ids + tokens(n), mask + [True] * n
                if turn + 1 < case.turns:
                    m = rng.randint(*case.tool_tokens)
                    ids2, mask2 = ids2 + tokens(m), mask2 + [False] * m
                nxt.append((ids2, mask2))
        paths = nxt
    return [p for p, _ in paths], [m for _, m in paths]


# ---------------------------------------------------------------------------- linear and treerow attention

_PLAN: contextvars.ContextVar = contextvars.ContextVar("hetrl_bench_tree_plan", default=None)


def _segment_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Per segment (q0, q1, keys): its queries against `keys` (a (start, end) slice: causal on a view; or a row
    index [path + own]: gathered, causal aligned bottom-right), outputs concatenated in stream order."""
    gqa = query.shape[1] != key.shape[1]
    out = []
    for q0, q1, keys in _PLAN.get():
        q = query[:, :, q0:q1]
        if isinstance(keys, tuple):
            o = F.scaled_dot_product_attention(q, key[:, :, keys[0]:keys[1]], value[:, :, keys[0]:keys[1]],
                                               is_causal=True, scale=scaling, enable_gqa=gqa)
        else:
            k, v = key.index_select(2, keys), value.index_select(2, keys)        # the path's K/V, copied
            n_q, n_k = q1 - q0, keys.numel()
            mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        out.append(o)
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register("hetrl_bench_segments", _segment_attention)
AttentionMaskInterface.register("hetrl_bench_segments", lambda **_: None)


def _logp(logits, labels):
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits, -1).gather(-1, labels[:, None]).squeeze(-1)


def _run_plan(model, ids, pos, rows, labels, plan):
    """The model once on a packed row under `_segment_attention`; log-probs of `labels` from `rows`."""
    keep, inverse = torch.unique(rows, sorted=True, return_inverse=True)
    token = _PLAN.set(plan)
    original = model.config._attn_implementation
    model.set_attn_implementation("hetrl_bench_segments")
    try:
        logits = model(input_ids=ids[None], position_ids=pos[None], logits_to_keep=keep, use_cache=False).logits[0]
    finally:
        model.set_attn_implementation(original)
        _PLAN.reset(token)
    return _logp(logits[inverse], labels)


def _linear(model, seqs, masks):
    ids = torch.cat([torch.tensor(s) for s in seqs])
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    starts = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0).tolist()
    rows = torch.cat([torch.arange(a, b - 1)[torch.tensor(m[1:])] for a, b, m in zip(starts, starts[1:], masks)])
    labels = ids[rows + 1]
    plan = [(a, b, (a, b)) for a, b in zip(starts, starts[1:])]
    return lambda: _run_plan(model, ids, pos, rows, labels, plan), ids.numel()


def _treerow(model, seqs, masks, vocab: int):
    """TRL's TreeRow: the trie over (token, next token) pairs, so a token with k distinct next tokens is laid out k
    times; each segment attends to its gathered root-to-segment path."""
    end = vocab
    pairs = [[t * (vocab + 1) + n for t, n in zip(s, s[1:] + [end])] for s in seqs]
    layout = pack_sequences(pairs)
    ids = layout.input_ids // (vocab + 1)
    seq_rows = torch.split(layout.sequence_rows, list(layout.sequence_lens))
    rows = torch.cat([r[:-1][torch.tensor(m[1:])] for r, m in zip(seq_rows, masks)])
    labels = torch.cat([torch.tensor(s[1:])[torch.tensor(m[1:])] for s, m in zip(seqs, masks)])
    plan, paths = [], {}
    for i, (a, b, parent) in enumerate(layout.segments):
        paths[i] = torch.cat([paths[parent] if parent >= 0 else torch.zeros(0, dtype=torch.long), torch.arange(a, b)])
        plan.append((a, b, paths[i]))
    return lambda: _run_plan(model, ids, layout.position_ids, rows, labels, plan), ids.numel()


def layout_logprobs(layout: str, model, seqs, masks):
    """-> (a function computing the log-probs of every trained token, trajectory by trajectory; tokens computed)."""
    if layout == "linear":
        return _linear(model, seqs, masks)
    if layout == "treerow":
        return _treerow(model, seqs, masks, model.config.vocab_size)
    if layout == "prompt":
        p = min(_common_prefix(seqs), *(m.index(True) for m in masks if True in m))   # the prompt: before any turn
        batch = pack_groups([(seqs[0][:p], [s[p:] for s in seqs])], [[m[p:] for m in masks]])
        return lambda: shared_prompt_logprobs(model, batch, impl="sdpa"), batch.num_tokens
    if layout == "tree":
        batch = pack_sequences(seqs, masks)
        return lambda: torch.cat(sequence_logprobs(model, batch, impl="sdpa")), batch.num_tokens
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _common_prefix(seqs) -> int:
    p = 0
    while p < min(map(len, seqs)) and all(s[p] == seqs[0][p] for s in seqs):
        p += 1
    return p


def flops(model, seqs, masks) -> dict:
    """Forward FLOPs of the linear and tree layouts: 2 x body parameters x tokens + 2 x head parameters x
    predicting rows + 4 x layers x heads x head_dim x (query, key) pairs."""
    c = model.config
    body = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    head = c.vocab_size * c.hidden_size
    attn = (4 * c.num_hidden_layers * c.num_attention_heads
            * getattr(c, "head_dim", c.hidden_size // c.num_attention_heads))
    lin_tokens = sum(map(len, seqs))
    lin = 2 * body * lin_tokens + 2 * head * sum(sum(m[1:]) for m in masks) + attn * sum(
        len(s) * (len(s) + 1) / 2 for s in seqs)
    batch = pack_sequences(seqs, masks)
    tree = 2 * body * batch.num_tokens + 2 * head * batch.logit_rows.numel() + attn * float(
        (batch.position_ids + 1).sum())
    return {"linear_flops": lin, "tree_flops": tree, "flop_ratio": lin / tree}


def update_step(fn, advantages):
    """One GRPO micro-step: forward, clipped loss on the trained tokens, backward."""
    logp = fn()
    ratio = torch.exp(logp - logp.detach())
    loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()
    loss.backward()


def _advantages(masks) -> torch.Tensor:
    per_seq = torch.randn(len(masks), generator=torch.Generator().manual_seed(1))
    return torch.repeat_interleave(per_seq, torch.tensor([sum(m[1:]) for m in masks]))


def build_model(name: str):
    from hetrl.bench.dualkv_grid import build_model as grid_model

    return grid_model(name)


def measure(model, case: TreeCase, repeats: int) -> dict:
    seqs, masks = make_tree(case, model.config.vocab_size)
    adv = _advantages(masks)
    fns, tokens = {}, {}
    for v in LAYOUTS:
        fns[v], tokens[v] = layout_logprobs(v, model, seqs, masks)
    with torch.no_grad():
        ref = fns["tree"]()
        max_diff = {v: (fn() - ref).abs().max().item() for v, fn in fns.items()}

    def upd(fn):
        def step():
            model.zero_grad(set_to_none=True)
            update_step(fn, adv)
        return step

    times = median_times({v: upd(fn) for v, fn in fns.items()}, repeats)
    return {"trajectories": len(seqs), "tokens": tokens, "trained_tokens": int(adv.numel()),
            **flops(model, seqs, masks), "update_s": times, "max_abs_logprob_diff_vs_tree": max_diff}


def measure_memory(model_name: str, case: TreeCase, jobs: int = 1) -> dict:
    """Peak RSS increase of one update step, per layout, each in a fresh interpreter, `jobs` of them at once."""
    return child_results({v: ["-m", "hetrl.bench.tree", "--child", v, model_name, json.dumps(asdict(case))]
                          for v in LAYOUTS}, jobs)


def _child(layout: str, model_name: str, case_json: str) -> None:
    spec = json.loads(case_json)
    case = TreeCase(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
    model = build_model(model_name)
    seqs, masks = make_tree(case, model.config.vocab_size)
    fn, _ = layout_logprobs(layout, model, seqs, masks)
    adv = _advantages(masks)
    print(json.dumps(peak_rss_increase(lambda: update_step(fn, adv))))


def run(quick: bool, repeats: int, memory: bool, model_name: str = "qwen3-shaped",
        max_leaves: int | None = None) -> dict:
    cases = QUICK if quick else GRID
    if max_leaves is not None:
        cases = [TreeCase(**{**asdict(c), "max_leaves": max_leaves}) for c in cases]
    model = build_model(model_name)
    rows = []
    for case in cases:
        row = {"case": case.name, **asdict(case), **measure(model, case, repeats)}
        if memory:
            row["memory"] = measure_memory(model_name, case, jobs=2 if quick else 1)
        rows.append(row)
    return {"machine": machine(), "model": model_name, "repeats": repeats, "quick": quick, "rows": rows}


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# Tree engine on agentic trees ({res['model']}, {m['cpus']} CPUs, torch {m['torch']}, "
             f"{m['torch_threads']} threads; median of {res['repeats']} interleaved rounds"
             f"{', --quick' if res['quick'] else ''})",
             "",
             "One update micro-step (forward, GRPO clipped loss on the model's tokens, backward). Speedup of `tree` "
             "over each layout; `frac` = speedup over linear / FLOP ratio (target >= 0.85). Memory: peak RSS increase "
             "of the update in a fresh process.", "",
             "| case | leaves | tokens linear / prompt / treerow / tree | FLOP ratio | "
             "update s linear / prompt / treerow / tree "
             "| speedup vs linear / prompt / treerow | frac | memory MB linear / prompt / treerow / tree |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        u, mem = r["update_s"], r.get("memory", {})
        mb = lambda v: f"{mem[v]['increase_kb'] / 1024:.0f}" if "increase_kb" in mem.get(v, {}) else "-"   # noqa: E731
        frac = u["linear"] / u["tree"] / r["flop_ratio"]
        lines.append(f"| {r['case']} | {r['trajectories']} | {' / '.join(str(r['tokens'][v]) for v in LAYOUTS)} | "
                     f"{r['flop_ratio']:.2f} | {' / '.join(f'{u[v]:.3f}' for v in LAYOUTS)} | "
                     f"{' / '.join(f'{u[v] / u[LAYOUTS[-1]]:.2f}x' for v in BASELINES)} | {frac:.2f} | "
                     f"{' / '.join(mb(v) for v in LAYOUTS)} |")
    worst = max(max(r["max_abs_logprob_diff_vs_tree"].values()) for r in res["rows"])
    lines += ["", f"Largest |log-prob difference| of any layout against `tree` before timing: {worst:.2e}."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4])
