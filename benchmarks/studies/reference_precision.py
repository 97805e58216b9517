"""A bf16-mixed run's KL to its reference at step 1 (issue 45, the one precision decision): the policy scores under
bf16 autocast with fp32 master weights; `build.frozen` holds the reference's matmul weights in bf16 and the rest in
fp32 (until 2026-11-28 it held the whole copy in bf16, whose residual stream then ran in bf16).
This scores the same sampled responses (the embedded SmolLM2-135M, temperature 1, as a rollout samples) with the
policy and with each candidate reference, and reports the k3 KL between them (`kl_penalty`'s low_var_kl, what a
run's `kl` logs): 0 is what a KL to an untrained policy's own copy should read. It also reads the step-1 `kl` of
the default_recipe study's runs where their folders are here (runs/default_recipe, not committed).

    python -m benchmarks.studies.reference_precision

About a minute on 2 cores; results: benchmarks/results/reference_precision.md (and .json).
"""

from __future__ import annotations

import copy
import json
import pathlib

import torch

from hetrl.algo.losses import kl_penalty
from hetrl.bench.harness import machine, revision, utc_now, write_results
from hetrl.models import load_model
from hetrl.trainer.build import frozen
from hetrl.trainer.precision import RunPrecision

ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPTS = ("What is 12 + 30? Answer:", "Compute 7 * 8. Answer:", "What is 100 - 37? Answer:", "Solve 9 + 16. Answer:")
NEW_TOKENS = 64
SAMPLES = 4   # responses per prompt


def token_logprobs(model, ids, mask, start: int, amp: RunPrecision) -> torch.Tensor:
    with torch.no_grad(), amp.amp(model):
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp[:, start - 1:][mask[:, start:].bool()]


def step1_kl() -> dict:
    out = {}
    for run in sorted((ROOT / "runs" / "default_recipe").glob("grpo-kl0.001-*")):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        first = next((r for r in rows if r.get("step") == 1 and "kl" in r), None)
        if first is not None:
            out[run.name] = first["kl"]
    return out


def main() -> None:
    torch.manual_seed(0)
    model, tok = load_model()
    model.eval()
    mixed = RunPrecision("bf16-mixed", autocast=True)
    enc = tok([p for p in PROMPTS for _ in range(SAMPLES)], return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        ids = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(ids[:, enc["input_ids"].shape[1]:])], 1)
    start = enc["input_ids"].shape[1]
    policy = token_logprobs(model, ids, mask, start, mixed)
    candidates = {
        "build.frozen: matmul weights bf16, embeddings and norms fp32": frozen(copy.deepcopy(model), mixed),
        "all bf16 (build.frozen until 2026-11-28)": copy.deepcopy(model).requires_grad_(False).to(torch.bfloat16),
        "fp32 copy under the same autocast": copy.deepcopy(model).requires_grad_(False),
    }
    rows = [{"reference": name, "k3_kl": kl_penalty(policy, token_logprobs(m, ids, mask, start, mixed),
                                                                "low_var_kl").mean().item(),
             "weight_dtype": ", ".join(sorted({str(p.dtype) for p in m.parameters()})),
             "weight_bytes": sum(p.numel() * p.element_size() for p in m.parameters())}
            for name, m in candidates.items()]
    res = {"rows": rows, "tokens": int(policy.numel()), "step1_kl": step1_kl(), "machine": machine(),
           "revision": revision(), "date": utc_now()}
    text = "\n".join([
        "# The KL to the reference at step 1 under bf16-mixed",
        "",
        f"`python -m benchmarks.studies.reference_precision` at {res['revision']}, {res['date']}: SmolLM2-135M "
        f"(embedded), {len(PROMPTS)} prompts x {SAMPLES} responses of {NEW_TOKENS} sampled tokens at temperature 1 "
        f"({res['tokens']} response tokens), the policy scored under bf16 autocast with fp32 weights; k3 KL of each "
        "reference against it (0 is right for an untrained policy).",
        "",
        "| reference | weights | weight MB | k3 KL vs the policy |",
        "|---|---|---:|---:|",
        *[f"| {r['reference']} | {r['weight_dtype']} | {r['weight_bytes'] / 1e6:.0f} | {r['k3_kl']:.4g} |"
          for r in rows],
        "",
        "Step-1 `kl` logged by the default_recipe study's runs (runs/default_recipe, where present): "
        + (", ".join(f"{k} {v:.4g}" for k, v in res["step1_kl"].items()) or "none here") + ". Not a numerics "
        "probe: the default job makes 2 optimizer steps a step, so a step's `kl` can include a mini-batch scored "
        "by an already updated policy (one fp32 seed logs 0.2 at step 1).",
    ]) + "\n"
    write_results(ROOT / "benchmarks" / "results", "reference_precision", res, text)
    print(text)


if __name__ == "__main__":
    main()
