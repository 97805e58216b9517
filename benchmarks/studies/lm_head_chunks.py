"""Why the LM head and log-softmax run in row chunks (#20 item 3: "[tokens x vocab] logits never exist whole; measure
the memory"): at Qwen's 151,936-token vocabulary, against the same pass with the logits whole, side by side; results:
benchmarks/results/lm_head_chunks.md and lm_head_chunks_checkpointing.md.

    python -m benchmarks.studies.lm_head_chunks [--response-tokens 2048] [--rounds 2] [--checkpointing]

The model is `config:qwen2.5-0.5b` (Qwen2.5-0.5B's architecture, random weights, fp32; vocabulary 151,936, tied
embeddings). One group: a 256-token prompt and 8 responses of response-tokens / 8 tokens. Each measurement is a
fresh process that loads the model, then runs `shared_prompt_logprobs` forward, a weighted sum and backward; the
peak RSS increase over the loaded model (VmHWM reset before the pass: hetrl.bench.harness.reset_peak_rss) is the pass's
memory. `whole`: the chunking threshold (api.CHUNK_LOGITS_ABOVE_BYTES) raised above these logits, so the head runs
on all rows at once. Rounds interleave the two.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import subprocess
import sys

from hetrl.bench.harness import machine, revision, seconds, utc_now, write_results

ROOT = pathlib.Path(__file__).resolve().parents[2]

MODEL = "config:qwen2.5-0.5b"


def child(variant: str, response_tokens: int, checkpointing: bool) -> None:
    import torch

    from hetrl.bench.harness import reset_peak_rss, status_kb
    from hetrl.dualkv import api, pack_groups, shared_prompt_logprobs
    from hetrl.models import load_model

    model, _ = load_model(MODEL)
    if checkpointing:         # activations of one layer: what is left is mostly the head's
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    if variant == "whole":
        api.CHUNK_LOGITS_ABOVE_BYTES = 1 << 62
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 150000, (256,), generator=g).tolist()
    responses = [torch.randint(100, 150000, (response_tokens // 8,), generator=g).tolist() for _ in range(8)]
    batch = pack_groups([(prompt, responses)])
    resident = reset_peak_rss()

    def update():
        logp = shared_prompt_logprobs(model, batch, impl="sdpa")
        (logp * torch.linspace(0.5, 1.5, logp.numel())).sum().backward()

    took = seconds(update)
    print(f"RESULT {variant} {status_kb('VmHWM') - resident} {took:.2f} {batch.labels.numel()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--response-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on in both variants")
    ap.add_argument("--child", nargs=2, metavar=("VARIANT", "TOKENS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.checkpointing)
        return 0
    from hetrl.dualkv import api

    runs = {"chunked": [], "whole": []}
    labels = 0
    for _ in range(args.rounds):
        for variant in runs:
            out = subprocess.run([sys.executable, "-m", "benchmarks.studies.lm_head_chunks", "--child", variant,
                                  str(args.response_tokens)]
                                 + (["--checkpointing"] if args.checkpointing else []),
                                 capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT")), None)
            if line is None:
                raise RuntimeError(f"{variant} failed:\n{out.stderr[-2000:]}")
            _, _, kb, seconds, labels = line.split()
            runs[variant].append({"peak_increase_mb": int(kb) / 1024, "seconds": float(seconds)})
            print(variant, runs[variant][-1], flush=True)
    logits_mb = int(labels) * 151936 * 4 / 2**20
    res = {"revision": revision(), "date": utc_now(), "machine": machine(),
           "model": MODEL, "checkpointing": args.checkpointing, "response_tokens": int(labels),
           "fp32_logits_mb": logits_mb,
           "chunk_above_bytes": api.CHUNK_LOGITS_ABOVE_BYTES, "chunk_bytes": api.CHUNK_BYTES, "runs": runs}
    med = {k: statistics.median(r["peak_increase_mb"] for r in v) for k, v in runs.items()}
    sec = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    lines = ["# The LM head in row chunks at a 151,936-token vocabulary: the pass's memory", "",
             f"`python -m benchmarks.studies.lm_head_chunks` at {res['revision']}, {res['date']}: "
             f"{res['machine']['model']}, "
             f"{res['machine']['torch_threads']} threads, torch {res['machine']['torch']}. {MODEL} (fp32), one group "
             f"of a 256-token prompt and 8 responses, {labels} response tokens: their fp32 logits would be "
             f"{logits_mb:.0f} MiB whole; activation checkpointing "
             f"{'on' if args.checkpointing else 'off'}; head chunks of {api.CHUNK_BYTES >> 20} MiB of logits. "
             "Forward + backward of shared_prompt_logprobs in a fresh process per run; "
             f"peak RSS increase over the loaded model; {args.rounds} interleaved rounds, medians.", "",
             "| head | peak increase MiB (runs) | median MiB | seconds (median) |", "|---|---|---:|---:|"]
    for k, v in runs.items():
        each = ", ".join(f"{r['peak_increase_mb']:.0f}" for r in v)
        lines.append(f"| {k} | {each} | {med[k]:.0f} | {sec[k]:.1f} |")
    lines += ["", f"chunked / whole: {med['chunked'] / med['whole']:.2f}x of the memory, "
              f"{sec['chunked'] / sec['whole']:.2f}x of the time."]
    name = "lm_head_chunks" + ("_checkpointing" if args.checkpointing else "")
    write_results(args.out, name, res, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
