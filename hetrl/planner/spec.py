"""Cluster and workload specs: frozen dataclasses validated on construction; YAML is a thin layer on top.

Units are in field names (_bytes, _bytes_per_s, _s). Every unknown key, GPU name, region or preset
is an error that lists the valid choices.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from dataclasses import dataclass, field

from hetrl.schema import (
    InputError,
    check,
    choice_error,
    from_mapping,
    located,
    read_yaml,
    reject_unknown,
    require_mapping,
    rule,
    show,
)

from .catalog import GPUType, gpu, spelling

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer by its architecture numbers (MoE when experts > 0).

    MoE (all optional; absent = every layer's MLP is the routed experts, as Qwen3-MoE): `experts` routed experts
    of `moe_intermediate` each, `experts_per_token` of them per token, `shared_intermediate` the FFN size of
    the always-on shared expert(s) of an MoE layer (0: none), the first `first_k_dense` layers dense (FFN size
    `intermediate`; DeepSeek-V3's first_k_dense_replace) and after them every `moe_every`-th layer an MoE
    layer (the rest dense; Qwen's decoder_sparse_step). Multi-head latent attention (DeepSeek-V3) when
    `kv_lora_rank` > 0: the KV cache holds kv_lora_rank + rope_head_dim values per token and layer, and the
    attention weights are the low-rank projections (see attn_params_per_layer); its attention FLOPs are
    counted as heads x head_dim (an approximation: MLA's scores use head_dim + rope_head_dim)."""

    layers: int = rule(ge=1)
    hidden: int = rule(ge=1)
    heads: int = rule(ge=1)
    kv_heads: int = rule(ge=1)
    head_dim: int = rule(ge=1)
    intermediate: int = rule(ge=0)
    vocab: int = rule(ge=1)
    tied_embeddings: bool = False
    experts: int = rule(0, ge=0)
    experts_per_token: int = rule(0, ge=0)
    moe_intermediate: int = rule(0, ge=0)
    name: str = "custom"
    shared_intermediate: int = rule(0, ge=0)
    first_k_dense: int = rule(0, ge=0)
    moe_every: int = rule(1, ge=1)
    kv_lora_rank: int = rule(0, ge=0)
    q_lora_rank: int = rule(0, ge=0)
    rope_head_dim: int = rule(0, ge=0)
    # Hybrid attention stacks: `linear_attention_layers` layers attend linearly (Gated DeltaNet / Mamba-style, as
    # Qwen3-Next's and Qwen3.5's three of every four): a fixed-size state per sequence instead of a KV cache, cost
    # linear in tokens; `sliding_window_layers` layers attend to the last `sliding_window` tokens only (gpt-oss'
    # alternate 128-token layers). The rest are full attention. Their projections are counted as a full layer's.
    linear_attention_layers: int = rule(0, ge=0)
    sliding_window_layers: int = rule(0, ge=0)
    sliding_window: int = rule(0, ge=0)
    # A vision tower (a VLM's image encoder) of `vision_params` parameters: it encodes each prompt's images
    # (the workload's image_patches) before the language model reads them; its tokens join the prompt.
    vision_params: int = rule(0, ge=0)

    def __post_init__(self):
        check(self)
        if self.linear_attention_layers + self.sliding_window_layers > self.layers:
            raise ValueError(f"model {self.name}: linear_attention_layers ({self.linear_attention_layers}) + "
                             f"sliding_window_layers ({self.sliding_window_layers}) exceed its {self.layers} layers")
        if bool(self.sliding_window_layers) != bool(self.sliding_window):
            raise ValueError(f"model {self.name}: sliding_window_layers and sliding_window go together (the "
                             f"layers and their window in tokens); got {self.sliding_window_layers} and "
                             f"{self.sliding_window}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.moe_intermediate > 0):
            raise ValueError(f"model {self.name}: an MoE needs 0 < experts_per_token <= experts and "
                             "moe_intermediate > 0")
        if not self.experts and self.intermediate < 1:
            raise ValueError(f"model {self.name}: intermediate must be >= 1 for a dense model")
        if not self.experts and (self.shared_intermediate or self.first_k_dense or self.moe_every != 1
                                 or self.experts_per_token or self.moe_intermediate):
            raise ValueError(f"model {self.name}: shared_intermediate, first_k_dense, moe_every, experts_per_token "
                             "and moe_intermediate describe an MoE; set experts > 0 or leave them out")
        if self.experts and self.moe_layers == 0:
            raise ValueError(f"model {self.name}: first_k_dense {self.first_k_dense} and moe_every {self.moe_every} "
                             f"leave no MoE layer among its {self.layers}; lower first_k_dense (< layers)")
        if self.dense_layers and self.intermediate < 1:
            raise ValueError(f"model {self.name}: {self.dense_layers} dense layers (first_k_dense / moe_every) need "
                             "intermediate >= 1 (their FFN size)")
        if (self.q_lora_rank or self.rope_head_dim) and not self.kv_lora_rank:
            raise ValueError(f"model {self.name}: q_lora_rank and rope_head_dim describe multi-head latent attention; "
                             "set kv_lora_rank > 0 too or leave them out")

    @functools.cached_property   # fields are frozen; the cost model reads it per option priced
    def moe_layers(self) -> int:
        """Layers whose MLP is the routed experts: after the first `first_k_dense`, every `moe_every`-th."""
        if not self.experts:
            return 0
        return len(range(self.first_k_dense + self.moe_every - 1, self.layers, self.moe_every))

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    @property
    def attn_params_per_layer(self) -> int:
        if self.kv_lora_rank:   # MLA: q down/up (or one q projection), kv down (+ rope key), kv up, output
            qk = self.head_dim + self.rope_head_dim
            q = (self.hidden * self.q_lora_rank + self.q_lora_rank * self.heads * qk) if self.q_lora_rank \
                else self.hidden * self.heads * qk
            return (q + self.hidden * (self.kv_lora_rank + self.rope_head_dim)
                    + self.kv_lora_rank * self.heads * 2 * self.head_dim + self.heads * self.head_dim * self.hidden)
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    @property
    def expert_params_per_layer(self) -> int:
        """Routed experts' weights of one MoE layer (what expert parallelism shards)."""
        return self.experts * 3 * self.hidden * self.moe_intermediate

    @property
    def mlp_params_per_layer(self) -> int:
        """MLP weights of the largest layer (an MoE layer when there are experts): routed + shared experts + router."""
        if self.experts:
            return (self.expert_params_per_layer + self.hidden * self.experts
                    + 3 * self.hidden * self.shared_intermediate)
        return self.dense_mlp_params

    @property
    def active_mlp_params_per_layer(self) -> int:
        if self.experts:
            return (self.experts_per_token * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
                    + 3 * self.hidden * self.shared_intermediate)
        return self.mlp_params_per_layer

    @functools.cached_property   # fields are frozen; the cost model reads it per option priced
    def expert_params(self) -> int:
        """Routed experts' weights of every MoE layer."""
        return self.moe_layers * self.expert_params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @functools.cached_property   # fields are frozen; the cost model reads it per option priced
    def params(self) -> int:
        """All parameters (what memory holds), the vision tower's included."""
        if not self.dense_layers or not self.experts:   # one kind of layer (the only form before MoE patterns)
            return (self.layers * (self.attn_params_per_layer + self.mlp_params_per_layer) + self.embedding_params
                    + self.vision_params)
        return (self.layers * self.attn_params_per_layer + self.moe_layers * self.mlp_params_per_layer
                + self.dense_layers * self.dense_mlp_params + self.embedding_params + self.vision_params)

    @functools.cached_property   # fields are frozen; the cost model reads it per option priced
    def active_params(self) -> int:
        """Parameters each token touches (what FLOPs scale with)."""
        if not self.dense_layers or not self.experts:
            return self.layers * (self.attn_params_per_layer + self.active_mlp_params_per_layer) + self.embedding_params
        return (self.layers * self.attn_params_per_layer + self.moe_layers * self.active_mlp_params_per_layer
                + self.dense_layers * self.dense_mlp_params + self.embedding_params)

    @functools.cached_property   # fields are frozen; the cost model reads it per option priced
    def expert_active_params(self) -> int:
        """Routed-expert weights each token touches over all layers (the grouped-GEMM part of its FLOPs)."""
        return self.moe_layers * self.experts_per_token * 3 * self.hidden * self.moe_intermediate

    @property
    def full_attention_layers(self) -> int:
        return self.layers - self.linear_attention_layers - self.sliding_window_layers

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over the layers that cache every token (full attention), in bf16 (MLA: its latent
        and rope key). A sliding-window layer holds at most its window per sequence and a linear-attention layer
        a fixed state: neither grows with the tokens, and neither is counted here."""
        layers = self.full_attention_layers
        if self.kv_lora_rank:
            return layers * (self.kv_lora_rank + self.rope_head_dim) * 2
        return 2 * layers * self.kv_heads * self.head_dim * 2

    def attention_flops(self, pairs: float, tokens: float) -> float:
        """Forward FLOPs of attention's scores and weighted sum (2 x 2 x heads x head_dim per pair and layer) over
        `pairs` causal (query, key) pairs of `tokens` tokens: full layers every pair, a sliding-window layer at
        most `sliding_window` keys per query, a linear-attention layer its state update and read (head_dim x
        head_dim per head and token: head_dim pairs' worth)."""
        if not (self.linear_attention_layers or self.sliding_window_layers):
            return 4 * self.layers * self.heads * self.head_dim * pairs
        return 4 * self.heads * self.head_dim * (self.full_attention_layers * pairs
                                                 + self.sliding_window_layers * min(pairs, tokens * self.sliding_window)
                                                 + self.linear_attention_layers * tokens * self.head_dim)


def _preset(name, layers, hidden, heads, kv, inter, vocab, tied=False, head_dim=128, **moe):
    return ModelSpec(layers, hidden, heads, kv, head_dim, inter, vocab, tied, name=name, **moe)


PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # Hugging Face config.json of each model
    _preset("qwen3-4b", 36, 2560, 32, 8, 9728, 151936, tied=True),
    _preset("qwen3-8b", 36, 4096, 32, 8, 12288, 151936),
    _preset("qwen3-14b", 40, 5120, 40, 8, 17408, 151936),
    _preset("qwen3-32b", 64, 5120, 64, 8, 25600, 151936),
    _preset("qwen3-30b-a3b", 48, 2048, 32, 4, 0, 151936, experts=128, experts_per_token=8, moe_intermediate=768),
    # Qwen/Qwen3-235B-A22B: 94 layers, all MoE (decoder_sparse_step 1), no shared expert
    _preset("qwen3-235b-a22b", 94, 4096, 64, 4, 0, 151936, experts=128, experts_per_token=8, moe_intermediate=1536),
    # deepseek-ai/DeepSeek-V3: MLA (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, rope 64, v 128), 256 routed
    # experts of 2048 + 1 shared of 2048, 8 per token, first 3 layers dense (18432). MLA is approximated: its
    # attention FLOPs counted at heads x 128 (the scores use 192 per head); the MTP module is left out.
    # kv_heads is not used under MLA (the cache holds the latent); 128 keeps heads % kv_heads valid.
    _preset("deepseek-v3", 61, 7168, 128, 128, 18432, 129280, experts=256, experts_per_token=8,
            moe_intermediate=2048, shared_intermediate=2048, first_k_dense=3, kv_lora_rank=512, q_lora_rank=1536,
            rope_head_dim=64),
    # openai/gpt-oss-120b shape: 36 layers, hidden 2880, 64 query heads of 64, 8 KV heads, 128 experts of 2880,
    # 4 per token, vocab 201088; every other layer attends to a 128-token sliding window. Approximated: its MXFP4
    # expert weights as bf16 (memory and reads are those of a bf16 checkpoint), its attention sinks left out
    _preset("gpt-oss-120b", 36, 2880, 64, 8, 0, 201088, head_dim=64, experts=128, experts_per_token=4,
            moe_intermediate=2880, sliding_window_layers=18, sliding_window=128),
    # Qwen/Qwen3-Next-80B-A3B-Instruct config.json: 48 layers, hidden 2048, full attention every 4th layer
    # (full_attention_interval 4: 16 query heads of 256, 2 KV heads), the other 36 Gated DeltaNet (linear
    # attention; its projections counted as a full layer's), all MoE: 512 experts of 512, 10 per token, one
    # shared expert of 512
    _preset("qwen3-next-80b-a3b", 48, 2048, 16, 2, 0, 151936, head_dim=256, experts=512, experts_per_token=10,
            moe_intermediate=512, shared_intermediate=512, linear_attention_layers=36),
    _preset("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064),
    _preset("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256),
    _preset("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256),
]}


def model_spec(value, where: str = "model") -> ModelSpec | None:
    """A preset name, a mapping of architecture numbers, or None (no such model)."""
    if value is None or isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise InputError(choice_error(f"{where}: preset", value, PRESETS)
                             + " (or give {layers, hidden, heads, kv_heads, head_dim, intermediate, vocab})",
                             located=True)
        return PRESETS[value]
    if isinstance(value, dict):
        return from_mapping(ModelSpec, value, where)
    raise InputError(f"{where}: a model is a preset name ({', '.join(PRESETS)}) or a mapping of architecture "
                     f"numbers, got {show(value)}", located=True)


# ---------------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Node:
    name: str
    region: str
    gpu: str
    count: int = rule(ge=1)
    intra_node: str = rule("nvlink", choices=("nvlink", "pcie"))
    network_gbps: float = rule(100.0, gt=0)
    host_memory_gb: float | None = rule(None, gt=0)   # CPU RAM for offload and swap; default per GPU, below
    # devices' worth of compute and memory bandwidth the node delivers while all its devices run at once (default:
    # count). Fewer where devices draw on one pool: CPU cores of one socket (shared memory bandwidth, caches,
    # SMT siblings). A group running on k of the node's devices gets min(1, concurrent_devices / k) of each.
    concurrent_devices: float | None = rule(None, gt=0)
    # measured bandwidth between two of the node's devices, where intra_node's default does not describe it
    # (CPU processes exchanging tensors through gloo over loopback: far below PCIe's 25 GB/s)
    intra_node_gbps: float | None = rule(None, gt=0)

    @property
    def host_memory_bytes(self) -> float:
        return (self.host_memory_gb if self.host_memory_gb is not None
                else DEFAULT_HOST_MEMORY_GB_PER_GPU * self.count) * 1e9

    def __post_init__(self):  # the GPU type is checked by ClusterSpec, which also knows the cluster's own types
        if isinstance(self.intra_node, str):   # NVLink, PCIe: any case
            object.__setattr__(self, "intra_node", self.intra_node.lower())
        check(self)
        if self.concurrent_devices is not None and self.concurrent_devices > self.count:
            raise ValueError(f"node {self.name}: concurrent_devices {self.concurrent_devices:g} is more than its "
                             f"count {self.count}; it says how many devices' worth of throughput the node delivers "
                             "with all of them busy (at most count; fewer where they share one pool)")


@dataclass(frozen=True)
class RegionLink:
    between: tuple[str, str]
    latency_ms: float = rule(ge=0)
    bandwidth_gbps: float = rule(gt=0)

    def __post_init__(self):
        check(self)
        if self.between[0] == self.between[1]:
            raise ValueError(f"between names {self.between[0]!r} twice; a region link joins two different regions "
                             "(traffic inside one region uses the nodes' network_gbps)")


@dataclass(frozen=True)
class GPU:
    """One concrete GPU: `<node>:<index>`."""

    id: int
    name: str
    node: str
    region: str
    type: GPUType


# DGX A100 (1 TB for 8 GPUs) and DGX H100 (2 TB for 8): 128 GB per GPU is the smaller; say host_memory_gb
# on a node that has less (or more).
DEFAULT_HOST_MEMORY_GB_PER_GPU = 128
PCIE_BYTES_PER_S = 25e9   # PCIe Gen4 x16 ~32 GB/s per direction at ~80% NCCL bus efficiency
INTRA_NODE_LATENCY_S = 5e-6
INTRA_REGION_LATENCY_S = 50e-6


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    nodes: tuple[Node, ...]
    regions: tuple[RegionLink, ...] = ()
    gpu_types: tuple[GPUType, ...] = ()   # types beyond the catalog (e.g. a CPU that emulates a GPU), with sources
    gpus: tuple[GPU, ...] = field(init=False, repr=False, compare=False)
    _hash: int = field(init=False, repr=False, compare=False)
    _nodes: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        check(self)
        if not self.nodes:
            raise ValueError(f"cluster {self.name}: no nodes")
        own = [t.name for t in self.gpu_types]   # "h100": the catalog's H100, spelled so everywhere after
        object.__setattr__(self, "nodes", tuple(n if spelling(n.gpu, own) == n.gpu else
                                                dataclasses.replace(n, gpu=spelling(n.gpu, own)) for n in self.nodes))
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"cluster {self.name}: node names must be unique, repeated: {dup}")
        regions = {n.region for n in self.nodes}
        linked = set()
        for link in self.regions:
            if frozenset(link.between) in linked:
                raise ValueError(f"cluster {self.name}: two region links between {sorted(link.between)}; keep one")
            a, b = link.between
            for r in (a, b):
                if r not in regions:
                    raise ValueError(f"cluster {self.name}: region link names {r!r}, which no node is in; "
                                     f"regions: {sorted(regions)}")
            linked.add(frozenset((a, b)))
        missing = [(a, b) for a, b in itertools.combinations(sorted(regions), 2) if frozenset((a, b)) not in linked]
        if missing:
            raise ValueError(f"cluster {self.name}: no region link between {missing}; add "
                             "{between: [a, b], latency_ms, bandwidth_gbps} for each pair")
        for n in self.nodes:
            if self.gpu_type(n.gpu).nvlink_bytes_per_s == 0 and n.intra_node == "nvlink":
                raise ValueError(f"node {n.name}: {n.gpu} has no NVLink; set intra_node: pcie")
        gpus = [(n, i) for n in self.nodes for i in range(n.count)]
        object.__setattr__(self, "gpus", tuple(GPU(k, f"{n.name}:{i}", n.name, n.region, self.gpu_type(n.gpu))
                                               for k, (n, i) in enumerate(gpus)))
        object.__setattr__(self, "_hash", hash((self.name, self.nodes, self.regions, self.gpu_types)))
        object.__setattr__(self, "_nodes", {n.name: n for n in self.nodes})

    def gpu_type(self, name: str) -> GPUType:
        """The cluster's own GPU types first, then the catalog; unknown names list both."""
        own = {t.name: t for t in self.gpu_types}
        name = spelling(name, own)
        if name in own:
            return own[name]
        try:
            return gpu(name)
        except ValueError as e:
            if not own:
                raise
            raise ValueError(f"{e}; this cluster also defines: {', '.join(own)}") from None

    def __hash__(self):  # the cost model caches per cluster; hashing every field each call was its hot spot
        return self._hash

    def node(self, name: str) -> Node:
        return self._nodes[name]

    def link(self, a: GPU, b: GPU) -> tuple[float, float]:
        """(latency_s, bytes_per_s) of the path between two GPUs."""
        if a.node == b.node:
            n = self.node(a.node)
            bw = a.type.nvlink_bytes_per_s if n.intra_node == "nvlink" else PCIE_BYTES_PER_S
            if n.intra_node_gbps is not None:
                bw = n.intra_node_gbps * GBIT
            return INTRA_NODE_LATENCY_S, bw
        if a.region == b.region:
            bw = min(self.node(a.node).network_gbps, self.node(b.node).network_gbps) * GBIT
            return INTRA_REGION_LATENCY_S, bw
        link = next(r for r in self.regions if set(r.between) == {a.region, b.region})
        return link.latency_ms / 1e3, link.bandwidth_gbps * GBIT


# ---------------------------------------------------------------------------------------------- workload

ROLES = ("actor", "reference", "reward", "critic")


@dataclass(frozen=True)
class TokenLengths:
    max: int = rule(ge=1)
    mean: float = rule(gt=0)

    def __post_init__(self):
        check(self)
        if self.mean > self.max:
            raise ValueError(f"mean ({self.mean:g}) must be <= max ({self.max})")


def check_max_leaves(max_leaves, responses_per_prompt: int | None = None) -> None:
    """max_leaves: None (the default cap, `leaf_cap`) or an int >= 1 that leaves room for a task's
    responses_per_prompt rollouts, which are leaves too (hetrl train's branches=, an agent's, a workload's alike)."""
    if max_leaves is None:
        return
    if isinstance(max_leaves, bool) or not isinstance(max_leaves, int) or max_leaves < 1:
        raise InputError(f"max_leaves must be None (responses_per_prompt x branches) or an int >= 1, got "
                         f"{max_leaves!r}")
    if responses_per_prompt is not None and max_leaves < responses_per_prompt:
        raise InputError(f"max_leaves ({max_leaves}) counts a task's leaves, its responses_per_prompt "
                         f"({responses_per_prompt}) rollouts among them; use at least {responses_per_prompt}")


def check_group_size(responses_per_prompt: int, critic: bool) -> None:
    """Without a critic, advantages are group-relative: a prompt's responses compared with each other, so a lone
    response's advantage is 0 and it teaches nothing (hetrl train's rule and a workload's alike)."""
    if responses_per_prompt < 2 and not critic:
        raise InputError(f"responses_per_prompt ({responses_per_prompt}) must be >= 2: group-relative advantages "
                         "compare a prompt's responses with each other, and a lone response's is 0 (algorithm ppo, "
                         "whose critic gives the baseline, takes 1)")


def leaf_cap(max_leaves: int | None, responses_per_prompt: int, branches: int) -> int:
    """The most leaves a task's tree grows to: max_leaves, by default responses_per_prompt x branches."""
    return max_leaves or responses_per_prompt * branches


@dataclass(frozen=True)
class WorkloadSpec:
    algorithm: str = rule(choices=("grpo", "dapo", "ppo"))
    mode: str = rule(choices=("sync", "async"))
    actor: ModelSpec
    reference: ModelSpec | None
    reward: ModelSpec | None
    critic: ModelSpec | None
    prompts_per_step: int = rule(ge=1)
    responses_per_prompt: int = rule(ge=1)
    prompt_tokens: TokenLengths
    response_tokens: TokenLengths
    dualkv: bool = True
    # bf16/fp16: mixed precision (16-bit weights, gradients and activations; fp32 master weights and Adam moments);
    # fp32: everything in fp32 (hetrl train on CPU)
    precision: str = rule("bf16", choices=("bf16", "fp16", "fp32"))
    micro_batch_responses: int | None = rule(None, ge=1)  # responses per training micro-batch; default: a whole group
    # optimizer steps per iteration: the batch is split into this many mini-batches (verl ppo_mini_batch_size,
    # NeMo-RL train_global_batch_size, OpenRLHF train_batch_size), each one gradient sync and one Adam step
    optimizer_steps: int = rule(1, ge=1)
    # share of the samples the actor_infer pass (the sampling policy's log-probs for the importance ratio) runs
    # on: 1 recomputes them for every mini-batch (verl, NeMo-RL, OpenRLHF); (k-1)/k when the first of k
    # mini-batches takes its update forward's own, detached (TRL; hetrl sync with bf16 rollout logits); 0 when they
    # come with the samples from the rollout (hetrl async, hetrl's fp32 rollouts)
    old_logprob_share: float = rule(1.0, ge=0, le=1)
    # the rollout scores its samples' behaviour log-probs in a forward pass of its own, on the generation devices
    # (hetrl async on Ray where its sampling logits are bf16, or old_logprobs=recompute); false where they come
    # with the tokens (vLLM and SGLang return them; hetrl's fp32 rollout reads them off its sampling logits)
    rollout_logprob_pass: bool = False
    # training and log-prob micro-batches packed by tokens per GPU instead of by responses (verl's
    # use_dynamic_bsz with ppo_max_token_len_per_gpu, remove-padding; NeMo-RL's sequence packing): a micro-batch
    # holds at most this many tokens on one GPU (x sp over a sequence-parallel group); absent: micro_batch_responses
    max_tokens_per_micro_batch: int | None = rule(None, ge=1)
    # dynamic sampling (DAPO): the rollout generates this many times the prompts that are trained, and groups whose
    # rewards do not vary are dropped before the log-prob passes and the update (NeMo-RL grpo.batch_multiplier with
    # use_dynamic_sampling; verl's DAPO recipe data.gen_batch_size / data.train_batch_size). A lower bound where the
    # engine draws further batches until enough groups are kept.
    rollout_batch_multiplier: float = rule(1.0, ge=1)
    # what the training and log-prob passes compute over: 'none', the real tokens (packed micro-batches, verl's
    # remove-padding, NeMo-RL's sequence packing); 'prompt', every prompt padded to the longest a prompt may be
    # (DeepSpeed-Chat's DataCollatorRLHF), responses at their mean; 'max', prompts and responses padded to their
    # maxima (an engine that pads each micro-batch to its longest sequence, where that reaches the caps)
    padding: str = rule("none", choices=("none", "prompt", "max"))
    # multi-turn tool-use episodes (hetrl train tools=..., docs/agents.md): `turns` model turns of response_tokens
    # each, a tool result of tool_tokens between two turns; a round's calls run at once, so every turn boundary
    # waits tool_latency_s. After each tool result an episode forks into `branches` continuations while its task
    # has at most max_leaves leaves (default responses_per_prompt x branches), as hetrl train's branches= does
    turns: int = rule(1, ge=1)
    tool_tokens: TokenLengths | None = None
    tool_latency_s: float = rule(0.0, ge=0)
    branches: int = rule(1, ge=1)
    max_leaves: int | None = rule(None, ge=1)
    # image patches per prompt that the actor's vision tower (models: vision_params) encodes, mean; their tokens
    # are part of prompt_tokens
    image_patches: int = rule(0, ge=0)
    # tasks the executor runs as data parallelism only, one GPU per replica (tp = pp = sp = ep = 1; ZeRO and
    # offload still apply): 'none' (any layout, as verl, NeMo-RL and Megatron run), 'but_generation' (hetrl's Ray
    # executor with vLLM: its learners, critics and references are FSDP2 / ZeRO ranks, generation keeps vLLM's
    # tensor_parallel_size), 'all' (hetrl's Ray executor with its own HF generation)
    data_parallel_only: str = rule("none", choices=("none", "but_generation", "all"))

    def __post_init__(self):
        check(self)
        self._check_turns()
        if self.micro_batch_responses is None:   # a whole group: a task's leaves
            object.__setattr__(self, "micro_batch_responses", self.leaves)
        if self.prompts_per_step % self.optimizer_steps:
            raise ValueError(f"optimizer_steps must divide prompts_per_step ({self.prompts_per_step}) so every "
                             f"mini-batch holds whole prompt groups, got {self.optimizer_steps}")
        if self.image_patches and not self.actor.vision_params:
            raise ValueError(f"image_patches={self.image_patches} are encoded by the actor's vision tower, and its "
                             f"model {self.actor.name} has none; give the model vision_params (or leave "
                             "image_patches out)")
        if self.image_patches > self.prompt_tokens.max:
            raise ValueError(f"image_patches ({self.image_patches}) are part of the prompt, so at most "
                             f"prompt_tokens.max ({self.prompt_tokens.max})")
        if self.algorithm == "ppo" and self.critic is None:
            raise ValueError("ppo needs a critic model: set models.critic (e.g. the actor's preset)")
        if self.algorithm != "ppo" and self.critic is not None:
            raise ValueError(f"{self.algorithm} has no critic; set models.critic: null")
        check_group_size(self.responses_per_prompt, critic=self.algorithm == "ppo")
        if self.algorithm == "dapo" and self.reference is not None:   # hetrl train refuses dapo with kl_coef > 0
            raise ValueError(f"dapo has no KL term, so no reference model, and models.reference is "
                             f"{self.reference.name}; set models.reference: null, or use algorithm grpo (with a KL)")

    def __hash__(self):  # cached: every cost-model cache lookup hashes the workload
        if "_hash" not in self.__dict__:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))
        return self.__dict__["_hash"]

    def _check_turns(self) -> None:
        if self.turns == 1:
            given = [k for k, default in (("tool_tokens", None), ("tool_latency_s", 0.0), ("branches", 1),
                                          ("max_leaves", None)) if getattr(self, k) != default]
            if given:
                raise ValueError(f"{', '.join(given)} describe what happens between turns, and turns is 1; set "
                                 "turns (model turns per episode, >= 2) or leave them out")
            return
        if self.tool_tokens is None:
            raise ValueError(f"turns={self.turns} puts a tool result between two turns; give its length as "
                             "tool_tokens: {max: N, mean: M}")
        if self.branches == 1 and self.max_leaves is not None:
            raise ValueError(f"max_leaves={self.max_leaves} bounds the leaves of forks, and branches is 1 (no forks); "
                             "set branches >= 2 or leave it out")
        check_max_leaves(self.max_leaves, self.responses_per_prompt)

    @property
    def turn_rows(self) -> tuple[int, ...]:
        """Episodes of one task alive in each turn: responses_per_prompt in the first; after each tool result every
        episode forks into `branches` while the task's leaves stay within max_leaves (in order, as hetrl train's
        rollout does when every episode calls a tool every turn)."""
        k, rows = self.branches, [self.responses_per_prompt]
        cap = leaf_cap(self.max_leaves, self.responses_per_prompt, k)
        for _ in range(self.turns - 1):
            c = rows[-1]
            rows.append(c + (k - 1) * min(c, (cap - c) // (k - 1)) if k > 1 else c)
        return tuple(rows)

    @property
    def leaves(self) -> int:
        """Samples per task: its episodes' leaves (responses_per_prompt without forks)."""
        return self.turn_rows[-1]

    @property
    def samples(self) -> int:
        """Samples trained per step: the kept groups under dynamic sampling, each of a task's leaves for episodes."""
        return self.prompts_per_step * self.leaves

    @property
    def completion_tokens(self) -> TokenLengths:
        """One sample's tokens after its prompt: response_tokens, or for episodes every turn and tool result along
        one leaf."""
        if self.turns == 1:
            return self.response_tokens
        t, r, u = self.turns, self.response_tokens, self.tool_tokens
        return TokenLengths(t * r.max + (t - 1) * u.max, t * r.mean + (t - 1) * u.mean)

    @property
    def generated_samples(self) -> float:
        """Samples the rollout generates per step: `samples` x rollout_batch_multiplier."""
        return self.samples * self.rollout_batch_multiplier

    @property
    def pass_lengths(self) -> tuple[float, float]:
        """(prompt, completion) tokens per sample that the training and log-prob passes compute over: the means, or
        the maxima where the engine pads to them (`padding`)."""
        p = self.prompt_tokens.max if self.padding != "none" else self.prompt_tokens.mean
        r = self.completion_tokens.max if self.padding == "max" else self.completion_tokens.mean
        return p, r

    def model(self, role: str) -> ModelSpec | None:
        return getattr(self, role)


# ---------------------------------------------------------------------------------------------- YAML


def cluster_from_dict(data: dict, where: str = "cluster") -> ClusterSpec:
    data = require_mapping(data, where)
    reject_unknown(data, ("name", "nodes", "regions", "gpu_types"), where)
    for key in ("nodes", "regions", "gpu_types"):
        if data.get(key) is not None and not isinstance(data[key], list):
            raise InputError(f"{where}: {key} must be a list, got {show(data[key])}", located=True)
    types = tuple(from_mapping(GPUType, t, f"{where}: gpu_types[{i}]")
                  for i, t in enumerate(data.get("gpu_types") or []))
    nodes = tuple(from_mapping(Node, n, f"{where}: nodes[{i}]") for i, n in enumerate(data.get("nodes") or []))
    links = tuple(from_mapping(RegionLink, r, f"{where}: regions[{i}]")
                  for i, r in enumerate(data.get("regions") or []))
    with located(where):
        return ClusterSpec(data.get("name", where), nodes, links, types)


WORKLOAD_KEYS = ("algorithm", "mode", "models", "prompts_per_step", "responses_per_prompt", "prompt_tokens",
                 "response_tokens", "dualkv", "precision", "micro_batch_responses", "optimizer_steps",
                 "old_logprob_share", "rollout_logprob_pass", "max_tokens_per_micro_batch", "rollout_batch_multiplier",
                 "padding", "turns", "tool_tokens", "tool_latency_s", "branches", "max_leaves", "image_patches",
                 "data_parallel_only")


def workload_from_dict(data: dict, where: str = "workload") -> WorkloadSpec:
    data = require_mapping(data, where)
    reject_unknown(data, WORKLOAD_KEYS, where)
    models = require_mapping(data.get("models") or {}, f"{where}: models")
    reject_unknown(models, ROLES, f"{where}: models")
    if models.get("actor") is None:
        raise InputError(f"{where}: models.actor is required (a preset such as qwen3-8b, or architecture numbers)",
                         located=True)
    specs = {role: model_spec(models.get(role), f"{where}: models.{role}") for role in ROLES}
    lengths = {}
    for key in ("prompt_tokens", "response_tokens", "tool_tokens"):
        v = data.get(key)
        if key == "tool_tokens" and v is None:
            continue
        if not isinstance(v, dict):
            raise InputError(f"{where}: {key} must be {{max: N, mean: M}}, got {show(v)}", located=True)
        lengths[key] = from_mapping(TokenLengths, {"mean": v.get("max"), **v} if "max" in v else v, f"{where}: {key}")
    rest = {k: v for k, v in data.items() if k not in ("models", "prompt_tokens", "response_tokens", "tool_tokens")}
    with located(where):
        return WorkloadSpec(**{"algorithm": "grpo", "mode": "sync", "prompts_per_step": 128,
                               "responses_per_prompt": 8, **rest}, **specs, **lengths)


def load_cluster(path: str) -> ClusterSpec:
    return cluster_from_dict(read_yaml(path, "cluster YAML"), path)


def load_workload(path: str) -> WorkloadSpec:
    return workload_from_dict(read_yaml(path, "workload YAML"), path)
