"""`hetrl bench demo`: DualKV against the standard layout on one real group of the embedded model.

One prompt (a few-shot arithmetic chat), N responses sampled from SmolLM2-135M itself, then:
the largest log-prob difference between the shared-prompt path and the standard forward (the
HF model on the N full sequences), and the time of one policy-update micro-step (forward,
backward) and one no-grad log-prob pass in each layout, measured interleaved, median of the
repeats after one warm-up. Times are wall-clock on this machine; nothing here is estimated.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from hetrl.bench.harness import machine, median_times
from hetrl.dualkv import pack_groups, shared_prompt_logprobs
from hetrl.models import EMBEDDED, load_model

FEW_SHOT = [
    ("What is 23 + 48?", "23 + 48 = 71. The answer is 71."),
    ("What is 91 - 37?", "91 - 37 = 54. The answer is 54."),
    ("What is 12 * 6?", "12 * 6 = 72. The answer is 72."),
    ("What is 150 + 275?", "150 + 275 = 425. The answer is 425."),
    ("What is 64 / 8?", "64 / 8 = 8. The answer is 8."),
    ("What is 305 - 129?", "305 - 129 = 176. The answer is 176."),
    ("What is 17 * 4?", "17 * 4 = 68. The answer is 68."),
    ("What is 999 + 1?", "999 + 1 = 1000. The answer is 1000."),
]


@dataclass(frozen=True)
class DemoConfig:
    responses: int = 8
    max_new_tokens: int = 32
    repeats: int = 3
    few_shot: int = 8
    seed: int = 0
    model: str = EMBEDDED


@dataclass(frozen=True)
class DemoResult:
    machine: dict
    config: dict
    prompt_tokens: int
    response_tokens: list
    packed_tokens: int
    standard_tokens: int
    rho: float
    max_abs_logprob_diff: float
    update_s: dict
    logprob_s: dict
    update_speedup: float
    logprob_speedup: float


def _prompt_ids(tokenizer, n_shots: int) -> list[int]:
    messages = [{"role": "system", "content": "You are a careful calculator. End with 'The answer is N.'"}]
    for q, a in FEW_SHOT[:n_shots]:
        messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    messages.append({"role": "user", "content": "What is 358 + 467?"})
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = enc["input_ids"] if not torch.is_tensor(enc) else enc
    return ids[0].tolist()


def sample_responses(model, tokenizer, prompt: list[int], n: int, max_new_tokens: int) -> list[list[int]]:
    """N sampled continuations, each cut after its first EOS (kept: its log-prob is trained too)."""
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=True, temperature=1.0, top_p=1.0,
                             max_new_tokens=max_new_tokens, num_return_sequences=n, pad_token_id=eos)
    responses = []
    for row in out[:, len(prompt):].tolist():
        responses.append(row[: row.index(eos) + 1] if eos in row else row)
    return responses


def run_demo(cfg: DemoConfig) -> DemoResult:
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model)
    prompt = _prompt_ids(tokenizer, cfg.few_shot)
    responses = sample_responses(model, tokenizer, prompt, cfg.responses, cfg.max_new_tokens)
    batch = pack_groups([(prompt, responses)])

    with torch.no_grad():
        standard = shared_prompt_logprobs(model, batch, impl="reference")
        packed = shared_prompt_logprobs(model, batch, impl="sdpa")
    max_diff = (standard - packed).abs().max().item()

    def update(impl):
        def step():
            model.zero_grad(set_to_none=True)
            shared_prompt_logprobs(model, batch, impl=impl).sum().backward()
        return step

    def logprob(impl):
        def step():
            with torch.no_grad():
                shared_prompt_logprobs(model, batch, impl=impl)
        return step

    update_s = median_times({"standard": update("reference"), "dualkv": update("sdpa")}, cfg.repeats,
                             "update fwd+bwd")
    logprob_s = median_times({"standard": logprob("reference"), "dualkv": logprob("sdpa")}, cfg.repeats,
                              "log-prob pass")
    return DemoResult(
        machine=machine(), config=asdict(cfg), prompt_tokens=len(prompt),
        response_tokens=[len(r) for r in responses], packed_tokens=batch.num_tokens,
        standard_tokens=batch.num_standard_tokens, rho=batch.rho, max_abs_logprob_diff=max_diff,
        update_s=update_s, logprob_s=logprob_s,
        update_speedup=update_s["standard"] / update_s["dualkv"],
        logprob_speedup=logprob_s["standard"] / logprob_s["dualkv"],
    )


def format_result(r: DemoResult) -> str:
    lines = [
        f"model {r.config['model']}, 1 group: prompt {r.prompt_tokens} tokens, {len(r.response_tokens)} sampled "
        f"responses of {min(r.response_tokens)}-{max(r.response_tokens)} tokens",
        f"tokens: standard {r.standard_tokens}, packed {r.packed_tokens}, rho = {r.rho:.2f}",
        f"max |log-prob difference| vs the standard forward: {r.max_abs_logprob_diff:.2e} (fp32)",
        f"{'pass':<22}{'standard s':>12}{'dualkv s':>12}{'speedup':>10}",
        f"{'update (fwd+bwd)':<22}{r.update_s['standard']:>12.3f}{r.update_s['dualkv']:>12.3f}"
        f"{r.update_speedup:>9.2f}x",
        f"{'log-prob (no grad)':<22}{r.logprob_s['standard']:>12.3f}{r.logprob_s['dualkv']:>12.3f}"
        f"{r.logprob_speedup:>9.2f}x",
        f"median of {r.config['repeats']} interleaved rounds after a warm-up; {r.machine['cpus']} CPUs, "
        f"torch {r.machine['torch']} ({r.machine['torch_threads']} threads)",
    ]
    return "\n".join(lines)


def write_result(r: DemoResult, path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(r), f, indent=2)
    os.replace(tmp, path)
