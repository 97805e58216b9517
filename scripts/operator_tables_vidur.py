"""Write the cost model's operator tables from Vidur's published profiling data (hetrl/planner/data/operators/).

    python scripts/operator_tables_vidur.py /work/.mirror/microsoft+vidur/repo   # a clone or `fetch`ed snapshot

Reads, with `git show` at the commits named below (no working tree needed):
  - data/profiling/compute/{h100,a100}/<model>/mlp.csv at HEAD: per-operator kernel time (ms) by tokens and TP.
    Each projection becomes a `gemm` row of the shape it ran (M tokens x N x K, per TP shard), the small per-token
    kernels (norms, rope, activation, residual add) rows of their own op;
  - data/profiling/network/{h100,a100}_dgx/{all_reduce,send_recv}.csv at HEAD: collective time by message size
    (fp16 elements) and group, NVLink inside a DGX node (A100: also 16 GPUs over two nodes);
  - data/profiling/a100/cpu_overheads.csv at 6d98aa8 (gone at HEAD): the engine's CPU time per decode step by
    batch and TP (vLLM-v0-style scheduler, sampler, input preparation and output processing; no CUDA graphs).
The medians are kept (the max over ranks for a collective: it ends when its slowest rank does), on a log-spaced
subset of the measured token counts and sizes. Every row names its file and commit.
"""

from __future__ import annotations

import csv
import io
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hetrl.planner.optables import DATA, FIELDS  # noqa: E402

HEAD = "7d47513"          # microsoft/vidur at the snapshot read (2024-07, "Remove broken links ... (#45)")
OVERHEAD_COMMIT = "6d98aa8"
GPUS = {"h100": "H100", "a100": "A100-80G"}
MODELS = ("meta-llama/Llama-2-7b-hf", "meta-llama/Llama-2-70b-hf", "codellama/CodeLlama-34b-Instruct-hf",
          "internlm/internlm-20b", "Qwen/Qwen-72B", "microsoft/phi-2")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
SMALL = {"input_layernorm": "norm", "post_attention_layernorm": "norm", "attn_rope": "rope", "mlp_act": "act",
         "add": "add"}


def show(repo: str, commit: str, path: str) -> list[dict]:
    text = subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], check=True, capture_output=True,
                          text=True).stdout
    return list(csv.DictReader(io.StringIO(text)))


def nearest(values, targets):
    have = sorted(set(values))
    return sorted({min(have, key=lambda v: abs(v - t) / t) for t in targets})


def compute_rows(repo: str, gpu: str) -> list[dict]:
    rows = []
    for model in MODELS:
        path = f"data/profiling/compute/{gpu}/{model}/mlp.csv"
        try:
            data = show(repo, HEAD, path)
        except subprocess.CalledProcessError:
            continue
        src = f"microsoft/vidur@{HEAD} {path}"
        groups: dict[tuple, list[dict]] = {}
        for r in data:
            groups.setdefault((int(r["num_tensor_parallel_workers"]), int(r["num_tokens"])), []).append(r)
        for tp in sorted({t for t, _ in groups}):
            for m in nearest([n for t, n in groups if t == tp], TOKENS):
                rs = groups[(tp, m)]
                r0 = rs[0]
                heads, kv, hidden, inter = (int(r0[c]) for c in ("n_head", "n_kv_head", "n_embd", "n_expanded_embd"))
                hd = hidden // heads
                gated = r0["use_gated_mlp"] == "True"

                def ms(op):
                    return statistics.median(float(r[f"time_stats.{op}.median"]) for r in rs) / 1e3
                for op, n, k in (("attn_pre_proj", (heads + 2 * kv) * hd // tp, hidden),
                                 ("attn_post_proj", hidden, heads * hd // tp),
                                 ("mlp_up_proj", (2 if gated else 1) * inter // tp, hidden),
                                 ("mlp_down_proj", hidden, inter // tp)):
                    s = ms(op)
                    rows.append(dict(op="gemm", dtype="float16", m=m, n=n, k=k, tp=tp, seconds=s,
                                     rate=2 * m * n * k / s, source=f"{src} ({op}, {model.split('/')[1]})"))
                for op, kind in SMALL.items():
                    if f"time_stats.{op}.median" not in r0:   # phi-2 has no post-attention norm
                        continue
                    n = inter // tp if kind == "act" else hidden
                    rows.append(dict(op=kind, dtype="float16", m=m, n=n, tp=tp, seconds=ms(op),
                                     source=f"{src} ({op}, {model.split('/')[1]})"))
    return rows


def network_rows(repo: str, gpu: str) -> list[dict]:
    rows = []
    for coll in ("all_reduce", "send_recv"):
        path = f"data/profiling/network/{gpu}_dgx/{coll}.csv"
        data = show(repo, HEAD, path)
        groups: dict[tuple, list[float]] = {}
        for r in data:
            key = (int(r["num_workers"]), int(r["devices_per_node"]), int(r["size"]))
            groups.setdefault(key, []).append(float(r[f"time_stats.{coll}.median"]) / 1e3)
        for workers, per_node in sorted({(a, b) for a, b, _ in groups}):
            sizes = [s for a, b, s in groups if (a, b) == (workers, per_node)]
            for size in nearest(sizes, [2 ** e for e in range(11, 27)]):
                s = max(groups[(workers, per_node, size)])
                nbytes = 2 * size
                rows.append(dict(op=coll, dtype="float16", bytes=nbytes, group=workers,
                                 link="nvlink" if workers <= per_node else "nvlink+ib", seconds=s, rate=nbytes / s,
                                 source=f"microsoft/vidur@{HEAD} {path} ({workers} GPUs, {per_node} per node)"))
    return rows


def overhead_rows(repo: str, gpu: str) -> list[dict]:
    path = f"data/profiling/{gpu}/cpu_overheads.csv"
    rows = []
    parts = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")
    groups: dict[tuple, list[dict]] = {}
    for r in show(repo, OVERHEAD_COMMIT, path):
        groups.setdefault((r["model_name"], int(r["tensor_parallel_degree"]), int(r["batch_size"])), []).append(r)
    for (model, tp, batch), rs in sorted(groups.items()):
        s = statistics.median(sum(float(r[f"{p}_median"]) for p in parts) for r in rs) / 1e3
        rows.append(dict(op="engine_step", batch=batch, tp=tp, seconds=s,
                         source=f"microsoft/vidur@{OVERHEAD_COMMIT} {path} ({model.split('/')[1]}; "
                                "schedule + sampler + prepare inputs + process outputs, medians)"))
    return rows


def write(name: str, rows: list[dict]) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    with open(DATA / name, "w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    print(f"{DATA / name}: {len(rows)} rows")


def main() -> None:
    repo = sys.argv[1] if len(sys.argv) > 1 else "/work/.mirror/microsoft+vidur/repo"
    for gpu, name in GPUS.items():
        write(f"vidur_{name}.csv", compute_rows(repo, gpu) + network_rows(repo, gpu))
    write("vidur-cpu-overheads_A100-80G.csv", overhead_rows(repo, "a100"))


if __name__ == "__main__":
    main()
