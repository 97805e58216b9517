"""`hetrl bench dualkv --layer qwen3-8b --device cuda`: one decoder layer, forward + backward, DualKV against the packed
(varlen) layout, in the DualKV paper's Table 2 setup, with the paper's own numbers beside.

Setup (the paper's): one prompt of P tokens and `mb` responses per micro-batch, response lengths R ~ U(131, 2048)
drawn by seed, bf16 on the GPU, forward + backward of one layer. Layers:

  paper      the paper's benchmark layer: hidden 4096, 32 query / 8 KV heads, head dim 128, intermediate 14336
             (Llama-style)
  qwen3-8b   the real Qwen3-8B layer: the same attention shape with RoPE and q/k-norm, intermediate 12288
  tiny       hidden 64, 4 / 2 heads, head dim 16, intermediate 128, P in {64, 128}, R ~ U(8, 32): for CPU and tests

Each is a transformers causal LM with one such layer and a 256-token vocabulary (embedding and head add ~0.5% of
the layer's FLOPs at hidden 4096), so every layout runs through the model's own code, as in training:

  dualkv          hetrl `shared_prompt_logprobs` (impl flex on CUDA, sdpa on CPU): the prompt once, each response
                  attending to it and to itself
  dualkv_ckpt     the same with activation checkpointing on (`--checkpointing`): the memory it saves, the time
                  the recompute costs
  packed_*        the responses each with their own copy of the prompt in one row, causal attention per sequence
                  (the paper's FA2 baseline is flash-attn varlen); three kernels, the fastest that runs is `packed`:
    packed_varlen   torch's own flash varlen (`torch.nn.attention.varlen.varlen_attn`; CUDA)
    packed_flex     flex with a document-causal block mask (compiled; CUDA: torch has no CPU flex backward)
    packed_sdpa     SDPA per sequence (flash on CUDA; the CPU path)
  prefix_grouper  the prefix-grouper package (the paper's Prefix-Grouper-style baseline) through its own
                  transformers integration; its inner attention is SDPA with flash-attn's causal rule, since the
                  flash-attn package is not installed (see dualkv_grid._prefix_grouper)

Reported per (P, mb): median seconds over the timed rounds after warm-up (CUDA events on the GPU), peak memory
(CUDA only: torch.cuda.max_memory_allocated), TFLOP/s counting only the FLOPs each layout executes (linear layers
6 x params per token, attention 4 x heads x head dim per causal (query, key) pair forward and twice that backward),
each layout's largest log-prob difference from dualkv, the paper's milliseconds where its Table 2 has them, and
the planner's cost model's prediction for the same pass on its H100 catalog entry (#20 item 7: what the planner
would charge, to set against the measured seconds on an H100). A layout that fails (out of memory, or an API
this torch lacks) gets its error in its cell; the others still run. Written by hand: no library times a
shared-prompt layout against varlen (see ../shared/reference for the paper).
"""

from __future__ import annotations

import contextvars
import inspect
import json
import statistics
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM
from transformers.masking_utils import AttentionMaskInterface

from hetrl.bench.dualkv_grid import _SEGMENTS, _logp, _prefix_grouper  # _SEGMENTS: its per-segment SDPA attention
from hetrl.bench.harness import interleaved_times, machine
from hetrl.dualkv import pack_groups, shared_prompt_logprobs
from hetrl.dualkv.impl import flex

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


PACKED = ("packed_varlen", "packed_flex", "packed_sdpa")
LAYOUTS = ("dualkv", "dualkv_ckpt") + PACKED + ("prefix_grouper",)
PROMPT_ONCE = ("dualkv", "dualkv_ckpt", "prefix_grouper")     # the layouts that run each prompt once


def executed_flops(model, case: LayerCase, layout: str) -> float:
    """Forward + backward FLOPs the layout executes: linear layers (6 per parameter and token) and causal attention
    (4 per head dim, head and (query, key) pair forward, twice that backward); with checkpointing, the forward
    again (8 and 4 x). prefix_grouper runs the prompt through the linear layers once and each response's
    attention over the prompt once, so it counts as dualkv (the padding of its shorter responses, which its
    masked attention also computes, is not counted)."""
    c = model.config
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    p, rs = case.p, case.responses
    if layout in PROMPT_ONCE:
        tokens, pairs = p + sum(rs), p * p / 2 + sum(r * p + r * r / 2 for r in rs)
    else:
        tokens, pairs = len(rs) * p + sum(rs), sum((p + r) ** 2 / 2 for r in rs)
    linear, attn = (8, 4) if layout == "dualkv_ckpt" else (6, 3)
    return linear * params * tokens + attn * 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * pairs


def predicted_seconds(model, case: LayerCase, layout: str, gpu: str = "H100") -> float:
    """The planner's cost model's seconds for this forward + backward on one `gpu` of its catalog: the compute
    term of an actor_train pass over one prompt of P tokens and mb responses (their mean and longest length),
    bf16, no optimizer step (the benchmark takes none). DualKV and prefix-grouper are priced as the cost model
    prices DualKV, the packed layouts as it prices the standard layout."""
    from hetrl.planner.cost import task_costs
    from hetrl.planner.plan import Group, Parallelism
    from hetrl.planner.spec import TokenLengths, WorkloadSpec, cluster_from_dict
    from hetrl.trainer.placement import model_spec_from_hf

    cluster = cluster_from_dict({"name": "one", "nodes": [{"name": "n", "region": "r", "gpu": gpu, "count": 1}]})
    rs = case.responses
    w = WorkloadSpec(algorithm="grpo", mode="sync", actor=model_spec_from_hf(model.config, "layer"), reference=None,
                     reward=None, critic=None, prompts_per_step=1, responses_per_prompt=case.mb,
                     prompt_tokens=TokenLengths(case.p, float(case.p)),
                     response_tokens=TokenLengths(max(rs), sum(rs) / len(rs)),
                     dualkv=layout in PROMPT_ONCE, micro_batch_responses=case.mb)
    par = Parallelism(1, 1, 1, recompute=layout == "dualkv_ckpt")
    costs = task_costs(cluster, w, Group(("actor_train",), (0,), (("actor_train", par),)))
    return costs["actor_train"].terms["compute"]


def _group(case: LayerCase, device):
    g = torch.Generator().manual_seed(case.p * 7 + case.mb)
    prompt = torch.randint(0, VOCAB, (case.p,), generator=g)
    return prompt.to(device), [torch.randint(0, VOCAB, (r,), generator=g).to(device) for r in case.responses]


# ------------------------------------------------------------------- the packed layout's kernels

_DOC_MASK: contextvars.ContextVar = contextvars.ContextVar("hetrl_bench_doc_mask", default=None)


def _flex_document(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention inside each packed sequence with flex and a document-causal block mask (hetrl's flex
    path: compiled on CUDA, tile-classified mask)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return flex.attend(query, key, value, _DOC_MASK.get(), scale).transpose(1, 2).contiguous(), None


def _varlen_kwargs(varlen_attn) -> dict:
    """Causal (and GQA) as this torch's `varlen_attn` spells them: `is_causal` in some releases, a (-1, 0) window
    in others; `enable_gqa` where it exists (flash takes fewer K/V heads natively)."""
    params = inspect.signature(varlen_attn).parameters
    kw = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return kw | ({"enable_gqa": True} if "enable_gqa" in params else {})


def _flash_varlen(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Causal attention inside each packed sequence with torch's flash varlen kernel: query [1, H, T, d] ->
    [1, T, H, d]."""
    from torch.nn.attention.varlen import varlen_attn

    bounds = _SEGMENTS.get()
    cu = torch.tensor([s for s, _ in bounds] + [bounds[-1][1]], dtype=torch.int32, device=query.device)
    longest = max(e - s for s, e in bounds)
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))    # [T, H, d]
    return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **_varlen_kwargs(varlen_attn))[None], None


for _name, _fn in (("hetrl_bench_flex_document", _flex_document), ("hetrl_bench_torch_varlen", _flash_varlen)):
    AttentionInterface.register(_name, _fn)
    AttentionMaskInterface.register(_name, lambda **_: None)
_PACKED_ATTN = {"packed_sdpa": "hetrl_bench_varlen", "packed_flex": "hetrl_bench_flex_document",
                "packed_varlen": "hetrl_bench_torch_varlen"}


def unavailable(layout: str, device) -> str | None:
    """Why `layout` cannot run forward + backward on `device` (None: it can)."""
    if layout == "packed_varlen":
        if device.type != "cuda":
            return "flash varlen is CUDA-only"
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen"
    if layout == "packed_flex" and device.type != "cuda":
        return "torch has no flex backward on CPU"
    if layout == "prefix_grouper":
        try:
            import prefix_grouper  # noqa: F401
        except ImportError:
            return "prefix-grouper is not installed"
    return None


def layout_logprobs(layout: str, model, prompt, responses, device):
    """-> a function computing the response tokens' log-probs [sum R] in `layout`, in the same order."""
    if layout in ("dualkv", "dualkv_ckpt"):
        batch = pack_groups([(prompt.cpu().tolist(), [r.cpu().tolist() for r in responses])])
        impl = "flex" if device.type == "cuda" else "sdpa"
        return lambda: shared_prompt_logprobs(model, batch, impl=impl)
    if layout == "prefix_grouper":
        return _prefix_grouper(model, prompt, responses)
    p = prompt.numel()
    ids = torch.cat([torch.cat([prompt, r]) for r in responses])[None]
    pos = torch.cat([torch.arange(p + r.numel()) for r in responses])[None].to(device)
    starts = [0]
    for r in responses:
        starts.append(starts[-1] + p + r.numel())
    bounds = list(zip(starts[:-1], starts[1:]))
    keep = torch.cat([torch.arange(s + p - 1, e - 1) for s, e in bounds]).to(device)
    labels = torch.cat(responses)
    doc = torch.repeat_interleave(torch.arange(len(bounds)), torch.tensor([e - s for s, e in bounds])).to(device)

    def packed():
        tokens = [_SEGMENTS.set(bounds)]
        if layout == "packed_flex":      # built per call, as DualKV builds its own
            tokens.append(_DOC_MASK.set(flex.block_mask_from_ids(doc, torch.zeros_like(doc))))
        original = model.config._attn_implementation
        model.set_attn_implementation(_PACKED_ATTN[layout])
        try:
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0, keep]
        finally:
            model.set_attn_implementation(original)
            _SEGMENTS.reset(tokens[0])
            if len(tokens) > 1:
                _DOC_MASK.reset(tokens[1])
        return _logp(logits, labels)
    return packed


def _error(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "out of memory"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:160]}"


def measure(model, case: LayerCase, device, warmup: int, repeats: int, layouts=LAYOUTS) -> dict:
    prompt, responses = _group(case, device)
    row = {"p": case.p, "mb": case.mb, "responses": list(case.responses), "layouts": {}}
    weights = torch.randn(sum(case.responses), generator=torch.Generator().manual_seed(1)).to(device)
    values = {}
    for layout in layouts:
        entry = {"flops": executed_flops(model, case, layout),
                 "predicted_h100_s": predicted_seconds(model, case, layout)}
        row["layouts"][layout] = entry
        why = unavailable(layout, device)
        if why:
            entry["skipped"] = why
            continue
        if layout == "dualkv_ckpt":
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        try:
            fn = layout_logprobs(layout, model, prompt, responses, device)

            def step():
                model.zero_grad(set_to_none=True)
                (fn() * weights).sum().backward()

            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            times = interleaved_times({"step": step}, repeats, warmup, device=device)["step"]
            entry |= {"seconds": statistics.median(times), "times": times}
            entry["tflops"] = entry["flops"] / entry["seconds"] / 1e12
            if device.type == "cuda":
                entry["peak_bytes"] = torch.cuda.max_memory_allocated(device)
            with torch.no_grad():
                values[layout] = fn().float()
        except Exception as e:          # one layout's failure (OOM, a missing API) is its cell, not the run's end
            entry["error"] = _error(e)
        finally:
            model.zero_grad(set_to_none=True)
            if layout == "dualkv_ckpt":
                model.activation_checkpointing_disable()
    if "dualkv" in values:
        for layout, v in values.items():
            if layout != "dualkv":
                row["layouts"][layout]["max_abs_logprob_diff"] = (v - values["dualkv"]).abs().max().item()
    timed = {k: e["seconds"] for k, e in row["layouts"].items() if "seconds" in e}
    packed = [k for k in PACKED if k in timed]
    if packed:
        row["packed"] = min(packed, key=timed.get)
    if "dualkv" in timed:
        if packed:
            row["speedup"] = timed[row["packed"]] / timed["dualkv"]
        if "prefix_grouper" in timed:
            row["speedup_vs_prefix_grouper"] = timed["prefix_grouper"] / timed["dualkv"]
    if (case.p, case.mb) in PAPER_MS:
        row["paper_ms"] = dict(zip(("fa2", "dualkv", "prefix_grouper"), PAPER_MS[case.p, case.mb]))
    return row


def run(layer: str, device: str = "cpu", grid: str | None = None, warmup: int = 2, repeats: int = 5,
        seed: int = 0, checkpointing: bool = False, only: list[tuple[int, int]] | None = None,
        rows_path: str | None = None) -> dict:
    """Every (P, mb) of the grid (or `only` those, in that order), each row appended to `rows_path` (JSON lines) as it
    finishes, so a run cut short keeps what it measured."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA GPU here; use --device cpu (with --layer tiny)")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = build_layer(layer, dev, dtype)
    grid = grid or ("tiny" if layer == "tiny" else "full")
    grid_cases = {(c.p, c.mb): c for c in cases(grid, seed)}
    if only is not None and not set(only) <= set(grid_cases):
        raise ValueError(f"--cases: {', '.join(f'{p}x{mb}' for p, mb in only if (p, mb) not in grid_cases)} not in "
                         f"the {grid} grid ({', '.join(f'{p}x{mb}' for p, mb in grid_cases)})")
    todo = list(grid_cases.values()) if only is None else [grid_cases[k] for k in dict.fromkeys(only)]  # in given order
    layouts = LAYOUTS if checkpointing else tuple(x for x in LAYOUTS if x != "dualkv_ckpt")
    rows = []
    for c in todo:
        rows.append(measure(model, c, dev, warmup, repeats, layouts))
        if rows_path:
            with open(rows_path, "a") as f:
                f.write(json.dumps({"layer": layer, "device": str(dev)} | rows[-1]) + "\n")
    return {"layer": layer, "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "grid": grid,
            "warmup": warmup, "repeats": repeats, "seed": seed, "machine": machine(),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
            "layouts": list(layouts), "rows": rows}


def from_rows(rows_path: str, repeats: int, warmup: int = 2, seed: int = 0) -> dict:
    """The result of a run from the rows it appended to `rows_path` (`run`'s rows_path), e.g. of a run cut short by
    a time limit: what `run` returns, for `markdown` and `write`, with this process's machine facts."""
    with open(rows_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{rows_path} holds no finished row")
    layer, device = rows[0].pop("layer"), rows[0].pop("device")
    for r in rows[1:]:
        if (r.pop("layer"), r.pop("device")) != (layer, device):
            raise ValueError(f"{rows_path} mixes layers or devices")
    dev = torch.device(device)
    layouts = list(dict.fromkeys(k for r in rows for k in r["layouts"]))
    return {"layer": layer, "device": device, "dtype": "bfloat16" if dev.type == "cuda" else "float32",
            "grid": "tiny" if layer == "tiny" else "full", "warmup": warmup, "repeats": repeats, "seed": seed,
            "machine": machine(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "layouts": layouts, "rows": rows}


def parse_case(text: str) -> tuple[int, int]:
    """'8192x8' or '8Kx8' -> (P, mb)."""
    try:
        p, mb = text.lower().split("x")
        return int(float(p[:-1]) * 1024) if p.endswith("k") else int(p), int(mb)
    except ValueError:
        raise ValueError(f"a layer case is PxMB, e.g. 8192x8 or 8Kx8; got {text!r}") from None


def _ms(entry: dict) -> str:
    if "seconds" in entry:
        return f"{entry['seconds'] * 1e3:.2f}"
    return entry.get("error") or "n/a"


def markdown(res: dict) -> str:
    from hetrl.planner.catalog import gpu
    from hetrl.planner.cost import MFU_TRAIN

    on_gpu = res["device"].startswith("cuda")
    timed_layouts = [k for k in res.get("layouts", ("dualkv", "packed_sdpa"))
                     if any("seconds" in r["layouts"].get(k, {}) for r in res["rows"])]
    skipped = {k: e["skipped"] for r in res["rows"] for k, e in r["layouts"].items() if "skipped" in e}

    def gib(e):
        return f"{e['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in e else "-"

    lines = [f"# DualKV, one {res['layer']} layer, forward + backward ({res['device']}, {res['dtype']})", "",
             f"torch {res['torch']}{', ' + res['gpu'] if res['gpu'] else ''}; median of {res['repeats']} rounds after "
             f"{res['warmup']} warm-up; responses R ~ U{GRIDS[res['grid']][2]} by seed {res['seed']}. "
             "`hetrl bench dualkv --layer " + res["layer"] + " --device " + res["device"] + "`. "
             "`packed` is the fastest packed kernel that ran; speedup = packed / dualkv.", ""]
    if skipped:
        lines += ["Not run here: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()) + ".", ""]
    head = ["P", "mb"] + [f"{k} ms" for k in timed_layouts] + ["packed", "speedup", "vs prefix-grouper",
                                                                 "paper FA2 / DualKV / PG ms", "paper speedup"]
    lines += ["## Time", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in res["rows"]:
        paper = r.get("paper_ms")
        theirs = "/".join("-" if v is None else f"{v:g}" for v in paper.values()) if paper else ""
        ratio = f"{paper['fa2'] / paper['dualkv']:.2f}x" if paper and paper["fa2"] else ""
        cells = [str(r["p"]), str(r["mb"])] + [_ms(r["layouts"].get(k, {})) for k in timed_layouts]
        cells += [r.get("packed", "-"), f"{r['speedup']:.2f}x" if "speedup" in r else "-",
                  f"{r['speedup_vs_prefix_grouper']:.2f}x" if "speedup_vs_prefix_grouper" in r else "-", theirs, ratio]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## TFLOP/s (executed FLOPs), peak GiB, largest log-prob difference from dualkv", "",
              "| P | mb | layout | TFLOP/s | peak GiB | max logp diff |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for k in timed_layouts:
            e = r["layouts"].get(k, {})
            if "seconds" in e:
                diff = f"{e['max_abs_logprob_diff']:.1e}" if "max_abs_logprob_diff" in e else "-"
                lines.append(f"| {r['p']} | {r['mb']} | {k} | {e['tflops']:.3g} | {gib(e)} | {diff} |")
    lines += ["", "## The cost model against the measurement" + ("" if on_gpu else " (predictions only: "
              "the measurement here is not on an H100)"), "",
              "The planner's compute term for the same pass on its H100 catalog entry "
              f"({gpu('H100').dense_bf16_flops / 1e12:g} "
              f"TFLOP/s bf16 dense at MFU_TRAIN = {MFU_TRAIN}), DualKV and prefix-grouper priced as DualKV, packed as "
              "the standard layout.", "",
              "| P | mb | layout | predicted ms | measured ms | error |", "|---|---|---|---|---|---|"]
    for r in res["rows"]:
        for k in ("dualkv", "dualkv_ckpt", r.get("packed")):
            e = r["layouts"].get(k) if k else None
            if not e:
                continue
            pred = e["predicted_h100_s"] * 1e3
            meas = e["seconds"] * 1e3 if on_gpu and "seconds" in e else None
            err = f"{(pred - meas) / meas:+.0%}" if meas else "-"
            lines.append(f"| {r['p']} | {r['mb']} | {k} | {pred:.3g} | {f'{meas:.3g}' if meas else '-'} | {err} |")
    return "\n".join(lines) + "\n"


def write(res: dict, out: str) -> str:
    from hetrl.bench.harness import write_results

    return write_results(out, f"dualkv_layer_{res['layer']}_{res['device'].split(':')[0]}", res, markdown(res))
