"""Where the `long` case of `hetrl bench train` spends its time on this CPU, to judge whether issue #17's 1/6 target
was reachable here; result: benchmarks/results/long_case_profile.md.

The rollout split into
prefill and decode with torch.profiler's top operators, the decode's projection matmuls alone (weights streamed
from memory as in decode, 16 and 64 rows, fp32 and bf16), and one long group's update pass (forward + backward)
with its top operators. Numbers for the note on whether the 1/6 target is reachable here; nothing is asserted.

    python -m benchmarks.studies.long_case_profile --out benchmarks/results
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from benchmarks.studies.rollout import cases
from hetrl.bench.harness import interleaved_times, machine, matmul_gflops, timed, write_results
from hetrl.dualkv.api import shared_prompt_logprobs
from hetrl.dualkv.packing import pack_groups
from hetrl.models import load_model
from hetrl.trainer.rollout import RolloutWorker


def top_ops(prof, n: int = 8) -> list[dict]:
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    total = sum(e.self_cpu_time_total for e in prof.key_averages())
    return [{"op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total,
             "calls": e.count, "gflops": e.flops / e.self_cpu_time_total / 1e3 if e.flops else None} for e in rows]


def op_line(o: dict) -> str:
    return (f"- {o['op']}: {o['self_s']:.2f} s ({o['share']:.0%}), {o['calls']} calls"
            + (f", {o['gflops']:.0f} GFLOP/s" if o["gflops"] else ""))


def rollout(model, tokenizer, rounds: int) -> dict:
    worker = RolloutWorker(model.eval(), tokenizer, batch_size=64)
    prompts, new = cases(tokenizer)["long"]
    runs = []
    for r in range(rounds):
        torch.manual_seed(r)
        worker.phase_seconds = {"prefill_s": 0.0, "decode_s": 0.0}
        groups, total_s = timed(lambda: worker.generate(prompts, 8, new, 0.7, logprobs=True))
        runs.append({"total_s": total_s, **worker.phase_seconds,
                     "new_tokens_mean": statistics.mean(len(s.tokens) for g in groups for s in g)})
    torch.manual_seed(0)
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        worker.generate(prompts, 8, new, 0.7, logprobs=True)
    return {"prompt_tokens": [len(p) for p in prompts], "n": 8, "max_new_tokens": new, "rounds": runs,
            "top_ops": top_ops(prof)}


def projections(config) -> list[dict]:
    """One decode step's projection matmuls (q, k, v, o, gate, up, down per layer) on distinct weights, so that
    each step reads them from memory as decode does."""
    h, kv, inter = (config.hidden_size, config.num_key_value_heads * (config.hidden_size // config.num_attention_heads),
                    config.intermediate_size)
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)] * config.num_hidden_layers
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
        flop_per_row = 2 * sum(o * i for o, i in shapes)
        for rows in (16, 64):
            xs = {d: torch.randn(rows, d).to(dtype) for d in (h, inter)}

            def step():
                for w in weights:
                    F.linear(xs[w.shape[1]], w)

            dt = statistics.mean(interleaved_times({"step": step}, 5, warmup=2)["step"])
            out.append({"dtype": str(dtype).removeprefix("torch."), "rows": rows, "step_ms": dt * 1e3,
                        "gflops": flop_per_row * rows / dt / 1e9, "weight_mb": sum(o * i for o, i in shapes) * 4 / 1e6})
    return out


def long_group():
    """One long group: a 505-token prompt and 8 responses of 30-64 tokens (random ids, seed 0), packed."""
    g = torch.Generator().manual_seed(0)
    return pack_groups([(torch.randint(10, 40000, (505,), generator=g).tolist(),
                         [torch.randint(10, 40000, (int(torch.randint(30, 65, (1,), generator=g)),),
                                        generator=g).tolist() for _ in range(8)])])


def update_pass(model, batch) -> None:
    """The update's forward + backward through DualKV (entropy kept in the graph as the loss does)."""
    logp, entropy = shared_prompt_logprobs(model, batch, return_entropy=True)
    (logp.sum() + 0.0 * entropy.sum()).backward()
    model.zero_grad(set_to_none=True)


def update(model, rounds: int) -> dict:
    """One long group (long_group): forward + backward through DualKV."""
    model.train()
    batch = long_group()

    def once():
        update_pass(model, batch)

    times = interleaved_times({"update": once}, rounds, warmup=1)["update"]
    with profile(activities=[ProfilerActivity.CPU], with_flops=True) as prof:
        once()
    return {"tokens": int(batch.labels.numel()), "times_s": times, "top_ops": top_ops(prof)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    model, tokenizer = load_model("smollm2-135m")
    result = {"machine": machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "fp32_matmul_peak_gflops": matmul_gflops(torch.float32),
              "rollout": rollout(model, tokenizer, args.rounds), "projections": projections(model.config),
              "update": update(model, args.rounds)}
    r, u = result["rollout"], result["update"]
    lines = ["# The `long` case's time on this CPU, profiled", "",
             "Made by `python -m benchmarks.studies.long_case_profile --out benchmarks/results` on "
             f"{result['machine']['model']}, "
             f"{result['threads']} torch threads, torch {result['torch']}, nothing else running. SmolLM2-135M fp32. "
             f"fp32 1024^3 matmul peak measured at the start: {result['fp32_matmul_peak_gflops']:.0f} GFLOP/s "
             "(GFLOP/s per operator below: the profiler's FLOP count over its self time).", "",
             f"## Rollout: {len(r['prompt_tokens'])} prompts of {r['prompt_tokens'][0]} tokens x {r['n']}, up to "
             f"{r['max_new_tokens']} new tokens", "", "| round | total s | prefill s | decode s | new tokens per row |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {i} | {x['total_s']:.2f} | {x['prefill_s']:.2f} | {x['decode_s']:.2f} | {x['new_tokens_mean']:.1f} |"
              for i, x in enumerate(r["rounds"])]
    lines += ["", "Top operators (one profiled rollout, self time):", ""]
    lines += [op_line(o) for o in r["top_ops"]]
    lines += ["", "## Decode's projection matmuls alone (one step, every layer's weights distinct)", "",
              "| dtype | rows | ms per step | GFLOP/s |", "|---|---:|---:|---:|"]
    lines += [f"| {p['dtype']} | {p['rows']} | {p['step_ms']:.1f} | {p['gflops']:.0f} |" for p in result["projections"]]
    lines += ["", f"## Update: one group ({u['tokens']} response tokens behind a 505-token prompt), forward + backward",
              "", "Seconds per pass: " + ", ".join(f"{t:.2f}" for t in u["times_s"]), "",
              "Top operators (one profiled pass, self time):", ""]
    lines += [op_line(o) for o in u["top_ops"]]
    write_results(args.out, "long_case_profile", result, "\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
