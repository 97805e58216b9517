"""The rollout phase on hetrl's own decoding loop (`hf`) against vLLM (`vllm`), side by side in one process, and the
weight sync into each; results: benchmarks/results/rollout_engines.md.

    python -m benchmarks.rollout_engines [--out benchmarks/results] [--precision auto|fp32|bf16-mixed]

The default job's model (embedded SmolLM2-135M) and its first 8 training prompts, 8 samples each, 16 new tokens at
temperature 0.7 (the default job's rollout, examples/runs/default.yaml), in the precision the run would use: hf
samples from the policy (fp32) or from its bf16 copy (bf16-mixed, as the local engine does), vLLM from its own
weights in the same dtype. Rounds interleave the engines after one warm-up round; generated tokens per second
counts every sampled token. vLLM's start-up (engine and model load) is reported apart, as is one weight sync:
the policy's state dict into vLLM (bucketed reload_weights) against the bf16 copy's load_state_dict (hf).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hetrl.bench.harness import interleaved_times, machine, revision, spread, timed, utc_now, write_results
from hetrl.models import load_model
from hetrl.trainer import build
from hetrl.trainer.config import load_config
from hetrl.trainer.precision import decide
from hetrl.trainer.run import build_source


def measure(precision: str, rounds: int, out_dir: str) -> dict:
    cfg = load_config("examples/runs/default.yaml", [f"precision={precision}", f"out_dir={out_dir}"])
    prec = decide(cfg)
    torch.manual_seed(0)
    model, tokenizer = load_model(cfg.model)
    prompts = [e.prompt_ids for e in build_source(cfg, tokenizer).train_examples(0, cfg.prompts_per_step)[0]]
    bf16 = prec.autocast
    sampler = build.bf16_copy(model) if bf16 else model
    hf = build.rollout_worker(cfg, sampler, tokenizer, prec)
    vllm, start_s = timed(lambda: build.vllm_worker(cfg, build.Policy(model), tokenizer, prec))
    produced = {"hf": [], "vllm": []}

    def rollout(worker, name):
        def run():
            groups = worker.generate(prompts, cfg.responses_per_prompt, cfg.max_new_tokens,
                                     temperature=cfg.temperature, logprobs=True)
            produced[name].append(sum(len(s.tokens) for g in groups for s in g))
        return run

    times = interleaved_times({"hf": rollout(hf, "hf"), "vllm": rollout(vllm, "vllm")}, rounds, warmup=1,
                              desc=f"rollout {prec.name}")
    state = model.state_dict()
    sync_vllm = [vllm.load_weights(state)["weight_sync_s"] for _ in range(3)]
    sync_hf = []
    if bf16:
        for _ in range(3):
            t0 = time.perf_counter()
            hf.load_weights(build.bf16_weights_of(state))
            sync_hf.append(time.perf_counter() - t0)
    vllm.close()
    res = {"precision": prec.name, "prompts": len(prompts), "samples_per_prompt": cfg.responses_per_prompt,
           "max_new_tokens": cfg.max_new_tokens, "vllm_start_s": start_s, "vllm_dtype": str(vllm.dtype)}
    for name in ("hf", "vllm"):
        tokens = produced[name][1:]          # the warm-up round's are not timed
        res[name] = {**spread(times[name]), "times_s": times[name], "tokens": tokens,
                     "tokens_per_s": sum(tokens) / sum(times[name])}
    res["weight_sync_s"] = {"vllm": spread(sync_vllm), **({"hf_bf16_copy": spread(sync_hf)} if sync_hf else {})}
    res["vllm_over_hf_time"] = res["vllm"]["median_s"] / res["hf"]["median_s"]
    return res


def page(results: list[dict], mach: dict) -> str:
    lines = ["# Rollout: hetrl's decoding loop (hf) vs vLLM, side by side", "",
             f"Machine: {mach['model']} ({', '.join(mach['flags'])}), {mach['cpus']} cores, torch threads "
             f"{mach['torch_threads']}. "
             "Command: `python -m benchmarks.rollout_engines`. The default job's rollout: SmolLM2-135M, 8 prompts x "
             "8 samples x 16 new tokens, temperature 0.7, with log-probs. Median of the timed rounds (engines "
             "interleaved, one warm-up round), vLLM's start-up apart.", "",
             "| precision | hf s | vLLM s | vLLM / hf time | hf tok/s | vLLM tok/s | vLLM start-up s | weight sync s "
             "(vLLM) | weight sync s (hf bf16 copy) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        hf_sync = r["weight_sync_s"].get("hf_bf16_copy")
        lines.append(f"| {r['precision']} | {r['hf']['median_s']:.2f} | {r['vllm']['median_s']:.2f} | "
                     f"{r['vllm_over_hf_time']:.2f} | {r['hf']['tokens_per_s']:.0f} | {r['vllm']['tokens_per_s']:.0f}"
                     f" | {r['vllm_start_s']:.1f} | {r['weight_sync_s']['vllm']['median_s']:.3f} | "
                     + (f"{hf_sync['median_s']:.3f}" if hf_sync else "- (samples from the policy itself)") + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--precision", nargs="+", default=["fp32", "bf16-mixed"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    results = [measure(p, args.rounds, os.path.join(args.out, "rollout_engines_run")) for p in args.precision]
    mach = machine()
    res = {"machine": mach, "revision": revision(), "when": utc_now(), "results": results}
    path = write_results(args.out, "rollout_engines", res, page(results, mach))
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
