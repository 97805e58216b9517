"""Where the default job's memory goes: its peak RSS by phase, beside what each resident piece weighs, and what can
be dropped without a change in numbers; results: benchmarks/results/memory_default_job.md (bf16-mixed),
benchmarks/results/memory_default_job_fp32.md (fp32, with the candidates).

    python -m benchmarks.memory_default_job [--steps 4] [--precision auto] [--out benchmarks/results]
    python -m benchmarks.memory_default_job --steps 2 --precision fp32 --candidates --name memory_default_job_fp32

Runs `hetrl.train` on examples/runs/default.yaml (fewer steps: the memory of a step does not grow after the
first) in this process, with a thread sampling the process's resident set (/proc/self/statm) every 10 ms and the
phase the run is in: rollout (RolloutWorker.generate), old log-probs (Learner.logprobs), reference log-probs
(the reference Scorer), update (Learner.update), evaluation (evaluation.evaluate), and the set-up before the first
of them. A phase's row is the largest resident set seen while it ran. Beside it, the resident pieces by their
sizes (parameters, AdamW states, gradients, the reference's and the rollout's bf16 copies) and the largest
transient: one micro-batch's logits (micro_batch_tokens x vocab, fp32) and the log-softmax over them.

`--candidates`: the run as it is and each candidate (`CANDIDATES`: a way to hold less, or what the code did before
a drop was made the default) in a fresh process apiece, one after another: each one's peak RSS, its update seconds,
and whether its per-step metrics (every metrics.jsonl key but the timings) and held-out evaluations are
bit-identical to the run as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from hetrl.bench.harness import child_results, machine, revision, utc_now, write_results

PAGE = os.sysconf("SC_PAGE_SIZE")
GB = 1e9


# Written after the trace of the committed run (fp32, AVX2 host): what was examined and kept
LOOKED_AT = ('Looked at, nothing more to drop at fp32 (a finer trace of the same run): gradients are freed after every'
             " optimizer step already; the optimizer is torch's fused AdamW, whose step added no memory (no parameter-"
             'sized temporaries); at fp32 the rollout samples from the policy itself, so there is no rollout copy to '
             'release (in bf16-mixed each weight sync builds a 0.27 GB bf16 copy: not measured, this CPU has no bf16 '
             "instructions); the update's growth is mostly one micro-batch's activations (~0.83 GB), which only "
             'checkpointing removes (smaller micro-batches would change the gradient sums); the default job has no '
             'reference since the grpo preset dropped its KL (with kl_coef=0.001 the fp32 copy adds 0.54 GB, read by '
             'the KL every step: 4.44 GB peak at 50a8b90); evaluation is not at the peak.')


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Sampler:
    """The largest resident set seen in each phase (the outermost phase named at the time: a phase inside another,
    such as the learner's scorer inside its update, counts as the outer one)."""

    def __init__(self, every_s: float = 0.01):
        self.stack: list[str] = ["set-up"]
        self.peak: dict[str, int] = {}
        self.growth: dict[str, int] = {}     # the most one occurrence of the phase raised the resident set
        self.calls: dict[str, int] = {}
        self.every_s, self.done = every_s, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self.done.is_set():
            phase, now = self.stack[min(1, len(self.stack) - 1)], rss()
            self.peak[phase] = max(self.peak.get(phase, 0), now)
            time.sleep(self.every_s)

    @contextlib.contextmanager
    def phase(self, name: str):
        outer = len(self.stack) == 1
        if outer and name == "evaluation":   # before training, between steps, after training
            self.calls[name] = self.calls.get(name, 0) + 1
            name = "evaluation before training" if self.calls[name] == 1 else "evaluation after training"
        self.stack[0] = "between phases (rewards, advantages, logging)"   # the set-up ends with the first phase
        self.stack.append(name)
        at = rss()
        try:
            yield
        finally:
            self.stack.pop()
            if outer:
                self.growth[name] = max(self.growth.get(name, 0), self.peak.get(name, at) - at)


def wrap(sampler: Sampler, owner, attr: str, name: str) -> None:
    fn = getattr(owner, attr)

    def wrapped(*args, **kwargs):
        with sampler.phase(name):
            return fn(*args, **kwargs)

    setattr(owner, attr, wrapped)


def pieces(cfg, precision) -> dict[str, float]:
    """Bytes of the resident pieces and of one micro-batch's logits, by their sizes."""
    from hetrl.models import load_model
    from hetrl.trainer.build import frozen_bytes

    model, _ = load_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    bf16 = precision.autocast
    return {"parameters (fp32)": params * 4, "AdamW states (2 x fp32)": params * 8, "gradients (fp32)": params * 4,
            **({"reference (bf16 matmul weights)" if bf16 else "reference (fp32 copy)": frozen_bytes(model, precision)}
               if cfg.has_reference else {}),
            **({"rollout's bf16 copy": params * 2} if bf16 else {}),
            f"one micro-batch's logits ({cfg.micro_batch_tokens} tokens x {vocab}, fp32)":
                cfg.micro_batch_tokens * vocab * 4}


@dataclass(frozen=True)
class Candidate:
    """A run beside the run as it is: how to get it, its config overrides and environment; `lazy_adamw`: AdamW's
    states made by its first step, as before build.states_now (the benchmark switches it off)."""

    how: str
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    lazy_adamw: bool = False


AS_RUN = "as run"
CANDIDATES = {
    AS_RUN: Candidate("hetrl train"),
    "AdamW states made by its first step (before)": Candidate("build.states_now switched off", lazy_adamw=True),
    "freed memory returned to the system": Candidate("HETRL_MALLOC=system", env=(("HETRL_MALLOC", "system"),)),
    "activation checkpointing": Candidate("gradient_checkpointing=true", overrides=("gradient_checkpointing=true",)),
}


def measure(steps: int, precision_name: str, candidate: Candidate = CANDIDATES[AS_RUN]) -> dict:
    """One run of the default job in this process, its resident set sampled by phase; -> every number."""
    for k, v in candidate.env:
        os.environ[k] = v          # read where the run starts (the allocator setting)
    from hetrl.trainer import build, evaluation, learner, loop, rollout
    from hetrl.trainer.config import load_config
    from hetrl.trainer.metrics import TIMING_KEYS, MetricsLog
    from hetrl.trainer.precision import decide
    from hetrl.trainer.run import train

    if candidate.lazy_adamw:
        build.states_now = lambda opt: None
    sampler = Sampler()
    wrap(sampler, rollout.RolloutWorker, "generate", "rollout")
    wrap(sampler, learner.Learner, "logprobs", "old log-probs")
    wrap(sampler, learner.Learner, "update", "update")
    wrap(sampler, learner.Scorer, "logprobs", "reference log-probs")   # the learner's own scorer counts as its caller
    wrap(sampler, loop, "evaluate", "evaluation")
    wrap(sampler, evaluation, "evaluate", "evaluation")
    start = rss()
    sampler.thread.start()
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = load_config("examples/runs/default.yaml", [f"steps={steps}", f"precision={precision_name}",
                                                         "checkpoint_every=0", f"out_dir={run_dir}",
                                                         *candidate.overrides])
        t0 = time.perf_counter()
        summary = train(cfg)
        seconds = time.perf_counter() - t0
        rows = MetricsLog(pathlib.Path(run_dir) / "metrics.jsonl").read()
        evals = MetricsLog(pathlib.Path(run_dir) / "eval.jsonl").read()
    sampler.done.set()
    sampler.thread.join()
    precision = decide(cfg)
    return {"steps": steps, "precision": precision.name, "seconds": seconds, "rss_at_start": start,
            "peak_rss_by_phase": sampler.peak, "growth_by_phase": sampler.growth,
            "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "pieces": pieces(cfg, precision), "held_out_after": summary.get("eval_accuracy_after"),
            "update_s": [r.get("update_s") for r in rows], "step_s": [r.get("step_s") for r in rows],
            "numbers": [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows], "evals": evals}


def differences(a: dict, b: dict) -> list[str]:
    """Where run `b`'s numbers differ from run `a`'s: metrics.jsonl keys by step, held-out evaluations."""
    out = [f"step {r['step']} {k}: {r[k]} vs {q.get(k)}" for r, q in zip(a["numbers"], b["numbers"])
           for k in r if r[k] != q.get(k)]
    if len(a["numbers"]) != len(b["numbers"]):
        out.append(f"{len(a['numbers'])} vs {len(b['numbers'])} steps")
    return out + ([f"held-out: {a['evals']} vs {b['evals']}"] if a["evals"] != b["evals"] else [])


def phase_lines(res: dict) -> list[str]:
    growth = res["growth_by_phase"]
    lines = ["| phase | peak resident GB | the most one call of it added, GB |", "|---|---:|---:|"]
    lines += [f"| {k} | {v / GB:.2f} | {growth[k] / GB:.2f} |" if k in growth else f"| {k} | {v / GB:.2f} | - |"
              for k, v in res["peak_rss_by_phase"].items()]
    return lines + ["", "| piece | GB |", "|---|---:|"] + [f"| {k} | {v / GB:.2f} |" for k, v in res["pieces"].items()]


def candidate_lines(runs: dict[str, dict]) -> list[str]:
    base = runs[AS_RUN]
    lines = ["## What can be dropped", "",
             "Each candidate in a fresh process, one after another; `numbers identical`: every metrics.jsonl key "
             "but the timings, at every step, and the held-out evaluations before and after, bit for bit. Update "
             "seconds are per step, on a 2-core machine shared with other work while these ran: noisy, a hint "
             "and not a timing.", "",
             "| candidate | how | peak RSS GB | vs as run, GB | numbers identical | update s per step |",
             "|---|---|---:|---:|---|---|"]
    for name, res in runs.items():
        if "error" in res:
            lines.append(f"| {name} | {CANDIDATES[name].how} | failed: {res['error'][-120:]} | | | |")
            continue
        diff = differences(base, res)
        same = "yes" if not diff else f"no ({len(diff)} differ, e.g. {diff[0]})"
        delta = "-" if name == AS_RUN else f"{(res['max_rss'] - base['max_rss']) / GB:+.2f}"
        lines.append(f"| {name} | {CANDIDATES[name].how} | {res['max_rss'] / GB:.2f} | {delta} | {same} | "
                     + ", ".join(f"{t:.1f}" for t in res["update_s"] if t is not None) + " |")
    return lines + ["", LOOKED_AT]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--name", default="memory_default_job")
    ap.add_argument("--candidates", action="store_true", help="also run each of CANDIDATES, in a fresh process")
    ap.add_argument("--child", choices=list(CANDIDATES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.steps, args.precision, CANDIDATES[args.child])))
        return

    if args.candidates:
        runs = {}
        for name in CANDIDATES:     # one at a time: a process's peak is its own, and its timings too
            print(f"running: {name}", flush=True)
            runs |= child_results({name: ["-m", "benchmarks.memory_default_job", "--steps", str(args.steps),
                                          "--precision", args.precision, "--child", name]})
        res = runs[AS_RUN]
        if "error" in res:
            sys.exit(f"the run as it is failed: {res['error']}")
    else:
        res, runs = measure(args.steps, args.precision), None
    res = {"machine": machine(), "revision": revision(), "when": utc_now(), **res}
    command = f"python -m benchmarks.memory_default_job --steps {args.steps}" + (
        f" --precision {args.precision} --candidates --name {args.name}" if args.candidates else "")
    lines = ["# Where the default job's memory goes", "",
             f"`{command}` at {res['revision']}: examples/runs/default.yaml for {args.steps} steps, precision "
             f"{res['precision']}, in one process, its resident set sampled every 10 ms by phase. Machine: "
             f"{res['machine']['model']} ({', '.join(res['machine']['flags']) or 'no AVX2'}), "
             f"{res['machine']['cpus']} cores, torch {res['machine']['torch']}.", "",
             f"Resident at start (Python, torch, transformers imported): {res['rss_at_start'] / GB:.2f} GB; the "
             f"process's peak (getrusage): {res['max_rss'] / GB:.2f} GB; held-out accuracy after training "
             f"{res['held_out_after']}.", "", *phase_lines(res)]
    if runs is not None:
        res["candidates"] = {k: v if "error" in v else {**v, "differences": differences(runs[AS_RUN], v)}
                             for k, v in runs.items()}
        lines += ["", *candidate_lines(runs)]
    path = write_results(args.out, args.name, res, "\n".join(lines) + "\n")
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
