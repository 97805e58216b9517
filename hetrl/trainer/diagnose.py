"""`hetrl diagnose mismatch`: where the rollout-vs-trainer log-prob mismatch comes from.

One rollout batch of a run (its config, model, prompts and rollout engine) is scored three ways: the rollout
engine's own log-probs of its samples, the trainer's at the run's precision (and in fp32 where the run is
bf16-mixed), and an fp64 forward of the same weights through DualKV's exact path (norms in fp64 too:
hetrl.models.float64_norms). Each side's distance from fp64 says which one drifts: an engine far from fp64 while
the trainer is close is the engine's (kernels, bf16 weights, a stale weight sync); both at the same distance is
the shared precision's noise. Written as mismatch.json, mismatch.md (a table by token position) and mismatch.png.

A run with tools or an environment is scored on its multi-turn episodes, rolled out as the run rolls them out
(the same rounds on either engine): the model's own tokens only, as the run's mismatch and correction count them
(tool results are context, log-prob 0 on the engine's side); positions count from the start of the response, tool
tokens included.
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch
from tqdm import tqdm

from hetrl.algo import mismatch_metrics, to_padded
from hetrl.models import float64_norms
from hetrl.trainer import build, episodes, files
from hetrl.trainer.config import load_config
from hetrl.trainer.engine import make_engine
from hetrl.trainer.evaluation import replies
from hetrl.trainer.precision import FP32, RunPrecision

BUCKETS = (0, 4, 16, 64, 256, 1024)
FP64 = RunPrecision("fp64", autocast=False)


def mismatch(config: str | None, overrides: list[str] = (), out: str | pathlib.Path | None = None,
             prompts: int | None = None) -> dict:
    """Score one rollout batch of the run `config` (+ `overrides`) three ways; -> the report (also written to `out`,
    by default the run's out_dir/diagnose_mismatch). `prompts`: how many of the run's prompts (default
    prompts_per_step), each with responses_per_prompt samples."""
    # the run's own start and data path (run imports the loop; not at import)
    from hetrl.trainer.run import build_source, decide_run, load_policy

    cfg = load_config(config, list(overrides))
    if cfg.executor != "local":
        raise ValueError("hetrl diagnose mismatch scores one batch in this process; use executor=local (the "
                         "engines and precisions are those of the run)")
    out = pathlib.Path(cfg.out_dir) / "diagnose_mismatch" if out is None else pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    device, precision, engine_name = decide_run(cfg)
    tools, environment_factory = episodes.resolve_tools(cfg, None, None)
    model, tokenizer = load_policy(cfg, device)
    agent = episodes.agent_from_config(cfg, tokenizer, tools, environment_factory)
    exact_model = float64_norms(copy.deepcopy(model).double().eval())
    source = build_source(cfg, agent.render_tokenizer(tokenizer) if agent else tokenizer, model_config=model.config)
    examples, _, _ = source.train_examples(0, prompts or cfg.prompts_per_step)
    engine = make_engine(cfg, model, tokenizer, max(len(e.prompt_ids) for e in examples), precision, agent,
                         rollout_engine=engine_name)
    try:
        with tqdm(total=4, desc="diagnose mismatch", unit="pass") as bar:
            sampled = replies(engine.worker, engine.episodes, examples, cfg.responses_per_prompt, cfg.max_new_tokens,
                              temperature=cfg.temperature, top_p=cfg.top_p, logprobs=True)
            bar.update()
            groups = [(episodes.group_prompt(e, g).prompt_ids, [s.tokens for s in g])
                      for e, g in zip(examples, sampled)]
            samples = [s for g in sampled for s in g]
            sides = {f"rollout engine ({_engine_label(engine_name, engine)})":
                     torch.cat([s.logprobs for s in samples]).double()}
            sides[f"trainer ({precision.name})"] = engine.learner.logprobs(groups).double()
            bar.update()
            if precision.autocast:
                sides["trainer (fp32)"] = build.scorer(cfg, engine.policy.module, FP32).logprobs(groups).double()
            bar.update()
            exact = build.scorer(cfg, exact_model, FP64).logprobs(groups)
            bar.update()
    finally:
        engine.close()
    lens = torch.tensor([len(r) for _, rs in groups for r in rs])
    report = _report(cfg, exact, sides, lens, episodes.loss_mask(samples), engine_name, precision)
    files.write_text(out / "mismatch.json", json.dumps(report, indent=2))
    files.write_text(out / "mismatch.md", _table(report))
    _plot(report, out / "mismatch.png")
    return report | {"out": str(out)}


def _engine_label(name: str, engine) -> str:
    if name == "vllm":
        return f"vllm, {str(engine.worker.dtype).split('.')[-1]}"
    return f"hf, {'bf16 copy' if engine.bf16_rollout else engine.precision.name}"


def _report(cfg, exact: torch.Tensor, sides: dict, lens: torch.Tensor, model_tokens: torch.Tensor | None,
            engine_name: str, precision) -> dict:
    """`model_tokens` [K] bool: the model's own tokens (None: all are); tool tokens are context, not scored."""
    flat = torch.ones(int(lens.sum()), dtype=torch.bool) if model_tokens is None else model_tokens
    mask = to_padded(flat.double(), lens)
    ref = to_padded(exact, lens)
    per_side = {}
    for name, logp in sides.items():
        m = mismatch_metrics(ref, to_padded(logp, lens), mask, buckets=BUCKETS)
        per_side[name] = {k.removeprefix("mismatch/"): v for k, v in m.items()}
    names = list(sides)
    between = mismatch_metrics(to_padded(sides[names[1]], lens), to_padded(sides[names[0]], lens), mask,
                               buckets=BUCKETS)
    engine_gap, trainer_gap = (per_side[n]["abs_diff_mean"] for n in names[:2])
    if engine_gap > 2 * trainer_gap:
        verdict = (f"the rollout engine drifts: {engine_gap:.2e} mean |dlogp| from fp64 against the trainer's "
                   f"{trainer_gap:.2e}; look at the engine (its kernels, its dtype, a stale weight sync)")
    elif trainer_gap > 2 * engine_gap:
        verdict = (f"the trainer drifts: {trainer_gap:.2e} mean |dlogp| from fp64 against the engine's "
                   f"{engine_gap:.2e}; the trainer's precision ({precision.name}) is the larger share")
    else:
        verdict = (f"both sides are as far from fp64 ({engine_gap:.2e} and {trainer_gap:.2e} mean |dlogp|): the "
                   f"mismatch between them is their shared precision's noise, not one side's error")
    return {"config": {k: cfg.to_dict()[k] for k in ("model", "rollout_engine", "precision", "temperature",
                                                    "max_new_tokens", "responses_per_prompt", "seed")},
            "rollout_engine": engine_name, "precision": precision.name, "tokens": int(flat.sum()),
            "tool_tokens": int((~flat).sum()), "responses": int(lens.numel()), "buckets": list(BUCKETS),
            "vs_fp64": per_side,
            "engine_vs_trainer": {k.removeprefix("mismatch/"): v for k, v in between.items()}, "verdict": verdict}


def _bucket_keys(report) -> list[tuple[str, str]]:
    b = report["buckets"]
    return [(f"abs_diff_mean_pos_{lo}_{hi}", f"{lo}-{hi}") for lo, hi in zip(b, b[1:])] + \
        [(f"abs_diff_mean_pos_{b[-1]}_inf", f"{b[-1]}+")]


def _table(report) -> str:
    cols = [("abs_diff_mean", "mean"), ("abs_diff_p99", "p99"), ("abs_diff_max", "max"), ("kl_k3", "KL k3"),
            ("ratio_out_of_range_frac", "ratio outside [0.5, 2]")]
    tools = f" (tool results' {report['tool_tokens']} tokens not scored)" if report.get("tool_tokens") else ""
    lines = [f"# Rollout-vs-trainer mismatch: {report['tokens']} tokens of {report['responses']} responses{tools}",
             "", f"Verdict: {report['verdict']}.", "", "|Δ log p| from an fp64 forward of the same weights:", "",
             "| side | " + " | ".join(c for _, c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    rows = dict(report["vs_fp64"], **{"engine vs trainer": report["engine_vs_trainer"]})
    for name, m in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{m.get(k, 0.0):.2e}" for k, _ in cols) + " |")
    keys = [(k, label) for k, label in _bucket_keys(report) if any(k in m for m in rows.values())]
    lines += ["", "Mean |Δ log p| by the token's position in its response:", "",
              "| side | " + " | ".join(label for _, label in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for name, m in rows.items():
        lines.append(f"| {name} | " + " | ".join(f"{m[k]:.2e}" if k in m else "-" for k, _ in keys) + " |")
    return "\n".join(lines) + "\n"


def _plot(report, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, label) for k, label in _bucket_keys(report)
            if any(k in m for m in report["vs_fp64"].values())]
    fig, ax = plt.subplots(figsize=(7, 4))
    rows = dict(report["vs_fp64"], **{"engine vs trainer": report["engine_vs_trainer"]})
    for name, m in rows.items():
        xs = [i for i, (k, _) in enumerate(keys) if k in m]
        ax.plot(xs, [max(m[keys[i][0]], 1e-12) for i in xs], marker="o",
                linestyle="--" if name == "engine vs trainer" else "-",
                label=name if name == "engine vs trainer" else f"{name} vs fp64")
    ax.set_xticks(range(len(keys)), [label for _, label in keys])
    ax.set_yscale("log")
    ax.set_xlabel("token position in the response")
    ax.set_ylabel("mean |Δ log p|")
    ax.set_title(f"{report['config']['model']}: {report['tokens']} tokens, run precision {report['precision']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.write_bytes(path, _png(fig))
    plt.close(fig)


def _png(fig) -> bytes:
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()
