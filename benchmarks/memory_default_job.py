"""Where the default job's memory goes: its peak RSS by phase, beside what each resident piece weighs; results:
benchmarks/results/memory_default_job.md.

    python -m benchmarks.memory_default_job [--steps 4] [--precision auto] [--out benchmarks/results]

Runs `hetrl.train` on examples/runs/default.yaml (fewer steps: the memory of a step does not grow after the
first) in this process, with a thread sampling the process's resident set (/proc/self/statm) every 10 ms and the
phase the run is in: rollout (RolloutWorker.generate), old log-probs (Learner.logprobs), reference log-probs
(the reference Scorer), update (Learner.update), evaluation (evaluation.evaluate), and the set-up before the first
of them. A phase's row is the largest resident set seen while it ran. Beside it, the resident pieces by their
sizes (parameters, AdamW states, gradients, the reference's and the rollout's bf16 copies) and the largest
transient: one micro-batch's logits (micro_batch_tokens x vocab, fp32) and the log-softmax over them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import threading
import time

from hetrl.bench.harness import machine, revision, utc_now, write_results

PAGE = os.sysconf("SC_PAGE_SIZE")
GB = 1e9


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

    model, _ = load_model(cfg.model)
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    bf16 = precision.autocast
    return {"parameters (fp32)": params * 4, "AdamW states (2 x fp32)": params * 8, "gradients (fp32)": params * 4,
            "reference (bf16 copy)" if bf16 else "reference (fp32 copy)": params * (2 if bf16 else 4),
            **({"rollout's bf16 copy": params * 2} if bf16 else {}),
            f"one micro-batch's logits ({cfg.micro_batch_tokens} tokens x {vocab}, fp32)":
                cfg.micro_batch_tokens * vocab * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    from hetrl.trainer import evaluation, learner, loop, rollout
    from hetrl.trainer.config import load_config
    from hetrl.trainer.precision import decide
    from hetrl.trainer.run import train

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
        cfg = load_config("examples/runs/default.yaml", [f"steps={args.steps}", f"precision={args.precision}",
                                                         "checkpoint_every=0", f"out_dir={run_dir}"])
        t0 = time.perf_counter()
        summary = train(cfg)
        seconds = time.perf_counter() - t0
    sampler.done.set()
    sampler.thread.join()
    precision = decide(cfg)
    import resource

    res = {"machine": machine(), "revision": revision(), "when": utc_now(), "steps": args.steps,
           "precision": precision.name, "seconds": seconds, "rss_at_start": start,
           "peak_rss_by_phase": sampler.peak, "growth_by_phase": sampler.growth,
           "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
           "pieces": pieces(cfg, precision), "held_out_after": summary.get("eval_accuracy_after")}
    lines = ["# Where the default job's memory goes", "",
             f"`python -m benchmarks.memory_default_job --steps {args.steps}` at {res['revision']}: "
             f"examples/runs/default.yaml for {args.steps} steps, precision {precision.name}, in one process, its "
             f"resident set sampled every 10 ms by phase. Machine: {res['machine']['model']}, "
             f"{res['machine']['cpus']} cores, torch {res['machine']['torch']}.", "",
             f"Resident at start (Python, torch, transformers imported): {start / GB:.2f} GB; the process's peak "
             f"(getrusage): {res['max_rss'] / GB:.2f} GB.", "", "| phase | peak resident GB |", "|---|---:|"]
    lines[-2:] = ["| phase | peak resident GB | the most one call of it added, GB |", "|---|---:|---:|"]
    lines += [f"| {k} | {v / GB:.2f} | {sampler.growth[k] / GB:.2f} |" if k in sampler.growth else
              f"| {k} | {v / GB:.2f} | - |" for k, v in sampler.peak.items()]
    lines += ["", "| piece | GB |", "|---|---:|"] + [f"| {k} | {v / GB:.2f} |" for k, v in res["pieces"].items()]
    path = write_results(args.out, "memory_default_job", res, "\n".join(lines) + "\n")
    print(open(path + ".md").read())


if __name__ == "__main__":
    main()
