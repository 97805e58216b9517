"""Cluster and workload specs: frozen dataclasses validated on construction; YAML is a thin layer on top.

Units are in field names (_bytes, _bytes_per_s, _s). Every unknown key, GPU name, region or preset
is an error that lists the valid choices.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import yaml

from .catalog import GPUType, gpu

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# ---------------------------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer by its architecture numbers (MoE when experts > 0)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    name: str = "custom"

    def __post_init__(self):
        for f in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"model {self.name}: {f} must be an int >= 1, got {v!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.experts and not (0 < self.experts_per_token <= self.experts and self.moe_intermediate > 0):
            raise ValueError(f"model {self.name}: an MoE needs 0 < experts_per_token <= experts and moe_intermediate > 0")
        if not self.experts and self.intermediate < 1:
            raise ValueError(f"model {self.name}: intermediate must be >= 1 for a dense model")

    @property
    def attn_params_per_layer(self) -> int:
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    @property
    def mlp_params_per_layer(self) -> int:
        if self.experts:
            return self.experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
        return 3 * self.hidden * self.intermediate

    @property
    def active_mlp_params_per_layer(self) -> int:
        if self.experts:
            return self.experts_per_token * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
        return self.mlp_params_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        """All parameters (what memory holds)."""
        return self.layers * (self.attn_params_per_layer + self.mlp_params_per_layer) + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters each token touches (what FLOPs scale with)."""
        return self.layers * (self.attn_params_per_layer + self.active_mlp_params_per_layer) + self.embedding_params

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _preset(name, layers, hidden, heads, kv, inter, vocab, tied=False, **moe):
    return ModelSpec(layers, hidden, heads, kv, 128, inter, vocab, tied, name=name, **moe)


PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    # Hugging Face config.json of each model
    _preset("qwen3-4b", 36, 2560, 32, 8, 9728, 151936, tied=True),
    _preset("qwen3-8b", 36, 4096, 32, 8, 12288, 151936),
    _preset("qwen3-14b", 40, 5120, 40, 8, 17408, 151936),
    _preset("qwen3-32b", 64, 5120, 64, 8, 25600, 151936),
    _preset("qwen3-30b-a3b", 48, 2048, 32, 4, 0, 151936, experts=128, experts_per_token=8, moe_intermediate=768),
    _preset("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256),
    _preset("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256),
]}


def model_spec(value) -> ModelSpec | None:
    if value is None:
        return None
    if isinstance(value, ModelSpec):
        return value
    if isinstance(value, str):
        if value not in PRESETS:
            raise ValueError(f"unknown model preset {value!r}; known: {', '.join(PRESETS)} "
                             "(or give {layers, hidden, heads, kv_heads, head_dim, intermediate, vocab})")
        return PRESETS[value]
    if isinstance(value, dict):
        valid = [f.name for f in dataclasses.fields(ModelSpec)]
        unknown = sorted(set(value) - set(valid))
        if unknown:
            raise ValueError(f"unknown model key(s) {unknown}; valid: {', '.join(valid)}")
        return ModelSpec(**value)
    raise ValueError(f"a model is a preset name or a mapping of architecture numbers, got {value!r}")


# ---------------------------------------------------------------------------------------------- cluster


@dataclass(frozen=True)
class Node:
    name: str
    region: str
    gpu: str
    count: int
    intra_node: str = "nvlink"    # nvlink | pcie
    network_gbps: float = 100.0

    def __post_init__(self):  # the GPU type is checked by ClusterSpec, which also knows the cluster's own types
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"node {self.name}: count must be an int >= 1, got {self.count!r}")
        if self.intra_node not in ("nvlink", "pcie"):
            raise ValueError(f"node {self.name}: intra_node must be 'nvlink' or 'pcie', got {self.intra_node!r}")
        if not self.network_gbps > 0:
            raise ValueError(f"node {self.name}: network_gbps must be > 0, got {self.network_gbps!r}")


@dataclass(frozen=True)
class RegionLink:
    between: tuple[str, str]
    latency_ms: float
    bandwidth_gbps: float


@dataclass(frozen=True)
class GPU:
    """One concrete GPU: `<node>:<index>`."""

    id: int
    name: str
    node: str
    region: str
    type: GPUType


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

    def __post_init__(self):
        if not self.nodes:
            raise ValueError(f"cluster {self.name}: no nodes")
        names = [n.name for n in self.nodes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"cluster {self.name}: node names must be unique, repeated: {dup}")
        regions = {n.region for n in self.nodes}
        linked = set()
        for link in self.regions:
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

    def gpu_type(self, name: str) -> GPUType:
        """The cluster's own GPU types first, then the catalog; unknown names list both."""
        own = {t.name: t for t in self.gpu_types}
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
        return next(n for n in self.nodes if n.name == name)

    def link(self, a: GPU, b: GPU) -> tuple[float, float]:
        """(latency_s, bytes_per_s) of the path between two GPUs."""
        if a.node == b.node:
            n = self.node(a.node)
            bw = a.type.nvlink_bytes_per_s if n.intra_node == "nvlink" else PCIE_BYTES_PER_S
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
    max: int
    mean: float

    def __post_init__(self):
        if not (isinstance(self.max, int) and self.max >= 1 and 0 < self.mean <= self.max):
            raise ValueError(f"token lengths need an int max >= 1 and 0 < mean <= max, got max={self.max}, "
                             f"mean={self.mean}")


@dataclass(frozen=True)
class WorkloadSpec:
    algorithm: str
    mode: str
    actor: ModelSpec
    reference: ModelSpec | None
    reward: ModelSpec | None
    critic: ModelSpec | None
    prompts_per_step: int
    responses_per_prompt: int
    prompt_tokens: TokenLengths
    response_tokens: TokenLengths
    dualkv: bool = True
    precision: str = "bf16"
    micro_batch_responses: int | None = None   # responses per training micro-batch; default: a whole group

    def __post_init__(self):
        if self.micro_batch_responses is None:
            object.__setattr__(self, "micro_batch_responses", self.responses_per_prompt)
        if not isinstance(self.micro_batch_responses, int) or not 1 <= self.micro_batch_responses:
            raise ValueError(f"micro_batch_responses must be an int >= 1, got {self.micro_batch_responses!r}")
        if self.algorithm not in ("grpo", "dapo", "ppo"):
            raise ValueError(f"algorithm must be grpo, dapo or ppo, got {self.algorithm!r}")
        if self.mode not in ("sync", "async"):
            raise ValueError(f"mode must be sync or async, got {self.mode!r}")
        if self.algorithm == "ppo" and self.critic is None:
            raise ValueError("ppo needs a critic model: set models.critic (e.g. the actor's preset)")
        if self.algorithm != "ppo" and self.critic is not None:
            raise ValueError(f"{self.algorithm} has no critic; set models.critic: null")
        if self.precision not in ("bf16", "fp16"):
            raise ValueError(f"precision must be bf16 or fp16, got {self.precision!r}")
        for f in ("prompts_per_step", "responses_per_prompt"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f} must be an int >= 1, got {v!r}")

    def __hash__(self):  # cached: every cost-model cache lookup hashes the workload
        if "_hash" not in self.__dict__:
            object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self))))
        return self.__dict__["_hash"]

    @property
    def samples(self) -> int:
        return self.prompts_per_step * self.responses_per_prompt

    def model(self, role: str) -> ModelSpec | None:
        return getattr(self, role)


# ---------------------------------------------------------------------------------------------- YAML


def _reject_unknown(data: dict, valid, where: str):
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {where}; valid: {', '.join(valid)}")


def _read_yaml(path: str) -> dict:
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a mapping, got {type(data).__name__}")
    return data


def _gpu_type_from_dict(data, where: str) -> GPUType:
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping of GPU type fields")
    valid = [f.name for f in dataclasses.fields(GPUType)]
    _reject_unknown(data, valid, where)
    missing = [k for k in ("name", "dense_bf16_flops", "memory_bytes", "hbm_bytes_per_s", "source") if k not in data]
    if missing:
        raise ValueError(f"{where} is missing {missing} (a GPU type needs its numbers and where they come from)")
    data = dict(data)
    for k in ("dense_bf16_flops", "memory_bytes", "hbm_bytes_per_s", "nvlink_bytes_per_s"):
        if isinstance(data.get(k), str):  # YAML 1.1 reads 1.5e11 (no dot before e) as a string
            try:
                data[k] = float(data[k])
            except ValueError:
                pass
    for k in ("dense_bf16_flops", "memory_bytes", "hbm_bytes_per_s"):
        if not isinstance(data[k], (int, float)) or isinstance(data[k], bool) or data[k] <= 0:
            raise ValueError(f"{where}: {k} must be a number > 0, got {data[k]!r}")
    return GPUType(name=str(data["name"]), dense_bf16_flops=float(data["dense_bf16_flops"]),
                   memory_bytes=int(data["memory_bytes"]), hbm_bytes_per_s=float(data["hbm_bytes_per_s"]),
                   nvlink_bytes_per_s=float(data.get("nvlink_bytes_per_s", 0)),
                   has_bf16=bool(data.get("has_bf16", True)), source=str(data["source"]))


def cluster_from_dict(data: dict, where: str = "cluster") -> ClusterSpec:
    _reject_unknown(data, ("name", "nodes", "regions", "gpu_types"), where)
    types = tuple(_gpu_type_from_dict(t, f"{where} gpu_types[{i}]") for i, t in enumerate(data.get("gpu_types") or []))
    node_keys = [f.name for f in dataclasses.fields(Node)]
    nodes = []
    for i, n in enumerate(data.get("nodes") or []):
        if not isinstance(n, dict):
            raise ValueError(f"{where}: nodes[{i}] must be a mapping")
        _reject_unknown(n, node_keys, f"{where} nodes[{i}]")
        missing = [k for k in ("name", "region", "gpu", "count") if k not in n]
        if missing:
            raise ValueError(f"{where}: nodes[{i}] is missing {missing}")
        nodes.append(Node(**n))
    links = []
    for i, r in enumerate(data.get("regions") or []):
        _reject_unknown(r, ("between", "latency_ms", "bandwidth_gbps"), f"{where} regions[{i}]")
        if len(r.get("between", ())) != 2:
            raise ValueError(f"{where}: regions[{i}].between must name two regions")
        links.append(RegionLink(tuple(r["between"]), float(r["latency_ms"]), float(r["bandwidth_gbps"])))
    return ClusterSpec(str(data.get("name", where)), tuple(nodes), tuple(links), types)


def workload_from_dict(data: dict, where: str = "workload") -> WorkloadSpec:
    valid = ("algorithm", "mode", "models", "prompts_per_step", "responses_per_prompt", "prompt_tokens",
             "response_tokens", "dualkv", "precision", "micro_batch_responses")
    _reject_unknown(data, valid, where)
    models = data.get("models") or {}
    _reject_unknown(models, ROLES, f"{where} models")
    if models.get("actor") is None:
        raise ValueError(f"{where}: models.actor is required")
    lengths = {}
    for key in ("prompt_tokens", "response_tokens"):
        v = data.get(key)
        if not isinstance(v, dict):
            raise ValueError(f"{where}: {key} must be {{max: N, mean: M}}")
        _reject_unknown(v, ("max", "mean"), f"{where} {key}")
        lengths[key] = TokenLengths(v["max"], float(v.get("mean", v["max"])))
    return WorkloadSpec(
        algorithm=data.get("algorithm", "grpo"), mode=data.get("mode", "sync"),
        actor=model_spec(models["actor"]), reference=model_spec(models.get("reference")),
        reward=model_spec(models.get("reward")), critic=model_spec(models.get("critic")),
        prompts_per_step=data.get("prompts_per_step", 128), responses_per_prompt=data.get("responses_per_prompt", 8),
        dualkv=bool(data.get("dualkv", True)), precision=data.get("precision", "bf16"),
        micro_batch_responses=data.get("micro_batch_responses"), **lengths)


def load_cluster(path: str) -> ClusterSpec:
    return cluster_from_dict(_read_yaml(path), path)


def load_workload(path: str) -> WorkloadSpec:
    return workload_from_dict(_read_yaml(path), path)
