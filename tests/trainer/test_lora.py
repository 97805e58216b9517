"""LoRA runs (peft): only the adapter moves, the base weights stay bit-identical, the reference is the base with
the adapter off, checkpoints hold the adapter and resume exactly, and the final merged model loads in plain
transformers."""

import json
import pathlib

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hetrl.cli import main
from hetrl.dualkv import pack_groups, shared_prompt_logprobs
from hetrl.models import load_model
from hetrl.trainer import build
from hetrl.trainer.config import load_config
from hetrl.trainer.engine import LocalEngine
from hetrl.trainer.precision import decide

TINY = str(pathlib.Path(__file__).parents[2] / "examples" / "runs" / "tiny.yaml")
LORA = ["lora_rank=4", "lora_alpha=8", "eval_size=8", "kl_coef=0.05"]


def _rows(path):
    return [json.loads(x) for x in pathlib.Path(path).read_text().splitlines()]


def test_a_lora_run_moves_only_the_adapter_and_writes_a_loadable_merged_model(tmp_path):
    out = tmp_path / "lora"
    assert main(["train", "--config", TINY, f"out_dir={out}", *LORA]) == 0
    ckpt = out / "checkpoints" / "step_000003"
    adapter = load_file(ckpt / "adapter_model.safetensors")
    assert adapter and all("lora_" in k for k in adapter) and (ckpt / "adapter_config.json").is_file()
    assert not (ckpt / "model.safetensors").exists()     # the adapter only, in peft's format

    # the final policy = base weights untouched + the trained adapter
    base, _ = load_model("tiny", seed=0)
    cfg = load_config(TINY, LORA)
    pol = build.policy(cfg, load_model("tiny", seed=0)[0])
    initial = {k: v.clone() for k, v in pol.sync_state().items()}
    pol.load_sync_state(adapter)
    moved = [k for k in adapter if not torch.equal(initial[k], adapter[k])]
    assert moved and len(moved) >= len(adapter) // 2          # B starts at 0; A and B both train
    for name, p in pol.module.named_parameters():
        if "lora_" not in name:                                 # bit-identical base weights
            assert torch.equal(p, dict(base.named_parameters())[name.replace(".base_layer", "")]), name

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, pol.module(ids).logits, atol=1e-5)
    assert json.loads((out / "summary.json").read_text())["merged_model"] == str(out / "merged")


def test_the_lora_reference_is_the_base_model_with_the_adapter_off():
    cfg = load_config(TINY, [*LORA, "lr=0.05"])
    model, tokenizer = load_model("tiny", seed=0)
    engine = LocalEngine(cfg, model, tokenizer, decide(cfg))
    assert engine.policy.lora and engine.reference.model is engine.policy.module   # no second copy
    with torch.no_grad():   # make the adapter matter
        for p in engine.policy.trainable():
            p.add_(0.1)
    groups = [([5, 6, 7, 8, 9], [[10, 11], [12, 13, 14]])]
    base, _ = load_model("tiny", seed=0)
    with torch.no_grad():
        want = shared_prompt_logprobs(base, pack_groups(groups), impl=cfg.impl, temperature=cfg.temperature)
        policy = shared_prompt_logprobs(engine.policy.module, pack_groups(groups), impl=cfg.impl,
                                        temperature=cfg.temperature)
    assert torch.equal(engine.reference.logprobs(groups), want) and not torch.allclose(policy, want)


def test_a_lora_run_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "a", tmp_path / "b"
    assert main(["train", "--config", TINY, f"out_dir={straight}", *LORA]) == 0
    assert main(["train", "--config", TINY, f"out_dir={resumed}", *LORA, "steps=2"]) == 0
    assert main(["train", "--resume", f"out_dir={resumed}", "steps=3"]) == 0
    a = load_file(straight / "checkpoints" / "step_000003" / "adapter_model.safetensors")
    b = load_file(resumed / "checkpoints" / "step_000003" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(straight / "metrics.jsonl")[2]["loss"] == _rows(resumed / "metrics.jsonl")[2]["loss"]


def test_a_resume_cannot_change_what_the_checkpoints_weights_are(tmp_path, capsys):
    """lora_rank (or going to or from LoRA) on a resume, even with --allow-config-change: one line, exit 2, before
    anything loads, and nothing logged as changed (it crashed loading the adapter and logged the change)."""
    out = tmp_path / "r"
    assert main(["train", "--config", TINY, f"out_dir={out}", *LORA, "steps=1"]) == 0
    capsys.readouterr()
    for change in (["lora_rank=8"], ["lora_rank=0"]):
        assert main(["train", "--resume", f"out_dir={out}", "steps=2", *change, "--allow-config-change"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "lora_rank 4 -> " in err[0] and "cannot change on a resume" in err[0], err
    assert not (out / "resumes.jsonl").exists()


def test_weight_sync_of_a_lora_policy_carries_the_adapter_alone_and_lands():
    """What Ray sends between learner and rollout actors (no Ray needed): the adapter tensors, loaded into the
    other side's adapter."""
    from hetrl.trainer.ray_executor import load_numpy_weights, weights_to_numpy

    cfg = load_config(TINY, LORA)
    sender, receiver = (build.policy(cfg, load_model("tiny", seed=0)[0]) for _ in range(2))
    with torch.no_grad():
        for p in sender.trainable():
            p.add_(0.5)
    sent = weights_to_numpy(sender)
    assert sent and all("lora_" in k for k in sent)
    load_numpy_weights(receiver, sent)
    assert all(torch.equal(a, b) for a, b in zip(sender.trainable(), receiver.trainable()))


def test_a_lora_target_that_matches_nothing_is_one_line(tmp_path, capsys):
    assert main(["train", "--config", TINY, f"out_dir={tmp_path / 'x'}", "lora_rank=4",
                 "lora_target_modules=[qproj, v_proj]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "match no module of LlamaForCausalLM" in err[0] and "did you mean 'q_proj'" in err[0], err


@pytest.mark.slow
def test_lora_on_smollm2_keeps_the_base_weights_bit_identical(tmp_path):
    out = tmp_path / "smol"
    assert main(["train", f"out_dir={out}", "lora_rank=8", "lora_alpha=16", "lr=2e-4", "steps=2", "eval_size=8",
                 "prompts_per_step=4", "checkpoint_every=0"]) == 0
    base, _ = load_model("smollm2-135m")
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    adapter = load_file(out / "checkpoints" / "step_000002" / "adapter_model.safetensors")
    cfg = load_config(None, ["lora_rank=8", "lora_alpha=16"])
    pol = build.policy(cfg, load_model("smollm2-135m")[0])
    pol.load_sync_state(adapter)
    base_params = dict(base.named_parameters())
    for name, p in pol.module.named_parameters():
        if "lora_" not in name:
            assert torch.equal(p, base_params[name.replace(".base_layer", "")]), name
    changed = [n for n, p in merged.named_parameters() if not torch.equal(p, base_params[n])]
    assert changed and all(n.endswith("proj.weight") for n in changed)   # only where an adapter was merged


@pytest.mark.slow   # the real SmolLM2 weights (33 s of the default suite's 10 minutes)
def test_an_adapter_checkpoint_of_the_embedded_model_does_not_look_for_its_config_on_the_hub(tmp_path):
    """peft's save_embedding_layers="auto" looks for the base model's config.json by its name (on the Hub where it
    is not a local folder) and warned 'Could not find a config file' on every LoRA checkpoint of SmolLM2 (read from
    a package, offline); the embeddings are saved only where LoRA targets them."""
    import warnings

    from hetrl.trainer import checkpoint

    model, tok = load_model("smollm2-135m")
    pol = build.policy(load_config(None, ["lora_rank=4"]), model)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        path = checkpoint.save(tmp_path, 1, pol.saved, tok, torch.optim.SGD(pol.trainable(), lr=0.1), {}, {})
    assert not [w for w in said if "Could not find a config file" in str(w.message)], [str(w.message) for w in said]
    assert all("lora_" in k for k in load_file(path / "adapter_model.safetensors"))
