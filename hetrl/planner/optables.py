"""Operator tables: measured kernel and collective times the cost model prices GPUs from (docs/cost_model.md).

The tables are data, one CSV per source and GPU in `hetrl/planner/data/operators/` (`<source>_<GPU>.csv`, the GPU as
the catalog names it), plus any folder named by `HETRL_OPERATOR_TABLES` (a user's own measurements, e.g. from
`python -m hetrl.bench.operators`; they come first: a series they measured, such as one GEMM shape, replaces the
same series of a later file, and the later file's other series stay, SERIES). Each row names its source. Rows
(FIELDS; blank where it does not apply):

  gemm          seconds of one M x K by K x N matrix product (M = tokens, N x K a projection's weight per TP shard)
  norm/rope/act/add  seconds of a per-token elementwise kernel over M tokens of width N
  all_reduce, send_recv  seconds for `bytes` over `group` GPUs on `link`
  engine_step   the inference engine's CPU time per decode step for `batch` sequences at `tp`
  moe_layer     one MoE layer's routed experts as the engine's fused kernel runs them (routing, both grouped
                projections, the weighted sum) for M tokens: `experts` experts of N (intermediate per shard) x K
                (hidden), `topk` per token
  attention_decode  one layer's decode attention over a batch's KV cache: `batch` sequences of `context` tokens,
                `heads` / `kv_heads` of `head_dim`; `bytes` the K and V it reads (default: bf16 K and V of every
                token and KV head)
  attention_prefill, attention_train, decode_step  (hetrl.bench.operators' own measurements; not priced from)
  ep_dispatch / ep_combine  an expert-parallel all-to-all's bottleneck bandwidth (`rate`, bytes/s) over `group`
                GPUs whose bottleneck is `link` (nvlink inside a node, rdma across), the normal (training and
                prefill) kernels: no `seconds`
  ep_dispatch_ll / ep_combine_ll  the low-latency (decode) kernels: `seconds` of one call of `m` tokens per GPU
                of hidden `k`, `topk` experts each, over `group` GPUs, and the bandwidth (`rate`) it moved

Lookups interpolate between measured points in log-log and never extrapolate a time below the smallest measured
(a kernel's launch floor). A GPU without a table of an operator is priced from the nearest measured GPU
(`nearest_measured`): the measured point's fraction of its own roofline (max of FLOPs over peak FLOP/s and bytes
over HBM bytes/s) is kept and the target's roofline applied, i.e. time scales by the stated ratio of peak FLOP/s
or HBM bandwidth, whichever bounds the operator. `source_of` says which table and which scaling priced a GPU, for
`--evaluate`'s breakdown.

Hand-written: no library interpolates published operator tables this way (Vidur's own predictor trains a random
forest per operator over its tables, which is fitting; here only measured points and rooflines are used).
"""

from __future__ import annotations

import csv
import functools
import math
import os
import pathlib

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent / "data" / "operators"
FIELDS = ("op", "dtype", "m", "n", "k", "batch", "context", "heads", "kv_heads", "head_dim", "experts", "topk", "tp",
          "bytes", "group", "link", "seconds", "rate", "source")
SMALL_OPS = ("norm", "norm", "rope", "act", "add")   # per layer, as Vidur composes a block (two norms, one add)

# What names one measured series of an op, as its pricing function keys it (the swept axis left out: M, bytes,
# batch): a later file's series joins an earlier file's table of the same op and GPU unless the earlier file measured
# that series (a user's 8 GEMM shapes replace those 8 of Vidur's 100+, not all of them). An op not named here is
# priced as one curve over every shape (decode attention by bytes, the fused MoE layer by tokens per expert, EP by
# span), so one file's kernel prices it whole: the first file with it
SERIES = {"gemm": ("n", "k"), "norm": ("n",), "rope": ("n",), "act": ("n",), "add": ("n",),
          "all_reduce": ("link", "group"), "decode_all_reduce": ("link", "group"), "send_recv": ("link", "group"),
          "engine_step": ("tp",)}

def series_of(row: dict) -> tuple:
    """The series an operator row belongs to (SERIES: its fields other than the swept axis)."""
    return (row["op"], *(row.get(f) for f in SERIES.get(row["op"], ())))


# GPU types whose kernels are priced from another GPU's tables (same architecture, different clocks, SMs or HBM);
# the rest without tables of their own take the measured GPU whose FLOP/s-to-HBM ratio is closest
SAME_ARCHITECTURE = {"H200": "H100", "H20": "H100", "H800": "H100", "GB200": "H100", "B200": "H100",
                     "A100-40G": "A100-80G", "A800-80G": "A100-80G"}


def _num(v: str):
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        return float(v)


OFF = "off"   # HETRL_OPERATOR_TABLES=off: no tables; every GPU priced by the roofline constants (the model before them)
_RELOAD: list = []


def _folders() -> list[pathlib.Path]:
    own = os.environ.get("HETRL_OPERATOR_TABLES", "")
    if own.strip().lower() == OFF:
        return []
    folders = [pathlib.Path(p) for p in own.split(os.pathsep) if p]
    for f in folders:
        if not f.is_dir():
            raise ValueError(f"HETRL_OPERATOR_TABLES: {f} is not a folder (operator tables are <source>_<GPU>.csv "
                             f"files in one; '{OFF}' prices without tables)")
    return folders + [DATA]


def on_reload(clear) -> None:
    """Register a cache that depends on the tables (cleared by `reload`)."""
    _RELOAD.append(clear)


def reload() -> None:
    """Read the tables again (after HETRL_OPERATOR_TABLES changed) and forget everything priced from them."""
    tables.cache_clear()
    _gemm_series.cache_clear()
    _medians.cache_clear()
    _values.cache_clear()
    _moe_series.cache_clear()
    _decode_attention_series.cache_clear()
    for clear in _RELOAD:
        clear()


@functools.cache
def tables() -> dict[str, dict[str, list[dict]]]:
    """{GPU name: {op: rows}}: folders in order (a user's first), files by name within one; an op's rows from the
    first file that has it, joined by a later file's series (SERIES) that no earlier file measured."""
    out: dict[str, dict[str, list[dict]]] = {}
    for folder in _folders():
        if not folder.is_dir():
            continue
        for path in sorted(folder.glob("*_*.csv")):
            gpu = path.stem.rsplit("_", 1)[1]
            by_op: dict[str, list[dict]] = {}
            with open(path, newline="") as f:
                for r in csv.DictReader(f):
                    if not r.get("op") or not (r.get("seconds") or r.get("rate")):
                        continue
                    row = {k: (v if k in ("op", "dtype", "link", "source") else _num(v)) for k, v in r.items()}
                    if not row["source"]:
                        raise ValueError(f"{path}: a {row['op']} row has no source; every operator row names one")
                    row["file"] = path.name
                    by_op.setdefault(row["op"], []).append(row)
            have = out.setdefault(gpu, {})
            for op, rows in by_op.items():
                if op not in have:
                    have[op] = rows
                elif op in SERIES:
                    taken = {series_of(r) for r in have[op]}
                    have[op] = have[op] + [r for r in rows if series_of(r) not in taken]
    return out


def measured_gpus(op: str) -> list[str]:
    return [g for g, ops in tables().items() if op in ops]


def nearest_measured(gpu, op: str, where=None) -> str | None:
    """The GPU whose `op` table prices `gpu`: a catalog GPU's own, its architecture's, else the measured GPU with
    the closest peak-FLOP/s-to-HBM-bandwidth ratio; a cluster's own type the one it names (`operator_tables`);
    None when there is none (the roofline constants price it), and for a device measured whole (its own `mfu` or
    `decode_mfu_by_rows`, as CPU cores: those keep their measurements). `where`: only tables with a row it
    accepts."""
    from .catalog import GPUS
    if gpu.mfu is not None or gpu.decode_mfu_by_rows is not None:
        return None
    have = [g for g in measured_gpus(op) if where is None or any(where(r) for r in tables()[g][op])]
    if GPUS.get(gpu.name) != gpu:   # a type of the cluster's own: the tables it names, else none
        return gpu.operator_tables if gpu.operator_tables in have else None
    if gpu.name in have:
        return gpu.name
    if SAME_ARCHITECTURE.get(gpu.name) in have:
        return SAME_ARCHITECTURE[gpu.name]
    known = [g for g in have if g in GPUS]
    if not known:
        return None
    ratio = gpu.dense_bf16_flops / gpu.hbm_bytes_per_s
    return min(known, key=lambda g: abs(math.log(GPUS[g].dense_bf16_flops / GPUS[g].hbm_bytes_per_s / ratio)))


def source_of(gpu, op: str) -> str:
    """Which table prices `op` on `gpu`, and how: for --evaluate's breakdown."""
    src = nearest_measured(gpu, op)
    if src is None:
        return "no table (roofline constants)"
    files = sorted({r["file"] for r in tables()[src][op]})
    if src == gpu.name:
        if op == "gemm" and (same := _architecture_gemms(src)):
            theirs = sorted({r["file"] for r in tables()[same][op]})
            return (f"{', '.join(files)}; the shapes it lacks from {', '.join(theirs)}, scaled from {same} by "
                    f"peak FLOP/s and HBM bandwidth")
        return ", ".join(files)
    if op == "engine_step":   # host work: the engine's CPU time is not scaled by the GPU
        return f"{', '.join(files)} ({src}'s host time, not scaled)"
    if op in ("all_reduce", "decode_all_reduce"):
        return f"{', '.join(files)}, scaled from {src} by NVLink bandwidth"
    if op == "attention_decode":
        return f"{', '.join(files)}, scaled from {src} by HBM bandwidth"
    if op.startswith("ep_"):
        return (f"{', '.join(files)}: {src}'s measured fraction of each link's line rate by EP span, and its "
                f"low-latency calls' time as a floor")
    return f"{', '.join(files)}, scaled from {src} by peak FLOP/s and HBM bandwidth"


def _interp_loglog(x: float, xs, ys, proportional_above: bool = False) -> float:
    """y at x, linear in (log x, log y) between measured points; the ends held beyond them, or, with
    `proportional_above`, y growing in proportion to x above the largest measured x (bandwidth-bound work)."""
    if proportional_above and x > xs[-1]:
        return float(ys[-1]) * x / float(xs[-1])
    lx = np.log(np.asarray(xs, dtype=float))
    ly = np.log(np.asarray(ys, dtype=float))
    return float(np.exp(np.interp(math.log(max(x, 1e-30)), lx, ly)))


def _roofline(gpu, m: float, n: float, k: float, vb: float) -> float:
    return max(2 * m * n * k / gpu.dense_bf16_flops, vb * (m * k + k * n + m * n) / gpu.hbm_bytes_per_s)


def _architecture_gemms(src: str) -> str | None:
    """The GPU whose GEMM table fills the shapes `src`'s own table lacks: its architecture's (SAME_ARCHITECTURE),
    where that has one. A lent H200's few measured shapes (hetrl-measured_H200.csv) price those shapes, and every
    other shape keeps the H100 profile's efficiency, as the H200 was priced before it had a table of its own."""
    same = SAME_ARCHITECTURE.get(src)
    return same if same and "gemm" in tables().get(same, {}) else None


@functools.cache
def _gemm_series(src: str) -> tuple[dict, tuple[tuple[float, tuple, tuple], ...]]:
    """`src`'s GEMM efficiencies (roofline time / measured time, the median of repeats): by measured shape
    {(n, k): (ms, efficiencies)}, and by weight size [(log(n k), ms, efficiencies)] sorted, the shapes that share a
    weight size (4096 x 11008 and 11008 x 4096) joined by the geometric mean of their efficiencies at each M. The
    shapes src did not measure come from its architecture's table (`_architecture_gemms`), each efficiency against
    the roofline of the GPU that measured it."""
    from .catalog import gpu as gpu_type
    shapes: dict[tuple[int, int], tuple[str, dict[int, list[float]]]] = {}
    for owner in (src, _architecture_gemms(src)):   # the shapes src lacks from its architecture's table
        for r in tables()[owner]["gemm"] if owner else ():
            mine, by_m = shapes.setdefault((r["n"], r["k"]), (owner, {}))
            if mine == owner:
                by_m.setdefault(r["m"], []).append(r["seconds"])
    exact, by_size = {}, {}
    for (n, k), (owner, by_m) in shapes.items():
        ms = sorted(by_m)
        g = gpu_type(owner)   # an efficiency is against the roofline of the GPU that measured it
        eff = [_roofline(g, m, n, k, 2) / float(np.median(by_m[m])) for m in ms]
        exact[(n, k)] = (tuple(ms), tuple(eff))
        for m, e in zip(ms, eff):
            by_size.setdefault(math.log(n * k), {}).setdefault(m, []).append(math.log(e))
    series = tuple((w, tuple(sorted(pts)), tuple(math.exp(sum(pts[m]) / len(pts[m])) for m in sorted(pts)))
                   for w, pts in sorted(by_size.items()))
    return exact, series


def gemm_s(gpu, m: float, n: float, k: float, vb: float = 2) -> float | None:
    """Seconds of an M x K by K x N product on `gpu` from the tables; None without any gemm table. A measured
    shape: its own efficiency at M (log-log between measured Ms); another: interpolated in log weight size between
    the two nearest measured sizes."""
    if m <= 0:
        return 0.0
    src = nearest_measured(gpu, "gemm")
    if src is None:
        return None
    exact, series = _gemm_series(src)
    if (n, k) in exact:
        eff = _interp_loglog(m, *exact[(n, k)])
        return _roofline(gpu, m, n, k, vb) / eff
    w = math.log(n * k)
    ws = [s[0] for s in series]
    j = int(np.searchsorted(ws, w))
    near = [series[i] for i in sorted({max(j - 1, 0), min(j, len(series) - 1)})]
    if len(near) == 1:
        eff = _interp_loglog(m, near[0][1], near[0][2])
    else:
        (w0, m0, e0), (w1, m1, e1) = near
        t = min(max((w - w0) / (w1 - w0), 0.0), 1.0)
        eff = math.exp((1 - t) * math.log(_interp_loglog(m, m0, e0)) + t * math.log(_interp_loglog(m, m1, e1)))
    return _roofline(gpu, m, n, k, vb) / eff


@functools.cache
def _medians(src: str, op: str, x: str, y: str = "seconds", **select) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`src`'s `op` rows that match `select` (field=value): the measured `x` values, sorted, and the median `y`
    (seconds, or another measured field such as `rate`) of the repeats at each (the planner looks these up per
    plan it scores: computed once per table)."""
    pts: dict[float, list[float]] = {}
    for r in tables()[src][op]:
        if all(r[k] == v for k, v in select.items()):
            pts.setdefault(r[x], []).append(r[y])
    xs = tuple(sorted(pts))
    return xs, tuple(float(np.median(pts[v])) for v in xs)


@functools.cache
def _values(src: str, op: str, field: str, **select) -> tuple:
    """The distinct values of `field` among `src`'s `op` rows that match `select`, sorted."""
    return tuple(sorted({r[field] for r in tables()[src][op] if all(r[k] == v for k, v in select.items())}))


def _moe_roofline(gpu, m_e: float, n_touched: float, n: float, k: float, vb: float) -> float:
    """Roofline of `n_touched` gated experts (gate+up N x K twice, down K x N) at `m_e` tokens each."""
    flops = 2 * m_e * n_touched * 3 * n * k
    moved = vb * n_touched * (3 * n * k + m_e * (2 * k + 3 * n))
    return max(flops / gpu.dense_bf16_flops, moved / gpu.hbm_bytes_per_s)


@functools.cache
def _moe_series(src: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """`src`'s fused-MoE efficiencies (roofline over measured median) by tokens per touched expert; points of
    several shapes at the same tokens per expert joined by the geometric mean."""
    from .catalog import gpu as gpu_type
    g = gpu_type(src)
    reps: dict[tuple, list[float]] = {}
    for r in tables()[src]["moe_layer"]:
        reps.setdefault((r["m"], r["n"], r["k"], r["experts"], r["topk"]), []).append(r["seconds"])
    pts: dict[float, list[float]] = {}
    for (m, n, k, e, topk), secs in reps.items():
        touched = e * (1 - (1 - topk / e) ** m)
        m_e = m * topk / touched
        pts.setdefault(m_e, []).append(math.log(_moe_roofline(g, m_e, touched, n, k, 2)
                                                          / float(np.median(secs))))
    xs = tuple(sorted(pts))
    return xs, tuple(math.exp(sum(pts[x]) / len(pts[x])) for x in xs)


def moe_layer_s(gpu, m_e: float, n_touched: float, n: float, k: float, vb: float = 2) -> float | None:
    """Seconds of one MoE layer's routed experts in the engine's fused kernel: `n_touched` experts of N x K (N the
    intermediate per shard) at `m_e` tokens each; the measured efficiency at that many tokens per expert applied
    to this shape's roofline on `gpu`. None without a moe_layer table."""
    if m_e <= 0 or n_touched <= 0:
        return 0.0
    src = nearest_measured(gpu, "moe_layer")
    if src is None:
        return None
    xs, eff = _moe_series(src)
    return _moe_roofline(gpu, m_e, n_touched, n, k, vb) / _interp_loglog(m_e, xs, eff)


# The links the EP tables were measured on, one way per GPU, as the catalog states line rates (the fraction of it a
# kernel reached is what carries to another cluster's links): DeepEP's H800 (NVLink 200 GB/s one way, catalog) and
# one 400 Gb/s CX7 NIC per GPU (the source's setting)
EP_MEASURED_LINK_BYTES_PER_S = {("H800", "nvlink"): 200e9, ("H800", "rdma"): 50e9}


def ep_link_fraction(gpu, span: int, link: str) -> float | None:
    """The fraction of a link's one-way line rate an expert-parallel all-to-all over `span` GPUs keeps on its
    bottleneck `link` ('nvlink' inside a node, 'rdma' across nodes): the EP tables' dispatch and combine bandwidths
    (mean), at the nearest measured span, over the measured cluster's line rate. Above 1 across nodes where the
    kernel sends a token once per node and forwards it over NVLink (DeepEP's normal kernels count the bytes the
    experts receive). None without an EP table (the all-to-all keeps NCCL's bus efficiency)."""
    src = nearest_measured(gpu, "ep_dispatch", lambda r: r["link"] == link)
    line = EP_MEASURED_LINK_BYTES_PER_S.get((src, link))
    if src is None or line is None or "ep_combine" not in tables()[src]:
        return None
    rates = []
    for op in ("ep_dispatch", "ep_combine"):
        spans, rs = _medians(src, op, "group", y="rate", link=link)
        if not spans:
            return None
        j = min(range(len(spans)), key=lambda i: abs(math.log(spans[i] / max(span, 2))))
        rates.append(rs[j])
    return sum(rates) / len(rates) / line


def ep_lowlatency_s(gpu, span: int, dispatch_bytes: float, combine_bytes: float,
                    net_bytes_per_s: float | None) -> float | None:
    """Seconds of one decode step's dispatch + combine in one MoE layer with the low-latency kernels over `span` GPUs,
    each GPU sending `dispatch_bytes` and receiving back `combine_bytes`: per call the measured time at that span
    (log-log between measured spans, the ends held) as its floor, and above the measured call's bytes the bytes at
    the measured bandwidth, scaled by the ratio of this cluster's network bandwidth per GPU (`net_bytes_per_s`) to
    the measured one's. None without a low-latency table."""
    src = nearest_measured(gpu, "ep_dispatch_ll")
    if src is None or "ep_combine_ll" not in tables()[src]:
        return None
    line = EP_MEASURED_LINK_BYTES_PER_S.get((src, "rdma"))
    scale = net_bytes_per_s / line if net_bytes_per_s and line else 1.0
    total = 0.0
    for op, nbytes in (("ep_dispatch_ll", dispatch_bytes), ("ep_combine_ll", combine_bytes)):
        spans, secs = _medians(src, op, "group", link="rdma")
        rates = _medians(src, op, "group", y="rate", link="rdma")[1]
        t = _interp_loglog(max(span, 2), spans, secs)
        rate = _interp_loglog(max(span, 2), spans, rates) * scale
        total += max(t, nbytes / rate)
    return total


def _kv_bytes(r: dict) -> float:
    return float(r["bytes"] or 2 * 2 * r["batch"] * r["context"] * r["kv_heads"] * r["head_dim"])


@functools.cache
def _decode_attention_series(src: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(KV bytes read, seconds) of `src`'s decode-attention rows, by bytes (the median where a size repeats)."""
    by: dict[float, list[float]] = {}
    for r in tables()[src]["attention_decode"]:
        by.setdefault(_kv_bytes(r), []).append(float(r["seconds"]))
    xs = sorted(by)
    return tuple(xs), tuple(float(np.median(by[x])) for x in xs)


def attention_decode_s(gpu, kv_bytes: float) -> float | None:
    """Seconds of one layer's decode attention reading `kv_bytes` of K and V (a decode step's sequences on one TP
    shard): the measured kernels' time at that many bytes (log-log between measured sizes; never below the
    smallest measured, the kernel's floor; in proportion above the largest, bandwidth-bound), from the nearest
    measured GPU scaled by the ratio of HBM bandwidths. None without a table."""
    if kv_bytes <= 0:
        return 0.0
    src = nearest_measured(gpu, "attention_decode")
    if src is None:
        return None
    from .catalog import gpu as gpu_type
    xs, ys = _decode_attention_series(src)
    t = _interp_loglog(kv_bytes, xs, ys, proportional_above=True)
    return t * gpu_type(src).hbm_bytes_per_s / gpu.hbm_bytes_per_s if src != gpu.name else t


def small_ops_s(gpu, m: float, hidden: float, intermediate: float) -> float | None:
    """Seconds of one layer's per-token kernels (norms, rope, activation, residual add) over m tokens."""
    total = 0.0
    from .catalog import gpu as gpu_type
    for op in SMALL_OPS:
        src = nearest_measured(gpu, op)
        if src is None:
            return None
        width = intermediate if op == "act" else hidden
        n = min(_values(src, op, "n"), key=lambda v: abs(math.log(v / width)))
        ms, ys = _medians(src, op, "m", n=n)
        s = _interp_loglog(m * width, [v * n for v in ms], ys, proportional_above=True)
        total += s * gpu_type(src).hbm_bytes_per_s / gpu.hbm_bytes_per_s if src != gpu.name else s
    return total


def engine_step_s(gpu, batch: float, tp: int) -> float | None:
    """The inference engine's CPU time per decode step for `batch` sequences at tensor parallelism `tp` (host work:
    not scaled by the GPU)."""
    src = nearest_measured(gpu, "engine_step")
    if src is None:
        return None
    t = min(_values(src, "engine_step", "tp"), key=lambda v: abs(math.log(v / max(tp, 1))))
    xs, ys = _medians(src, "engine_step", "batch", tp=t)
    return _interp_loglog(max(batch, 1.0), xs, ys)


MEASURED_GBPS_PER_GPU = {"A100-80G": 200}   # DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU (NVIDIA's design)


def allreduce_s(gpu, nbytes: float, group: int, nodes: int = 1, gbps_per_gpu: float | None = None,
                inter_latency_s: float = 0.0, op: str = "all_reduce") -> float | None:
    """Seconds of one NCCL all-reduce of `nbytes` over `group` GPUs, from the collective tables; None without one.
    One node (`nodes` 1): its GPUs joined by NVLink. Several: `group` GPUs spread evenly over `nodes` nodes, each
    GPU with `gbps_per_gpu` of its node's network. Another group size than measured: the nearest measured
    one's time (by GPUs per node), its bandwidth part scaled by the ring's 2(k-1)/k; another GPU: the bandwidth
    part (above the smallest message's time, the latency floor) scaled by the ratio of NVLink bandwidths (one
    node) or of network bandwidth per GPU (several); more than the two nodes measured: NCCL's tree adds two
    inter-node latencies per level, 2 (ceil(log2 nodes) - 1) x `inter_latency_s`. `op`: which table
    (`decode_all_reduce`: vLLM's own all-reduce kernels, decode_allreduce_s)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    link = "nvlink" if nodes <= 1 else "nvlink+ib"
    src = nearest_measured(gpu, op, lambda r: r["link"] == link)
    if src is None:
        return None
    from .catalog import gpu as gpu_type
    per_node = group / max(nodes, 1)
    per = 2 if link != "nvlink" else 1              # the measured groups' nodes
    g = min(_values(src, op, "group", link=link), key=lambda v: abs(math.log(v / per / per_node)))
    xs, ys = _medians(src, op, "bytes", link=link, group=g)
    floor = min(ys)
    t = _interp_loglog(nbytes, xs, ys, proportional_above=True)
    ring = (2 * (group - 1) / group) / (2 * (g - 1) / g)
    if nodes <= 1:
        s_bw, t_bw = gpu_type(src).nvlink_bytes_per_s, gpu.nvlink_bytes_per_s
    else:
        s_bw, t_bw = MEASURED_GBPS_PER_GPU.get(src, 0), gbps_per_gpu or 0
    scale = s_bw / t_bw if s_bw > 0 and t_bw > 0 and (src != gpu.name or nodes > 1) else 1.0
    levels = max(math.ceil(math.log2(nodes)) - 1, 0) if nodes > 1 else 0
    return floor + max(t - floor, 0.0) * ring * scale + 2 * levels * inter_latency_s


VLLM_CUSTOM_ALLREDUCE_MAX_RANKS = 8   # vLLM's CustomAllreduce: world sizes 2, 4, 6, 8 (custom_all_reduce.py)


def decode_allreduce_s(gpu, nbytes: float, group: int) -> float | None:
    """Seconds of one decode all-reduce of `nbytes` over `group` GPUs of one NVLink node as vLLM runs it: its own
    kernels (custom all-reduce, symmetric memory; `decode_all_reduce` rows, the fastest backend at each size, which
    vLLM dispatches by size) up to the largest size measured, priced by allreduce_s's rules (another group size
    by the ring's 2(k-1)/k on the bandwidth part, another GPU by its NVLink bandwidth); above it vLLM falls back
    to NCCL, so the NCCL table prices it (never below the largest measured call). None without the table, and for
    groups above VLLM_CUSTOM_ALLREDUCE_MAX_RANKS (vLLM's own kernels serve at most 8 ranks; NCCL does the rest)."""
    src = nearest_measured(gpu, "decode_all_reduce", lambda r: r["link"] == "nvlink")
    if src is None or group > VLLM_CUSTOM_ALLREDUCE_MAX_RANKS or not gpu.nvlink_bytes_per_s:
        return None
    largest = max(_values(src, "decode_all_reduce", "bytes", link="nvlink"))
    if nbytes <= largest:
        return allreduce_s(gpu, nbytes, group, op="decode_all_reduce")
    top = allreduce_s(gpu, largest, group, op="decode_all_reduce")
    nccl = allreduce_s(gpu, nbytes, group)
    return max(top, nccl) if nccl is not None else allreduce_s(gpu, nbytes, group, op="decode_all_reduce")


def pricing(types, moe: bool = False) -> dict[str, dict[str, str]]:
    """For a report: per GPU type, which table prices its decode kernels, its engine steps and its NVLink
    all-reduces (and how: its own, or scaled from another GPU's), or that the roofline constants do."""
    out = {}
    for t in types:
        if t.mfu is not None or t.decode_mfu_by_rows is not None:
            out[t.name] = {"all": "its own measured mfu (no operator tables)"}
            continue
        out[t.name] = {"kernels": source_of(t, "gemm"), "engine_step": source_of(t, "engine_step")}
        if nearest_measured(t, "attention_decode") is not None:
            out[t.name]["decode_attention"] = source_of(t, "attention_decode")
        if moe and nearest_measured(t, "moe_layer") is not None:
            out[t.name]["moe_layer"] = source_of(t, "moe_layer")
        if moe and nearest_measured(t, "ep_dispatch") is not None:
            out[t.name]["ep_all_to_all"] = source_of(t, "ep_dispatch")
        out[t.name]["all_reduce"] = source_of(t, "all_reduce") if t.nvlink_bytes_per_s else \
            "no NVLink: alpha-beta over PCIe"
        if t.nvlink_bytes_per_s and nearest_measured(t, "decode_all_reduce") is not None:
            out[t.name]["decode_all_reduce"] = source_of(t, "decode_all_reduce")
    return out
