"""`hetrl bench dualkv --layer qwen3-8b --device cuda`: one decoder layer, forward + backward, DualKV against the packed
(varlen) layout, in the DualKV paper's Table 2 setup, with the paper's own numbers beside.

Setup (the paper's): one prompt of P tokens and `mb` responses per micro-batch, response lengths R ~ U(131, 2048)
drawn by seed, bf16 on the GPU, forward + backward of one layer. Layers:

  paper      the paper's benchmark layer: hidden 4096, 32 query / 8 KV heads, head dim 128, intermediate 14336
             (Llama-style)
  qwen3-8b   the real Qwen3-8B layer: the same attention shape with RoPE and q/k-norm, intermediate 12288
  tiny       hidden 64, 4 / 2 heads, head dim 16, intermediate 128, P in {64, 128}, R ~ U(8, 32): for CPU and tests

Each is a transformers causal LM with one such layer and a 256-token vocabulary (embedding and head add ~0.5% of
the layer's FLOPs at hidden 4096), so both layouts run through the model's own code, as in training:

  dualkv   hetrl `shared_prompt_logprobs` (impl flex on CUDA, sdpa on CPU): the prompt once, each response
           attending to it and to itself
  packed   the responses each with their own copy of the prompt in one row, attention per sequence: SDPA per
           segment (the stand-in for flash-attn varlen, which the paper's FA2 baseline is)

Reported per (P, mb): median seconds over the timed rounds after warm-up (CUDA events on the GPU), peak memory
(CUDA only: torch.cuda.max_memory_allocated), TFLOP/s counting only the FLOPs each layout executes (linear layers
6 x params per token, attention 4 x heads x head dim per causal (query, key) pair forward and twice that backward),
the largest log-prob difference between the layouts, and the paper's milliseconds where its Table 2 has them.
Written by hand: no library times a shared-prompt layout against varlen (see ../shared/reference for the paper).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from hetrl.bench.dualkv import machine_info
from hetrl.bench.dualkv_grid import _SEGMENTS  # the per-segment (varlen) attention registered there
from hetrl.dualkv import pack_groups, shared_prompt_logprobs

VOCAB = 256
ATTN = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096)
LAYERS = {
    "paper": (LlamaConfig, LlamaForCausalLM, dict(ATTN, intermediate_size=14336)),
    "qwen3-8b": (Qwen3Config, Qwen3ForCausalLM, dict(ATTN, intermediate_size=12288, rope_theta=1_000_000)),
    "tiny": (Qwen3Config, Qwen3ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                 hidden_size=64, intermediate_size=128)),
}
GRIDS = {   # (prompt lengths, micro-batch sizes, response length range)
    "full": ((5120, 8192, 16384, 32768), (4, 8, 16, 32), (131, 2048)),
    "tiny": ((64, 128), (2, 4), (8, 32)),
}
# The DualKV paper's Table 2 (one Qwen3-8B-shaped layer, H100, bf16, fwd + bwd), milliseconds: (P, mb) ->
# (FA2, DualKV, Prefix-Grouper-style); None where it ran out of memory or the table gives no number.
PAPER_MS = {(8192, 8): (245.4, 70.3, 232.1), (16384, 8): (553.0, 125.4, None), (32768, 4): (810.2, 246.4, None),
            (8192, 32): (None, 184.2, None)}


@dataclass(frozen=True)
class LayerCase:
    p: int
    mb: int
    responses: tuple[int, ...]      # response lengths


def cases(grid: str, seed: int = 0) -> list[LayerCase]:
    ps, mbs, (lo, hi) = GRIDS[grid]
    out = []
    for p in ps:
        for mb in mbs:
            g = torch.Generator().manual_seed(seed * 1_000_003 + p * 101 + mb)
            out.append(LayerCase(p, mb, tuple(int(x) for x in torch.randint(lo, hi + 1, (mb,), generator=g))))
    return out


def build_layer(name: str, device: torch.device, dtype: torch.dtype):
    if name not in LAYERS:
        raise ValueError(f"layer must be one of {', '.join(LAYERS)}, got {name!r}")
    config_cls, model_cls, shape = LAYERS[name]
    torch.manual_seed(0)
    config = config_cls(**shape, num_hidden_layers=1, vocab_size=VOCAB, max_position_embeddings=65536,
                        tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="sdpa")
    return model_cls(config).to(device=device, dtype=dtype)


def executed_flops(model, case: LayerCase, layout: str) -> float:
    """Forward + backward FLOPs the layout executes: linear layers (6 per parameter and token) and causal attention
    (4 per head dim, head and (query, key) pair forward, twice that backward)."""
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    p, rs = case.p, case.responses
    if layout == "dualkv":
        tokens, pairs = p + sum(rs), p * p / 2 + sum(r * p + r * r / 2 for r in rs)
    else:
        tokens, pairs = len(rs) * p + sum(rs), sum((p + r) ** 2 / 2 for r in rs)
    return 6 * params * tokens + 3 * 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs


def _group(case: LayerCase, device):
    g = torch.Generator().manual_seed(case.p * 7 + case.mb)
    prompt = torch.randint(0, VOCAB, (case.p,), generator=g)
    return prompt, [torch.randint(0, VOCAB, (r,), generator=g) for r in case.responses]


def layout_logprobs(layout: str, model, prompt, responses, device):
    """-> a function computing the response tokens' log-probs [sum R] in `layout`, in the same order."""
    if layout == "dualkv":
        batch = pack_groups([(prompt.tolist(), [r.tolist() for r in responses])])
        impl = "flex" if device.type == "cuda" else "sdpa"
        return lambda: shared_prompt_logprobs(model, batch, impl=impl)
    p = prompt.numel()
    ids = torch.cat([torch.cat([prompt, r]) for r in responses])[None].to(device)
    pos = torch.cat([torch.arange(p + r.numel()) for r in responses])[None].to(device)
    starts = [0]
    for r in responses:
        starts.append(starts[-1] + p + r.numel())
    bounds = list(zip(starts[:-1], starts[1:]))
    keep = torch.cat([torch.arange(s + p - 1, e - 1) for s, e in bounds]).to(device)
    labels = torch.cat(responses).to(device)

    def packed():
        token = _SEGMENTS.set(bounds)
        original = model.config._attn_implementation
        model.set_attn_implementation("hetrl_bench_varlen")
        try:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, keep]
        finally:
            model.set_attn_implementation(original)
            _SEGMENTS.reset(token)
        return torch.log_softmax(logits.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    return packed


def _timed(fn, device, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def measure(model, case: LayerCase, device, warmup: int, repeats: int) -> dict:
    prompt, responses = _group(case, device)
    row = {"p": case.p, "mb": case.mb, "responses": list(case.responses), "layouts": {}}
    weights = torch.randn(sum(case.responses), generator=torch.Generator().manual_seed(1)).to(device)
    values = {}
    for layout in ("dualkv", "packed"):
        fn = layout_logprobs(layout, model, prompt, responses, device)

        def step():
            model.zero_grad(set_to_none=True)
            (fn() * weights).sum().backward()

        entry = {"flops": executed_flops(model, case, layout)}
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = _timed(step, device, warmup, repeats)
            entry |= {"seconds": statistics.median(times), "times": times}
            entry["tflops"] = entry["flops"] / entry["seconds"] / 1e12
            if device.type == "cuda":
                entry["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            with torch.no_grad():
                values[layout] = fn().float()
        except torch.OutOfMemoryError:
            entry["error"] = "out of memory"
        row["layouts"][layout] = entry
    if len(values) == 2:
        row["max_abs_logprob_diff"] = (values["dualkv"] - values["packed"]).abs().max().item()
    d, k = row["layouts"]["dualkv"].get("seconds"), row["layouts"]["packed"].get("seconds")
    if d and k:
        row["speedup"] = k / d
    if (case.p, case.mb) in PAPER_MS:
        row["paper_ms"] = dict(zip(("fa2", "dualkv", "prefix_grouper"), PAPER_MS[case.p, case.mb]))
    return row


def run(layer: str, device: str = "cpu", grid: str | None = None, warmup: int = 2, repeats: int = 5,
        seed: int = 0) -> dict:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA GPU here; use --device cpu (with --layer tiny)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_layer(layer, dev, dtype)
    grid = grid or ("tiny" if layer == "tiny" else "full")
    rows = [measure(model, c, dev, warmup, repeats) for c in cases(grid, seed)]
    return {"layer": layer, "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "grid": grid,
            "warmup": warmup, "repeats": repeats, "seed": seed, "machine": machine_info(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "rows": rows}


def markdown(res: dict) -> str:
    def ms(entry):
        return entry["error"] if "error" in entry else f"{entry['seconds'] * 1e3:.2f}"

    lines = [f"# DualKV, one {res['layer']} layer, forward + backward ({res['device']}, {res['dtype']})", "",
             f"torch {res['torch']}{', ' + res['gpu'] if res['gpu'] else ''}; median of {res['repeats']} rounds after "
             f"{res['warmup']} warm-up; responses R ~ U{GRIDS[res['grid']][2]} by seed {res['seed']}. "
             "`hetrl bench dualkv --layer " + res["layer"] + " --device " + res["device"] + "`.", "",
             "| P | mb | dualkv ms | packed ms | speedup | dualkv TFLOP/s | packed TFLOP/s | dualkv peak | "
             "packed peak | max logp diff | paper FA2 / DualKV ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        d, k = r["layouts"]["dualkv"], r["layouts"]["packed"]
        peak = lambda e: f"{e['peak_bytes'] / 2**30:.2f} GiB" if "peak_bytes" in e else "n/a"
        paper = r.get("paper_ms")
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        tflops = lambda e: f"{e['tflops']:.3g}" if "tflops" in e else "-"
        diff = f"{r['max_abs_logprob_diff']:.1e}" if "max_abs_logprob_diff" in r else "-"
        theirs = "/".join("OOM" if v is None else f"{v:g}" for v in (paper["fa2"], paper["dualkv"])) if paper else ""
        lines.append(f"| {r['p']} | {r['mb']} | {ms(d)} | {ms(k)} | {speedup} | {tflops(d)} | {tflops(k)} | "
                     f"{peak(d)} | {peak(k)} | {diff} | {theirs} |")
    return "\n".join(lines) + "\n"


def write(res: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    name = f"dualkv_layer_{res['layer']}_{res['device'].split(':')[0]}"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(res, f, indent=2)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(markdown(res))
    return os.path.join(out, name)
