"""Where a `hetrl train` step goes on one device, against the device's peak (#20 item 8): rollout, log-probs and update
seconds, tokens/s and MFU; result: benchmarks/results/train_split_cpu.md (GPU: not run yet).

    python -m benchmarks.train_split --device cuda --out benchmarks/results/gpu
    python -m benchmarks.train_split --device cpu --out benchmarks/results        # the same jobs on the CPU

Each model runs the default job (GRPO, 8 prompts x 8 samples of the default task, 16 new tokens, 2 mini-batches,
precision auto) for `--steps` steps as `python -m hetrl train` in its own process, with a small held-out set
(`eval_size`, only to finish the run) and no checkpoints. The models are real architectures with random weights
(`config:NAME`: the embedded weights cannot reach a GPU machine), so the numbers are speed only;
random weights rarely sample EOS, so every response runs to max_new_tokens.

Per phase, from metrics.jsonl, the median over the steps after the first (the first compiles and warms up):
  rollout    gen_s; tokens/s = generated tokens / s; FLOPs = 2 x active params x (each prompt once + the
             generated tokens): the prefill-once decode's linear layers
  log-probs  logprob_s; tokens/s = packed tokens / s; FLOPs = 2 x active params x packed tokens x the passes the
             run makes (the reference where kl_coef > 0, plus old_logprob_share of a pass: placement.run_workload)
  update     update_s; tokens/s = packed tokens / s; FLOPs = 6 x active params x packed tokens (8 x with
             gradient checkpointing)
  decode     decode_s per decode step (every row runs to max_new_tokens), against its memory floor: the weights
             and the KV cache one step reads (each group's prompt once, each row's own tokens) over the copy
             bandwidth measured in the run (#20 item 5's HBM floor on a GPU)
With 3 or more steps the last runs under torch.profiler (`profile_step`; --no-profile: not) and is left out of
the medians: the table lists the operators with the most device time (CPU time on a CPU), and torch's operator
table is written beside the results (train_split_DEVICE_profile_MODEL.txt).
Attention FLOPs are left out (short sequences here). MFU = FLOP/s over the device's bf16 peak: the planner
catalog's entry for a GPU it names (hetrl.planner.catalog), or this CPU's bf16 (fp32 for an fp32 run) matmul
peak measured in the run (hetrl.bench.harness).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import subprocess
import sys
import tempfile

from hetrl.bench import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODELS = ("config:smollm2-135m", "config:qwen2.5-0.5b")
JOB = {"eval_size": 8, "checkpoint_every": 0}


def run_job(model: str, device: str, steps: int, work: pathlib.Path, extra: list[str],
            profile: bool = True) -> tuple[dict, list[dict]]:
    """One model's run; with `profile` and at least 3 steps, its last step under torch.profiler (profile_step),
    left out of the medians."""
    out = work / model.replace(":", "_")
    profile_step = steps if profile and steps >= 3 else 0
    cmd = [sys.executable, "-m", "hetrl", "train", f"model={model}", f"device={device}", f"steps={steps}",
           f"out_dir={out}"] + [f"{k}={v}" for k, v in JOB.items()] + [f"profile_step={profile_step}"] + extra
    proc, wall = harness.timed(lambda: subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True))
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads(json.dumps(summary.get("config", {})))
    run = {"command": " ".join(cmd[1:]), "wall_s": wall, "precision": summary.get("precision"), "config": config}
    if profile_step:
        run["profile"] = json.loads((out / f"profile_step_{profile_step}.json").read_text())
        run["profile_table"] = (out / f"profile_step_{profile_step}.txt").read_text()
    return run, rows


def peak_flops(device: str, precision: str) -> tuple[float, str]:
    import torch

    from hetrl.planner.catalog import GPUS, device_type

    if device.startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(device))
        key = device_type(name)
        if key is None:
            raise ValueError(f"{name} is not in the planner catalog; add it to compare MFU")
        return GPUS[key].dense_bf16_flops, f"catalog {key} ({GPUS[key].source})"
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    return (harness.matmul_gflops(dtype, 1024, 3.0) * 1e9,
            f"measured 1024^3 {str(dtype).removeprefix('torch.')} matmul here")


def decode_floor(spec, cfg, precision: str, prompt_tokens: float, bandwidth: float) -> float:
    """Seconds one decode step must take at least: the bytes it must read over the measured copy bandwidth. It
    reads every weight once (bf16 where the rollout samples in bf16, else fp32) and the KV cache of its rows: each
    group's prompt once (the rollout's SharedPrefixCache) and each row's own tokens, on average half of
    max_new_tokens (#20 item 5's HBM floor)."""
    wbytes = 2 if precision == "bf16-mixed" else 4
    rows = min(cfg.rollout_batch_size, cfg.prompts_per_step * cfg.responses_per_prompt)
    groups = max(1, rows // cfg.responses_per_prompt)
    kv_tokens = groups * prompt_tokens + rows * cfg.max_new_tokens / 2
    kv_bytes = spec.kv_bytes_per_token / 2 * wbytes * kv_tokens      # kv_bytes_per_token counts 2-byte values
    return (spec.params * wbytes + kv_bytes) / bandwidth


def phases(model: str, rows: list[dict], run: dict, peak: float, bandwidth: float) -> dict:

    from hetrl.models import load_model
    from hetrl.trainer.config import RunConfig
    from hetrl.trainer.placement import model_spec_from_hf, old_logprob_share
    # the model's shape, from a model built on the CPU (transformers refuses from_pretrained under a meta device)
    spec = model_spec_from_hf(load_model(model)[0].config, model)
    params = spec.active_params
    cfg = RunConfig(**{k: v for k, v in run["config"].items() if k in RunConfig.__dataclass_fields__})
    passes = (1.0 if cfg.kl_coef > 0 else 0.0) + old_logprob_share(cfg, "bf16" if run["precision"] == "bf16-mixed"
                                                                      else "fp32")
    timed = [r for r in rows[1:] if not r.get("profiled")] or rows     # the profiled step's times carry its overhead

    def med(key):
        return statistics.median(r[key] for r in timed)

    generated = med("response_len_mean") * cfg.prompts_per_step * cfg.responses_per_prompt
    packed = med("packed_tokens")
    prompt_once = packed - generated      # each group's prompt once (the packed stream's other tokens)
    train_factor = 8 if cfg.gradient_checkpointing else 6
    out = {"params_active": params, "logprob_passes": passes, "steps_timed": len(timed), "step_s": med("step_s")}
    for name, seconds, tokens, flops in (
            ("rollout", med("gen_s"), generated, 2 * params * (prompt_once + generated)),
            ("logprobs", med("logprob_s"), packed, 2 * params * packed * passes),
            ("update", med("update_s"), packed, train_factor * params * packed)):
        out[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
                     "mfu": flops / seconds / peak if seconds and flops else None}
    # decode per step against the memory floor, where every row ran to max_new_tokens (random weights do): each
    # generate call then runs max_new_tokens decode steps (the first one runs each prompt's last token)
    if all(r.get("truncated_frac") == 1.0 for r in timed):
        calls = math.ceil(cfg.prompts_per_step * cfg.responses_per_prompt / cfg.rollout_batch_size)
        step = med("decode_s") / (calls * cfg.max_new_tokens)
        floor = decode_floor(spec, cfg, run["precision"], prompt_once / cfg.prompts_per_step, bandwidth)
        out["decode"] = {"step_s": step, "floor_s": floor, "over_floor": step / floor}
    return out


def markdown(res: dict) -> str:
    lines = [f"# `hetrl train` per phase on {res['device_name']}", "",
             f"`python -m benchmarks.train_split --device {res['device']}` at {res['revision']}, {res['date']}. "
             f"{res['machine']}; torch {res['torch']}. Peak for MFU: {res['peak_flops'] / 1e12:.3g} TFLOP/s "
             f"({res['peak_source']}); memory bandwidth {res['copy_bytes_per_s'] / 1e9:.0f} GB/s (a 1 GiB copy, read + "
             "written). Decode per step against its memory floor: weights and KV cache read once per step over that "
             f"bandwidth (decode_floor). Default job (GRPO, 8 x 8 samples, 16 new tokens), random-weight models of "
             "real shapes (speed only); medians over the steps after the first (and before a profiled one).", "",
             "| model | precision | step s | rollout s | tok/s | MFU | log-probs s | tok/s | MFU | update s | tok/s | "
             "MFU | decode ms/step | memory floor ms | x floor |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    def num(v):
        return "-" if v is None else f"{v:.0f}"

    for m, r in res["runs"].items():
        p = r["phases"]
        cells = [m, r["precision"], f"{p['step_s']:.2f}"]
        for ph in ("rollout", "logprobs", "update"):
            cells += [f"{p[ph]['seconds']:.2f}", num(p[ph]["tokens_per_s"]), pct(p[ph]["mfu"])]
        d = p.get("decode")
        cells += [f"{d['step_s'] * 1e3:.1f}", f"{d['floor_s'] * 1e3:.2f}", f"{d['over_floor']:.1f}"] if d else ["-"] * 3
        lines.append("| " + " | ".join(cells) + " |")
    for m, r in res["runs"].items():
        prof = r.get("profile")
        if not prof:
            continue
        busy = (f"; the device busy {prof['device_busy_s']:.3f} s ({prof['device_busy_s'] / prof['wall_s']:.0%})"
                if prof["on_device"] else "")
        lines += ["", f"{m}, step {prof['step']} under torch.profiler: {prof['wall_s']:.3f} s wall{busy}; the host's "
                      f"operators {prof['host_s']:.3f} s. Most {'device' if prof['on_device'] else 'CPU'} time:", ""]
        key = "self_device_s" if prof["on_device"] else "self_cpu_s"
        lines += [f"- `{e['name']}`: {e[key] * 1e3:.1f} ms in {e['calls']} calls" for e in prof["top"][:8]]
    lines += ["", "Commands:", ""] + [f"- `{r['command']}` ({r['wall_s']:.0f} s wall)" for r in res["runs"].values()]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--set", nargs="*", default=[], metavar="key=value", help="more overrides for every run")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--work", help="directory for the runs (default: a temporary one)")
    ap.add_argument("--no-profile", action="store_true",
                    help="do not run the last step under torch.profiler (it is by default, from 3 steps)")
    args = ap.parse_args()

    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA GPU here", file=sys.stderr)
        return 2
    work = pathlib.Path(args.work or tempfile.mkdtemp(prefix="hetrl_split_"))
    info = harness.machine()
    res = {"device": args.device, "revision": harness.revision(), "date": harness.utc_now(),
           "torch": torch.__version__, "machine": f"{info['model']}, {info['cpus']} cores",
           "device_name": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda")
           else f"CPU ({info['model']}, {info['torch_threads']} threads)", "runs": {}}
    name = f"train_split_{args.device.split(':')[0]}"
    for model in args.models:
        run, rows = run_job(model, args.device, args.steps, work, args.set, profile=not args.no_profile)
        table = run.pop("profile_table", None)
        if table:       # torch's operator table beside the results (the GPU call tars it into logs.tgz)
            pathlib.Path(args.out).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(args.out) / f"{name}_profile_{model.replace(':', '_')}.txt").write_text(table)
        if "peak_flops" not in res:       # measured after the first run, on an otherwise idle device
            res["peak_flops"], res["peak_source"] = peak_flops(args.device, run["precision"])
            res["copy_bytes_per_s"] = harness.copy_bytes_per_s(args.device)
        run["phases"] = phases(model, rows, run, res["peak_flops"], res["copy_bytes_per_s"])
        run["metrics"] = rows
        res["runs"][model] = run
        harness.write_results(args.out, name, res, markdown(res))      # after every model: a run cut short keeps it
        print(f"{model}: {run['phases']['step_s']:.2f} s/step", flush=True)
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
