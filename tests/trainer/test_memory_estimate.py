"""The trainer's memory guard uses the planner's memory rule (hetrl.planner.cost.task_memory), not a copy."""

import torch

from hetrl.planner.cost import task_memory
from hetrl.planner.plan import Parallelism
from hetrl.planner.spec import TokenLengths
from hetrl.trainer import memory
from hetrl.trainer.config import RunConfig
from hetrl.trainer.placement import model_spec_from_hf, run_workload
from hetrl.trainer.precision import decide
from tests.dualkv.oracle import tiny_model


def test_trainer_estimate_is_the_planners_task_memory():
    cfg = RunConfig(micro_batch_tokens=256, max_prompt_tokens=128, kl_coef=0.05)
    for dtype, precision, scale in ((torch.float32, "fp32", 1), (torch.float64, "fp32", 2)):
        model = tiny_model("llama", dtype=dtype)
        got = memory.estimate(cfg, model, 40, decide(cfg))
        w = run_workload(cfg, model_spec_from_hf(model.config), TokenLengths(40, 40.0), precision)
        want = task_memory(w, "actor_train", Parallelism(1, 1, 1, recompute=False), micro_batch_tokens=256)
        n = sum(p.numel() for p in model.parameters())
        assert got["weights"] == int(want.weights * scale)
        assert got["gradients_and_optimizer"] == int(want.states * scale) == 3 * got["weights"]   # grads + 2 moments
        # the spec counts the model's matrices; norms (0.4% of this tiny model) are left out
        assert abs(got["weights"] - n * dtype.itemsize) <= 0.01 * n * dtype.itemsize
        assert got["activations_and_logits"] == int(want.working * scale)
        assert got["reference_model"] == got["weights"]
    no_kl = RunConfig(kl_coef=0.0)
    assert memory.estimate(no_kl, tiny_model("llama", dtype=torch.float32), 40, decide(no_kl))["reference_model"] == 0
