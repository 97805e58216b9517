"""Why the gathered log-softmax (hetrl.dualkv.api._GatheredLogSoftmax) works through cache-sized row chunks: against
the whole-matrix passes it replaced, side by side in one run; result: benchmarks/results/logsoftmax_chunks.md.

    python -m benchmarks.studies.logsoftmax_chunks [--rounds 7] [--out benchmarks/results]

Forward + backward with entropy (what each update micro-batch runs) over [U, V] logits at the default job's size
(U = 1300 rows: its packed tokens per update; V = 49,152: SmolLM2's vocabulary; temperature 0.7), in fp32 and
with bf16 logits (a bf16-mixed run's), and at U = 4096. The baseline is the previous implementation, kept here
verbatim as `WholeMatrix` (the logits promoted to fp32 as a whole, each elementwise pass over all [U, V]).
Interleaved rounds, the first dropped as warm-up, medians; both checked against an fp64 reference.
"""

from __future__ import annotations

import argparse

import torch

from hetrl.bench.harness import interleaved_times, machine, revision, spread, utc_now, write_results


class WholeMatrix(torch.autograd.Function):
    """The previous _GatheredLogSoftmax (before the row chunks), for comparison."""

    @staticmethod
    def forward(ctx, z, row_of_label, labels, temperature: float, with_entropy: bool):
        zt = z / temperature if temperature != 1.0 else z
        lse = torch.logsumexp(zt, dim=-1)
        logp = zt[row_of_label, labels] - lse[row_of_label]
        entropy = lse - (torch.exp(zt - lse[:, None]) * zt).sum(-1) if with_entropy else lse.new_empty(0)
        ctx.save_for_backward(z, row_of_label, labels, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        z, row_of_label, labels, lse = ctx.saved_tensors
        t = ctx.temperature
        g_row = torch.zeros_like(lse).index_add_(0, row_of_label, grad_logp)
        dz = torch.sub(z / t if t != 1.0 else z, lse[:, None]).exp_().mul_(-g_row[:, None])
        dz.index_put_((row_of_label, labels), grad_logp, accumulate=True)
        if t != 1.0:
            dz.div_(t)
        return dz, None, None, None, None


def old(z, rows, labels, t):
    """As the previous _token_logprobs called it: bf16 logits promoted to fp32 first."""
    return WholeMatrix.apply(z.to(torch.promote_types(z.dtype, torch.float32)), rows, labels, t, True)


def new(z, rows, labels, t):
    from hetrl.dualkv.api import _GatheredLogSoftmax

    return _GatheredLogSoftmax.apply(z, rows, labels, t, True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    from hetrl.dualkv.api import CACHE_CHUNK_BYTES

    res = {"revision": revision(), "date": utc_now(), "machine": machine(),
           "chunk_bytes": CACHE_CHUNK_BYTES, "rounds": args.rounds, "cases": []}
    v, t = 49152, 0.7
    for u, dtype in ((1300, torch.float32), (1300, torch.bfloat16), (4096, torch.float32)):
        g = torch.Generator().manual_seed(u)
        z = (torch.randn(u, v, generator=g) * 3).to(dtype).requires_grad_(True)
        rows = torch.arange(u)
        labels = torch.randint(0, v, (u,), generator=g)
        fns = {"whole matrix": old, "row chunks": new}

        def step(fn):
            z.grad = None
            logp, _ = fn(z, rows, labels, t)
            logp.sum().backward()
            return logp

        errs = {}   # the warm-up round: each variant against an fp64 reference
        for name, fn in fns.items():
            logp = step(fn)
            z64 = z.detach().double().requires_grad_(True)
            ref = torch.log_softmax(z64 / t, -1)[rows, labels]
            ref.sum().backward()
            errs[name] = {"logp": (logp.double() - ref.detach()).abs().max().item(),
                          "grad": (z.grad.double() - z64.grad).abs().max().item()}
        times = interleaved_times({name: lambda fn=fn: step(fn) for name, fn in fns.items()}, args.rounds, warmup=0)
        case = {"rows": u, "vocab": v, "dtype": str(dtype).removeprefix("torch."), "errors_vs_fp64": errs,
                **{name: {**spread(ts), "times": ts} for name, ts in times.items()}}
        res["cases"].append(case)
        print(u, case["dtype"], {k: round(case[k]["median_s"], 3) for k in times}, flush=True)

    lines = ["# The gathered log-softmax: cache-sized row chunks against whole-matrix passes", "",
             f"`python -m benchmarks.studies.logsoftmax_chunks` at {res['revision']}, {res['date']}: "
             f"{res['machine']['model']}, "
             f"{res['machine']['torch_threads']} threads, torch {res['machine']['torch']}. Forward + backward with "
             f"entropy, temperature {t}; chunks of {CACHE_CHUNK_BYTES >> 20} MiB of fp32 rows; median of "
             f"{args.rounds} interleaved rounds after one warm-up. Errors: the largest absolute difference from an "
             "fp64 reference (log-probs; gradient).", "",
             "| rows x vocab | logits | whole matrix s | row chunks s | chunks / whole | error whole | error chunks |",
             "|---|---|---:|---:|---:|---|---|"]
    for c in res["cases"]:
        w, k = c["whole matrix"]["median_s"], c["row chunks"]["median_s"]
        e = c["errors_vs_fp64"]

        def err(x):
            return f"{x['logp']:.1e}; {x['grad']:.1e}"

        lines.append(f"| {c['rows']} x {c['vocab']} | {c['dtype']} | {w:.3f} | {k:.3f} | {k / w:.2f}x | "
                     f"{err(e['whole matrix'])} | {err(e['row chunks'])} |")
    write_results(args.out, "logsoftmax_chunks", res, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
