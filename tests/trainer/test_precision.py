"""precision=bf16-mixed: the rollout, log-prob, value and update passes run their matmuls in bf16 (autocast) while
the weights and the optimizer stay fp32, the log-softmax in fp32; the numbers stay close to fp32's; a run
completes; bad combinations are refused."""

import math

import pytest
import torch

from hetrl.algo import token_weights
from hetrl.models import load_model
from hetrl.trainer import build
from hetrl.trainer.config import load_config
from hetrl.trainer.precision import RunPrecision, cpu_has_fast_bf16, decide

from .test_algorithms import _reward
from .test_train import TINY, _rows

GROUPS = [([5, 6, 7, 8, 9, 10], [[11, 12, 13], [14, 15], [16, 17, 18, 19]]), ([20, 21, 22], [[23, 24], [25]])]


def _linear_dtypes(model):
    """Records the output dtype of every nn.Linear call on `model` (the decoder's projections and the LM head)."""
    seen = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_hook(lambda _m, _i, out: seen.append(out.dtype))
    return seen


def _roles(precision, kind="learner"):
    cfg = load_config(TINY, [f"precision={precision}", "kl_coef=0", "lr=1e-3", "algorithm=ppo"])
    model, tokenizer = load_model("tiny", seed=0)
    pol = build.policy(cfg, model)
    return cfg, pol, tokenizer


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_learner_passes_run_in_the_precision_asked_for(precision):
    cfg, pol, _ = _roles(precision)
    learner = build.learner(cfg, pol, build.optimizer(cfg, pol), decide(cfg))
    seen = _linear_dtypes(pol.module)
    logp = learner.logprobs(GROUPS)
    want = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    assert seen and set(seen) == {want}
    assert logp.dtype == torch.float32                     # log-softmax in fp32 either way
    lens = torch.tensor([len(r) for _, rs in GROUPS for r in rs])
    weights = token_weights(lens, torch.ones_like(lens, dtype=torch.bool), "token-mean")
    adv = torch.repeat_interleave(torch.tensor([1.0, -1.0, 0.5, -0.5, 0.2]), lens)
    before = [p.detach().clone() for p in pol.trainable()]
    stats = learner.update(GROUPS, adv, weights, logp + 0.01)
    assert math.isfinite(stats.loss) and stats.grad_norm > 0
    after = list(pol.trainable())
    assert all(p.dtype == torch.float32 for p in after)     # master weights stay fp32
    assert all(p.grad is None for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_mixed_log_probs_and_values_are_close_to_fp32():
    """bf16 keeps 8 bits of mantissa: the log-probs of the same weights differ by ~1e-2, not more."""
    out = {}
    for precision in ("fp32", "bf16-mixed"):
        cfg, pol, _ = _roles(precision)
        critic = build.critic(cfg, build.critic_model(cfg, pol.module), decide(cfg))
        torch.nn.init.normal_(critic.head.weight, std=0.1, generator=torch.Generator().manual_seed(0))  # not 0
        seen = _linear_dtypes(critic.model)
        values = critic.values(GROUPS)
        assert values.dtype == torch.float32 and set(seen) == {
            torch.bfloat16 if precision == "bf16-mixed" else torch.float32}
        out[precision] = (build.scorer(cfg, pol.module, decide(cfg)).logprobs(GROUPS), values)
    (lp32, v32), (lp16, v16) = out["fp32"], out["bf16-mixed"]
    assert not torch.equal(lp32, lp16)                        # bf16 did run
    assert (lp32 - lp16).abs().max() < 0.1 and (v32 - v16).abs().max() < 0.05


def test_mixed_rollout_decodes_in_bf16():
    cfg, pol, tokenizer = _roles("bf16-mixed")
    worker = build.rollout_worker(cfg, pol.module, tokenizer, decide(cfg))
    seen = _linear_dtypes(pol.module)
    torch.manual_seed(0)
    out = worker.generate([[5, 6, 7, 8], [9, 10, 11]], 3, 6, temperature=1.0)
    assert [len(g) for g in out] == [3, 3] and all(1 <= len(s.tokens) <= 6 for g in out for s in g)
    assert seen and set(seen) == {torch.bfloat16}


def test_a_mixed_precision_run_completes(tmp_path):
    from hetrl.cli import main

    assert main(["train", "--config", TINY, "precision=bf16-mixed", "steps=2", "eval_size=4",
                 f"out_dir={tmp_path / 'run'}"]) == 0
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert all(r["weight_sync_s"] >= 0 for r in rows)         # the rollout's bf16 copy refreshed every step


@pytest.mark.parametrize("path", [["algorithm=ppo", "critic_lr=1e-3"], ["lora_rank=4", "lr=1e-3"]],
                         ids=["ppo", "lora"])
def test_ppo_and_lora_runs_complete_under_forced_bf16(tmp_path, path):
    """What precision=auto picks on a CPU with bf16 (the suite pins auto to fp32), forced on PPO's critic and a LoRA
    policy (the agent and tree paths: tests/trainer/test_tools_train.py and tests/dualkv/test_trees.py)."""
    from hetrl.cli import main

    # a reward that differs within each group: the tiny model's replies score 0 on the task's, and with an exact
    # reference (build.frozen) nothing else moves the weights
    assert main(["train", "--config", TINY, "precision=bf16-mixed", "steps=2", "eval_size=4", "checkpoint_every=0",
                 *path, _reward(tmp_path), f"out_dir={tmp_path / 'run'}"]) == 0
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)
    if path[0] == "algorithm=ppo":
        assert all(math.isfinite(r["value_loss"]) for r in rows)


def test_auto_precision_is_fp32_on_a_cpu_without_bf16(monkeypatch):
    """precision=auto (the default) runs a CPU without bf16 instructions in fp32 (conftest pins the suite there)."""
    monkeypatch.setenv("HETRL_CPU_BF16", "0")
    cfg, pol, _ = _roles("auto")
    assert load_config(TINY, []).precision == "auto"
    seen = _linear_dtypes(pol.module)
    build.scorer(cfg, pol.module, decide(cfg)).logprobs(GROUPS)
    assert seen and set(seen) == {torch.float32}
    assert decide(load_config(TINY, ["device=cpu"])) == RunPrecision("fp32", autocast=False, auto=True)


def test_auto_precision_is_bf16_mixed_on_a_cpu_with_bf16(monkeypatch):
    """On a CPU with AVX512-BF16 or AMX, precision=auto is bf16-mixed everywhere the run asks: the learner's and
    the reference's passes, the planner's workload, the run's summary and the TRL bench's GRPOConfig."""
    monkeypatch.setenv("HETRL_CPU_BF16", "1")
    cfg, pol, _ = _roles("auto")
    learner = build.learner(cfg, pol, build.optimizer(cfg, pol), decide(cfg))
    seen = _linear_dtypes(pol.module)
    logp = learner.logprobs(GROUPS)
    assert seen and set(seen) == {torch.bfloat16} and logp.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in pol.trainable())
    cpu = decide(load_config(TINY, ["device=cpu"]))
    assert cpu.planner == "bf16" and str(cpu) == "bf16-mixed (auto)"
    assert decide(load_config(TINY, ["device=cpu", "precision=fp32"])).planner == "fp32"   # asked for: kept


def test_cpu_bf16_is_asked_of_the_cpu_unless_said(monkeypatch):
    monkeypatch.delenv("HETRL_CPU_BF16")
    asked = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert cpu_has_fast_bf16() is asked
    assert decide(load_config(TINY, ["device=cpu"])).name == ("bf16-mixed" if asked else "fp32")
    for said, has in (("1", True), ("0", False)):
        monkeypatch.setenv("HETRL_CPU_BF16", said)
        assert cpu_has_fast_bf16() is has
    monkeypatch.setenv("HETRL_CPU_BF16", "yes")
    with pytest.raises(ValueError, match="HETRL_CPU_BF16='yes': use 1"):
        cpu_has_fast_bf16()


# dtype, precision, device, CPU has bf16 -> what runs, under autocast, the planner's name
DECIDED = [
    ("float32", "auto", "cpu", False, "fp32", False, "fp32"),
    ("float32", "auto", "cpu", True, "bf16-mixed", True, "bf16"),
    ("float32", "auto", "cuda", False, "bf16-mixed", True, "bf16"),
    ("float32", "fp32", "cuda", True, "fp32", False, "fp32"),
    ("float32", "bf16-mixed", "cpu", False, "bf16-mixed", True, "bf16"),
    # autocast never casts fp64 values: an fp64 run is fp64 whatever precision=auto would choose on the device
    ("float64", "auto", "cpu", True, "fp64", False, "fp32"),
    ("float64", "auto", "cuda", False, "fp64", False, "fp32"),
    ("float64", "fp32", "cpu", False, "fp64", False, "fp32"),
    ("bfloat16", "auto", "cpu", False, "bf16", False, "fp32"),
    ("bfloat16", "auto", "cuda", False, "bf16", True, "bf16"),
]


@pytest.mark.parametrize("dtype,asked,device,cpu_bf16,name,autocast,planner", DECIDED)
def test_a_run_decides_its_precision_once_from_dtype_precision_and_device(monkeypatch, dtype, asked, device,
                                                                          cpu_bf16, name, autocast, planner):
    monkeypatch.setenv("HETRL_CPU_BF16", "1" if cpu_bf16 else "0")
    decided = decide(load_config(TINY, [f"dtype={dtype}", f"precision={asked}", f"device={device}"]))
    assert (decided.name, decided.autocast, decided.planner, decided.auto) == (name, autocast, planner, asked == "auto")
    assert str(decided) == name + (" (auto)" if asked == "auto" else "")


def test_every_role_of_a_run_carries_its_one_precision(monkeypatch):
    """The learner (and its log-prob scorer), the reference, the critic and the rollout hold the very value the
    engine was built with, and the summary's precision is read off the engine."""
    from hetrl.trainer.engine import LocalEngine

    monkeypatch.setenv("HETRL_CPU_BF16", "1")
    cfg = load_config(TINY, ["algorithm=ppo", "kl_coef=0.01"])
    model, tokenizer = load_model("tiny", seed=0)
    decided = decide(cfg)
    engine = LocalEngine(cfg, model, tokenizer, decided)
    roles = [engine.learner, engine.learner.scorer, engine.reference, engine.critic, engine.worker]
    assert decided.name == "bf16-mixed" and all(r.precision is decided for r in roles) and engine.precision is decided


def test_an_fp64_run_says_fp64(tmp_path, capsys, monkeypatch):
    """A dtype=float64 run on a CPU with bf16 (where precision=auto means bf16-mixed for fp32 weights) computes in
    fp64, and its log line and summary.json say so; no pass runs under autocast."""
    import json

    from hetrl.cli import main

    monkeypatch.setenv("HETRL_CPU_BF16", "1")
    seen = []
    real = RunPrecision.amp
    monkeypatch.setattr(RunPrecision, "amp", lambda self, model: seen.append(self.autocast) or real(self, model))
    assert main(["train", "--config", TINY, "dtype=float64", "steps=1", "eval_size=4", "checkpoint_every=0",
                 f"out_dir={tmp_path / 'run'}"]) == 0
    assert "; precision: fp64 (auto)\n" in capsys.readouterr().out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["precision"] == "fp64"
    assert seen and not any(seen)


@pytest.mark.gpu
def test_auto_precision_is_bf16_mixed_on_cuda():   # conftest skips gpu tests where CUDA is absent
    cfg, pol, _ = _roles("auto")
    pol.module.to("cuda")
    learner = build.learner(cfg, pol, build.optimizer(cfg, pol), decide(cfg))
    seen = _linear_dtypes(pol.module)
    logp = learner.logprobs(GROUPS)
    assert set(seen) == {torch.bfloat16} and logp.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in pol.trainable())


def test_mixed_precision_needs_fp32_weights():
    with pytest.raises(ValueError, match="dtype=float32"):
        load_config(TINY, ["precision=bf16-mixed", "dtype=bfloat16"])
    with pytest.raises(ValueError, match="precision"):
        load_config(TINY, ["precision=fp16"])


def test_a_mixed_run_holds_its_reference_matmul_weights_in_bf16_and_scores_as_the_policy():
    """The reference is never trained: a bf16-mixed run keeps its matmul weights in bf16 (autocast's own casts of
    them, held once: about half an fp32 copy's memory) and its embeddings and norms in fp32, so under the same
    autocast it scores exactly as the untrained policy does (the KL reads 0 at step 1; an all-bf16 copy ran its
    residual stream in bf16 and did not); fp32 keeps it in fp32."""
    import copy

    from hetrl.trainer import memory

    out = {}
    for precision in ("fp32", "auto", "bf16-mixed"):
        cfg = load_config(TINY, [f"precision={precision}", "kl_coef=0.01"])
        model, _ = load_model("tiny", seed=0)
        pol = build.policy(cfg, model)
        ref = build.reference(cfg, pol, lambda: copy.deepcopy(model), decide(cfg))
        linear = {id(m.weight) for m in ref.model.modules() if isinstance(m, torch.nn.Linear)}
        for p in ref.model.parameters():
            assert p.dtype == (torch.bfloat16 if precision == "bf16-mixed" and id(p) in linear else torch.float32)
        assert all(p.dtype == torch.float32 for p in pol.trainable())     # the policy keeps its fp32 master copy
        assert not any(p.requires_grad for p in ref.model.parameters())
        held = sum(p.numel() * p.element_size() for p in ref.model.parameters())
        assert build.frozen_bytes(model, decide(cfg)) == held
        out[precision] = (ref.logprobs(GROUPS), memory.estimate(cfg, model, 16, decide(cfg))["reference_model"], held)
    assert torch.equal(out["fp32"][0], out["auto"][0])                     # auto is fp32 on the CPU
    assert 0 < (out["fp32"][0] - out["bf16-mixed"][0]).abs().max() < 0.1   # bf16 matmuls, close to fp32's
    mixed = decide(load_config(TINY, ["precision=bf16-mixed"]))
    policy = build.scorer(load_config(TINY, ["precision=bf16-mixed"]), load_model("tiny", seed=0)[0].eval(), mixed)
    assert torch.equal(out["bf16-mixed"][0], policy.logprobs(GROUPS))     # the fp32 policy under autocast, to the bit
    assert 0.5 < out["bf16-mixed"][2] / out["fp32"][2] < 0.75               # matmul weights in bf16, the rest fp32
    # the estimate's ratio is the held one (the planner's spec leaves the norms out: int-rounded terms)
    assert out["bf16-mixed"][1] / out["fp32"][1] == pytest.approx(out["bf16-mixed"][2] / out["fp32"][2], rel=1e-4)


def test_a_mixed_local_run_samples_from_a_bf16_copy_refreshed_after_each_update():
    """bf16-mixed with full fine-tuning: the rollout samples from a bf16 copy of the policy (a decode step reads
    half the bytes, and no autocast casts per step), which each update's weight sync refreshes before the next
    generate call, never during one; the memory estimate counts it. fp32 and LoRA runs sample from the policy."""
    from hetrl.trainer import memory
    from hetrl.trainer.engine import LocalEngine

    cfg = load_config(TINY, ["precision=bf16-mixed", "kl_coef=0"])
    model, tokenizer = load_model("tiny", seed=0)
    terms = memory.estimate(cfg, model, 16, decide(cfg))
    assert terms["rollout_model"] * 2 == terms["weights"] > 0
    engine = LocalEngine(cfg, model, tokenizer, decide(cfg))
    sampler, policy = engine.worker.model, engine.policy.module
    assert sampler is not policy and {p.dtype for p in sampler.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    with torch.no_grad():
        for p in policy.parameters():        # an update
            p.add_(torch.randn_like(p) * 0.05)
    before = {k: v.clone() for k, v in sampler.state_dict().items()}
    assert engine.sync_weights(1)["weight_sync_s"] >= 0
    assert all(torch.equal(v, before[k]) for k, v in sampler.state_dict().items())   # queued, not yet applied
    torch.manual_seed(0)
    engine.worker.generate([[5, 6, 7, 8]], 2, 3, temperature=1.0)
    want = {k: v.to(torch.bfloat16) for k, v in policy.state_dict().items()}
    assert all(torch.equal(v, want[k]) for k, v in sampler.state_dict().items())
    assert any(not torch.equal(v, before[k]) for k, v in sampler.state_dict().items())

    for overrides in (["precision=fp32"], ["precision=bf16-mixed", "lora_rank=4"]):
        cfg = load_config(TINY, overrides + ["kl_coef=0"])
        model, tokenizer = load_model("tiny", seed=0)
        assert memory.estimate(cfg, model, 16, decide(cfg))["rollout_model"] == 0
        engine = LocalEngine(cfg, model, tokenizer, decide(cfg))
        assert engine.worker.model is engine.policy.module and engine.sync_weights(1) == {}
