"""ZeRO-3 and ZeRO-2 learners with PyTorch's own FSDP2 (`torch.distributed.fsdp.fully_shard`), and ZeRO-1 with its
`ZeroRedundancyOptimizer`: what a plan's `zero: 3`, `2` and `1` mean over several data-parallel ranks.

`zero: 1` (the planner's default) is DeepSpeed's ZeRO-1, as the cost model prices it (task_memory: AdamW states
/ dp, gradients and weights whole): every rank holds the whole model and computes whole gradients, but the AdamW
states of only its part of the parameters (torch's sorted-greedy partition by size); each part's gradients are
summed onto its rank (`reduce_to_owners`), which clips them by the global norm, steps that part and broadcasts it
to the others (`ZeroRedundancyOptimizer.step`). The step is elementwise, so the ranks' weights are the one-learner
step's. Its states are saved by gathering the partitions on rank 0 in torch's own `optimizer.state_dict()` form
(`consolidate`), the file a single learner writes.

Each decoder layer and then the whole model are sharded over the learners' process group (gloo on CPU, NCCL on
GPU): every rank holds 1/world of the parameters, gradients and AdamW states, and all-gathers a layer's weights
for its forward and backward. `zero: 2` is DeepSpeed's ZeRO-2, as the planner prices it (docs/cost_model.md):
the weights are gathered once, at the first pass after an optimizer step, and held whole through every
micro-batch's forward and backward (FSDP2's `reshard_after_forward=False` and `set_reshard_after_backward(False)`);
each micro-batch's gradients are reduce-scattered as with `zero: 3`, and AdamW states are split. `reshard` frees
the gathered weights: before the optimizer step (which steps the shards) and after a pass without a backward.

Nothing here is hand-written collective code; it only states what hetrl's learner needs of FSDP2:

- gradients **summed** over ranks, not averaged: the loss weights are global (token_weights over the whole
  batch), so the sum is the one-learner gradient (FSDP2's default divides by the world size);
- every rank runs the **same number of passes**: each backward reduce-scatters (and each forward of zero: 3
  all-gathers), so a rank with fewer micro-batches (groups are split by tokens) runs zero-weight passes on a
  one-token dummy until all have run as many (`common_count`);
- full weights when they leave the learners (weight sync, checkpoints): `full_state` gathers them on rank 0,
  a collective every rank calls.

The DualKV attention receives unsharded activations (FSDP shards parameters, not activations), so the
shared-prompt path is unchanged; tests/trainer/test_ray_executor.py checks 2 sharded learners against 1 in fp64.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor


def decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks of a transformers causal LM (model.model.layers), each sharded as one unit."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"zero: 3 needs a decoder-only transformers model with model.layers; {type(model).__name__} "
                         "has none")
    return list(layers)


def shard(model, offload: bool = False, zero: int = 3, decoder_only: bool = False) -> torch.nn.Module:
    """Shard `model` in place over the default process group: each decoder layer, then the rest (embeddings,
    final norm, LM head) at the root. Gradients are summed over ranks. `zero`: 3 frees a layer's gathered weights
    after each use, 2 holds them until `reshard` (module docstring). `decoder_only`: the model's decoder is called
    without its LM head (PPO's critic), so the decoder is a unit of its own. `offload`: FSDP2's CPUOffloadPolicy, which
    keeps the parameter, gradient and optimizer-state shards in host memory, copies a layer's shard to the GPU for
    its pass and runs the optimizer step on the CPU. FSDP2 has no optimizer-only offload, so a plan's
    `offload: optimizer` and `offload: params` both run as this (on a CPU-only host it changes nothing)."""
    for layer in decoder_layers(model):
        _fully_shard(layer, offload, zero)
    if decoder_only:   # the critic runs the decoder alone (get_decoder()): the embeddings and norm are its unit
        _fully_shard(model.get_decoder(), offload, zero)
    return _fully_shard(model, offload, zero)


def shard_module(module, offload: bool = False, zero: int = 3) -> torch.nn.Module:
    """Shard a module that is called on its own (the critic's value head) as one unit, as `shard` does."""
    return _fully_shard(module, offload, zero)


def _fully_shard(module, offload: bool, zero: int) -> torch.nn.Module:
    if zero not in (2, 3):
        raise ValueError(f"FSDP2 shards for zero: 2 or 3, got {zero!r}")
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())} if offload else {}
    fully_shard(module, reshard_after_forward=zero == 3, **policy)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)   # plain SUM: gloo has no PREMUL_SUM / AVG
    module.set_reshard_after_backward(zero == 3, recurse=False)
    return module


def reshard(*models) -> None:
    """Free every gathered weight of the sharded `models` and register their shards again (a no-op where none is
    held, as with zero: 3 between passes): zero: 2 holds them from a pass until this is called."""
    for m in (m for model in models for m in model.modules()):
        if isinstance(m, FSDPModule):
            m.reshard()


def is_sharded(model) -> bool:
    return isinstance(model, FSDPModule)


def common_count(n: int) -> int:
    """The largest `n` over the ranks: how many passes every rank runs."""
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def full_value(x) -> float:
    """A scalar that may be a DTensor (e.g. clip_grad_norm_'s total norm of sharded gradients) as a float."""
    return float(x.full_tensor() if isinstance(x, DTensor) else x)


def full_state(model) -> dict[str, torch.Tensor]:
    """The full state dict on CPU, gathered on rank 0 (other ranks get an empty dict). Every rank must call it."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model, state: dict[str, torch.Tensor]):
    """Load a full state dict that every rank has (a checkpoint read by each) into the shards; -> (missing,
    unexpected) keys, as load_state_dict (a tied LM head is not in the file)."""
    return set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=False))


def _trainable_names(model) -> list[str]:
    """Names of the parameters the optimizer steps, in its order (build.optimizer: the trainable parameters)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def full_optimizer_state(model, optimizer) -> dict:
    """The whole AdamW state on rank 0 in torch's own `optimizer.state_dict()` form (parameters by index), so a
    checkpoint of sharded learners is the same file as one of replicas, and either resumes the other. Every rank
    must call it."""
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not osd:
        return {}
    index = {n: i for i, n in enumerate(_trainable_names(model))}
    return {"state": {index[k]: v for k, v in osd["state"].items()},
            "param_groups": [dict(g, params=[index[n] for n in g["params"]]) for g in osd["param_groups"]]}


def load_optimizer_state(model, optimizer, state: dict) -> None:
    """Each rank takes its shards of a full `optimizer.state_dict()`-form state (full_optimizer_state's); the run's
    own lr and weight decay stay (`CONFIG_HYPERPARAMETERS`)."""
    names = _trainable_names(model)
    osd = {"state": {names[i]: v for i, v in state["state"].items()},
           "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]]}
    # strict=False: a parameter that never had a gradient (the critic's unused LM head) has no state, as in
    # torch's own optimizer.load_state_dict, which starts such a parameter's moments afresh
    _keeping_config_hyperparameters(optimizer, lambda: set_optimizer_state_dict(
        model, optimizer, osd, options=StateDictOptions(full_state_dict=True, strict=False)))


# ------------------------------------------------------------------------------------------------------ ZeRO-1


def partitioned(params: list[torch.nn.Parameter], optimizer_class, **defaults) -> ZeroRedundancyOptimizer:
    """`optimizer_class(params, **defaults)` with its states split over the default process group (ZeRO-1): each
    rank makes and steps the states of its partition only, then the ranks broadcast their updated parameters.
    `param_groups` are the whole model's (a learning rate set there reaches every partition at the step)."""
    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)


def is_partitioned(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def reduce_to_owners(optimizer: ZeroRedundancyOptimizer):
    """ZeRO-1's gradient sync for `optimizer`'s ranks: -> grad_sync(params), which sums each parameter's gradient
    over the ranks onto the rank that steps it (one `dist.reduce` per rank's part, flattened) and frees the
    gradients this rank does not step. With the broadcast of the updated parts in the step, a step moves 2x the
    parameters' bytes, as an all-reduce does (what the cost model prices for zero 1; DeepSpeed's ZeRO-1 reduce-
    scatters and all-gathers the same). A parameter without a gradient on a rank joins with zeros, so every
    parameter is stepped on its rank however the groups fell. The partition is torch's (`_param_to_rank`, which
    its own state_dict uses)."""
    def grad_sync(params: list[torch.nn.Parameter]) -> None:
        owner, rank = optimizer._param_to_rank, dist.get_rank()
        for r in range(dist.get_world_size()):
            part = [p for p in params if owner[p] == r]
            if not part:
                continue
            for p in part:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in part])
            dist.reduce(flat, dst=r)
            offset = 0
            for p in part:
                if r == rank:
                    p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                else:
                    p.grad = None
                offset += p.numel()
    return grad_sync


def partitioned_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The 2-norm of every rank's gradients together, where each rank holds those of its part (after
    reduce_to_owners): the squares summed over the ranks."""
    grads = [p.grad for p in params if p.grad is not None]
    local = torch.nn.utils.get_total_norm(grads).double() if grads else \
        torch.zeros((), dtype=torch.float64, device=params[0].device)
    square = (local ** 2).reshape(1)
    dist.all_reduce(square)
    return square[0].sqrt()


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer that holds this rank's states: a ZeRO-1 rank's partition, else `optimizer` itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def consolidate(optimizer: torch.optim.Optimizer) -> bool:
    """Before `optimizer.state_dict()`: a ZeRO-1 rank's partition of the states is gathered on rank 0 (a collective
    every rank calls); -> whether this rank can give the whole state (rank 0, or any unpartitioned optimizer)."""
    if not isinstance(optimizer, ZeroRedundancyOptimizer):
        return True
    optimizer.consolidate_state_dict(to=0)
    return dist.get_rank() == 0


# The hyperparameters a run's config sets on its optimizers (build.adamw): a resume keeps the config's, not the
# checkpoint's (torch's load_state_dict restores the saved param_groups, so a resume with a new lr, allowed with
# --allow-config-change, kept stepping at the old one without a word; a schedule overwrote lr, a constant rate not).
CONFIG_HYPERPARAMETERS = ("lr", "weight_decay")


def _keeping_config_hyperparameters(optimizer: torch.optim.Optimizer, load) -> None:
    """Run `load` (which restores a saved state into `optimizer`), then put back the hyperparameters the run's
    config set on it (CONFIG_HYPERPARAMETERS); the moments and step counts stay the checkpoint's."""
    kept = [{k: g[k] for k in CONFIG_HYPERPARAMETERS if k in g} for g in optimizer.param_groups]
    load()
    for group, values in zip(optimizer.param_groups, kept):
        group.update(values)


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A whole `optimizer.state_dict()` (one learner's, or `consolidate`d) into `optimizer`; a ZeRO-1 rank keeps
    its partition's. The run's own lr and weight decay stay (`CONFIG_HYPERPARAMETERS`). ZeroRedundancyOptimizer
    moves the step counts to the CPU, where a fused or capturable AdamW on a GPU cannot take them: they go back to
    their parameters' device."""
    _keeping_config_hyperparameters(optimizer, lambda: optimizer.load_state_dict(state))
    local = local_optimizer(optimizer)
    if local is optimizer:
        return
    for group in local.param_groups:
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                st = local.state.get(p)
                if st and torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(p.device)
