"""What DualKV buys inside TRL: TRL 1.16's GRPOTrainer, stock against DualKVGRPOTrainer (hetrl.integrations.trl), its
log-prob passes on one batch; result: benchmarks/results/trl_dualkv.md.

    python -m benchmarks.trl_dualkv [--out benchmarks/results/trl_dualkv.json]

Both trainers are built the same way: the default job's model (embedded SmolLM2-135M-Instruct, fp32, saved once to
a temporary directory for TRL), lr 2e-5, clip 0.2, KL 0.001, temperature 0.7. They get one batch in TRL's own
layout: 8 prompts of the default job (reasoning-gym basic_arithmetic, chat template, left-padded) x 8 completions
of 16 random tokens. This is one generation batch of the default job.

Timed through `_get_per_token_logps_and_entropies`, TRL's one method for every log-prob pass, for each
trainer:
- the old / reference log-probs (no grad);
- one policy pass with its backward, TRL's `compute_loss` on the 64 rows.

Each is timed `--repeats` times (default 3) and the median kept, after a warm-up call.

A whole `trainer.train()` step was tried first, with TRL's defaults. One stock step took several minutes on this
2-core machine (that run's log was not kept). GRPOConfig's default `bf16=True` runs every pass under bf16
autocast, and this CPU has no bf16 matmul (benchmarks/results/precision_cpu.md measures what that costs). So
both trainers are given `bf16=False` here.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from hetrl.bench.harness import machine, median_times, write_json
from hetrl.integrations.trl import with_dualkv
from hetrl.trainer.config import load_config


def dataset(cfg, tokenizer, n: int):
    from datasets import Dataset

    from hetrl.data import TaskSource

    source = TaskSource(cfg.task, cfg.task_config, cfg.seed, cfg.eval_size, tokenizer, cfg.max_prompt_tokens,
                        cfg.prompt_suffix)
    examples, _, _ = source.train_examples(0, n)
    return Dataset.from_list([{"prompt": e.row["prompt"], "answer": str(e.row["answer"])} for e in examples])


def batch(cfg, tokenizer):
    """8 prompts x 8 completions in TRL's layout: (prompt_ids, prompt_mask, completion_ids, completion_mask)."""
    from hetrl.data import TaskSource

    source = TaskSource(cfg.task, cfg.task_config, cfg.seed, cfg.eval_size, tokenizer, cfg.max_prompt_tokens,
                        cfg.prompt_suffix)
    examples, _, _ = source.train_examples(0, 8)
    width = max(len(e.prompt_ids) for e in examples)
    g = torch.Generator().manual_seed(0)
    pid = torch.tensor([[tokenizer.pad_token_id] * (width - len(e.prompt_ids)) + e.prompt_ids
                        for e in examples for _ in range(8)])
    pm = torch.tensor([[0] * (width - len(e.prompt_ids)) + [1] * len(e.prompt_ids) for e in examples for _ in range(8)])
    cid = torch.randint(100, 1000, (64, 16), generator=g)
    return pid, pm, cid, torch.ones(64, 16, dtype=torch.long)


def trainer(cls, model_dir, tokenizer, data):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=64, num_generations=8,
                      max_completion_length=16, temperature=0.7, learning_rate=2e-5, beta=0.001, epsilon=0.2,
                      use_cpu=True, report_to=[], save_strategy="no", gradient_checkpointing=False,
                      # fp32 as hetrl runs on the CPU: GRPOConfig's default bf16=True puts every pass under bf16
                      # autocast, and this CPU has no bf16 matmul (benchmarks/results/precision_cpu.md)
                      bf16=False, model_init_kwargs={"dtype": torch.float32})
    return cls(model=model_dir, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
               train_dataset=data, processing_class=tokenizer)


def measure(t, pid, pm, cid, cm, repeats: int) -> dict:
    ids, am = torch.cat([pid, cid], 1), torch.cat([pm, cm], 1)

    def old():
        with torch.no_grad():
            t._get_per_token_logps_and_entropies(t.model, ids, am, cid.size(1))

    def update():
        inputs = {"prompt_ids": pid, "prompt_mask": pm, "completion_ids": cid, "completion_mask": cm,
                  "advantages": torch.linspace(-1, 1, 64), "old_per_token_logps": None,
                  "ref_per_token_logps": torch.full(cid.shape, -5.0), "num_items_in_batch": cm.sum().float()}
        t.model.zero_grad()
        t.compute_loss(t.model, inputs).backward()

    return {"logprobs_no_grad_s": median_times({"old": old}, repeats)["old"],
            "loss_forward_backward_s": median_times({"update": update}, repeats)["update"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/trl_dualkv.json")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up one (median kept)")
    args = ap.parse_args()
    from trl import GRPOTrainer

    from hetrl.models import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = load_config("examples/runs/default.yaml", ["precision=fp32"])   # TRL runs fp32 here too
    model, tokenizer = load_model(cfg.model)
    model_dir = tempfile.mkdtemp()
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    del model
    data = dataset(cfg, tokenizer, 8)
    rows = batch(cfg, tokenizer)
    result = {"machine": machine(),
              "batch": {"prompts": 8, "completions_per_prompt": 8, "prompt_tokens_padded": rows[0].size(1),
                        "prompt_tokens_mean": float(rows[1].sum(1).float().mean()), "completion_tokens": 16}}
    for name, cls in (("stock", GRPOTrainer), ("dualkv", with_dualkv(GRPOTrainer))):
        result[name] = measure(trainer(cls, model_dir, tokenizer, data), *rows, repeats=args.repeats)
        print(name, json.dumps(result[name]))
    for key in result["stock"]:
        result[f"speedup_{key}"] = result["stock"][key] / result["dualkv"][key]
    write_json(args.out, result)
    print(", ".join(f"{k}: stock {result['stock'][k]:.2f} s, dualkv {result['dualkv'][k]:.2f} s "
                    f"({result['speedup_' + k]:.2f}x)" for k in result["stock"]))


if __name__ == "__main__":
    main()
