"""What a plan's `zero: 1`, `2` and `3` buy a learner (hetrl/trainer/sharding.py): memory and step time of ZeRO-1
(AdamW states split) and FSDP2 shards over 2 ranks against 2 plain replicas (DDP's way: gradients all-reduced,
every state whole), SmolLM2-135M in fp32 with gloo; result: benchmarks/results/learner_sharding.md.

    python -m benchmarks.learner_sharding [--steps 4] [--out benchmarks/results]

Each setting starts 2 processes (torch.multiprocessing, gloo on loopback, 1 torch thread each: one core each), builds
the learner exactly as the Ray executor's LearnerActor does (hetrl.trainer.build.data_parallel_learner; "replicas" is
the plain optimizer with its gradients all-reduced, what zero 1 ran before ZeRO-1), and runs `steps`
updates on the same fixed groups (8 prompts x 4 responses, DualKV micro-batches). Per rank it reports:
  - states: bytes of parameters + gradients + AdamW moments this rank holds (counted from its tensors; for zero 2
    and 3 the local shards), at the end of an update before the gradients are freed; for zero 2 also the
    parameters it holds through the passes (the whole model, gathered once per step), counted just before they
    are freed for the optimizer step;
  - peak RSS: during the updates (VmHWM reset just before them), of loading and sharding, and of the process;
  - step time: median over the updates after the first.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import resource
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hetrl.bench.harness import machine, reset_peak_rss, status_kb, timed, write_results

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _local_bytes(t: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def _allreduce(params: list[torch.nn.Parameter]) -> None:
    """Plain replicas' gradient sync: every gradient summed over the ranks in one flat all-reduce."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def _rank(rank: int, world: int, zero: int, steps: int, store: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from hetrl.algo import token_weights
    from hetrl.models import load_model
    from hetrl.trainer import build, sharding
    from hetrl.trainer.config import load_config
    from hetrl.trainer.precision import decide

    cfg = load_config(str(ROOT / "examples" / "runs" / "default.yaml"),
                      ["dtype=float32", "precision=fp32", "kl_coef=0"])
    model, _ = load_model(cfg.model, torch.float32, seed=0)
    pol = build.Policy(model)
    if zero == 0:   # the baseline: every state whole on every rank, gradients all-reduced (DDP's way)
        opt = build.optimizer(cfg, pol)
        learner = build.learner(cfg, pol, opt, decide(cfg), grad_sync=_allreduce)
    else:           # as the Ray executor's learners
        opt, learner = build.data_parallel_learner(cfg, pol, decide(cfg), zero, world)
    held = {}
    reshard = sharding.reshard

    def counted_reshard(*models):   # the learner frees zero 2's gathered weights here, before the optimizer step
        held["params_in_passes"] = sum(_local_bytes(p) for m in models for p in m.parameters())
        reshard(*models)

    sharding.reshard = counted_reshard

    def count_states():   # at the end of backward, before the optimizer frees the gradients
        held["params"] = sum(_local_bytes(p) for p in model.parameters())
        held["grads"] = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)

    step = opt.step

    def counted_step(*a, **k):
        count_states()
        r = step(*a, **k)
        held["adam"] = sum(_local_bytes(v) for s in sharding.local_optimizer(opt).state.values() for v in s.values()
                           if isinstance(v, torch.Tensor) and v.dim() > 0)
        return r

    opt.step = counted_step
    g = torch.Generator().manual_seed(rank)
    groups = [(torch.randint(10, 40000, (40,), generator=g).tolist(),
               [torch.randint(10, 40000, (32,), generator=g).tolist() for _ in range(4)]) for _ in range(4)]
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])
    weights = token_weights(lens, torch.ones_like(lens, dtype=torch.bool), "seq-mean-token-mean") / world
    advantages = torch.randn(int(lens.sum()), generator=g)
    gc.collect()
    loaded_peak = status_kb("VmHWM") * 1024
    reset_peak_rss()                                # the peak of the updates alone
    times = []

    for _ in range(steps):
        dist.barrier()
        _, seconds = timed(lambda: learner.update(groups, advantages, weights, learner.logprobs(groups) + 0.01))
        times.append(seconds)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    pathlib.Path(out, f"{zero}-{rank}.json").write_text(json.dumps(
        {"zero": zero, "rank": rank, **held, "peak_rss": peak, "peak_rss_setup": loaded_peak,
         "peak_rss_updates": status_kb("VmHWM") * 1024, "step_s": times}))
    dist.destroy_process_group()


SETTINGS = (0, 1, 2, 3)   # 0: plain replicas (no ZeRO), the baseline


def _name(z: int) -> str:
    return "replicas" if z == 0 else f"zero {z}"


def run(steps: int) -> list[dict]:
    rows = []
    for zero in SETTINGS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(2, zero, steps, os.path.join(tmp, "store"), tmp), nprocs=2)
            rows += [json.loads(pathlib.Path(tmp, f"{zero}-{r}.json").read_text()) for r in range(2)]
    return rows


def markdown(res: dict) -> str:
    gib = 1 << 30
    zeros = sorted({r["zero"] for r in res["rows"]})
    by = {z: [r for r in res["rows"] if r["zero"] == z] for z in zeros}
    base, more = zeros[0], zeros[1:]   # the baseline: plain replicas (zero 1 in results made before ZeRO-1 was)

    def mean(z, key):
        return statistics.mean(r[key] for r in by[z])

    def step(z):
        return statistics.median(t for r in by[z] for t in r["step_s"][1:])

    def row(label, value, fmt):
        return (f"| {label} | " + " | ".join(fmt(value(z)) for z in zeros) + " | "
                + " | ".join(f"{value(z) / value(base):.2f}x" for z in more) + " |")

    def held_in_passes(z):
        if z == 3:
            return "a layer at a time"
        return gb(mean(z, "params_in_passes") if z == 2 else mean(z, "params"))

    gb = lambda v: f"{v / gib:.3f} GiB"   # noqa: E731
    lines = [f"# Learner sharding: {', '.join(_name(z) for z in more)} vs {_name(base)}, 2 ranks",
             "", f"SmolLM2-135M, fp32, gloo on loopback, 2 processes with 1 torch thread each; {res['date']}, "
             f"{res['machine']['cpus']} CPUs ({res['machine']['platform']}). `python -m benchmarks.learner_sharding`. "
             f"Batch: 4 prompts x 4 responses per rank (40 + 32 tokens), {res['steps']} updates (log-probs + "
             "update), the first a warm-up. replicas: every rank holds every state (DDP's way); zero 1: AdamW "
             "states split (torch's ZeroRedundancyOptimizer), each part's gradients reduced onto its rank and the "
             "rest freed before the step; zero 2 and 3: FSDP2 shards.", "",
             f"Conditions: {res.get('conditions', 'not stated')}", "",
             "| per rank (mean of 2) | " + " | ".join(_name(z) for z in zeros) + " | "
             + " | ".join(f"{_name(z)} / {_name(base)}" for z in more) + " |",
             "|---" * (1 + len(zeros) + len(more)) + "|"]
    for key, label in (("params", "parameters at the optimizer step"), ("grads", "gradients"),
                       ("adam", "AdamW moments")):
        lines.append(row(label, lambda z, k=key: mean(z, k), gb))
    tot = {z: mean(z, "params") + mean(z, "grads") + mean(z, "adam") for z in zeros}
    lines.append(row("**states total**", lambda z: tot[z], gb))
    if 2 in by and "params_in_passes" in by[2][0]:
        lines.append("| parameters held through the passes | " + " | ".join(held_in_passes(z) for z in zeros)
                     + " |" + " |" * len(more))
    lines += [*(row(label, lambda z, k=key: mean(z, k), lambda v: f"{v / gib:.2f} GiB")
                for key, label in (("peak_rss_updates", "peak RSS during the updates"),
                                   ("peak_rss_setup", "peak RSS of loading and sharding"),
                                   ("peak_rss", "peak RSS of the process")) if key in by[base][0]),
              row("step time (median)", step, lambda v: f"{v:.2f} s"), "",
              *(["Beyond the states, the peak during the updates held "
                 + ", ".join(f"{(mean(z, 'peak_rss_updates') - tot[z]) / gib:.2f} GiB with {_name(z)}"
                             for z in zeros)
                 + ": the difference is activations and logits, what FSDP2 adds (gathered weights: zero 2 holds "
                 "the whole model through the passes, zero 3 a layer at a time and the root's embedding and head), "
                 "gloo's buffers and freed memory the allocator keeps; this run does not break it down further.",
                 ""] if "peak_rss_updates" in by[base][0] else []),
              "The states are counted from the tensors each rank holds. Peak RSS during the updates is the "
              "resident high-water mark from just before the first update (VmHWM, reset through "
              "/proc/self/clear_refs) to after the last: states, activations and logits, the layer weights FSDP2 "
              "gathers for each pass, and torch's own footprint. Loading builds the whole model on every rank "
              "before it is sharded (the GGUF file is de-quantized in memory), so that peak does not fall. "
              "The step time includes the collectives: zero 3 all-gathers every layer for each forward and "
              "backward, zero 2 once per pass set (log-probs, then the update) and reduce-scatters each "
              "micro-batch's gradients, replicas all-reduce the gradients once, and zero 1 reduces each part's "
              "gradients onto the rank that steps it, then broadcasts the updated part; zero-weight passes keep "
              "sharded ranks in step; gloo on one machine."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--conditions", default="", help="how the machine was shared during the run")
    args = parser.parse_args()
    res = {"date": datetime.date.today().isoformat(), "steps": args.steps,
           "machine": machine(),
           "conditions": args.conditions or "not stated", "rows": run(args.steps)}
    write_results(args.out, "learner_sharding", res, markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
