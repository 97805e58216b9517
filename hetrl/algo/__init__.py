"""RL math on tensors, by verl's names: advantage estimators (`advantage`), policy losses and their aggregation
(`policy_loss`), KL estimators (`kl_penalty`), entropy, PPO's value loss and GAE. No I/O, no models.
docs/algorithms.md lists every name with its formula and its verl / TRL equivalents."""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    advantage,
    explained_variance,
    gae_returns,
    masked_mean,
    masked_whiten,
    whiten,
)
from .losses import (
    KL_PENALTIES,
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    KLController,
    agg_loss,
    clipped_value_loss,
    entropy_from_logits,
    entropy_loss,
    kl_in_reward,
    kl_penalty,
    loss_aggregation,
    per_token_policy_loss,
    policy_loss,
    token_weights,
    weighted_sum,
)
from .packing import packed_policy_loss, row_mask, to_packed, to_padded
from .rollout_correction import ROLLOUT_IS_LEVELS, ROLLOUT_RS_OPTIONS, mismatch_metrics, rollout_correction
from .tree import tree_advantages

__all__ = ["ADVANTAGE_ESTIMATORS", "KL_PENALTIES", "LOSS_AGGREGATIONS", "POLICY_LOSSES", "KLController", "advantage",
           "agg_loss", "kl_in_reward",
           "clipped_value_loss", "entropy_from_logits", "entropy_loss", "explained_variance", "gae_returns",
           "kl_penalty", "loss_aggregation", "masked_mean", "masked_whiten", "packed_policy_loss",
           "per_token_policy_loss", "policy_loss", "row_mask", "to_packed", "to_padded", "token_weights",
           "tree_advantages", "weighted_sum", "whiten",
           "ROLLOUT_IS_LEVELS", "ROLLOUT_RS_OPTIONS", "mismatch_metrics", "rollout_correction"]
