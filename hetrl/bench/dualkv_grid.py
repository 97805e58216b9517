"""`hetrl bench dualkv`: the shared-prompt update against the layouts a user would otherwise run, side by side.

For one group (a prompt of P tokens, N responses of R tokens) on the same model and batch:

  padded     TRL's way: N rows of P+R tokens, logits only on the completion (`logits_to_keep`)
  packed     verl's way (`use_remove_padding`): one row of N(P+R) tokens, position ids restarting per
             sequence, no cache; attention per sequence (the CPU stand-in for flash-attn varlen)
  prefix_grouper  the `prefix-grouper` package, where it runs
  dualkv     hetrl `shared_prompt_logprobs(impl="sdpa")`
  reference  hetrl's oracle (the prompt duplicated, the model's own attention)

Each is timed on one policy-update micro-step (forward, GRPO clipped loss on the response tokens,
backward) and one no-grad log-prob pass, interleaved, median of the repeats after a warm-up. Peak
memory of the update is the peak RSS (VmHWM, reset just before the step) of a fresh subprocess per
variant, minus its RSS before the step: tracemalloc cannot see torch's allocations.
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from hetrl.bench.harness import child_results, machine, median_times, peak_rss_increase
from hetrl.dualkv import pack_groups, shared_prompt_logprobs

VARIANTS = ("padded", "packed", "prefix_grouper", "dualkv", "reference")
BASELINES = ("packed", "padded", "prefix_grouper")          # what a user would run instead of dualkv
QWEN3_SHAPED = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=64, intermediate_size=1536, vocab_size=32000, max_position_embeddings=8192,
                    tie_word_embeddings=False)
GRID = [(n, p, r) for n in (4, 8, 16) for p in (256, 1024, 2048) for r in (64, 256)]
QUICK = [(4, 128, 32), (8, 128, 32)]          # under 2 minutes on 2 cores, memory included
SMOLLM2_GRID = [(4, 256, 64), (8, 256, 64), (4, 1024, 64)]   # few: 135M params is slow (benchmarks/README.md)


@dataclass(frozen=True)
class Case:
    model: str
    n: int
    p: int
    r: int

    @property
    def rho(self) -> float:
        return self.n * (self.p + self.r) / (self.p + self.n * self.r)


def build_model(name: str):
    if name == "qwen3-shaped":
        torch.manual_seed(0)
        return Qwen3ForCausalLM(Qwen3Config(**QWEN3_SHAPED, attn_implementation="sdpa")).float()
    from hetrl.models import load_model

    return load_model(name)[0]


def flop_ratio(model, case: Case) -> float:
    """Forward FLOPs of the standard layout over the packed one: linear layers + causal attention."""
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)

    def attn(pairs):
        return 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs

    n, p, r = case.n, case.p, case.r
    std = 2 * params * n * (p + r) + attn(n * (p + r) ** 2 / 2)
    dkv = 2 * params * (p + n * r) + attn(p * p / 2 + n * (r * p + r * r / 2))
    return std / dkv


def make_group(case: Case, vocab: int):
    g = torch.Generator().manual_seed(case.n * 7919 + case.p * 31 + case.r)
    prompt = torch.randint(0, vocab, (case.p,), generator=g)
    return prompt, [torch.randint(0, vocab, (case.r,), generator=g) for _ in range(case.n)]


# ------------------------------------------------------------------------------------- packed (varlen)

_SEGMENTS: contextvars.ContextVar = contextvars.ContextVar("hetrl_bench_segments", default=None)


def _varlen_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention inside each packed sequence: what flash-attn varlen does on GPU."""
    bounds = _SEGMENTS.get()
    gqa = query.shape[1] != key.shape[1]
    out = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                          scale=scaling, enable_gqa=gqa) for s, e in bounds]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register("hetrl_bench_varlen", _varlen_attention)
AttentionMaskInterface.register("hetrl_bench_varlen", lambda **_: None)


def _logp(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


def variant_logprobs(variant: str, model, prompt, responses):
    """-> a function computing the [N * R] response log-probs in this variant's layout."""
    n, p, r = len(responses), prompt.numel(), responses[0].numel()
    labels = torch.stack(responses)
    if variant == "padded":
        ids = torch.cat([prompt.expand(n, p), labels], dim=1)
        return lambda: _logp(model(input_ids=ids, logits_to_keep=r + 1, use_cache=False).logits[:, :-1],
                             labels).flatten()
    if variant == "packed":
        ids = torch.cat([torch.cat([prompt, x]) for x in responses])[None]
        pos = torch.arange(p + r).repeat(n)[None]
        keep = torch.cat([torch.arange(i * (p + r) + p - 1, (i + 1) * (p + r) - 1) for i in range(n)])
        bounds = [(i * (p + r), (i + 1) * (p + r)) for i in range(n)]

        def packed():
            token = _SEGMENTS.set(bounds)
            original = model.config._attn_implementation
            model.set_attn_implementation("hetrl_bench_varlen")
            try:
                logits = model(input_ids=ids, position_ids=pos, logits_to_keep=keep, use_cache=False).logits[0]
            finally:
                model.set_attn_implementation(original)
                _SEGMENTS.reset(token)
            return _logp(logits, labels.flatten())
        return packed
    if variant == "prefix_grouper":
        return _prefix_grouper(model, prompt, responses)
    batch = pack_groups([(prompt, responses)])
    impl = "sdpa" if variant == "dualkv" else "reference"
    return lambda: shared_prompt_logprobs(model, batch, impl=impl)


def _flash_like_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """CPU stand-in for the flash-attn varlen call prefix-grouper makes: over the real (unpadded) tokens, causal
    attention aligned bottom-right (the real queries are the last of the real keys, as flash-attn >= 2.1 aligns
    them). `attention_mask` is prefix-grouper's [b, Lk] key mask; its last Lq columns are the queries' own."""
    lq, lk = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    keys = (attention_mask.bool() if attention_mask is not None
            else torch.ones(key.shape[0], lk, dtype=torch.bool, device=key.device))
    if lq == lk and bool(keys.all()):            # no padding, square: SDPA's own causal kernel (what was timed)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    queries = keys[:, lk - lq:]
    k_rank, q_rank = keys.cumsum(1) - 1, queries.cumsum(1) - 1
    offset = (keys.sum(1) - queries.sum(1))[:, None, None]
    allowed = keys[:, None, :] & (k_rank[:, None, :] <= q_rank[:, :, None] + offset)        # [b, Lq, Lk]
    allowed |= ~queries[:, :, None]            # padded query rows (dropped later) attend anything: no NaN
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed[:, None], scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("hetrl_bench_flash_like", _flash_like_sdpa)


def _prefix_grouper(model, prompt, responses):
    """The prefix-grouper package through its own transformers integration (`register_attention`: ungroup
    the packed row, repeat the prompt's K/V per response, group the outputs back). Its default inner
    attention is flash_attention_2 (the flash-attn package, CUDA only), and transformers' own `sdpa` rejects the
    [b, L] padding masks it passes, so the inner attention here is `_flash_like_sdpa`: torch SDPA with
    flash-attn's causal rule. Responses may differ in length (right-padded, as the package pads them); the
    log-probs come back response after response, [sum R]."""
    try:
        from prefix_grouper import PrefixGrouper
        from prefix_grouper.utils.register_transformers import register_attention
    except ImportError as e:
        raise RuntimeError(f"prefix-grouper is not installed ({e}); pip install prefix-grouper==0.0.1.post1") from None
    register_attention()
    AttentionMaskInterface.register("prefix_grouper_attention", lambda **_: None)
    device, p = prompt.device, prompt.numel()
    lens = [x.numel() for x in responses]
    labels = torch.zeros(len(lens), max(lens), dtype=torch.long, device=device)
    real = torch.zeros(len(lens), max(lens), dtype=torch.bool, device=device)
    for i, x in enumerate(responses):
        labels[i, :lens[i]], real[i, :lens[i]] = x, True
    pg = PrefixGrouper([[p] + lens], device=device)
    ids = pg.concat_input(prompt[None], torch.ones(1, p, dtype=torch.bool, device=device), labels, real)
    pos = torch.cat([torch.arange(p)] + [torch.arange(p, p + r) for r in lens])[None].to(device)

    def grouped():
        original = model.config._attn_implementation
        model.set_attn_implementation("prefix_grouper_attention")
        try:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False, prefix_grouper=pg,
                           prefix_grouper_attn_func="hetrl_bench_flash_like").logits
        finally:
            model.set_attn_implementation(original)
        suffix = pg.split_output(logits, include_prefix_last=1)[2]      # [n, 1 + max R, V]
        return _logp(suffix[:, :-1], labels)[real]
    return grouped


def update_step(fn, advantages):
    """One GRPO micro-step: forward, clipped loss on response tokens, backward."""
    logp = fn()
    ratio = torch.exp(logp - logp.detach())
    loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()
    loss.backward()


def measure_times(model, case: Case, repeats: int) -> dict:
    prompt, responses = make_group(case, model.config.vocab_size)
    adv = torch.repeat_interleave(torch.randn(case.n, generator=torch.Generator().manual_seed(1)), case.r)
    fns, errors = {}, {}
    for v in VARIANTS:
        try:
            fns[v] = variant_logprobs(v, model, prompt, responses)
            with torch.no_grad():
                fns[v]()
        except RuntimeError as e:
            fns.pop(v, None)
            errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"

    def upd(fn):
        def step():
            model.zero_grad(set_to_none=True)
            update_step(fn, adv)
        return step

    def lp(fn):
        def step():
            with torch.no_grad():
                fn()
        return step

    with torch.no_grad():
        ref = fns["reference"]()
        max_diff = {v: (fn() - ref).abs().max().item() for v, fn in fns.items()}
    update = median_times({v: upd(fn) for v, fn in fns.items()}, repeats)
    logprob = median_times({v: lp(fn) for v, fn in fns.items()}, repeats)
    return {"update_s": update, "logprob_s": logprob, "errors": errors, "max_abs_logprob_diff": max_diff}


def measure_memory(case: Case, jobs: int = 1) -> dict:
    """Peak RSS increase of one update step, per variant, each in a fresh interpreter, `jobs` of them at once."""
    return child_results({v: ["-m", "hetrl.bench.dualkv_grid", "--child", v, case.model, str(case.n), str(case.p),
                              str(case.r)] for v in VARIANTS}, jobs)


def _child(variant: str, model_name: str, n: int, p: int, r: int) -> None:
    case = Case(model_name, n, p, r)
    model = build_model(model_name)
    prompt, responses = make_group(case, model.config.vocab_size)
    fn = variant_logprobs(variant, model, prompt, responses)
    adv = torch.ones(n * r)
    print(json.dumps(peak_rss_increase(lambda: update_step(fn, adv))))


def all_cases(quick: bool) -> list[Case]:
    """The grid (or the quick subset), cheapest first, so that a run cut short has measured the most cases."""
    cases = [Case("qwen3-shaped", *c) for c in (QUICK if quick else GRID)]
    if not quick:
        cases += [Case("smollm2-135m", *c) for c in SMOLLM2_GRID]
    return sorted(cases, key=lambda c: (c.model != "qwen3-shaped", c.n * (c.p + c.r), c.n, c.p, c.r))


def parse_case(text: str) -> Case:
    """"16x1024x64" (Qwen3-shaped) or "smollm2-135m:8x256x64" -> Case."""
    model, _, shape = text.rpartition(":")
    try:
        n, p, r = (int(x) for x in shape.split("x"))
    except ValueError:
        raise ValueError(f"a case is NxPxR, optionally prefixed by a model (e.g. 16x1024x64, "
                         f"smollm2-135m:8x256x64), got {text!r}") from None
    model = model or "qwen3-shaped"
    if model not in ("qwen3-shaped", "smollm2-135m"):
        raise ValueError(f"case model must be qwen3-shaped or smollm2-135m, got {model!r}")
    return Case(model, n, p, r)


def _key(row: dict) -> tuple:
    return row["model"], row["n"], row["p"], row["r"]


def run(quick: bool, repeats: int, memory: bool, cases: list[Case] | None = None,
        rows_path: str | None = None) -> dict:
    """Measure `cases` (default: the grid). With `rows_path` (JSONL), each finished case is appended at once
    and cases already there (same repeats) are not measured again: a long grid can run in pieces, and an
    interrupted run loses at most the case in progress. The result holds every row of the file."""
    cases = cases or all_cases(quick)
    done: list[dict] = []
    if rows_path and os.path.exists(rows_path):
        with open(rows_path) as f:
            done = [r for r in map(json.loads, f) if r.get("repeats") == repeats]
    have = {_key(r) for r in done if set(r["update_s"]) == set(VARIANTS)}   # rows missing a variant: again
    done = [r for r in done if _key(r) in have]
    todo = [c for c in cases if (c.model, c.n, c.p, c.r) not in have]
    models = {}
    for case in tqdm(todo, desc="bench dualkv", unit="case"):
        model = models.setdefault(case.model, build_model(case.model))
        row = {**asdict(case), "rho": case.rho, "flop_ratio": flop_ratio(model, case), "repeats": repeats,
               "machine": machine(), **measure_times(model, case, repeats)}
        if memory:
            row["memory"] = measure_memory(case, jobs=2 if quick else 1)   # the grid's largest need 1 at a time
        done.append(row)
        if rows_path:
            with open(rows_path, "a") as f:
                f.write(json.dumps(row) + "\n")
    grid = {(c.model, c.n, c.p, c.r) for c in all_cases(quick)}
    rows = sorted(done, key=lambda r: (r["model"] != "qwen3-shaped", r["n"], r["p"], r["r"]))
    return {"machine": machine(), "repeats": repeats, "rows": rows,
            "grid_cases": len(grid), "grid_cases_measured": len(grid & {_key(r) for r in rows})}


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# DualKV on CPU, side by side ({m['cpus']} CPUs, torch {m['torch']}, {m['torch_threads']} threads; "
             f"median of {res['repeats']} interleaved rounds)", ""]
    if res.get("grid_cases_measured", 0) < res.get("grid_cases", 0):
        lines += [f"**Partial: {res['grid_cases_measured']} of the {res['grid_cases']} grid cases measured so far** "
                  "(`hetrl bench dualkv --out benchmarks/results` measures the rest and keeps these).", ""]
    lines += [
             "Update = forward + GRPO clipped loss + backward of one group; speedups are over `packed` (verl's way), "
             "`padded` (TRL's way) and `prefix-grouper` (the prefix-grouper 0.0.1.post1 package through its own "
             "transformers integration; its inner attention here is torch SDPA with flash-attn's causal rule, as its "
             "default flash_attention_2 needs CUDA); memory = peak RSS increase of the update in a fresh process. "
             "Every row's log-probs were checked against hetrl's reference before timing "
             "(`max_abs_logprob_diff` in the JSON).", "",
             "| model | N | P | R | rho | FLOP ratio | update s: packed / padded / prefix-grouper / dualkv | "
             "update speedup vs packed / padded / prefix-grouper | "
             "log-prob speedup vs packed / padded / prefix-grouper | "
             "update memory MB: packed / padded / prefix-grouper / dualkv |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        u, lp = r["update_s"], r["logprob_s"]
        mem = r.get("memory", {})

        def mb(v):
            return f"{mem[v]['increase_kb'] / 1024:.0f}" if v in mem and "increase_kb" in mem[v] else "-"

        def sec(t):
            return " / ".join(f"{t[v]:.3f}" if v in t else "-" for v in BASELINES + ("dualkv",))

        def speedups(t):
            return " / ".join(f"{t[v] / t['dualkv']:.2f}x" if v in t else "-" for v in BASELINES)

        lines.append(f"| {r['model']} | {r['n']} | {r['p']} | {r['r']} | {r['rho']:.2f} | {r['flop_ratio']:.2f} | "
                     f"{sec(u)} | {speedups(u)} | {speedups(lp)} | "
                     f"{' / '.join(mb(v) for v in BASELINES + ('dualkv',))} |")
    lines += checks(res["rows"])
    errors = {v: e for r in res["rows"] for v, e in r["errors"].items()}
    for v, e in errors.items():
        lines.append(f"\n`{v}` did not run: {e}")
    return "\n".join(lines) + "\n"


TARGET_CASE = ("qwen3-shaped", 16, 1024, 64)     # update speedup over packed >= 0.8 x the FLOP ratio here
MEMORY_CASE = ("qwen3-shaped", 16, 2048, 256)    # update memory increase <= 1.3 / rho of packed's here


def checks(rows: list[dict]) -> list[str]:
    """The DualKV CPU issue's acceptance list, computed from the measured rows."""
    if not rows:
        return []

    def ok(cond):
        return "met" if cond else "**not met**"

    out = ["", "## Against the targets", ""]
    target = next((r for r in rows if _key(r) == TARGET_CASE), None)
    if target:
        frac = target["update_s"]["packed"] / target["update_s"]["dualkv"] / target["flop_ratio"]
        out.append(f"- Update speedup over packed at N=16, P=1024, R=64 = {frac:.2f} x the FLOP ratio "
                   f"({target['flop_ratio']:.2f}); target >= 0.8: {ok(frac >= 0.8)}.")
    for phase, name in (("update_s", "Update"), ("logprob_s", "Log-prob pass")):
        for base in BASELINES:
            have = [r for r in rows if base in r[phase] and "dualkv" in r[phase]]
            if not have:
                continue
            worst = min(have, key=lambda r: r[phase][base] / r[phase]["dualkv"])
            x = worst[phase][base] / worst[phase]["dualkv"]
            out.append(f"- {name} faster than {base} in {sum(r[phase][base] > r[phase]['dualkv'] for r in have)} of "
                       f"{len(have)} cases; smallest speedup {x:.2f}x ({worst['model']} {worst['n']}x{worst['p']}x"
                       f"{worst['r']}): {ok(x >= 1.0)}.")
    mem = next((r for r in rows if _key(r) == MEMORY_CASE and "memory" in r), None)
    if mem and all("increase_kb" in mem["memory"].get(v, {}) for v in ("packed", "dualkv")):
        ratio = mem["memory"]["dualkv"]["increase_kb"] / mem["memory"]["packed"]["increase_kb"]
        out.append(f"- Update memory at N=16, P=2048, R=256: dualkv / packed increase = {ratio:.3f}, target <= "
                   f"1.3 / rho = {1.3 / mem['rho']:.3f}: {ok(ratio <= 1.3 / mem['rho'])}.")
    over = [r for r in rows
            if "memory" in r and all("increase_kb" in r["memory"].get(v, {}) for v in ("packed", "dualkv"))
            and r["memory"]["dualkv"]["increase_kb"] > r["memory"]["packed"]["increase_kb"]]
    if over:
        out.append("- Update memory above packed's (not a target; for the record): " + ", ".join(
            f"{r['n']}x{r['p']}x{r['r']} "
            f"({r['memory']['dualkv']['increase_kb'] / r['memory']['packed']['increase_kb']:.2f}x)"
            for r in over) + ".")
    return out


def plot(res: dict, path: str) -> None:
    """Measured update speedup over `packed` and `padded` against the FLOP ratio, with the y = x ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    x = [r["flop_ratio"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for base, marker in zip(BASELINES, "osD"):
        have = [r for r in rows if base in r["update_s"]]
        ax.scatter([r["flop_ratio"] for r in have], [r["update_s"][base] / r["update_s"]["dualkv"] for r in have],
                   marker=marker, label=f"update speedup over {base}")
    top = max(x + [1.0]) * 1.1
    ax.plot([1, top], [1, top], "k--", lw=1, label="y = FLOP ratio")
    ax.axhline(1.0, color="k", lw=0.8, alpha=0.5)
    ax.plot([1, top], [0.8, 0.8 * top], ":", color="gray", lw=1, label="0.8 x FLOP ratio")
    ax.set_xlabel("FLOP ratio (standard / shared-prompt)")
    ax.set_ylabel("measured speedup")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], *map(int, sys.argv[4:7]))
