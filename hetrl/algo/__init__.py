"""RL math on tensors: group-relative advantages, clipped policy losses, KL estimators. No I/O, no models."""

from .advantages import group_advantages
from .losses import clipped_policy_loss, kl_k3, token_weights

__all__ = ["clipped_policy_loss", "group_advantages", "kl_k3", "token_weights"]
