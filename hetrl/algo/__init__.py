"""RL math on tensors: group-relative advantages and GAE, clipped policy and value losses, KL estimators. No I/O,
no models."""

from .advantages import explained_variance, gae, group_advantages, tree_advantages, whiten
from .losses import clipped_policy_loss, clipped_value_loss, kl_k3, token_weights

__all__ = ["clipped_policy_loss", "clipped_value_loss", "explained_variance", "gae", "group_advantages", "kl_k3",
           "token_weights", "tree_advantages", "whiten"]
