"""Operator tables for the cost model, measured on this machine's device (the GPU issue's stage d).

    python -m hetrl.bench.operators --device cuda --out DIR [--budget-s 90] [--models qwen3-8b ...] [--quick]

One row per measurement, each naming its source (this device, the torch version, the date): dense GEMM seconds
by (M, N, K) at the projection shapes of the planner's model presets (qkv, o, gate+up, down), M from 1 to 16K
tokens; attention (SDPA) by batch x context for decode (one query token), by length for prefill (causal) and
for training (`attention_train`: causal forward + backward; `rate` counts 3x the forward's FLOPs); an MoE layer's
routed experts (`moe_layer`: top-k routing, the tokens sorted by expert, gate+up and down as `torch._grouped_mm`,
the weighted sum back) at the MoE presets' shapes by tokens; a device-to-device copy's bandwidth; and the HF decode
step (`decode_step`: one new token per row over a DynamicCache, eager, as hetrl's own rollout loop runs it, on
config:qwen2.5-1.5b with random weights; `k` its hidden size, `rate` rows per second) by batch x context. An
attention shape two models share is measured once. Written as operators_DEVICE.csv (the catalog's table form,
hetrl.planner.optables.FIELDS) and .json; on a catalog GPU the rows that price what an inference engine runs
(`engine_rows`: CUDA-graph GEMMs of whole series) also as hetrl-measured_GPU.csv, which the cost model loads from a
folder named by HETRL_OPERATOR_TABLES ahead of the published tables, series by series. Rows are measured cheapest
first and the stage stops at `budget_s`, keeping every row it finished. Random inputs (never zeros), a warm-up pass
first, the median of `repeats` passes.

A row's time is one kernel's, not one launch's: each pass runs the operator CALLS times back to back over inputs
rotated through enough copies that together exceed any catalog GPU's L2 cache (ROTATE_BYTES; a model's layers read
different weights, so a decode GEMM must not find its weight in L2), between two CUDA events, and the row is the
pass over CALLS. On CUDA the pass is captured once as a CUDA graph and replayed, as an inference engine's decode
runs, so no host launch sits inside the time; an operator that syncs with the host (the MoE layer's routing) is
launched back to back instead. Each row's source says which. (The first lent GPU timed one call between two events:
small GEMMs read 37-46 us where Vidur's H100 profile reads 16-30 us, the wait for Python to launch them;
benchmarks/results/gpu/h100-2026-11-28/README.md.)

Hand-written because no library measures these tables in this form: Vidur's profiler (the cost model's published
source) needs its own GPU setup and Sarathi's kernels; this is its minimal subset on plain torch.
"""

from __future__ import annotations

import argparse
import csv
import json
import pathlib
import statistics
import time

import torch

from hetrl.bench.harness import machine, seconds, utc_now
from hetrl.planner import optables
from hetrl.planner.catalog import device_type
from hetrl.planner.spec import PRESETS

FIELDS = optables.FIELDS   # the catalog's table form: a CUDA run's file can go into HETRL_OPERATOR_TABLES as it is
TOKENS = (1, 8, 64, 256, 1024, 4096, 16384)
DECODE = ((1, 1024), (8, 1024), (32, 2048), (64, 4096), (128, 8192), (256, 8192))   # (batch, context)
PREFILL = (512, 2048, 8192, 16384)
QUICK = dict(tokens=(1, 8, 32), decode=((1, 64), (4, 128)), prefill=(64, 128))
# the HF decode step (hetrl's own rollout loop, eager): (batch, context) on a config-built model of a real shape
DECODE_STEP = ((1, 512), (8, 512), (32, 512), (64, 512), (64, 2048))
DECODE_STEP_MODEL = "qwen2.5-1.5b"
QUICK_DECODE_STEP = ((2, 16),)
QUICK_DECODE_STEP_MODEL = "tiny"      # hetrl.models.tiny_model: a smoke run's
DECODE_STEPS = 8   # decode steps per timed pass (the cache grows by them: negligible against the context)
QUICK_MOE = (8, 32, 64, 2)   # experts, intermediate, hidden, top-k: a CPU smoke run's MoE layer
# a CPU smoke run's GEMMs: small, as a CPU without bf16 instructions runs a real shape's bf16 GEMM ~150x slower
QUICK_GEMMS = (("quick", 256, 128), ("quick", 128, 256))


def gemm_shapes(models: list[str], tp: int = 1) -> list[tuple[str, int, int]]:
    """(what, N, K) of every projection of `models` (planner presets) at tensor-parallel degree `tp`."""
    out = []
    for name in models:
        m = PRESETS[name]
        q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
        out += [(f"{name} qkv", (q + 2 * kv) // tp, m.hidden), (f"{name} o", m.hidden, q // tp),
                (f"{name} gate_up", 2 * m.intermediate // tp, m.hidden), (f"{name} down", m.hidden,
                                                                          m.intermediate // tp)]
    return out


CALLS = 8                   # calls per timed pass, at least
ROTATE_BYTES = 256 << 20    # inputs rotated per pass: more than any catalog GPU's L2 (H100 50 MiB, B200 126 MiB)
MAX_COPIES = 64
GRAPHED = "CUDA graph"      # a row's source says so when its pass was captured and replayed (engine_rows keeps those)


def copies_for(nbytes: int) -> int:
    """How many copies of inputs of `nbytes` a pass rotates through so that together they exceed ROTATE_BYTES."""
    return max(1, min(MAX_COPIES, -(-ROTATE_BYTES // max(1, nbytes))))


def _per_call(calls: list, device: torch.device, repeats: int, graph: bool = True) -> tuple[float, str]:
    """-> (seconds of one call, how it was timed): `calls` (closures, each over its own inputs) run back to back,
    on CUDA repeated to at least CALLS per pass; the median over `repeats` passes of a pass's time over its calls.
    On CUDA with `graph` the pass is captured as a CUDA graph and replayed; where capture fails, or without
    `graph`, the calls are launched back to back. On a CPU, where a call returns when its work is done, a pass is
    the calls given (no launch to amortise)."""
    if device.type == "cuda":
        calls = [calls[i % len(calls)] for i in range(max(CALLS, len(calls)))]

    def run_pass():
        for f in calls:
            f()

    how = f"{len(calls)} calls back to back"
    run_pass()   # warm-up (and any lazy initialisation)
    if device.type == "cuda" and graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):     # warm-up on a side stream, as torch.cuda.graph asks
                run_pass()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                run_pass()
            run_pass, how = g.replay, f"a {GRAPHED} of {len(calls)} calls"
            run_pass()
        except RuntimeError:
            torch.cuda.synchronize()
    return statistics.median(seconds(run_pass, device) for _ in range(repeats)) / len(calls), how


def moe_layer(x, router, w13, w2, topk: int):
    """One MoE layer's routed experts as a grouped kernel runs them: top-k of the router's softmax, the (token,
    expert) pairs sorted by expert, gate+up and down as `torch._grouped_mm` over the experts' row ranges, SiLU-gated,
    weighted and summed back per token."""
    e = w13.shape[0]
    weights, experts = torch.softmax(x @ router, dim=-1, dtype=torch.float32).topk(topk, dim=-1)
    order = experts.flatten().argsort()
    token = order // topk
    offs = torch.bincount(experts.flatten(), minlength=e).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x[token], w13, offs)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2, offs)
    out = torch.zeros_like(x)
    out.index_add_(0, token, (y.float() * weights.flatten()[order, None]).to(x.dtype))
    return out


def _decode_model(name: str, dev: torch.device, dtype: torch.dtype):
    """config:`name` (hetrl.models.SHAPES), or the tiny test model, with random weights, built on `dev` in `dtype`,
    in eval mode."""
    from hetrl.models import config_model, tiny_model, tiny_tokenizer

    if name == "tiny":
        return tiny_model(tiny_tokenizer(), dtype).to(dev).eval()
    return config_model(name, tiny_tokenizer(), dtype, device=dev).eval()


def decode_step_s(model, batch: int, context: int, dev: torch.device, repeats: int, g) -> tuple[float, str]:
    """Seconds of one HF decode step (the model's forward of one new token per row over a DynamicCache, eager, as
    hetrl's own rollout loop runs it) at `batch` rows of `context` cached tokens: the median over `repeats` passes
    of DECODE_STEPS steps each, after a prefill and one untimed step."""
    vocab = model.config.vocab_size
    with torch.no_grad():
        ids = torch.randint(vocab, (batch, context), device=dev, generator=g)
        cache = model(input_ids=ids, use_cache=True).past_key_values
        token = torch.randint(vocab, (batch, 1), device=dev, generator=g)

        def one_pass():
            for _ in range(DECODE_STEPS):
                model(input_ids=token, past_key_values=cache, use_cache=True)
        model(input_ids=token, past_key_values=cache, use_cache=True)
        times = [seconds(one_pass, dev) / DECODE_STEPS for _ in range(repeats)]
    return statistics.median(times), f"{DECODE_STEPS} eager steps launched back to back"


def moe_shapes(models: list[str], quick: bool) -> list[tuple[int, int, int, int]]:
    """(experts, intermediate, hidden, top-k) of the MoE presets among `models` (TP 1)."""
    if quick:
        return [QUICK_MOE]
    return [(PRESETS[n].experts, PRESETS[n].moe_intermediate, PRESETS[n].hidden, PRESETS[n].experts_per_token)
            for n in models if PRESETS[n].experts]


def measure(device: str, out: str | pathlib.Path, models: list[str], budget_s: float, repeats: int = 5,
            dtype: torch.dtype = torch.bfloat16, quick: bool = False,
            moe_models: list[str] = ("qwen3-30b-a3b",)) -> dict:
    """Measure until `budget_s`; -> {"rows": [...], "stopped": bool, ...}, also written to out/operators_DEVICE.*"""
    t_end = time.monotonic() + budget_s
    dev = torch.device(device)
    source = f"measured: {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}, torch " \
             f"{torch.__version__}, {utc_now()}"
    name = str(dtype).removeprefix("torch.")
    rows: list[dict] = []
    tokens, decode, prefill = (QUICK["tokens"], QUICK["decode"], QUICK["prefill"]) if quick else (TOKENS, DECODE,
                                                                                                 PREFILL)
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    def row(how: str, **kw):
        rows.append({k: kw.get(k) for k in FIELDS} | {"dtype": kw.get("dtype", name), "source": f"{source}; {how}"})

    def timed(nbytes: int, make, graph: bool = True) -> tuple[float, str]:
        """Seconds of one call over fresh inputs: `make()` -> a closure over its own inputs of about `nbytes`. On a
        CPU one copy: its rows price nothing (the cost model measures CPU cores whole), and rotating 64 copies of a
        smoke run's small inputs only made the smoke run slow."""
        copies = copies_for(nbytes) if dev.type == "cuda" else 1
        return _per_call([make() for _ in range(copies)], dev, repeats, graph)

    jobs = []
    a = torch.randn(1 << (16 if quick else 28), device=dev, generator=g)   # 256 KiB or 1 GiB of fp32
    b = torch.empty_like(a)

    def copy():
        s, how = _per_call([lambda: b.copy_(a)], dev, repeats)
        row(op="copy", dtype="float32", seconds=s, rate=2 * a.numel() * 4 / s, how=how)
    jobs.append(copy)
    for what, n, k in (QUICK_GEMMS if quick else gemm_shapes(models)):
        for m in tokens:
            def gemm(m=m, n=n, k=k):
                x = rand(m, k)

                def make():
                    w = rand(k, n)
                    return lambda: x @ w
                s, how = timed(k * n * 2, make)
                row(op="gemm", m=m, n=n, k=k, seconds=s, rate=2 * m * n * k / s, how=how)
            jobs.append(gemm)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen_attention = set()
    for name_ in models:
        p = PRESETS[name_]
        if (p.heads, p.kv_heads, p.head_dim) in seen_attention:   # qwen3-8b and qwen3-4b share theirs
            continue
        seen_attention.add((p.heads, p.kv_heads, p.head_dim))
        for batch, ctx in decode:
            def attn_decode(batch=batch, ctx=ctx, p=p):
                def make():
                    q = rand(batch, p.heads, 1, p.head_dim)
                    k, v = rand(batch, p.kv_heads, ctx, p.head_dim), rand(batch, p.kv_heads, ctx, p.head_dim)
                    return lambda: sdpa(q, k, v, enable_gqa=True)
                kv_bytes = 2 * batch * ctx * p.kv_heads * p.head_dim * 2
                s, how = timed(kv_bytes, make)
                row(op="attention_decode", batch=batch, context=ctx, heads=p.heads, kv_heads=p.kv_heads,
                    head_dim=p.head_dim, seconds=s, rate=kv_bytes / s, how=how)
            jobs.append(attn_decode)
        for length in prefill:
            def attn_prefill(length=length, p=p):
                def make():
                    q = rand(1, p.heads, length, p.head_dim)
                    k, v = rand(1, p.kv_heads, length, p.head_dim), rand(1, p.kv_heads, length, p.head_dim)
                    return lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True)
                s, how = timed(2 * length * (p.heads + 2 * p.kv_heads) * p.head_dim, make)
                row(op="attention_prefill", batch=1, context=length, heads=p.heads, kv_heads=p.kv_heads,
                    head_dim=p.head_dim, seconds=s, rate=2 * 2 * p.heads * p.head_dim * length * length / 2 / s,
                    how=how)
            jobs.append(attn_prefill)
        for length in prefill:
            def attn_train(length=length, p=p):
                def make():
                    q = rand(1, p.heads, length, p.head_dim).requires_grad_()
                    k = rand(1, p.kv_heads, length, p.head_dim).requires_grad_()
                    v = rand(1, p.kv_heads, length, p.head_dim).requires_grad_()
                    grad = rand(1, p.heads, length, p.head_dim)

                    def fwd_bwd():
                        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
                        return torch.autograd.grad(out, (q, k, v), grad)
                    return fwd_bwd
                # autograd's backward is launched back to back (not captured); its kernels take milliseconds
                s, how = timed(2 * length * (p.heads + 2 * p.kv_heads) * p.head_dim, make, graph=False)
                fwd = 2 * 2 * p.heads * p.head_dim * length * length / 2
                row(op="attention_train", batch=1, context=length, heads=p.heads, kv_heads=p.kv_heads,
                    head_dim=p.head_dim, seconds=s, rate=3 * fwd / s, how=how)
            jobs.append(attn_train)
    for e, f, h, topk in moe_shapes(list(moe_models), quick):
        for m in tokens:
            def moe(m=m, e=e, f=f, h=h, topk=topk):
                x, router = rand(m, h), rand(h, e)

                def make():
                    w13, w2 = rand(e, h, 2 * f) / h ** 0.5, rand(e, f, h) / f ** 0.5
                    return lambda: moe_layer(x, router, w13, w2, topk)
                # routing syncs with the host (bincount): launched back to back, not captured
                s, how = timed(e * 3 * f * h * 2, make, graph=False)
                row(op="moe_layer", m=m, n=f, k=h, experts=e, topk=topk, tp=1, seconds=s,
                    rate=2 * m * topk * 3 * f * h / s, how=how)
            jobs.append(moe)
    model_name = QUICK_DECODE_STEP_MODEL if quick else DECODE_STEP_MODEL
    # a CPU smoke run's decode step in fp32 (bf16 without bf16 instructions is emulated, ~150x slower)
    step_dtype = torch.float32 if quick else dtype
    held: dict = {}
    for batch, ctx in (QUICK_DECODE_STEP if quick else DECODE_STEP):
        def decode_step(batch=batch, ctx=ctx):
            import transformers

            if "model" not in held:     # built once, on the device, by the first of these rows
                held["model"] = _decode_model(model_name, dev, step_dtype)
            s, how = decode_step_s(held["model"], batch, ctx, dev, repeats, g)
            c = held["model"].config
            row(op="decode_step", dtype=str(step_dtype).removeprefix("torch."), batch=batch, context=ctx,
                heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads, k=c.hidden_size, seconds=s, rate=batch / s,
                how=f"{how}, {model_name} (random weights), transformers {transformers.__version__}")
        jobs.append(decode_step)
    stopped = False
    for job in jobs:
        if time.monotonic() > t_end:
            stopped = True
            break
        job()
    res = {"device": device, "dtype": name, "models": models, "machine": machine(), "when": utc_now(),
           "stopped_at_budget": stopped, "rows_done": len(rows), "rows_planned": len(jobs), "rows": rows}
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"operators_{dev.type}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    (out / f"operators_{dev.type}.json").write_text(json.dumps(res, indent=1))
    priced = engine_rows(rows, tokens)
    if dev.type == "cuda" and priced and (name := device_type(torch.cuda.get_device_name(dev))):
        # the rows that price the engine's kernels, named as the cost model loads them (HETRL_OPERATOR_TABLES)
        with open(out / f"hetrl-measured_{name}.csv", "w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(priced)
    return res


def engine_rows(rows: list[dict], tokens=TOKENS) -> list[dict]:
    """The rows that price an inference engine's kernels as it runs them, for the cost model's tables: GEMMs (the
    engine's are cuBLAS's too) timed as a CUDA graph (as the engine replays its decode steps), of a shape measured at
    every M in `tokens` (a shape the budget cut part-way would hold its largest measured M's efficiency up to 16K).
    Not these: decode attention here is contiguous SDPA, not the engine's paged kernel (the decode-attention table's);
    the MoE layer is torch's grouped GEMMs, not the engine's fused kernel (vllm-fused-moe); prefill and training
    attention and the HF decode step price nothing. They stay in operators_DEVICE.csv, to compare."""
    graphed = [r for r in rows if r["op"] == "gemm" and GRAPHED in r["source"]]
    ms: dict[tuple, set] = {}
    for r in graphed:
        ms.setdefault(optables.series_of(r), set()).add(r["m"])
    return [r for r in graphed if ms[optables.series_of(r)] >= set(tokens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=90.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-4b"], choices=sorted(PRESETS))
    ap.add_argument("--moe-models", nargs="*", default=["qwen3-30b-a3b"],
                    choices=sorted(n for n, p in PRESETS.items() if p.experts))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a CPU smoke run)")
    args = ap.parse_args()
    res = measure(args.device, args.out, args.models, args.budget_s, args.repeats, quick=args.quick,
                  moe_models=args.moe_models)
    print(f"operators: {res['rows_done']} of {res['rows_planned']} rows on {args.device}"
          + (" (stopped at the budget)" if res["stopped_at_budget"] else ""))


if __name__ == "__main__":
    main()
