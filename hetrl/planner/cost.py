"""Cost model: seconds per RL iteration of a plan, as named terms, and per-GPU memory as a hard constraint.

Roofline-style, following the structure HetRL describes (per task type: compute, HBM traffic,
pipeline bubble, TP/PP/DP communication; weight sync and cross-group transfer; dependency-ordered
aggregation). Formulas and constants are in docs/cost_model.md; in short:

  training   8·N_active FLOPs per token (full recompute) + causal attention, at MFU_TRAIN of the
             slowest GPU of each pipeline stage; DP replicas get data in proportion to their speed
             (or evenly, the group's data_split, as verl does: then the slowest replica sets the pace);
             bubble (pp-1)/m per optimizer step; TP 4 all-reduces per layer; PP activations; DP gradient
             all-reduce per optimizer step (ZeRO-1/2) or per-micro-batch gathers (ZeRO-3), over rings that
             share their nodes' network; Adam step HBM traffic, or host Adam and PCIe (offload).
  inference  2·N_active FLOPs per token + attention; TP 2 all-reduces per layer; PP one way.
  generation prefill once per prompt (prefix sharing) + decode for max-response-length steps: each
             step reads the weights and the KV cache (HBM) or is compute-bound, whichever is slower;
             continuous batching over paged KV (a prompt's KV held once for its N responses): more steps
             only when the KV memory binds. Every term that moves values uses the workload's precision (2 or 4 bytes).
DualKV shrinks the token count of training and inference tasks from N(P+R) to P+NR per group
and their attention pairs accordingly. Collectives use the slowest link of the GPU set.
Memory is checked per GPU: resident weights of every model in the group, gradients and optimizer
states of its training tasks, plus the largest working set of its tasks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np

from . import optables
from .catalog import NVLINK_BUS_EFFICIENCY, attention_efficiency, gemm_efficiency
from .plan import ROLE_OF_TASK, Group, Parallelism, Plan, check_structure
from .spec import GBIT, INTRA_REGION_LATENCY_S, PCIE_BYTES_PER_S, ClusterSpec, ModelSpec, WorkloadSpec

MFU_TRAIN = 0.45     # Megatron-style 3D parallelism on A100/H100: 35-55% (peers_schedulers.md §6.1)
MFU_INFER = 0.50     # prefill-like forward passes
MFU_DECODE = 0.50    # compute-bound decode steps (large batches)
HBM_EFF = 0.70       # achievable fraction of peak HBM bandwidth in decode (0.6-0.85, §6.2)
MEM_UTIL = 0.90      # usable fraction of GPU memory (allocator, CUDA context, fragmentation)
BYTES = 2            # bf16/fp16 weights, activations, gradients
SAMPLE_BYTES_PER_TOKEN = 16  # token id, masks, old/ref log-probs, advantages moved between groups
LOGIT_CHUNK_TOKENS = 4096    # log-probs computed over vocab chunks of this many tokens (fused linear-CE)
# Offloaded Adam runs on the host CPU and is bound by host memory bandwidth: it reads fp32 master, m, v and the
# gradient and writes master, m, v and the bf16 weights: ~30 B per parameter. A DGX A100 node has two 8-channel
# DDR4-3200 sockets (2 x 204.8 GB/s) for 8 GPUs; at ~50% achieved that is ~25 GB/s per GPU.
CPU_ADAM_BYTES_PER_PARAM = 30
HOST_BYTES_PER_S_PER_GPU = 25e9
GATHERED_LAYERS = 2          # ZeRO-3 / FSDP keep the layer in use and the prefetched next one unsharded
# MoE load imbalance under expert parallelism: tokens the busiest EP rank's experts receive over the mean. Routers
# trained with a balancing loss (Qwen3-MoE's aux loss, DeepSeek-V3's bias-based balancing) keep it near 1;
# Megatron's recipes bound it with moe_expert_capacity_factor where set, commonly 1.0-1.25 (dropless: no bound).
# A stated assumption, not measured here and not fitted: 1.2. With ep = 1 every expert is on every GPU and the
# imbalance changes nothing.
MOE_LOAD_IMBALANCE = 1.2

ROLE_OF = ROLE_OF_TASK
TRAIN_TASKS = ("actor_train", "critic_train")
INFER_TASKS = ("actor_infer", "ref_infer", "reward_infer", "critic_infer")


@dataclass
class TaskCost:
    seconds: float
    terms: dict[str, float]


@dataclass
class Estimate:
    feasible: bool
    reason: str
    iteration_time_s: float = math.inf
    breakdown: dict[str, float] = field(default_factory=dict)
    task_times_s: dict[str, float] = field(default_factory=dict)
    memory_bytes: dict[int, float] = field(default_factory=dict)   # GPU id -> peak bytes
    task_terms: dict[str, dict[str, float]] = field(default_factory=dict)   # task -> its named terms
    timeline: list[dict] = field(default_factory=list)   # one iteration's bars (cost.timeline)

    def throughput(self, workload: WorkloadSpec) -> tuple[float, float]:
        """(samples/s, tokens/s); tokens are prompt + response of every sample."""
        if not self.feasible:
            return 0.0, 0.0
        tokens = workload.samples * (workload.prompt_tokens.mean + workload.completion_tokens.mean)
        return workload.samples / self.iteration_time_s, tokens / self.iteration_time_s


# ------------------------------------------------------------------------------------------ links


def slowest_link(cluster: ClusterSpec, gpu_ids) -> tuple[float, float]:
    """(latency_s, bytes_per_s) of the slowest link inside a GPU set."""
    return _slowest_link(cluster, frozenset(gpu_ids))


@functools.lru_cache(maxsize=200_000)
def _slowest_link(cluster: ClusterSpec, ids: frozenset) -> tuple[float, float]:
    gpus = [cluster.gpus[i] for i in ids]
    nodes = {g.node for g in gpus}
    if len(nodes) == 1:
        return cluster.link(gpus[0], gpus[0]) if len(gpus) > 1 else (0.0, math.inf)
    node_bw = min(cluster.node(n).network_gbps for n in nodes) * GBIT
    regions = sorted({g.region for g in gpus})
    if len(regions) == 1:
        return INTRA_REGION_LATENCY_S, node_bw
    pairs = [r for r in cluster.regions if set(r.between) <= set(regions)]
    return max(r.latency_ms for r in pairs) / 1e3, min(node_bw, min(r.bandwidth_gbps for r in pairs) * GBIT)


def allreduce_s(nbytes: float, k: int, link: tuple, messages: int = 1) -> float:
    """`messages` all-reduces moving `nbytes` in all over k ranks on `link` (latency, bytes/s[, GPU type]): where
    the link names a GPU type (a group of one node's GPUs joined by NVLink: _nvlink_type) each call's time comes
    from that type's NCCL collective tables (optables.allreduce_s); otherwise, or without a table, the ring's
    2 (k - 1) / k of the bytes over the link's bandwidth plus 2 (k - 1) latencies per call."""
    if k <= 1:
        return 0.0
    if messages >= 1 and len(link) > 2 and link[2] is not None:
        one = optables.allreduce_s(link[2], nbytes / messages, k)
        if one is not None:
            return messages * one
    lat, bw = link[:2]
    return 2 * (k - 1) / k * nbytes / bw + 2 * (k - 1) * lat * messages


# ------------------------------------------------------------------------------------------ work


def _vision_tokens(w: WorkloadSpec) -> float:
    """Image patches a vision tower encodes in one pass over the batch: each prompt copy's (with DualKV one per
    micro-batch of responses, as its prompt; without, one per response)."""
    if not w.image_patches:
        return 0.0
    n = w.responses_per_prompt
    copies = math.ceil(n / min(n, w.micro_batch_responses)) if w.dualkv else n
    return w.prompts_per_step * copies * w.image_patches


def _tokens_and_pairs(w: WorkloadSpec) -> tuple[float, float]:
    """Tokens and causal attention (query, key) pairs one pass over the batch processes.

    With DualKV the prompt runs once per micro-batch of responses (a group larger than the micro-batch is
    split into sub-groups that each carry the prompt), so rho is capped by the micro-batch. Episodes (turns > 1)
    are trees: every turn shared by the leaves below it is computed once (_episode_tokens_and_pairs)."""
    if w.turns > 1:
        return _episode_tokens_and_pairs(w)
    (p, r), n, g = w.pass_lengths, w.responses_per_prompt, w.prompts_per_step
    if w.dualkv:
        copies = math.ceil(n / min(n, w.micro_batch_responses))
        return g * (copies * p + n * r), g * (copies * p * p / 2 + n * (r * p + r * r / 2))
    s = p + r
    return g * n * s, g * n * s * s / 2


def _episode_tokens_and_pairs(w: WorkloadSpec) -> tuple[float, float]:
    """_tokens_and_pairs of multi-turn episodes, at mean lengths. Turn j (of `turns`) runs on c_j rows of each
    task (w.turn_rows), each a turn of R model tokens and, but for the last, a tool result of U tokens, starting
    at depth D_j = P + (j-1)(R + U). DualKV (the trie packing of hetrl's update): P + sum_j c_j (R + U_j) tokens
    per task, each attending to its ancestors only: P^2/2 + sum_j c_j (S_j D_j + S_j^2/2) pairs; the prompt once
    per micro-batch of leaves (a task cut into parts repeats it; the turns are counted once). Linear: every leaf
    alone, L (P + C) tokens and L (P + C)^2/2 pairs, C its completion. Lengths as `pass_lengths` pads them (the
    turns and tool results at their maxima with padding=max)."""
    (p, completion), g, leaves = w.pass_lengths, w.prompts_per_step, w.leaves
    if not w.dualkv:
        s = p + completion
        return g * leaves * s, g * leaves * s * s / 2
    r, u = (w.response_tokens.max, w.tool_tokens.max) if w.padding == "max" else \
        (w.response_tokens.mean, w.tool_tokens.mean)
    copies = math.ceil(leaves / min(leaves, w.micro_batch_responses))
    tokens, pairs, depth = copies * p, copies * p * p / 2, p
    for j, c in enumerate(w.turn_rows):
        seg = r + (u if j < w.turns - 1 else 0.0)
        tokens += c * seg
        pairs += c * (seg * depth + seg * seg / 2)
        depth += seg
    return g * tokens, g * pairs


def _micro_batch_tokens(w: WorkloadSpec) -> float:
    """Tokens of one micro-batch of `micro_batch_responses` responses of one prompt, at maximum lengths (an
    episode's leaves counted whole: an upper bound where they share turns)."""
    p, r, m = w.prompt_tokens.max, w.completion_tokens.max, w.micro_batch_responses
    return p + m * r if w.dualkv else m * (p + r)


def _shards(group: Group, par: Parallelism) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """[replica][stage] -> GPU ids of that stage's tensor-parallel group."""
    return _shards_of(group.gpus, par.tp, par.pp, par.replicas)


@functools.lru_cache(maxsize=20_000)   # the search prices many options of one group's degrees
def _shards_of(g: tuple[int, ...], tp: int, pp: int, replicas: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    return tuple(tuple(g[(r * pp + s) * tp:(r * pp + s) * tp + tp] for s in range(pp)) for r in range(replicas))


def pooled(cluster: ClusterSpec, ids) -> dict[int, float]:
    """Share of its own compute and memory bandwidth each device of `ids` gets while all of `ids` run at once:
    1, except on a node whose devices draw on one pool (Node.concurrent_devices, e.g. CPU cores of one socket),
    where k busy devices get min(1, concurrent_devices / k) each. Cached: the search asks for the same groups."""
    return _pooled(cluster, tuple(ids))


@functools.lru_cache(maxsize=100_000)
def _pooled(cluster: ClusterSpec, ids: tuple[int, ...]) -> dict[int, float]:
    busy: dict[str, int] = {}
    for i in ids:
        busy[cluster.gpus[i].node] = busy.get(cluster.gpus[i].node, 0) + 1
    pool = {n: cluster.node(n).concurrent_devices for n in busy}
    return {i: 1.0 if pool[cluster.gpus[i].node] is None else min(1.0, pool[cluster.gpus[i].node]
                                                                   / busy[cluster.gpus[i].node]) for i in ids}


def _flops(cluster: ClusterSpec, i: int, share: dict[int, float]) -> float:
    return cluster.gpus[i].type.dense_bf16_flops * share[i]


def _achieved(cluster: ClusterSpec, i: int, share: dict[int, float], mfu: float) -> float:
    """FLOP/s a pass reaches on GPU i: its peak (pooled) times its type's measured `mfu`, else times the
    model's constant `mfu` for that kind of pass."""
    own = cluster.gpus[i].type.mfu
    return _flops(cluster, i, share) * (mfu if own is None else own)


def _decode_achieved(cluster: ClusterSpec, i: int, share: dict[int, float], rows: float) -> float:
    """FLOP/s a decode step of `rows` sequences reaches on GPU i: its type's measured `decode_mfu_by_rows`
    (linear in log(rows) between the measured rows, clamped to the ends), else `_achieved` at MFU_DECODE."""
    table = cluster.gpus[i].type.decode_mfu_by_rows
    if table is None:
        return _achieved(cluster, i, share, MFU_DECODE)
    mfu = np.interp(math.log(max(rows, 1.0)), [math.log(r) for r, _ in table], [m for _, m in table])
    return _flops(cluster, i, share) * float(mfu)


def _hbm(cluster: ClusterSpec, i: int, share: dict[int, float]) -> float:
    return cluster.gpus[i].type.hbm_bytes_per_s * share[i]


@functools.lru_cache(maxsize=20_000)
def _slowest_hbm(cluster, gpus: tuple[int, ...]) -> float:
    """HBM bytes/s of the slowest of `gpus` while all of them run (pooled)."""
    share = pooled(cluster, gpus)
    return min(_hbm(cluster, i, share) for i in gpus)


@functools.lru_cache(maxsize=20_000)   # pure in (cluster, shards, mfu); the search asks for the same ones often
def _replica_speeds(cluster, shards, mfu) -> tuple[float, ...]:
    """FLOP/s of each DP replica: its pipeline runs at the pace of its slowest stage."""
    share = pooled(cluster, [i for stages in shards for ids in stages for i in ids])
    return tuple(len(stages) * min(len(ids) * min(_achieved(cluster, i, share, mfu) for i in ids)
                                   for ids in stages) for stages in shards)


def _shares(group: Group, speeds) -> list[float]:
    """Fraction of the batch each DP replica processes."""
    return _split(group.data_split, speeds)


def _split(data_split: str, speeds) -> list[float]:
    if data_split == "even":
        return [1 / len(speeds)] * len(speeds)
    total = sum(speeds)
    return [v / total for v in speeds]


def _dp_groups(shards, par: Parallelism) -> tuple[tuple[int, ...], ...]:
    """GPU ids of each data-parallel group: the replicas' GPUs holding the same stage and tensor slice."""
    return _dp_groups_of(shards, par.replicas, par.pp, par.tp)


@functools.lru_cache(maxsize=20_000)
def _dp_groups_of(shards, replicas: int, pp: int, tp: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(shards[r][s][t] for r in range(replicas)) for s in range(pp) for t in range(tp))


@functools.lru_cache(maxsize=20_000)
def _replica_links(cluster, shards) -> tuple[tuple[tuple, tuple], ...]:
    """Per replica: the slowest link of each stage's TP group (with, where the group is one node's GPUs over NVLink,
    their type, whose collective tables then price its all-reduces), and of each pair of adjacent stages (a PP
    hop)."""
    return tuple((tuple(slowest_link(cluster, ids) + (_nvlink_type(cluster, ids),) for ids in stages),
                  tuple(slowest_link(cluster, a + b) for a, b in zip(stages, stages[1:]))) for stages in shards)


def _nvlink_type(cluster, ids):
    """The GPU type of `ids` when they are GPUs of one node joined by NVLink (the collective tables' setting)."""
    nodes = {cluster.gpus[i].node for i in ids}
    if len(nodes) != 1 or len(ids) < 2:
        return None
    node = cluster.node(next(iter(nodes)))
    t = cluster.gpus[ids[0]].type
    return t if node.intra_node == "nvlink" and node.intra_node_gbps is None else None


@functools.lru_cache(maxsize=20_000)   # pure in (cluster, groups)
def _dp_links(cluster, dp_groups: tuple[tuple[int, ...], ...]) -> tuple[tuple, ...]:
    """The link each DP group's ring runs at. Rings that leave their node run side by side (one per stage and
    tensor slice) and share each node's network: a node carrying k such rings gives each 1/k of its bandwidth.
    A group inside one NVLink node also names its GPU type, whose collective tables then price its all-reduces
    (allreduce_s)."""
    nodes = [{cluster.gpus[i].node for i in ids} for ids in dp_groups]
    crossing: dict[str, int] = {}
    for ns in nodes:
        if len(ns) > 1:
            for n in ns:
                crossing[n] = crossing.get(n, 0) + 1
    links = []
    for ids, ns in zip(dp_groups, nodes):
        lat, bw = slowest_link(cluster, ids)
        links.append((lat, bw / max(crossing[n] for n in ns)) if len(ns) > 1
                     else (lat, bw, _nvlink_type(cluster, ids)))
    return tuple(links)


def _overlapped(seconds: float, compute: float, layers: float) -> float:
    """Exposed seconds of per-layer traffic that runs beside compute (ZeRO-3 gathers, streamed offloaded
    weights): what the link cannot hide behind compute, and at least the first layer's share."""
    return max(seconds - compute, seconds / max(1.0, layers))


def param_split(model: ModelSpec, par: Parallelism) -> tuple[float, float, float, float]:
    """(S, S_dp, layer, expert_share) per GPU: parameters held without ZeRO sharding, after sharding over the
    task's data-parallel ranks, of the largest layer (what FSDP gathers at a time), and the routed experts' part
    of S. Dense weights split over TP x PP and shard over dp x sp; with ep > 1 the routed experts split over
    EP x PP (whole experts, expert tensor parallelism 1) and shard over the tp x sp x dp / ep ranks that hold the
    same experts; with ep = 1 they split like dense weights (TP-sharded experts, FSDP gathers every expert)."""
    tp, pp = par.tp, par.pp
    if par.ep == 1:
        shard = model.params / (tp * pp)
        return shard, shard / par.replicas, (model.attn_params_per_layer + model.mlp_params_per_layer) / tp, \
            model.expert_params / (tp * pp)
    dense = (model.params - model.expert_params) / (tp * pp)
    experts = model.expert_params / (par.ep * pp)
    edp = tp * par.sp * par.dp // par.ep
    layer = (model.attn_params_per_layer + model.mlp_params_per_layer - model.expert_params_per_layer) / tp \
        + model.expert_params_per_layer / par.ep
    return dense + experts, dense / par.replicas + experts / edp, layer, experts


def alltoall_s(cluster: ClusterSpec, ids, nbytes: float, busy_per_node: dict[str, int] | None = None,
               messages: int = 1) -> float:
    """All-to-alls in which each of the GPUs `ids` sends `nbytes` in all, spread evenly over all of them (a 1/k
    share stays home), in `messages` calls: the part to GPUs of its own node over the node's link, the rest over
    its node's NIC, shared by the node's GPUs that send across at once (`busy_per_node`, default: those of
    `ids`); one latency per call (NCCL groups the k - 1 point-to-point sends of a rank and runs them at once,
    unlike a ring's k - 1 sequential steps). Message size
    enters through that latency (the alpha-beta model), not through a measured bus-bandwidth curve."""
    ids = tuple(ids)
    if len(ids) <= 1:
        return 0.0
    busy = tuple(sorted((busy_per_node or {}).items()))
    return max(per_byte * nbytes + lat * messages for per_byte, lat in _alltoall_coeffs(cluster, ids, busy))


@functools.lru_cache(maxsize=100_000)
def _alltoall_coeffs(cluster: ClusterSpec, ids: tuple[int, ...], busy: tuple,
                     ep: bool = False) -> tuple[tuple[float, float], ...]:
    """Per node of an all-to-all group: (seconds per byte a GPU sends, latency per call); alltoall_s takes the
    max over nodes of per_byte x bytes + latency x calls. Cached: the search prices the same groups many times.
    `ep`: an expert-parallel dispatch / combine, whose links run at the fraction of their line rate the EP tables
    measured at this span (optables.ep_link_fraction: DeepEP's normal kernels) where the GPUs are priced from
    tables; otherwise NVLink at NCCL's bus efficiency and the network at its line rate."""
    busy_of = dict(busy)
    k = len(ids)
    by_node: dict[str, list[int]] = {}
    for i in ids:
        by_node.setdefault(cluster.gpus[i].node, []).append(i)
    out = []
    for node, local in by_node.items():
        t = cluster.gpus[local[0]].type
        lat_in, bw_in = slowest_link(cluster, local) if len(local) > 1 else (0.0, math.inf)
        if cluster.node(node).intra_node == "nvlink" and cluster.node(node).intra_node_gbps is None:
            f = optables.ep_link_fraction(t, k, "nvlink") if ep else None
            bw_in *= NVLINK_BUS_EFFICIENCY if f is None else f   # NCCL's protocol overhead on NVLink, or the EP table's
        inside = (len(local) - 1) / k / bw_in if len(local) > 1 else 0.0
        outside, lat = 0.0, lat_in
        if len(local) < k:
            other = next(i for i in ids if cluster.gpus[i].node != node)
            lat_out, bw_out = slowest_link(cluster, [local[0], other])
            f = optables.ep_link_fraction(t, k, "rdma") if ep and lat_out <= INTRA_REGION_LATENCY_S else None
            outside = (k - len(local)) / k / (bw_out * (1.0 if f is None else f) / busy_of.get(node, len(local)))
            lat = max(lat, lat_out)
        out.append((max(inside, outside), lat))
    return tuple(out)


def _decode_allreduce_s(cluster: ClusterSpec, ids, nbytes: float, messages: int) -> float:
    """Decode's TP all-reduces: `messages` calls moving `nbytes` in all. Inside one NVLink node each call as vLLM
    runs it (optables.decode_allreduce_s: its own kernels, measured, up to the largest size measured, NCCL's table
    above); without that table, or on another link, a ring (allreduce_s). A TP group that spans nodes sends
    messages of a few KB, for which NCCL picks its tree algorithm with the LL protocol (NCCL's tuning model;
    Sanders et al.'s double binary tree): latency 2 (k_node - 1) alpha inside the node plus 2 ceil(log2 nodes)
    alpha between nodes per call, instead of a ring's 2 (k - 1) alpha over the slowest link; bandwidth as the
    ring. Where a collective table measured NCCL across nodes (Vidur's DGX A100 pairs), each call's time comes from
    it instead (optables.allreduce_s: the bandwidth part by the network share per GPU, the tree's further levels by
    the link's latency): decode's cross-node all-reduces are NCCL's."""
    ids = list(ids)
    link = slowest_link(cluster, ids)
    nodes: dict[str, list[int]] = {}
    for i in ids:
        nodes.setdefault(cluster.gpus[i].node, []).append(i)
    if len(nodes) == 1:
        t = _nvlink_type(cluster, ids)
        one = optables.decode_allreduce_s(t, nbytes / messages, len(ids)) if t is not None and messages >= 1 \
            else None
        return messages * one if one is not None else allreduce_s(nbytes, len(ids), link, messages)
    k = len(ids)
    k_node = max(len(v) for v in nodes.values())
    t = cluster.gpus[ids[0]].type
    if (messages >= 1 and link[0] <= INTRA_REGION_LATENCY_S   # one region: the tables' setting
            and all(cluster.gpus[i].type == t for i in ids)):
        gbps = min(cluster.node(n).network_gbps / cluster.node(n).count for n in nodes)   # each GPU's NIC share
        one = optables.allreduce_s(t, nbytes / messages, k, len(nodes), gbps, link[0])
        if one is not None:
            return messages * one
    lat_in = slowest_link(cluster, next(v for v in nodes.values() if len(v) == k_node))[0] if k_node > 1 else 0.0
    latency = 2 * (k_node - 1) * lat_in + 2 * math.ceil(math.log2(len(nodes))) * link[0]
    return 2 * (k - 1) / k * nbytes / link[1] + latency * messages


def _busy(cluster: ClusterSpec, ids) -> dict[str, int]:
    """GPUs of each node among `ids` (they all send across the node's NIC at once in an all-to-all phase)."""
    return dict(_busy_of(cluster, tuple(ids)))


@functools.lru_cache(maxsize=20_000)
def _busy_of(cluster: ClusterSpec, ids: tuple[int, ...]) -> tuple[tuple[str, int], ...]:
    out: dict[str, int] = {}
    for i in ids:
        out[cluster.gpus[i].node] = out.get(cluster.gpus[i].node, 0) + 1
    return tuple(out.items())


def _finish_new_layout(cluster, w, model, gpus, par, terms, compute, micro_batches, steps, passes, dp_links, train,
                       vb, layers_per_stage) -> TaskCost:
    """DP communication, optimizer and offload of a task that uses ep, sp, vpp or an engine: the same physics as
    the default path, with parameters split by param_split (experts over EP, states over dp x sp)."""
    shard, shard_dp, _, experts = param_split(model, par)
    dense = shard - experts
    edp = par.tp * par.sp * par.dp // par.ep if par.ep > 1 else par.replicas
    if par.zero == 3 and par.replicas > 1:
        halves = micro_batches * (3 if train else 1)
        msgs = max(1, round(layers_per_stage))
        gather = 0.0
        for link in dp_links:
            t = allreduce_s(vb * (dense if par.ep > 1 else shard), par.replicas, link, msgs)
            if par.ep > 1:
                t += allreduce_s(vb * experts, edp, link, msgs)
            gather = max(gather, halves / 2 * t)
        terms["dp_comm"] = _overlapped(gather, compute, layers_per_stage)
    elif train:
        dp_comm = 0.0
        for link in dp_links:
            t = allreduce_s(vb * (dense if par.ep > 1 else shard), par.replicas, link)
            if par.ep > 1:
                t += allreduce_s(vb * experts, edp, link)
            dp_comm = max(dp_comm, steps * t)
        terms["dp_comm"] = dp_comm
    offload = 0.0
    if par.offload == "params":
        offload += _overlapped(passes * vb * shard_dp / PCIE_BYTES_PER_S, compute, layers_per_stage)
    if train:
        slowest_hbm = _slowest_hbm(cluster, gpus)
        if par.offload == "none":
            written = shard_dp if par.zero == 3 else shard
            terms["optimizer"] = steps * (16 * shard_dp + 4 * written) / (slowest_hbm * HBM_EFF)
        else:
            offload += steps * (2 * vb * shard_dp / PCIE_BYTES_PER_S
                                + CPU_ADAM_BYTES_PER_PARAM * shard_dp / HOST_BYTES_PER_S_PER_GPU)
    if offload:
        terms["offload"] = offload
    return TaskCost(sum(terms.values()), terms)


def _ep_groups(shards, par: Parallelism, stage: int) -> list[list[int]]:
    """GPU ids of each expert-parallel group of a pipeline stage: `ep` consecutive GPUs of the stage in
    (replica, tensor rank) order (TP ranks of one replica first, then the next replicas: Megatron's order)."""
    ids = [i for r in range(par.replicas) for i in shards[r][stage]]
    return [ids[k:k + par.ep] for k in range(0, len(ids), par.ep)]


def _ep_alltoall_coeffs(cluster, gpus: tuple[int, ...], shards, par: Parallelism) -> tuple[tuple[float, float], ...]:
    """alltoall_s's (seconds per byte, latency per call) of every node of every EP group of every stage, with the
    group's GPUs all sending at once: the max over them of per_byte x bytes + latency x calls is the slowest EP
    group's all-to-all (alltoall_s of each group, maxed), without rebuilding the groups for every call."""
    return _ep_coeffs(cluster, gpus, shards, par.ep, par.pp, par.replicas)


@functools.lru_cache(maxsize=20_000)
def _ep_coeffs(cluster, gpus, shards, ep, pp, replicas) -> tuple[tuple[float, float], ...]:
    busy = tuple(sorted(_busy_of(cluster, gpus)))
    out = []
    for s in range(pp):
        ids = [i for r in range(replicas) for i in shards[r][s]]
        for k in range(0, len(ids), ep):
            g = tuple(ids[k:k + ep])
            out += _alltoall_coeffs(cluster, g, busy, ep=True) if len(g) > 1 else [(0.0, 0.0)]
    # a pair no larger in both than another can never be the max of per_byte x bytes + latency x calls
    return tuple(c for c in set(out) if not any(o != c and o[0] >= c[0] and o[1] >= c[1] for o in out))


@functools.lru_cache(maxsize=20_000)
def _sp_coeffs(cluster, shards, dp: int, pp: int, sp: int) -> tuple[tuple[tuple[tuple[float, float], ...], ...], ...]:
    """[dp rank][stage] -> alltoall_s's coefficients of the sp GPUs (first tensor rank) of that sequence-parallel
    group; ((0, 0),) for a group of one GPU, whose all-to-all costs nothing."""
    out = []
    for d in range(dp):
        stages = []
        for s in range(pp):
            ids = tuple(i for j in range(sp) for i in shards[d * sp + j][s][:1])
            stages.append(_alltoall_coeffs(cluster, ids, ()) if len(ids) > 1 else ((0.0, 0.0),))
        out.append(tuple(stages))
    return tuple(out)


def micro_batches_per_replica(w: WorkloadSpec, par: Parallelism, tokens: float, samples: float) -> int:
    """Micro-batches each data-parallel replica (a group of sp GPUs) runs over `samples` (of `tokens` in all):
    by responses (micro_batch_responses), or packed to max_tokens_per_micro_batch per GPU (sp of them share one)."""
    if w.max_tokens_per_micro_batch is None:
        return max(1, math.ceil(samples / par.dp / w.micro_batch_responses))
    return max(1, math.ceil(tokens / par.dp / (w.max_tokens_per_micro_batch * par.sp)))


def _moe_expert_time_factor(cluster, w: WorkloadSpec, model: ModelSpec, par: Parallelism, ids, mb_tokens: float,
                            mfu: float) -> float:
    """How much longer the routed experts' FLOPs take than at the pass's MFU: the grouped GEMM's efficiency at
    the tokens each expert receives per micro-batch (catalog.gemm_efficiency, gate/up and down GEMMs weighted
    by their FLOPs), times the load imbalance the busiest EP rank sees (MOE_LOAD_IMBALANCE, ep > 1 only).
    1 exactly when neither applies."""
    return _expert_factor(cluster, model, par.ep, par.tp, tuple(ids), mb_tokens, mfu)


@functools.lru_cache(maxsize=100_000)   # pure; the search prices many options with the same expert GEMMs
def _expert_factor(cluster, model: ModelSpec, ep: int, tp: int, ids: tuple[int, ...], mb_tokens: float,
                   mfu: float) -> float:
    per_expert = mb_tokens * model.experts_per_token * ep / model.experts
    share = pooled(cluster, ids)
    i = min(ids, key=lambda g: _achieved(cluster, g, share, mfu))
    flops, hbm = _achieved(cluster, i, share, mfu), _hbm(cluster, i, share) * HBM_EFF
    split = 1 if ep > 1 else tp        # with ep = 1 experts are TP-sharded: narrower GEMMs
    up = gemm_efficiency(per_expert, model.hidden, 2 * model.moe_intermediate / split, flops, hbm)
    down = gemm_efficiency(per_expert, model.moe_intermediate / split, model.hidden, flops, hbm)
    eff = 1.0 / ((2 / 3) / up + (1 / 3) / down)
    imbalance = MOE_LOAD_IMBALANCE if ep > 1 else 1.0
    return imbalance / eff


def _dense_pass(cluster, w: WorkloadSpec, model: ModelSpec, group: Group, task: str, train: bool) -> TaskCost:
    passes_over = w.old_logprob_share if task == "actor_infer" else 1.0   # of the samples this pass runs on
    if passes_over == 0:
        return TaskCost(0.0, {"compute": 0.0})
    cost = _pass_cost(cluster, w, model, group.gpus, group.data_split, group.par(task), train, passes_over)
    return TaskCost(cost.seconds, dict(cost.terms))   # a copy: the cached terms stay as computed


@functools.lru_cache(maxsize=200_000)
def _pass_cost(cluster, w: WorkloadSpec, model: ModelSpec, gpus: tuple[int, ...], data_split: str, par: Parallelism,
               train: bool, passes_over: float) -> TaskCost:
    """A training or log-prob pass of `model` with `par` on `gpus`: it depends on nothing else of its group or task,
    so the search's many pricings of one option (a task alone while sorting options, then in its group; the
    reference and reward passes of the actor's model) are computed once."""
    shards = _shards_of(gpus, par.tp, par.pp, par.replicas)
    tokens, pairs = _tokens_and_pairs(w)
    tokens, pairs = tokens * passes_over, pairs * passes_over
    vb = precision_bytes(w)[0]   # bytes of a weight, gradient or activation value
    attn = model.attention_flops(pairs, tokens)
    if train:   # forward + backward (2x) + the recomputed forward
        flops = (8 * model.active_params * tokens + 4 * attn) if par.recompute else \
            (6 * model.active_params * tokens + 3 * attn)
    else:
        flops = 2 * model.active_params * tokens + attn
    if model.vision_params and w.image_patches:   # the vision tower over the prompts' images, trained with the rest
        flops += (8 if par.recompute else 6 if train else 2) * model.vision_params * _vision_tokens(w) * passes_over
    mfu = MFU_TRAIN if train else MFU_INFER
    speeds = _replica_speeds(cluster, shards, mfu)
    shares = _split(data_split, speeds)
    micro_batches = micro_batches_per_replica(w, par, tokens, w.samples * passes_over)
    mb_tokens = tokens / (par.dp * micro_batches)     # tokens of one micro-batch of one replica (its sp GPUs)
    expert_factor = 1.0
    if model.experts:   # the routed experts' share of the FLOPs at the grouped GEMM's efficiency
        expert_factor = _moe_expert_time_factor(cluster, w, model, par, gpus, mb_tokens / (par.sp * par.tp)
                                                if par.ep > 1 else mb_tokens / par.sp, mfu)
    attn_eff = None
    if par.engine is not None and all(cluster.gpus[i].type.mfu is None for i in gpus):
        attn_eff = attention_efficiency(sum(w.pass_lengths))
    if expert_factor == 1.0 and attn_eff is None:
        compute = max(flops * f / v for f, v in zip(shares, speeds))     # the slowest replica sets the pace
    else:   # GEMMs at the pass's MFU, attention at its kernel's efficiency by length, experts at their factor
        per_token = (8 if par.recompute else 6) if train else 2
        attn_flops = (4 if par.recompute else 3) * attn if train else attn
        expert_flops = per_token * model.expert_active_params * tokens
        gemm_flops = flops - attn_flops - expert_flops
        attn_scale = 1.0 if attn_eff is None else mfu / attn_eff     # seconds at attn_eff over seconds at mfu
        compute = max(f * (gemm_flops + attn_flops * attn_scale + expert_flops * expert_factor) / v
                      for f, v in zip(shares, speeds))
    steps = w.optimizer_steps if train else 1   # the pipeline drains before every optimizer step
    bubble = compute * (par.pp - 1) * steps / micro_batches
    if par.vpp > 1:   # interleaved 1F1B: each GPU holds vpp virtual stages, the bubble shrinks by vpp
        bubble /= par.vpp
    layers_per_stage = model.layers / par.pp
    tp_comm = pp_comm = 0.0
    # replicas with the same share and links cost the same: each distinct one once (the max is unchanged)
    for f, (stage_links, hop_links) in set(zip(shares, _replica_links(cluster, shards))):
        share = tokens * f
        act_bytes = share * model.hidden * vb
        per_layer = 4 if train else 2
        if par.tp > 1:
            tp_comm = max(tp_comm, max(allreduce_s(per_layer * layers_per_stage * act_bytes, par.tp,
                                                      link, int(per_layer * layers_per_stage * micro_batches))
                                       for link in stage_links))
        for lat, bw in hop_links:
            hop = (2 if train else 1) * (act_bytes / bw + micro_batches * lat)
            pp_comm = max(pp_comm, hop * par.vpp if par.vpp > 1 else hop)   # interleaving crosses vpp x the hops
    terms = {"compute": compute, "pipeline_bubble": bubble, "tp_comm": tp_comm, "pp_comm": pp_comm}
    directions = ((3 if par.recompute else 2) if train else 1)   # forward, (recomputed forward), backward
    if par.ep > 1:   # dispatch + combine per MoE layer and direction: each token's rows to its k experts and back
        # the busiest replica's tokens (TP ranks split them before dispatch) over the slowest EP group: an
        # all-to-all's seconds only grow with its bytes, so this is the max over every replica and group
        nbytes = tokens * max(shares) / par.tp * model.experts_per_token * model.hidden * vb
        terms["ep_comm"] = 2 * directions * model.moe_layers / par.pp * max(
            per_byte * nbytes + lat * micro_batches for per_byte, lat in _ep_alltoall_coeffs(cluster, gpus,
                                                                                              shards, par))
    if model.experts and _tables_price(cluster, gpus):
        # the tokens' permutation to their experts and back (and the router's top-k over its logits), memory-bound
        # kernels priced at the HBM roofline: per MoE layer and direction each token read once and written k times,
        # the k rows read back and summed into one, and E fp32 router logits read (with the operator tables: they
        # are part of pricing the MoE layer from what its kernels move)
        per_gpu = tokens * max(shares) / par.tp
        moved = per_gpu * (2 * (model.experts_per_token + 1) * model.hidden * vb + 4 * model.experts)
        terms["moe_permute"] = directions * model.moe_layers / par.pp * moved / (_slowest_hbm(cluster, gpus)
                                                                                 * HBM_EFF)
    if par.sp > 1:   # Ulysses: q, k, v to head shards and the output back, per layer and direction
        sp_comm = 0.0
        qkvo = (2 * model.heads + 2 * model.kv_heads) * model.head_dim / par.tp
        for d, stages in enumerate(_sp_coeffs(cluster, shards, par.dp, par.pp, par.sp)):
            f = sum(shares[d * par.sp:(d + 1) * par.sp])
            nbytes = tokens * f / par.sp * qkvo * vb    # one GPU's tokens (of this replica's share)
            for coeffs in stages:   # alltoall_s over the stage's sp GPUs (0 for one GPU), by its coefficients
                sp_comm = max(sp_comm, directions * model.layers / par.pp * max(
                    per_byte * nbytes + lat * micro_batches for per_byte, lat in coeffs))
        terms["sp_comm"] = sp_comm
    shard_params = model.params / (par.tp * par.pp)
    passes = (3 if par.recompute else 2) if train else 1   # times the weights are read: fwd, recompute, bwd
    dp_links = _dp_links(cluster, _dp_groups(shards, par)) if par.replicas > 1 else []
    if not par.default_layout:
        return _finish_new_layout(cluster, w, model, gpus, par, terms, compute, micro_batches, steps, passes,
                                  dp_links, train, vb, layers_per_stage)
    if par.zero == 3 and par.dp > 1:
        # FSDP frees a layer's gathered weights after use, so every micro-batch all-gathers each layer's shards for
        # its forward and again for its backward (which also serves the recomputed forward), and reduce-scatters
        # its gradients (verl and FSDP2 do not skip the reduce while accumulating). Each is half an all-reduce of
        # the stage's weights, one message per layer; overlapped with compute as far as the link allows.
        halves = micro_batches * (3 if train else 1)
        gather = max(halves / 2 * allreduce_s(vb * shard_params, par.dp, link, max(1, round(layers_per_stage)))
                     for link in dp_links)
        terms["dp_comm"] = _overlapped(gather, compute, layers_per_stage)
    elif train:   # gradients accumulate locally and are all-reduced (ZeRO-2: reduce-scattered) once per optimizer step
        dp_comm = 0.0
        for link in dp_links:
            dp_comm = max(dp_comm, steps * allreduce_s(vb * shard_params, par.dp, link))
        terms["dp_comm"] = dp_comm
    offload = 0.0
    if par.offload == "params":   # each pass streams this rank's weight shard in from host memory
        offload += _overlapped(passes * vb * shard_params / par.dp / PCIE_BYTES_PER_S, compute, layers_per_stage)
    if train:
        slowest_hbm = _slowest_hbm(cluster, gpus)
        if par.offload == "none":
            weights_written = shard_params / par.dp if par.zero == 3 else shard_params
            terms["optimizer"] = steps * (16 * shard_params / par.dp + 4 * weights_written) / (slowest_hbm * HBM_EFF)
        else:   # Adam on the host: gradients out and weights back over PCIe, the step at host memory speed
            offload += steps * (2 * vb * shard_params / par.dp / PCIE_BYTES_PER_S
                                + CPU_ADAM_BYTES_PER_PARAM * shard_params / par.dp / HOST_BYTES_PER_S_PER_GPU)
    if offload:
        terms["offload"] = offload
    return TaskCost(sum(terms.values()), terms)


def _generation(cluster, w: WorkloadSpec, model: ModelSpec, group: Group, free_bytes: dict[int, float]) -> TaskCost:
    par = group.par("actor_gen")
    shards = _shards(group, par)
    vb = precision_bytes(w)[0]   # bytes of a weight, activation or KV value
    kv_token = model.kv_bytes_per_token * vb / 2 / par.tp   # one token's K and V on a TP shard (all layers; 16-bit / 2)
    if model.kv_lora_rank:   # MLA's latent is not split over TP: every TP rank caches all of it
        kv_token = model.kv_bytes_per_token * vb / 2
    # The N responses of a prompt hold its KV once (vLLM/SGLang prefix caching, hetrl's SharedPrefixCache: the
    # same sharing that lets the prompt be prefilled once), so a sequence occupies P/N + R tokens of cache, its
    # layers spread over the PP stages.
    kv_stage = kv_token / par.pp    # a token's K and V on one pipeline stage's TP shard
    kv_seq = (w.prompt_tokens.max / w.responses_per_prompt + w.completion_tokens.max) * kv_stage
    pool = pooled(cluster, group.gpus)
    caps = [min(min(_hbm(cluster, i, pool) for i in ids) for ids in stages) * par.tp for stages in shards]
    worst, worst_terms = -1.0, {}
    if par.ep > 1:
        ep_groups = [g for s_ in range(par.pp) for g in _ep_groups(shards, par, s_)]
        busy = _busy(cluster, group.gpus)
    for share, stages in zip(_shares(group, caps), shards):
        ids = [i for s in stages for i in s]
        batch = w.generated_samples * share
        free = min(free_bytes[i] for i in ids)
        if free < kv_seq:
            return TaskCost(math.inf, {"infeasible": math.inf})
        hbm = min(_hbm(cluster, i, pool) for i in ids) * HBM_EFF
        prefill_flops = min(_achieved(cluster, i, pool, MFU_INFER) for i in ids)
        p, r, r_max = w.prompt_tokens.mean, w.response_tokens.mean, w.response_tokens.max
        u = w.tool_tokens.mean if w.tool_tokens is not None else 0.0
        prefill = 2 * model.active_params * (batch / w.leaves) * p / (par.tp * prefill_flops)
        if model.vision_params and w.image_patches:   # each prompt's images encoded once, before its prefill
            prefill += 2 * model.vision_params * (batch / w.leaves) * w.image_patches / (par.tp * prefill_flops)
        terms = {"compute": prefill, "tp_comm": 0.0, "pp_comm": 0.0}
        if par.ep > 1:
            terms["ep_comm"] = 0.0
        hbm_s, memory_bound = 0.0, False
        # One decode per turn (a single-turn workload: one), on the task's episodes alive in it (turn_rows: forks
        # add rows); the turns before it are context, each row's own (a fork copies its rows).
        for j, c in enumerate(w.turn_rows):
            rows_j = batch * (c / w.leaves)   # sequences decoding this turn
            context = j * (r + u)              # tokens of the earlier turns and tool results, per sequence
            if j:   # the tool results, fed as one chunk per episode before it forks
                fed = batch * (w.turn_rows[j - 1] / w.leaves) * u
                terms["compute"] += 2 * model.active_params * fed / (par.tp * prefill_flops)
            # Continuous batching over paged KV (vLLM, SGLang): a sequence holds P/c + its context + the tokens it
            # has made so far, and a finished one's blocks go to a waiting one at once. The decode lasts R_max
            # steps (the longest turn) or, when the KV memory binds, as many steps as the cache needs to hold every
            # sequence's tokens for its lifetime: rows x R x (P/c + context + R/2) token-steps over the free tokens.
            steps = max(r_max, rows_j * r * (p / c + context + r / 2) / (free / kv_stage))
            rows = rows_j * r / steps   # sequences a decode step runs, on average
            decode_flops = min(_decode_achieved(cluster, i, pool, rows) for i in ids)
            ops = _decode_ops_s(cluster, ids, model, par, rows, vb)
            if par.ep > 1:   # dense weights over TP, the experts over EP (each step touches every local expert)
                weights_read = steps * (model.params - model.vision_params - model.expert_params
                                        + model.expert_params * par.tp / par.ep) * vb / par.tp / hbm
            else:   # a decode step reads the language model's weights (not its vision tower's)
                weights_read = steps * (model.params - model.vision_params) * vb / par.tp / hbm
            kv_read = rows_j * r * (p + context + r / 2) * kv_token / hbm
            decode_compute = 2 * model.active_params * rows_j * r / (par.tp * decode_flops)
            if par.tp > 1:   # every generated token's rows all-reduced twice per layer, 2 x layers calls per step
                terms["tp_comm"] += max(_decode_allreduce_s(cluster, s, 2 * model.layers * rows_j * r * model.hidden
                                                            * vb, 2 * model.layers * steps) for s in stages)
            terms["pp_comm"] += sum(steps * lat + rows_j * r * model.hidden * vb / bw
                                    for lat, bw in (slowest_link(cluster, a + b) for a, b in zip(stages, stages[1:])))
            if par.ep > 1:   # dispatch + combine per MoE layer and decode step, over the EP groups of this replica
                nbytes = rows_j * r / par.tp * model.experts_per_token * model.hidden * vb
                mine = set(ids)
                mine_groups = [g for g in ep_groups if mine.intersection(g)]
                ll = _decode_ep_s(cluster, mine_groups, nbytes / max(steps, 1.0)) if ops is not None else None
                if ll is not None:   # the EP tables' low-latency kernels: a measured floor per call
                    terms["ep_comm"] += model.moe_layers / par.pp * steps * ll
                else:
                    terms["ep_comm"] += max(2 * model.moe_layers / par.pp * alltoall_s(cluster, g, nbytes, busy,
                                                                                       round(steps))
                                            for g in mine_groups)
            if ops is not None:   # the step's kernels from the operator tables; its KV reads likewise where a
                kernels, engine = ops   # decode-attention table prices the GPU, else at HBM bandwidth
                terms["decode_ops"] = terms.get("decode_ops", 0.0) + steps * kernels
                terms["engine_step"] = terms.get("engine_step", 0.0) + steps * engine
                attn = _decode_attention_s(cluster, ids, model, kv_read * hbm, steps)
                hbm_s += kv_read if attn is None else attn
                memory_bound = True
            elif weights_read + kv_read >= decode_compute:
                hbm_s += weights_read + kv_read
                memory_bound = True
            else:
                terms["compute"] += decode_compute
        if memory_bound:
            terms["hbm"] = hbm_s
        if w.turns > 1:   # every turn boundary waits for its round's calls (they run at once), the GPUs idle
            terms["tool_wait"] = (w.turns - 1) * w.tool_latency_s
        total = sum(terms.values())
        if total > worst:
            worst, worst_terms = total, terms
    return TaskCost(worst, worst_terms)


def _tables_price(cluster, ids) -> bool:
    """Whether the operator tables price the GPUs `ids`: every type has a GEMM table in reach (none for a device
    measured whole, or with HETRL_OPERATOR_TABLES=off)."""
    return all(optables.nearest_measured(t, "gemm") is not None for t in {cluster.gpus[i].type for i in ids})


def _decode_attention_s(cluster, ids, model: ModelSpec, kv_bytes: float, steps: float) -> float | None:
    """Seconds of a decode's attention over `steps` steps that read `kv_bytes` of K and V in all (per TP shard, all
    layers): each step's full-attention layers each one call of an even share of the bytes, at the decode-attention
    table's measured time for that many bytes (optables.attention_decode_s: the kernel's floor at small batches,
    its achieved bandwidth at large), on the slowest GPU type of `ids`; None where a type has no table."""
    layers = model.full_attention_layers
    if kv_bytes <= 0 or steps <= 0 or layers <= 0:
        return 0.0
    per_call = kv_bytes / (steps * layers)
    got = [optables.attention_decode_s(t, per_call) for t in {cluster.gpus[i].type for i in ids}]
    return None if any(g is None for g in got) else steps * layers * max(got)


def _decode_ep_s(cluster, groups, per_call: float) -> float | None:
    """Seconds of one decode step's dispatch + combine in one MoE layer, each GPU sending `per_call` bytes, over the
    slowest of the EP `groups`, from the EP tables' low-latency kernels (optables.ep_lowlatency_s: DeepEP's measured
    latency by span as the floor, bandwidth-bound above it at the node's network share per GPU); None where a GPU
    type has no table."""
    worst = None
    for g in groups:
        if len(g) <= 1:
            continue
        t = cluster.gpus[g[0]].type
        nodes = {cluster.gpus[i].node for i in g}
        net = min(cluster.node(n).network_gbps * GBIT / cluster.node(n).count for n in nodes)
        s = optables.ep_lowlatency_s(t, len(g), per_call, per_call, net)
        if s is None:
            return None
        worst = s if worst is None else max(worst, s)
    return worst


def _decode_ops_s(cluster, ids, model: ModelSpec, par: Parallelism, rows: float, vb: int) -> tuple[float, float] | None:
    """(kernel seconds, engine seconds) of one decode step of `rows` sequences on the slowest GPU type of `ids`,
    from the operator tables; None where a GPU has none (a device type with its own measured `mfu`, as CPU cores:
    those keep the roofline constants)."""
    types = {cluster.gpus[i].type for i in ids}
    got = [_step_ops_s(t, model, par.tp, par.ep, round(rows, 3), vb) for t in types]
    return None if any(g is None for g in got) else max(got, key=sum)


@functools.lru_cache(maxsize=20_000)
def _step_ops_s(g, model: ModelSpec, tp: int, ep: int, rows: float, vb: int) -> tuple[float, float] | None:
    """One decode step on a TP shard of GPU type `g`, as the sum of its operators (Vidur's composition of a
    block): per layer the attention projections (qkv or MLA's low-rank ones, output), the MLP (dense; or the
    router, the local experts an average step touches at their tokens each as one grouped GEMM per projection,
    and the shared expert), the per-token kernels (norms, rope, activation, add); then the LM head; each
    GEMM at `rows` tokens. The attention over the KV cache is not here (the caller prices its reads at HBM
    bandwidth: no decode-attention table is public). Plus the engine's CPU time per step (engine_step)."""
    if optables.nearest_measured(g, "gemm") is None:
        return None
    h = model.hidden

    def gemm(n, k, m=rows):
        return optables.gemm_s(g, m, max(n, 1.0), max(k, 1.0), vb)
    o = model.heads * model.head_dim * h
    attn = gemm((model.attn_params_per_layer - o) / h / tp, h) + gemm(h, o / h / tp)
    small = optables.small_ops_s(g, rows, h, (model.intermediate or model.moe_intermediate) / tp)
    if small is None:
        return None
    total = model.dense_layers * (attn + small + (gemm(2 * model.intermediate / tp, h)
                                                  + gemm(h, model.intermediate / tp) if model.intermediate else 0.0))
    if model.moe_layers:
        e, k = model.experts, model.experts_per_token
        etp = 1 if ep > 1 else tp                      # experts over EP (whole), else each split over TP
        tokens = rows * max(1.0, ep / tp)              # an EP group's experts see its ranks' tokens
        local = e / ep
        touched = 1 - (1 - k / e) ** tokens            # the share of experts an average step routes a token to
        m_e = tokens * k / (e * touched)               # tokens per touched expert
        # vLLM's and SGLang's fused MoE runs a layer's routed experts as one grouped kernel per projection
        # (fused_moe: w13, then w2), not a GEMM launch per expert: from the moe_layer table (the measured fused
        # layer's efficiency at m_e tokens per expert); without one, as one GEMM per projection that reads every
        # touched local expert's weights (the gemm table's efficiency at that weight size)
        n_touched = local * touched
        experts = optables.moe_layer_s(g, m_e, n_touched, model.moe_intermediate / etp, h, vb)
        if experts is None:
            experts = (gemm(2 * model.moe_intermediate / etp, h * n_touched, m_e)
                       + gemm(h, model.moe_intermediate / etp * n_touched, m_e))
        shared = (gemm(2 * model.shared_intermediate / tp, h) + gemm(h, model.shared_intermediate / tp)
                  if model.shared_intermediate else 0.0)
        total += model.moe_layers * (attn + small + gemm(e, h) + experts + shared)
    total += gemm(model.vocab / tp, h)
    engine = optables.engine_step_s(g, rows, tp)
    return total, (engine or 0.0)


optables.on_reload(_step_ops_s.cache_clear)
optables.on_reload(_pass_cost.cache_clear)    # its TP all-reduces come from the collective tables
optables.on_reload(_alltoall_coeffs.cache_clear)   # EP all-to-alls from the EP tables
optables.on_reload(_ep_coeffs.cache_clear)


# ------------------------------------------------------------------------------------------ memory


@dataclass(frozen=True)
class TaskMemory:
    """Bytes one task holds per GPU: its copy of the role's weights, training states (gradients + Adam) on the
    GPU, its working set while it runs, and what it keeps in host memory (offload)."""

    weights: float
    states: float
    working: float
    host: float

    @property
    def gpu(self) -> float:
        return self.weights + self.states + self.working


def precision_bytes(w: WorkloadSpec) -> tuple[int, int]:
    """(bytes per weight, gradient and activation value; bytes of optimizer state per parameter): mixed precision
    keeps 16-bit values and an fp32 master copy plus Adam's two fp32 moments (12 B); fp32 keeps the two moments."""
    return (4, 8) if w.precision == "fp32" else (BYTES, 12)


@functools.lru_cache(maxsize=100_000)   # pure; the search asks for the same (task, degrees) many times
def task_memory(w: WorkloadSpec, task: str, par: Parallelism, micro_batch_tokens: float | None = None) -> TaskMemory:
    """Per-GPU memory of `task` run with `par` (its degrees and memory strategy). Generation's KV cache is not
    here: it takes whatever the group leaves free (see group_memory). `micro_batch_tokens` overrides the
    micro-batch the workload implies (the trainer packs micro-batches by tokens)."""
    model = w.model(ROLE_OF[task])
    b, adam = precision_bytes(w)
    if not par.default_layout or w.max_tokens_per_micro_batch is not None:
        return _task_memory_new(w, task, par, micro_batch_tokens)
    shard = model.params / (par.tp * par.pp)
    layer = (model.attn_params_per_layer + model.mlp_params_per_layer) / par.tp
    if par.offload == "params":
        weights, host = GATHERED_LAYERS * b * layer, b * shard / par.dp
    elif par.zero == 3:
        weights, host = b * shard / par.dp + GATHERED_LAYERS * b * layer, 0.0
    else:
        weights, host = b * shard, 0.0
    mb = _micro_batch_tokens(w) if micro_batch_tokens is None else micro_batch_tokens
    logits = min(mb, LOGIT_CHUNK_TOKENS) * model.vocab * 4 / par.tp \
        if task in ("actor_train", "actor_infer", "ref_infer") else 0
    act = 34 * b // 2   # bytes per token and hidden unit per layer (34 in 16-bit, flash attention; Korthikanti et al.)
    states = working = 0.0
    if task in TRAIN_TASKS:
        grads = b * shard if par.zero == 1 else b * shard / par.dp
        if par.offload == "none":
            states = grads + adam * shard / par.dp
        else:
            states, host = grads, host + adam * shard / par.dp
        if par.recompute:   # layer inputs kept, one layer's internals at a time
            working = mb * model.hidden * b * model.layers / par.pp + act * mb * model.hidden / par.tp + 2 * logits
        else:               # every layer's internals kept
            working = act * mb * model.hidden * model.layers / (par.pp * par.tp) + 2 * logits
    elif task in INFER_TASKS:
        working = act * mb * model.hidden / par.tp + logits
    return TaskMemory(weights, states, working, host)


def in_flight_micro_batches(par: Parallelism, micro_batches: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once: 1 without a pipeline or outside
    Megatron; Megatron's 1F1B keeps min(pp, m), and its interleaved schedule (vpp > 1) 1 + (pp-1)/(pp*vpp) times
    that (Korthikanti et al. 2022, §4.2.3; Narayanan et al. 2021)."""
    if par.engine != "megatron" or par.pp == 1:
        return 1.0
    inflight = float(min(par.pp, micro_batches))
    if par.vpp > 1:
        inflight *= 1 + (par.pp - 1) / (par.pp * par.vpp)
    return inflight


def sequence_tokens(w: WorkloadSpec) -> int:
    """Tokens of the longest single sequence a training or log-prob micro-batch must hold at once: a prompt with
    its response (DualKV: the prompt with the micro-batch's responses, which share it)."""
    p, r = w.prompt_tokens.max, w.completion_tokens.max
    return p + w.micro_batch_responses * r if w.dualkv else p + r


def _task_memory_new(w: WorkloadSpec, task: str, par: Parallelism, micro_batch_tokens: float | None) -> TaskMemory:
    """task_memory for plans that use ep, sp, vpp, an engine or a token budget: the same rules, with parameters
    split by param_split, micro-batches of max_tokens_per_micro_batch (or micro_batch_responses / sp) tokens per
    GPU, and Megatron's sequence parallelism and in-flight micro-batches."""
    model = w.model(ROLE_OF[task])
    b, adam = precision_bytes(w)
    shard, shard_dp, layer, _ = param_split(model, par)
    if par.offload == "params":
        weights, host = GATHERED_LAYERS * b * layer, b * shard_dp
    elif par.zero == 3:
        weights, host = b * shard_dp + GATHERED_LAYERS * b * layer, 0.0
    else:
        weights, host = b * shard, 0.0
    if micro_batch_tokens is not None:
        mb = micro_batch_tokens
    elif w.max_tokens_per_micro_batch is not None:   # packed up to the budget on every GPU
        mb = w.max_tokens_per_micro_batch
    else:
        mb = _micro_batch_tokens(w) / par.sp
    logits = min(mb, LOGIT_CHUNK_TOKENS) * model.vocab * 4 / par.tp \
        if task in ("actor_train", "actor_infer", "ref_infer") else 0
    act = 34 * b // 2
    # Megatron with TP shards the layer inputs it keeps too (sequence parallelism: Korthikanti et al. 34/t)
    inputs_split = par.tp if par.engine == "megatron" else 1
    states = working = 0.0
    if task in TRAIN_TASKS:
        grads = b * shard if par.zero == 1 else b * shard_dp
        if par.offload == "none":
            states = grads + adam * shard_dp
        else:
            states, host = grads, host + adam * shard_dp
        tokens, _ = _tokens_and_pairs(w)
        inflight = in_flight_micro_batches(par, micro_batches_per_replica(w, par, tokens / w.optimizer_steps,
                                                                          w.samples / w.optimizer_steps))
        if par.recompute:
            working = inflight * mb * model.hidden * b * model.layers / par.pp / inputs_split \
                + act * mb * model.hidden / par.tp + 2 * logits
        else:
            working = inflight * act * mb * model.hidden * model.layers / (par.pp * par.tp) + 2 * logits
    elif task in INFER_TASKS:
        working = act * mb * model.hidden / par.tp + logits
    return TaskMemory(weights, states, working, host)


def token_budget_error(w: WorkloadSpec, task: str, par: Parallelism) -> str:
    """'' when one sequence fits the task's token budget per GPU (max_tokens_per_micro_batch x sp), else why not:
    verl refuses a budget below the longest sequence (its dynamic batching never splits a sequence)."""
    if w.max_tokens_per_micro_batch is None or task == "actor_gen":
        return ""
    need = sequence_tokens(w)
    if need <= w.max_tokens_per_micro_batch * par.sp:
        return ""
    return (f"{task}: one sequence of {need} tokens does not fit max_tokens_per_micro_batch "
            f"{w.max_tokens_per_micro_batch} x sp {par.sp}; raise the budget to >= {math.ceil(need / par.sp)} or sp to "
            f">= {math.ceil(need / w.max_tokens_per_micro_batch)}")


PHASES = (("actor_gen",), INFER_TASKS, TRAIN_TASKS)


def _phase_bytes(mems: dict[str, TaskMemory], tasks) -> tuple[float, float, dict]:
    """(resident, working, {item: bytes}) of a group while `tasks` run: one copy of each role's weights (the
    largest its tasks hold), training states, and the largest working set."""
    items: dict = {}
    for t in tasks:
        role = ("weights", ROLE_OF[t])
        items[role] = max(items.get(role, 0.0), mems[t].weights)
        if mems[t].states:
            items[("states", t)] = mems[t].states
    return sum(items.values()), max((mems[t].working for t in tasks), default=0.0), items


@dataclass
class GroupMemory:
    peak: float            # bytes per GPU at the busiest moment
    kv_free: float         # bytes per GPU generation may fill with KV cache
    host: float            # bytes per GPU kept in host memory (offload, roles swapped out)
    swap_s: float          # seconds per iteration moving swapped roles between host and GPU


def group_memory(w: WorkloadSpec, group: Group, usable: float) -> GroupMemory:
    """Memory of one GPU of `group` (GPUs of a group hold the same shares). Without `swap` everything in the
    group stays resident; with it, each phase (generation, inference, training) holds only its own roles, so
    the peak is the largest phase, and every role or state idle in some phase is moved out and back in once
    per iteration over PCIe (the KV cache is dropped, not moved)."""
    return _group_bytes(w, group).on(usable)


@dataclass(frozen=True)
class _GroupBytes:
    """What `group_memory` reads of a group before the GPU's usable bytes come in (the same on every GPU type)."""

    peak: float
    gen_resident: float    # bytes held while generation runs; the rest of the GPU is KV cache
    host: float
    swapped: float

    def on(self, usable: float) -> GroupMemory:
        return GroupMemory(self.peak, usable - self.gen_resident, self.host + self.swapped,
                           2 * self.swapped / PCIE_BYTES_PER_S)


def _group_bytes(w: WorkloadSpec, group: Group) -> _GroupBytes:
    mems = {t: task_memory(w, t, p) for t, p in group.parallelism}
    host = sum(m.host for m in mems.values())
    if not group.swap:
        resident, working, _ = _phase_bytes(mems, group.tasks)
        return _GroupBytes(resident + working, resident, host, 0.0)
    phases = [[t for t in group.tasks if t in p] for p in PHASES]
    phases = [p for p in phases if p]
    per_phase = [_phase_bytes(mems, p) for p in phases]
    peak = max(r + wk for r, wk, _ in per_phase)
    gen = next((r for p, (r, _, _) in zip(phases, per_phase) if "actor_gen" in p), 0.0)
    moved = {}
    for _, _, items in per_phase:
        for k, v in items.items():
            moved[k] = max(moved.get(k, 0.0), v)
    out = {k: v for k, v in moved.items() if any(k not in items for _, _, items in per_phase)}
    return _GroupBytes(peak, gen, host, sum(out.values()))


@dataclass
class Memory:
    peak: dict[int, float]         # GPU id -> peak bytes
    kv_free: dict[int, float]      # GPU id -> bytes for generation's KV cache
    swap_s: dict[int, float]       # group index -> swap seconds per iteration
    why: str                       # the first GPU or node that does not fit, or ''


@functools.lru_cache(maxsize=100_000)   # the search asks for the same group's GPUs many times
def _runs(cluster: ClusterSpec, gpus: tuple[int, ...]) -> tuple[tuple[float, str, tuple[int, ...]], ...]:
    """A group's GPUs by (usable bytes, node), in the order each pair first appears (so a run's first GPU comes
    before every GPU of the runs after it)."""
    runs: dict[tuple[float, str], list[int]] = {}
    for i in gpus:
        g = cluster.gpus[i]
        runs.setdefault((g.type.memory_bytes * MEM_UTIL, g.node), []).append(i)
    return tuple((usable, node, tuple(ids)) for (usable, node), ids in runs.items())


def usable_host_bytes(cluster: ClusterSpec, node: str) -> float:
    """Host memory of `node` that offloaded and swapped states may fill (the same share as of GPU memory)."""
    return cluster.node(node).host_memory_bytes * MEM_UTIL


def memory(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan) -> Memory:
    """Peak bytes of every GPU and host memory of every node under `plan`, and the first thing that does not
    fit (a constraint: a plan that does not fit is infeasible, whatever its speed)."""
    peak, free, swap_s, why = {}, {}, {}, ""
    host_of_node: dict[str, float] = {}
    if w.max_tokens_per_micro_batch is not None:
        why = next((e for g in plan.groups for t, p in g.parallelism if (e := token_budget_error(w, t, p))), "")
    for k, group in enumerate(plan.groups):
        nbytes = _group_bytes(w, group)   # a group's GPUs hold the same shares
        swap_s[k] = 0.0
        for usable, node, ids in _runs(cluster, group.gpus):
            gm = nbytes.on(usable)
            peak.update(dict.fromkeys(ids, gm.peak))
            free.update(dict.fromkeys(ids, gm.kv_free))
            swap_s[k] = gm.swap_s
            host_of_node[node] = host_of_node.get(node, 0.0) + gm.host * len(ids)
            if gm.peak > usable and not why:   # the first GPU that does not fit (runs come in the group's order)
                g = cluster.gpus[ids[0]]
                why = f"{g.name} ({g.type.name}) needs {gm.peak / 1e9:.1f} GB but has {usable / 1e9:.1f} GB usable"
    for name, need in host_of_node.items():
        have = usable_host_bytes(cluster, name)
        if need > have and not why:
            why = (f"node {name} needs {need / 1e9:.1f} GB of host memory for offloaded and swapped states but has "
                   f"{have / 1e9:.1f} GB usable (host_memory_gb in the cluster YAML)")
    return Memory(peak, free, swap_s, why)


# ------------------------------------------------------------------------------------------ iteration


def group_transfer_s(cluster, a: Group, b: Group, nbytes: float) -> float:
    """Seconds to move `nbytes` from group a to group b over the best path between them."""
    if a is b:
        return 0.0
    regions_a = {cluster.gpus[i].region for i in a.gpus}
    regions_b = {cluster.gpus[i].region for i in b.gpus}
    nic = min(max(cluster.node(cluster.gpus[i].node).network_gbps for i in g.gpus) for g in (a, b)) * GBIT
    if regions_a & regions_b:
        lat, bw = INTRA_REGION_LATENCY_S, nic
    else:
        links = [r for r in cluster.regions if (r.between[0] in regions_a and r.between[1] in regions_b)
                 or (r.between[1] in regions_a and r.between[0] in regions_b)]
        best = max(links, key=lambda r: r.bandwidth_gbps)
        lat, bw = best.latency_ms / 1e3, min(nic, best.bandwidth_gbps * GBIT)
    return lat + nbytes / bw


def sample_bytes(w: WorkloadSpec) -> float:
    """Bytes of one iteration's samples moved from the generation group to another group (every generated sample:
    dynamic sampling filters them after they leave the rollout to be rewarded)."""
    return w.generated_samples * (w.prompt_tokens.max + w.completion_tokens.max) * SAMPLE_BYTES_PER_TOKEN


def shard_gather_s(cluster: ClusterSpec, w: WorkloadSpec, train: Group) -> float:
    """Seconds for actor training sharded with ZeRO-3 to all-gather its shards over its DP groups (half an
    all-reduce) before its weights can go to generation; 0 for every other training or a group without it."""
    par = train.par("actor_train") if "actor_train" in train.tasks else None
    if par is None or par.zero != 3 or par.replicas == 1:
        return 0.0
    if not par.default_layout:   # dense shards over dp x sp, experts (ep > 1) over their own replicas
        shard, _, _, experts = param_split(w.actor, par)
        vb = precision_bytes(w)[0]
        edp = par.tp * par.sp * par.dp // par.ep
        links = _dp_links(cluster, _dp_groups(_shards(train, par), par))
        if par.ep == 1:
            return max(allreduce_s(vb * shard, par.replicas, link) / 2 for link in links)
        return max((allreduce_s(vb * (shard - experts), par.replicas, link) + allreduce_s(vb * experts, edp, link)) / 2
                   for link in links)
    shard = w.actor.params * precision_bytes(w)[0] / (par.tp * par.pp)
    return max(allreduce_s(shard, par.dp, link) / 2
               for link in _dp_links(cluster, _dp_groups(_shards(train, par), par)))


def weight_sync_s(cluster: ClusterSpec, w: WorkloadSpec, train: Group, gen: Group, colocated: bool) -> float:
    """Actor weights from training to generation: a local reshard when they share a group, else over the network,
    after gathering ZeRO-3 shards (shard_gather_s)."""
    gather = shard_gather_s(cluster, w, train)
    if colocated:
        share = pooled(cluster, gen.gpus)
        hbm = min(_hbm(cluster, i, share) for i in gen.gpus)
        return gather + w.actor.params * precision_bytes(w)[0] / (hbm * HBM_EFF) / len(gen.gpus)
    return gather + group_transfer_s(cluster, train, gen, w.actor.params * precision_bytes(w)[0])


def aggregate(mode: str, groups: list[dict[str, float]], transfer: float, sync: float) -> tuple[float, list[str]]:
    """Iteration seconds from each group's task seconds -> (total, tasks on the critical path).

    sync: generation, then the inference phase, then the training phase, then weight sync; inside a phase
    colocated tasks add up and groups run side by side. async: generation overlaps the rest, so the
    busiest group sets the pace unless moving samples or weights takes even longer."""
    if mode == "sync":
        def phase(kind):
            return max(((sum(s for t, s in g.items() if t in kind), [t for t in g if t in kind]) for g in groups),
                       key=lambda x: x[0])
        (t_inf, inf), (t_train, train) = phase(INFER_TASKS), phase(TRAIN_TASKS)
        gen = next(g["actor_gen"] for g in groups if "actor_gen" in g)
        return gen + transfer + t_inf + t_train + sync, ["actor_gen", *inf, *train]
    busiest = max(groups, key=lambda g: sum(g.values()))
    return max(sum(busiest.values()), transfer, sync), list(busiest)


def timeline(mode: str, groups: list[dict[str, float]], transfer: float, sync: float) -> list[dict]:
    """One iteration as bars, by the rule `aggregate` prices it: {"group" (index; None for the links), "task",
    "start_s", "end_s", "kind" (compute | communication)}. sync: generation on its group, the samples' transfer,
    then each group's inference tasks one after another from the phase's start (groups side by side), the same
    for training, then the weight sync; the last bar ends at `aggregate`'s total. async: each group runs its tasks
    back to back from 0 (generation overlapping the rest); the transfer and weight sync run beside them."""
    bars = []

    def lay(start: float, kind) -> float:
        end = start
        for k, g in enumerate(groups):
            t0 = start
            for task in [t for t in g if t in kind]:
                bars.append({"group": k, "task": task, "start_s": t0, "end_s": t0 + g[task], "kind": "compute"})
                t0 += g[task]
            end = max(end, t0)
        return end

    if mode == "sync":
        gen = lay(0.0, ("actor_gen",))
        bars.append({"group": None, "task": "transfer", "start_s": gen, "end_s": gen + transfer,
                     "kind": "communication"})
        train = lay(lay(gen + transfer, INFER_TASKS), TRAIN_TASKS)
        bars.append({"group": None, "task": "weight_sync", "start_s": train, "end_s": train + sync,
                     "kind": "communication"})
        return bars
    lay(0.0, tuple(t for g in groups for t in g))
    bars += [{"group": None, "task": name, "start_s": 0.0, "end_s": s, "kind": "communication"}
             for name, s in (("transfer", transfer), ("weight_sync", sync))]
    return bars


def _swap_task(group: Group) -> str:
    """The task whose phase change pays the group's swap: training if the group trains, else inference."""
    for phase in reversed(PHASES):
        for t in group.tasks:
            if t in phase:
                return t
    return group.tasks[0]


def task_costs(cluster: ClusterSpec, w: WorkloadSpec, group: Group, kv_free: dict[int, float] | None = None,
               swap_s: float | None = None) -> dict[str, TaskCost]:
    """Seconds of every task of `group`, by named terms (the swap term on the task that pays it). `kv_free` and
    `swap_s` come from the plan's `memory`; without them they are computed for the group alone. The one way
    in to task seconds for estimate, the search space and reports."""
    if (kv_free is None or swap_s is None) and ("actor_gen" in group.tasks or group.swap):
        mem = memory(cluster, w, Plan((group,)))   # only generation (its KV budget) and swap read it
        kv_free, swap_s = mem.kv_free, mem.swap_s[0]
    costs = {}
    for task in group.tasks:
        model = w.model(ROLE_OF[task])
        if task == "actor_gen":
            costs[task] = _generation(cluster, w, model, group, kv_free)
            if w.rollout_logprob_pass:   # one inference pass over every sample, on the generation devices
                score = _dense_pass(cluster, w, model, group, task, False).seconds
                costs[task] = TaskCost(costs[task].seconds + score, {**costs[task].terms, "behaviour_logprobs": score})
        else:
            costs[task] = _dense_pass(cluster, w, model, group, task, task in TRAIN_TASKS)
    if group.swap:
        t = _swap_task(group)
        costs[t] = TaskCost(costs[t].seconds + swap_s, {**costs[t].terms, "swap": swap_s})
    eff = timeshare_efficiency(cluster, w, group)
    if eff < 1:   # generation and the rest compute on the same devices at once: each task slowed by the sharing
        costs = {t: TaskCost(c.seconds / eff, {**c.terms, "timeshare": c.seconds * (1 / eff - 1)})
                 for t, c in costs.items()}
    return costs


def timeshare_efficiency(cluster: ClusterSpec, w: WorkloadSpec, group: Group) -> float:
    """The throughput `group`'s devices keep while its tasks run at the same time: in async mode a group that
    generates and also does other work runs the rollout beside them (the slowest device's
    `timeshare_efficiency`); 1 otherwise (sync phases take turns)."""
    if w.mode != "async" or "actor_gen" not in group.tasks or len(group.tasks) < 2:
        return 1.0
    return min(cluster.gpus[i].type.timeshare_efficiency or 1.0 for i in group.gpus)


def estimate(cluster: ClusterSpec, w: WorkloadSpec, plan: Plan) -> Estimate:
    """Predicted seconds per iteration of `plan`, with its breakdown; infeasible plans say why."""
    check_structure(plan, cluster, w)
    mem = memory(cluster, w, plan)
    peak = mem.peak
    if mem.why:
        what = "" if "max_tokens_per_micro_batch" in mem.why else "out of memory: "
        return Estimate(False, f"{what}{mem.why}", memory_bytes=peak)
    costs: dict[str, TaskCost] = {}
    for k, group in enumerate(plan.groups):
        costs |= task_costs(cluster, w, group, mem.kv_free, mem.swap_s[k])
    for task, c in costs.items():
        if math.isinf(c.seconds):
            return Estimate(False, f"{task}: not even one sequence's KV cache fits next to the resident "
                                   "weights and optimizer states", memory_bytes=peak)
    gen_group, train_group = plan.group_of("actor_gen"), plan.group_of("actor_train")
    transfer = max([group_transfer_s(cluster, gen_group, g, sample_bytes(w))
                    for g in plan.groups if g is not gen_group], default=0.0)
    sync = weight_sync_s(cluster, w, train_group, gen_group, gen_group is train_group)
    seconds = [{t: costs[t].seconds for t in g.tasks} for g in plan.groups]
    total, critical = aggregate(w.mode, seconds, transfer, sync)
    bars = timeline(w.mode, seconds, transfer, sync)
    breakdown: dict[str, float] = {}
    for t in critical:
        for k, v in costs[t].terms.items():
            breakdown[k] = breakdown.get(k, 0.0) + v
    if w.mode == "async":   # overlapped with work: only what exceeds the busiest group is on the critical path
        busy = sum(costs[t].seconds for t in critical)
        transfer, sync = max(0.0, transfer - busy), max(0.0, sync - busy)
    breakdown["transfer"] = transfer
    breakdown["weight_sync"] = sync
    return Estimate(True, "", total, breakdown, {t: c.seconds for t, c in costs.items()}, peak,
                    {t: dict(c.terms) for t, c in costs.items()}, bars)


__all__ = ["Estimate", "GroupMemory", "Memory", "TaskCost", "TaskMemory", "aggregate", "estimate", "group_memory",
           "group_transfer_s", "memory", "precision_bytes", "sample_bytes", "shard_gather_s", "slowest_link",
           "task_costs", "task_memory", "timeline", "timeshare_efficiency", "weight_sync_s"]
