"""`hetrl bench train`: whole GRPO steps of `hetrl train` and of TRL 1.16's GRPOTrainer (stock, and with DualKV from
hetrl.integrations.trl) on one job, one after the other on this machine.

Each (case, system, seed) is one run: it trains `steps` hetrl steps (one rollout batch of prompts_per_step x N, then
mini_batches optimizer steps; TRL: the same batch through steps_per_generation = mini_batches optimizer steps) and
appends one JSON line to OUT/train_vs_trl.jsonl as soon as it finishes: its per-step times (rollout, log-probs,
update), tokens, and the held-out accuracy before and after (greedy, hetrl's own evaluator on the same held-out
prompts, so the two systems are scored by the same code). A run already in the file is not run again, so a long
comparison can be spread over several invocations; OUT/train_vs_trl.json and .md are rewritten from the whole file
after every run.

Both systems get the same prompts in the same order (hetrl's data source for that seed; TRL with
shuffle_dataset=False), the same reward code (hetrl's RewardSet, called from a TRL reward function), model, N,
lengths, sampling, learning rate and schedule, clip, KL and loss aggregation. `KNOBS` lists what still differs.

Cases:
- `default`: the default job (examples/runs/default.yaml): reasoning-gym arithmetic, prompts of ~38 tokens, 8 x 8
  samples of <= 16 tokens. The grpo preset has had no KL since the default_recipe study (TRL beta 0.0, no reference
  pass on either side); the committed results/train_vs_trl.md rows were measured before, with kl_coef = beta =
  0.001 (a reference pass on both sides), and say so.
- `long`: the same problems behind a shared few-shot block of solved problems (prompts of ~512 tokens), N = 8,
  <= 64 new tokens, 2 prompts per step: the prompt dominates. Timing only (exact_match on 4 held-out prompts).

FLOP/s: model FLOPs of the standard per-sample computation, 2 x (matmul weights) per token for a forward and 6 x
for a forward + backward, over every sample's prompt + completion tokens: one forward for the rollout, two for the
old and reference log-probs, one forward + backward for the update (attention scores not counted). The same work
definition for every system, so a system that skips repeated prompt work is credited with the work it made
unnecessary: `effective`. It is compared with the fp32 and bf16 matmul peaks measured at the start of the
invocation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pathlib
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from hetrl.bench import harness

SYSTEMS = ("hetrl", "trl-dualkv", "trl")
RESULTS = "train_vs_trl"

# what differs between the two systems when this benchmark runs them (everything else is set equal, see trl_args)
KNOBS = [
    "mini-batches: hetrl splits a rollout batch into mini_batches of whole prompt groups; TRL shuffles the 64 "
    "samples and splits them into steps_per_generation slices (groups spread over both optimizer steps).",
    "optimizer: both AdamW (betas 0.9/0.999, eps 1e-8, no weight decay, constant lr) with torch's fused kernel "
    "(hetrl's build.adamw, TRL's Trainer default adamw_torch_fused); hetrl's runs without a recorded revision "
    "used the foreach kernel.",
    "old log-probs: TRL computes them for all samples in a forward pass (steps_per_generation > 1); hetrl's first "
    "mini-batch is on-policy (its own forward's, detached, as TRL's num_iterations=1 loss does) and the later "
    "mini-batch's are read off the rollout's fp32 logits (old_logprobs=auto; a recomputing pass in runs without a "
    "recorded revision), equal to a recompute to fp32 rounding.",
    "log-prob numerics: stock TRL's CPU LM head scores every position and accumulates the log-softmax in fp32 tiles; "
    "hetrl (and DualKV TRL) gathers the completion rows and does log-softmax on those.",
    "rollout: hetrl prefills each prompt once and decodes its N continuations in its own loop, the prompt stored "
    "once in the KV cache, finished rows leaving the batch, one uniform draw per row inverting the CDF; TRL repeats "
    "each prompt N times and calls transformers' generate on the N x prompts rows (multinomial sampling, finished "
    "rows decoded on padding until the last ends). Same distribution: transformers' temperature warper, 0.7, "
    "top_p 1, top_k 0.",
    "micro-batching: hetrl packs up to micro_batch_tokens=2048 tokens per forward; TRL runs each optimizer step's "
    "rows in one forward (per_device_train_batch_size = samples / mini_batches).",
    "random streams: the same seed does not draw the same samples in both systems (different generate batches).",
    "allocator: hetrl train keeps freed memory in the process while it runs (glibc mallopt: no mmap'd chunks, "
    "hetrl.trainer.allocator; from 923dd2e on); TRL runs with glibc's "
    "defaults (hetrl's run, earlier in the same process, puts them back when it ends).",
]


# Both systems at fp32 unless --set precision=... says otherwise: precision=auto would be bf16-mixed on a CPU with bf16
# instructions and fp32 on one without, and the committed comparisons are fp32 on both sides.
BENCH_PRECISION = "precision=fp32"


@dataclass(frozen=True)
class Case:
    name: str
    overrides: tuple[str, ...]        # hetrl config key=value on top of the built-in defaults
    few_shot_tokens: int = 0          # > 0: a shared block of solved problems of about this many tokens
    eval_rows: int = 0                # few-shot cases: held-out prompts (from the same problem stream)
    accuracy: bool = True             # whether the held-out accuracy is part of the comparison


CASES = {
    "default": Case("default", ()),
    "long": Case("long", ("prompts_per_step=2", "max_new_tokens=64", "eval_max_new_tokens=64", "reward=exact_match",
                          "max_prompt_tokens=1024"), few_shot_tokens=512, eval_rows=4, accuracy=False),
}


# ----------------------------------------------------------------------------------------------- the job


def job(case: Case, seed: int, steps: int, out_dir: str, overrides: tuple[str, ...] = ()):
    """-> (RunConfig, train rows or None, eval rows or None): the run both systems do (`overrides`: more hetrl
    config key=value, e.g. model=tiny for a smoke test)."""
    cfg = _config(case, seed, steps, out_dir, overrides)
    if not case.few_shot_tokens:
        return cfg, None, None
    from hetrl.data import TaskSource, prompt_ids
    from hetrl.trainer.config import DEFAULT_TASK_CONFIG

    _, tokenizer = _load(cfg)
    task = TaskSource("basic_arithmetic", DEFAULT_TASK_CONFIG, seed, 1, tokenizer)
    problems = [e.row for e in task.train_examples(0, steps * cfg.prompts_per_step + case.eval_rows + 200)[0]]
    shots = ""
    for p in problems[steps * cfg.prompts_per_step + case.eval_rows:]:
        shots += f"{p['question']} {p['answer']}\n"
        if len(prompt_ids(tokenizer, [{"role": "user", "content": shots}])) >= case.few_shot_tokens - 16:
            break
    rows = [{"prompt": [{"role": "user", "content": shots + p["question"]}], "answer": str(p["answer"])}
            for p in problems[: steps * cfg.prompts_per_step + case.eval_rows]]
    return cfg, rows[case.eval_rows:], rows[: case.eval_rows]


def _config(case: Case, seed: int, steps: int, out_dir: str, overrides: tuple[str, ...] = ()):
    from hetrl.trainer.config import load_config

    return load_config(None, [BENCH_PRECISION, *case.overrides, *overrides, f"seed={seed}", f"steps={steps}",
                              f"out_dir={out_dir}", "checkpoint_every=0"])


def _load(cfg):
    """-> (model, tokenizer) of the run, fp32, seeded (the few-shot case reads only the tokenizer)."""
    from hetrl.models import load_model

    return load_model(cfg.model, seed=cfg.seed)


def matmul_params(model) -> int:
    """Weights that enter a matmul per token: every Linear, the LM head included (tied or not)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


# ----------------------------------------------------------------------------------------------- hetrl


def run_hetrl(case: Case, seed: int, steps: int, work: pathlib.Path, overrides: tuple[str, ...] = ()) -> dict:
    from hetrl.trainer.run import train

    cfg, rows, evals = job(case, seed, steps, str(work / f"hetrl-{case.name}-{seed}"), overrides)
    summary = train(cfg, train_dataset=rows, eval_dataset=evals)
    metrics = [json.loads(line) for line in open(pathlib.Path(cfg.out_dir) / "metrics.jsonl")]
    per_step = [{"step": m["step"], "step_s": m["step_s"], "rollout_s": m["gen_s"], "logprob_s": m["logprob_s"],
                 "update_s": m["update_s"], "sample_tokens": m["sample_tokens"],
                 "prefill_s": m.get("prefill_s"), "decode_s": m.get("decode_s"), "rho": m.get("rho")}
                for m in metrics]
    return {"steps": per_step, "eval_accuracy_before": summary.get("eval_accuracy_before"),
            "eval_accuracy_after": summary.get("eval_accuracy_after"), "gained": summary.get("gained"),
            "lost": summary.get("lost"), "sign_test_p": summary.get("sign_test_p")}


# ----------------------------------------------------------------------------------------------- TRL


def trl_args(cfg, seed: int, out_dir: str):
    """GRPOConfig with every knob hetrl's run has set to hetrl's value (KNOBS lists what cannot be)."""
    from trl import GRPOConfig

    from hetrl.trainer.precision import decide

    n, per_step = cfg.responses_per_prompt, cfg.prompts_per_step * cfg.responses_per_prompt
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    return GRPOConfig(
        output_dir=out_dir, seed=seed, data_seed=seed, use_cpu=not cuda,
        # fp32 weights; bf16 autocast where hetrl's run autocasts (precision.decide)
        bf16=decide(cfg).autocast,
        model_init_kwargs={"dtype": torch.float32},
        max_steps=cfg.steps * cfg.mini_batches, per_device_train_batch_size=per_step // cfg.mini_batches,
        steps_per_generation=cfg.mini_batches, gradient_accumulation_steps=1, num_iterations=1,
        num_generations=n, max_completion_length=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
        top_k=0, learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=cfg.max_grad_norm,
        beta=cfg.kl_coef, epsilon=cfg.clip_low, epsilon_high=cfg.clip_high, loss_type="grpo",   # the preset's
        scale_rewards="group" if cfg.scale_advantages else "none", mask_truncated_completions=False,
        shuffle_dataset=False, gradient_checkpointing=cfg.gradient_checkpointing, disable_dropout=True,
        logging_steps=1, report_to=[], save_strategy="no", dataloader_num_workers=0, log_completions=False,
        disable_tqdm=False)


class _StepTimes:
    """Per hetrl-equivalent step: wall time of its optimizer steps, and the time inside generation, reward scoring
    and no-grad log-prob passes (the rest is the update)."""

    def __init__(self, optimizer_steps_per_step: int):
        self.per, self.rows, self.current = optimizer_steps_per_step, [], None
        self.k = 0

    def phase(self, name: str, value) -> None:
        if self.current is not None:
            self.current[name] = self.current.get(name, type(value)()) + value

    def begin(self) -> None:
        if self.k % self.per == 0:
            self.current = {"step": len(self.rows) + 1, "rollout_s": 0.0, "logprob_s": 0.0, "sample_tokens": 0}
            self.t0 = time.perf_counter()

    def end(self) -> None:
        self.k += 1
        if self.k % self.per == 0:
            row = self.current
            row["step_s"] = time.perf_counter() - self.t0
            row["update_s"] = row["step_s"] - row["rollout_s"] - row["logprob_s"]
            self.rows.append(row)
            self.current = None


def _timed(cls, times: _StepTimes):
    """`cls` (a GRPOTrainer) with its phases timed into `times`."""

    @contextlib.contextmanager
    def clock(name):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            times.phase(name, time.perf_counter() - t0)

    class Timed(cls):
        def _generate(self, prompts):
            with clock("rollout_s"):
                return super()._generate(prompts)

        def _calculate_rewards(self, *args, **kwargs):
            with clock("rollout_s"):
                return super()._calculate_rewards(*args, **kwargs)

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            if torch.is_grad_enabled():
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)
            with clock("logprob_s"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            times.phase("sample_tokens", int(out["prompt_mask"].sum() + out["completion_mask"].sum()))
            return out

    return Timed


def run_trl(case: Case, seed: int, steps: int, work: pathlib.Path, dualkv: bool,
            overrides: tuple[str, ...] = ()) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from hetrl.data.rewards import completion_text
    from hetrl.integrations.trl import with_dualkv
    from hetrl.trainer.evaluation import evaluate, paired_comparison
    from hetrl.trainer.rollout import RolloutWorker
    from hetrl.trainer.run import build_rewards, build_source, python_fields

    name = "trl-dualkv" if dualkv else "trl"
    out = work / f"{name}-{case.name}-{seed}"
    out.mkdir(parents=True, exist_ok=True)
    cfg, rows, evals = job(case, seed, steps, str(out), overrides)
    if rows is not None:    # as hetrl.train records rows given from Python
        cfg = dataclasses.replace(cfg, **python_fields(cfg.data, cfg.eval_data, rows, evals, None))
    model, tokenizer = _load(cfg)
    model_dir = out / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    source = build_source(cfg, tokenizer, rows, evals, model.config)
    rewards = build_rewards(cfg, source)
    examples, _, _ = source.train_examples(0, steps * cfg.prompts_per_step)   # hetrl's prompts, in hetrl's order
    by_index = [e.row for e in examples]
    times = _StepTimes(cfg.mini_batches)

    def reward(completions, row_index, **_):
        times.phase("rows", sorted(set(row_index)))     # which prompts this step trained on (the same as hetrl's)
        picked = [by_index[i] for i in row_index]
        return rewards.score(picked, [r["prompt"] for r in picked], [completion_text(c) for c in completions]).total

    reward.__name__ = "_".join(rewards.names)
    data = Dataset.from_list([{"prompt": r["prompt"], "row_index": i} for i, r in enumerate(by_index)])
    worker = RolloutWorker(model.eval(), tokenizer)
    before, _ = evaluate(cfg, source, rewards, worker, out / "eval_step_0.jsonl")
    del worker, model

    class Clock(TrainerCallback):
        def on_step_begin(self, *_, **__):
            times.begin()

        def on_step_end(self, *_, **__):
            times.end()

    cls = _timed(with_dualkv(GRPOTrainer) if dualkv else GRPOTrainer, times)
    trainer = cls(model=str(model_dir), reward_funcs=[reward], args=trl_args(cfg, seed, str(out / "trl")),
                  train_dataset=data, processing_class=tokenizer, callbacks=[Clock()])
    trainer.train()
    worker = RolloutWorker(trainer.model.eval(), tokenizer)
    after, means = evaluate(cfg, source, rewards, worker, out / f"eval_step_{steps}.jsonl")
    rewards.close()
    return {"steps": times.rows, "eval_accuracy_before": sum(before) / len(before),
            "eval_accuracy_after": means.get("eval_accuracy"), **paired_comparison(before, after)}


# ----------------------------------------------------------------------------------------------- the table


def kl_of(rec: dict) -> float:
    """The run's KL coefficient (TRL's beta). Records from before it was recorded ran the grpo preset of the time,
    kl_coef 0.001, unless their overrides set it."""
    if "kl_coef" in rec:
        return rec["kl_coef"]
    for o in rec.get("overrides", ()):
        if o.startswith(("kl_coef=", "beta=")):
            return float(o.split("=", 1)[1])
    return 0.001


def label(rec: dict) -> str:
    """The table a record belongs to: its case, and the KL where it ran one (runs with and without a reference
    pass are not one comparison)."""
    kl = kl_of(rec)
    return rec["case"] if kl == 0 else f"{rec['case']}, kl_coef={kl:g}"


def _key(rec: dict) -> tuple:
    return rec["case"], rec["system"], rec["seed"], rec["steps_asked"], tuple(rec.get("overrides", ())), kl_of(rec)


def latest(records: list[dict]) -> list[dict]:
    """The last record of each (case, system, seed, steps, overrides): a run made again (`again`, after a change
    to that system's code) supersedes the earlier one, which stays in the .jsonl as history."""
    last = {_key(r): r for r in records}
    return [r for r in records if last[_key(r)] is r]


def back_to_back(records: list[dict]) -> list[dict]:
    """hetrl and stock TRL runs of one case and seed made in one invocation, one after the other: the comparison
    this VM's varying speed disturbs least. An invocation is recognised by the matmul peaks measured at its start
    (`machine`, measured once per invocation); every record counts, superseded ones too."""
    groups: dict = {}
    for r in records:
        if r["system"] in ("hetrl", "trl") and r.get("steps"):
            key = (label(r), r["seed"], json.dumps(r["machine"]["matmul_gflops"], sort_keys=True))
            groups.setdefault(key, {})[r["system"]] = r
    out = []
    for (case, seed, _), pair in groups.items():
        if len(pair) == 2:
            step = {k: statistics.median(s["step_s"] for s in (v["steps"][1:] or v["steps"])) for k, v in pair.items()}
            out.append({"case": case, "seed": seed, "revision": pair["hetrl"].get("revision") or "unrecorded",
                        "date": pair["hetrl"]["date"], "hetrl_step_s": step["hetrl"], "trl_step_s": step["trl"],
                        "ratio": step["hetrl"] / step["trl"],
                        "fp32_peak_gflops": pair["hetrl"]["machine"]["matmul_gflops"]["fp32"],
                        "bf16_peak_gflops": pair["hetrl"]["machine"]["matmul_gflops"]["bf16"],
                        "flags": pair["hetrl"]["machine"].get("flags", [])})
    return out


def summarise(records: list[dict]) -> dict:
    """Per (case, system): step times (median over each run's steps 2.., then mean / spread over seeds), phases,
    tokens/s, effective FLOP/s, held-out accuracy over seeds; and each system's step-time ratio to stock TRL.
    Only the latest record of each run counts (`latest`)."""
    out: dict = {}
    for rec in latest(records):
        out.setdefault(label(rec), {}).setdefault(rec["system"], []).append(rec)
    table = {}
    for case, systems in out.items():
        table[case] = {}
        for system, recs in systems.items():
            per_run = []
            for r in recs:
                steps = r["steps"][1:] or r["steps"]      # step 1 carries one-off warm-up
                med = {k: statistics.median(s[k] for s in steps) for k in ("step_s", "rollout_s", "logprob_s",
                                                                           "update_s")}
                tokens = statistics.median(s["sample_tokens"] for s in steps)
                flops = 12 * r["matmul_params"] * tokens
                per_run.append({**med, "tokens_per_s": tokens / med["step_s"],
                                "effective_gflops": flops / med["step_s"] / 1e9,
                                "acc_after": r.get("eval_accuracy_after"), "acc_before": r.get("eval_accuracy_before"),
                                "seed": r["seed"], "peaks": r["machine"]["matmul_gflops"]})
            row = {"seeds": [p["seed"] for p in per_run],
                   "revisions": sorted({r.get("revision") or "unrecorded" for r in recs}),
                   "dates": sorted({r["date"] for r in recs})}
            for k in ("step_s", "rollout_s", "logprob_s", "update_s", "tokens_per_s", "effective_gflops"):
                row[k] = statistics.mean(p[k] for p in per_run)
            # each run against the peaks measured at the start of its own invocation
            row["of_fp32_peak"] = statistics.mean(p["effective_gflops"] / p["peaks"]["fp32"] for p in per_run)
            row["of_bf16_peak"] = statistics.mean(p["effective_gflops"] / p["peaks"]["bf16"] for p in per_run)
            row["step_s_runs"] = [p["step_s"] for p in per_run]
            # the step in units of the machine's speed at the time: seconds x the fp32 matmul peak measured at the
            # start of the run's invocation (GFLOP of peak matmul per step), for ratios across invocations
            row["step_peak_gflop"] = statistics.mean(p["step_s"] * p["peaks"]["fp32"] for p in per_run)
            accs = [p["acc_after"] for p in per_run if p["acc_after"] is not None]
            base = case.split(",")[0]
            if accs and CASES.get(base, Case(base, ())).accuracy:
                row["accuracy_after"] = {"mean": statistics.mean(accs), "min": min(accs), "max": max(accs),
                                         "runs": accs}
                row["accuracy_before"] = statistics.mean(p["acc_before"] for p in per_run)
            table[case][system] = row
        if "trl" in table[case]:
            for system, row in table[case].items():
                row["step_time_vs_stock_trl"] = row["step_s"] / table[case]["trl"]["step_s"]
                row["peak_normalised_vs_stock_trl"] = row["step_peak_gflop"] / table[case]["trl"]["step_peak_gflop"]
    return table


def markdown(table: dict, records: list[dict]) -> str:
    m = records[0]["machine"]
    hosts = list(dict.fromkeys(f"{r['machine']['model']} ({', '.join(r['machine']['flags'])})" for r in records))
    fp32 = [r["machine"]["matmul_gflops"]["fp32"] for r in records]
    bf16 = [r["machine"]["matmul_gflops"]["bf16"] for r in records]
    lines = ["# `hetrl train` against TRL 1.16's GRPOTrainer, whole steps", "",
             f"`hetrl bench train` on {' and on '.join(hosts)} (the VM's host changed between invocations; each "
             f"record keeps its own), {m['cpus']} cores, torch "
             f"{m['torch']} with {m['torch_threads']} threads; 1024^3 matmul peaks measured at the start of each "
             f"invocation: fp32 {min(fp32):.1f}-{max(fp32):.1f} GFLOP/s, bf16 {min(bf16):.1f}-{max(bf16):.1f} "
             "GFLOP/s (this VM's throughput varies between invocations; each run is compared with its own). Runs one "
             "after the other; raw per-step numbers in train_vs_trl.jsonl. Step times: each run's median over its "
             "steps after the first, then the mean over seeds. One step = one rollout batch (prompts x N samples) "
             "and its optimizer steps (2 on both systems). Both systems at fp32 (hetrl precision=fp32, TRL bf16=False) "
             "unless a record's overrides say otherwise. A case named with `kl_coef=...` ran a KL to a frozen "
             "reference on both systems (TRL's beta; a reference log-prob pass per step): the grpo preset had it "
             "until 2026-11-28; without it, no KL and no reference.", "",
             "`effective GFLOP/s` counts the model FLOPs of the standard per-sample computation (12 x matmul "
             "weights per sample token: a rollout forward, two log-prob forwards, a forward + backward) over the "
             "step time: the same work for every system, so a system that skips repeated prompt work is credited "
             "with it, and can exceed the matmul peak. What the shared-prompt rollout alone gained is measured in "
             "[rollout.md](rollout.md).", ""]
    for case, systems in table.items():
        lines += [f"## Case `{case}`", "",
                  "| system | seeds | step s (each seed) | vs stock TRL | rollout s | log-probs s | update s | "
                  "tokens/s | effective GFLOP/s (of fp32 / bf16 peak) | held-out accuracy after (mean, min-max) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---|---|"]
        for system in SYSTEMS:
            if system not in systems:
                continue
            r = systems[system]
            acc = r.get("accuracy_after")
            acc_s = (f"{acc['mean']:.3f} ({acc['min']:.2f}-{acc['max']:.2f}); before {r['accuracy_before']:.2f}"
                     if acc else "-")
            ratio = f"{r['step_time_vs_stock_trl']:.3f}" if "step_time_vs_stock_trl" in r else "-"
            each = f" ({', '.join(f'{x:.1f}' for x in r['step_s_runs'])})" if len(r["step_s_runs"]) > 1 else ""
            lines.append(f"| {system} | {', '.join(map(str, r['seeds']))} | {r['step_s']:.1f}{each} | {ratio} | "
                         f"{r['rollout_s']:.1f} | {r['logprob_s']:.1f} | {r['update_s']:.1f} | "
                         f"{r['tokens_per_s']:.0f} | {r['effective_gflops']:.1f} ({r['of_fp32_peak']:.0%} / "
                         f"{r['of_bf16_peak']:.0%}) | {acc_s} |")
        lines += ["", "Code and dates of these runs: " + "; ".join(
            f"{system} {', '.join(systems[system]['revisions'])} ({', '.join(systems[system]['dates'])})"
            for system in SYSTEMS if system in systems) + ".", ""]
        superseded = sum(1 for r in records if label(r) == case) - sum(len(x["seeds"]) for x in systems.values())
        if superseded:
            lines += [f"{superseded} earlier run(s) of this case were made again after a code change; the table "
                      "shows the latest of each, train_vs_trl.jsonl keeps all.", ""]
    lines += ["## Against issue #17's targets", ""]
    for case, rows in table.items():
        target = {"default": 4, "long": 6}.get(case.split(",")[0])
        if target is None:
            continue
        if "hetrl" in rows and "trl" in rows:
            ratio = rows["hetrl"]["step_time_vs_stock_trl"]
            norm = rows["hetrl"]["peak_normalised_vs_stock_trl"]
            lines.append(f"- `{case}`: hetrl's step is {ratio:.3f} of stock TRL's (1/{1 / ratio:.1f}); the target is "
                         f"<= 1/{target}: {'met' if ratio <= 1 / target else 'NOT met'}. Each step time scaled by "
                         f"the matmul peak measured at the start of its invocation (this VM's speed varies between "
                         f"invocations), the ratio is {norm:.3f} (1/{1 / norm:.1f}): "
                         f"{'met' if norm <= 1 / target else 'NOT met'} that way.")
        accs = {s: r["accuracy_after"] for s, r in rows.items() if "accuracy_after" in r}
        if "hetrl" in accs and "trl" in accs:
            h, t = accs["hetrl"], accs["trl"]
            spread = max(h["max"] - h["min"], t["max"] - t["min"])
            lines.append(f"- `{case}` held-out accuracy: hetrl {h['mean']:.3f} over {len(h['runs'])} seeds, stock TRL "
                         f"{t['mean']:.3f} over {len(t['runs'])}; the larger spread (max - min) is {spread:.3f}; "
                         f"hetrl {'is not' if h['mean'] >= t['mean'] - spread else 'IS'} below TRL by more than it"
                         + ("" if min(len(h["runs"]), len(t["runs"])) >= 3 else " (fewer than 3 seeds: not yet the "
                                                                              "comparison the issue asks for)")
                         + ".")
    pairs = back_to_back(records)
    if pairs:
        lines += ["", "Back to back in one invocation (hetrl, then stock TRL; the same measured peak for both), the "
                  "comparison this VM's varying speed disturbs least:", ""]
        target = {"default": 4, "long": 6}
        for p in pairs:
            t = target.get(p["case"].split(",")[0])
            lines.append(f"- `{p['case']}` seed {p['seed']} ({p['revision']}, {', '.join(p.get('flags', []))}; peaks "
                         f"fp32 {p['fp32_peak_gflops']:.0f}, bf16 {p.get('bf16_peak_gflops', 0):.0f} GFLOP/s): "
                         f"hetrl {p['hetrl_step_s']:.1f} s, stock TRL {p['trl_step_s']:.1f} s: "
                         f"{p['ratio']:.3f} (1/{1 / p['ratio']:.1f})"
                         + (f"; the target <= 1/{t}: {'met' if p['ratio'] <= 1 / t else 'NOT met'}" if t else "") + ".")
    lines += ["", "## What differs between the two systems", ""] + [f"- {k}" for k in KNOBS] + [""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- driver


def machine_with_peaks() -> dict:
    """The machine with its fp32 and bf16 matmul peaks, measured now (each run's step is read against them)."""
    peaks = {"fp32": harness.matmul_gflops(torch.float32), "bf16": harness.matmul_gflops(torch.bfloat16)}
    return {**harness.machine(), "matmul_gflops": peaks}


def write_report(out: pathlib.Path, records: list[dict]) -> dict:
    """OUT/train_vs_trl.json and .md from every record in the file."""
    table = summarise(records)
    (out / f"{RESULTS}.json").write_text(json.dumps({"table": table, "back_to_back": back_to_back(records),
                                                    "knobs": KNOBS}, indent=2))
    (out / f"{RESULTS}.md").write_text(markdown(table, records))
    return table


def read_records(out: pathlib.Path) -> list[dict]:
    store = out / f"{RESULTS}.jsonl"
    return [json.loads(line) for line in open(store)] if store.exists() else []



def main(cases: list[str], systems: list[str], seeds: list[int], steps: int | None, out: pathlib.Path,
         work: pathlib.Path | None = None, overrides: tuple[str, ...] = (), again: bool = False) -> dict:
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    for c in cases:
        if c not in CASES:
            raise ValueError(f"--case: {c!r} is not one of {', '.join(CASES)}")
    for o in overrides:   # the benchmark sets these per run; --set's would be overridden (they were, silently)
        key = o.partition("=")[0]
        if key in ("steps", "seed", "out_dir"):
            flag = {"steps": "--steps N", "seed": "--seeds S [S ...]", "out_dir": "--work DIR"}[key]
            raise ValueError(f"--set {o}: the benchmark sets {key} for each run; use {flag}")
    if overrides:
        from hetrl.trainer.config import load_config

        try:   # a bad key or value, before any run
            load_config(None, [BENCH_PRECISION, *overrides])
        except ValueError as e:
            raise ValueError(f"--set: {str(e).removeprefix('the command line: ')}") from None
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{RESULTS}.jsonl"
    records = read_records(out)
    done = set() if again else {_key(r) for r in records}
    work = work or pathlib.Path(tempfile.mkdtemp(prefix="hetrl-bench-train-"))
    torch.set_num_threads(os.cpu_count() or 1)
    mach = params = None
    code = harness.revision()      # the code this invocation runs (read now: the tree may change while it runs)
    for case_name in cases:
        case = CASES[case_name]
        n = steps or (2 if case.few_shot_tokens else 16)
        kl = _config(case, 0, n, str(work / "probe"), overrides).kl_coef   # the case's, whatever the seed
        for seed in seeds:
            for system in systems:
                if (case_name, system, seed, n, tuple(overrides), kl) in done:
                    print(f"{case_name} {system} seed {seed}: in {store} already", flush=True)
                    continue
                if mach is None:      # measured once per invocation, before its first run
                    mach = machine_with_peaks()
                    print(f"matmul peaks: fp32 {mach['matmul_gflops']['fp32']:.1f}, bf16 "
                          f"{mach['matmul_gflops']['bf16']:.1f} GFLOP/s", flush=True)
                    cfg0 = job(case, 0, 1, str(work / "probe"), overrides)[0]
                    params = matmul_params(_load(cfg0)[0])
                print(f"== {case_name} {system} seed {seed}, {n} steps", flush=True)
                t0 = time.perf_counter()
                if system == "hetrl":
                    got = run_hetrl(case, seed, n, work, overrides)
                else:
                    got = run_trl(case, seed, n, work, system == "trl-dualkv", overrides)
                rec = {"case": case_name, "system": system, "seed": seed, "steps_asked": n,
                       "overrides": list(overrides), "kl_coef": kl, "machine": mach,
                       "matmul_params": params, "wall_s": time.perf_counter() - t0,
                       "date": time.strftime("%Y-%m-%d"), "revision": code, **got}
                with open(store, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                records.append(rec)
                write_report(out, records)
                print(json.dumps({k: v for k, v in rec.items() if k not in ("steps", "machine")}), flush=True)
    return summarise(records)
