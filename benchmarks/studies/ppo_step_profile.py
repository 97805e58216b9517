"""Where PPO's extra time goes: one half-batch of the PPO job through each pass, policy and critic side by side;
quoted in benchmarks/results/train_ppo/README.md ("Cost").

    python -m benchmarks.studies.ppo_step_profile

Builds the roles of examples/runs/ppo.yaml (embedded SmolLM2-135M, fp32) and times, on 4 groups of 8 responses
(prompt 40, response 16 random tokens): the old log-probs, the critic's values, one policy update and one critic
update, twice (the second round is the one to read; the first warms up).
"""

import copy
import random

import torch

from hetrl.bench.harness import timed
from hetrl.models import load_model
from hetrl.trainer import build
from hetrl.trainer.config import load_config
from hetrl.trainer.precision import decide


def main() -> None:
    torch.manual_seed(0)
    random.seed(0)
    cfg = load_config("examples/runs/ppo.yaml", ["precision=fp32"])   # as profiled (auto: bf16-mixed on bf16 CPUs)
    model, _ = load_model("smollm2-135m")
    critic = build.critic(cfg, copy.deepcopy(model), decide(cfg))
    pol = build.policy(cfg, model)
    learner = build.learner(cfg, pol, build.optimizer(cfg, pol), decide(cfg))
    groups = [([random.randrange(1000) for _ in range(40)], [[random.randrange(1000) for _ in range(16)]
                                                             for _ in range(8)]) for _ in range(4)]
    k = sum(len(r) for _, rs in groups for r in rs)
    weights = torch.full((k,), 1.0 / k, dtype=torch.float64)
    advantages = torch.randn(k, dtype=torch.float64)
    for rnd in (1, 2):
        logp, logp_s = timed(lambda: learner.logprobs(groups))
        values, values_s = timed(lambda: critic.values(groups).double())
        _, update_s = timed(lambda: learner.update(groups, advantages, weights, logp, logp))
        _, critic_s = timed(lambda: critic.update(groups, values + advantages, values, weights))
        print(f"round {rnd}: old log-probs {logp_s:.2f} s, values {values_s:.2f} s, policy update {update_s:.2f} s, "
              f"critic update {critic_s:.2f} s")


if __name__ == "__main__":
    main()
