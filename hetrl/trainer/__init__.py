"""The trainer: rollout, rewards, learner and the loop that joins them (uses dualkv and algo)."""
