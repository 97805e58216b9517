"""Which models DualKV computes exactly: the checks that refuse a model instead of computing something else.

The packed forward equals each sequence run alone when every layer mixes tokens only through softmax attention over
the sequence's causal past, positions come only from `position_ids`, and nothing couples the tokens of a batch. Each
check here stands for one way a Hugging Face model breaks that, found by running every `*ForCausalLM` that
transformers ships against the plain forward (docs/dualkv.md, "Families checked"; tests/dualkv/test_families.py).
`check_model` refuses what shows in the model's structure and config before anything runs; `mask_problem` (from
the mask interface) and `check_attention_call` (from the attention interface) refuse what shows only during the
forward: a mask of the model's own that is not plain causal over one sequence (sliding windows, chunked or
bidirectional attention, any overlay), and attention arguments DualKV does not implement (attention sinks,
softcapping); `check_every_layer_attended` afterwards, a layer that mixed its tokens without attention.
"""

from __future__ import annotations

import functools
import inspect
import re

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import causal_mask_function

from .packing import TreeBatch

# Layer types (config.layer_types) that are softmax attention; their masks are checked by `mask_problem`. MLP-only
# layers mix no tokens.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
_TOKENWISE_LAYER_TYPES = ("mlp", "moe")
# What transformers hands an attention function besides q, k, v, the mask, dropout and scaling that leaves the
# attention itself unchanged. Anything else (`s_aux`: attention sinks, ...) is refused, not ignored.
_INERT_KWARGS = frozenset({"position_ids", "use_cache", "cache_position", "output_attentions", "output_router_logits",
                           "past_key_values", "layer_idx", "position_embeddings"})
# Config entries of training-time randomness: a dropout mask or router noise that the standard layout draws for each
# copy of a shared token and the packed one draws once.
_RANDOM_IN_TRAINING = re.compile(r"(dropout|pdrop|jitter)")
_NOT_IN_THE_FORWARD = ("classifier", "summary")
_MASK_CHECK_PAIRS = 1 << 22      # (query, key) pairs of a model's mask evaluated at once


def _refuse(name: str, what: str, why: str, fix: str = "") -> ValueError:
    """what (with the numbers), why that cannot be exact, how to go on (`fix`, ending in "or ")."""
    use = "use" if fix else "Use"
    return ValueError(f"{name} {what}: {why}. {fix}{use} impl='reference' (each sequence run alone) for this model")


def check_model(model, batch: TreeBatch) -> None:
    """Raise ValueError if `model` is one DualKV cannot run exactly on `batch` (what, why, what to do instead)."""
    cfg = model.config.get_text_config()
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"{name} is an encoder-decoder model; DualKV needs a decoder-only causal LM")
    if not type(model)._can_set_attn_implementation():
        raise ValueError(
            f"{name} does not route its attention through transformers' AttentionInterface, so the "
            "shared-prompt attention cannot be plugged in; use impl='reference' or a model that does "
            "(Llama, Qwen2, Qwen3, Mistral, ...)"
        )
    if not getattr(cfg, "is_causal", True):
        raise ValueError(f"{name} is configured with non-causal attention (is_causal=False)")
    if getattr(cfg, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"{name} uses attention logit softcapping ({cfg.attn_logit_softcapping}), which the "
            "shared-prompt attention does not implement; use impl='reference'"
        )
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise ValueError(
            f"{name} uses final logit softcapping ({cfg.final_logit_softcapping}), which DualKV does "
            "not support yet; use impl='reference'"
        )
    _check_layer_types(name, cfg)
    _check_modules(model, name)
    if not getattr(type(model), "_supports_sdpa", True):
        raise _refuse(name, "is marked by transformers as unable to run on torch SDPA (_supports_sdpa = False)",
                      "its attention computes more than softmax(q k^T) v (attention sinks, softcapping, ...), and "
                      "that is all DualKV's tree attention computes")
    _check_positions(model, name)
    _check_rope(model, name, cfg, batch)
    if model.training:
        _check_training_randomness(model, name, cfg)


def _check_layer_types(name: str, cfg) -> None:
    types = getattr(cfg, "layer_types", None)
    if types is None or isinstance(types, str):
        return
    other: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if t not in ATTENTION_LAYER_TYPES + _TOKENWISE_LAYER_TYPES:
            other.setdefault(str(t), []).append(i)
    if other:
        which = "; ".join(f"{t!r} (layers {', '.join(map(str, idx))})" for t, idx in other.items())
        raise _refuse(name, f"has layers that are not softmax attention: {which}",
                      "such a token mixer (a state-space or linear-attention recurrence, a convolution, a learned "
                      "sparse index over the keys) would run over the packed stream as one sequence and mix prompts, "
                      f"responses and groups; DualKV packs only {', '.join(ATTENTION_LAYER_TYPES)} layers")


def _check_modules(model, name: str) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            raise ValueError(f"{name} has batch-statistic norms, which mix tokens across the batch")
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):       # (not a vision or audio tower's convolutions: they see no text stream)
        for sub, m in layer.named_modules():
            path = f"layer {i}: {sub}"
            if isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1:
                raise _refuse(name, f"convolves over the sequence ({path}: Conv1d, kernel {m.kernel_size[0]})",
                              "a convolution over the packed stream mixes neighbouring tokens of different sequences "
                              "(a state-space model's or a short-convolution layer's token mixer)")


@functools.cache
def takes(cls: type, argument: str) -> bool:
    """Whether `cls.forward` takes `argument` (per class: inspecting a signature costs ~0.5 ms a call)."""
    return argument in inspect.signature(cls.forward).parameters


def _check_positions(model, name: str) -> None:
    for m in (model, decoder_of(model) or model):
        if not takes(type(m), "position_ids"):
            raise _refuse(name, f"takes no position_ids ({type(m).__name__}.forward)",
                          "the packed stream's positions (each token's depth in its tree) cannot be given to it, "
                          "and it would number the stream 0, 1, ..., T-1 as one sequence")
    for path, m in model.named_modules():
        if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None and "position" in path.rsplit(".", 1)[-1]:
            raise _refuse(name, f"numbers positions from its padding id ({path} has padding_idx {m.padding_idx})",
                          "RoBERTa-style positions (padding_idx + 1 + i, pad tokens skipped) depend on the tokens, "
                          "not only on the depth DualKV passes as position_ids")


def _check_rope(model, name: str, cfg, batch: TreeBatch) -> None:
    """Dynamic NTK and LongRoPE scaling pick their frequencies from the longest position in the forward: alone, each
    sequence its own; packed, the batch's longest. Exact only while that choice is the same for every sequence."""
    labelled = [n for n, k in zip(batch.sequence_lens, batch.labels_per_sequence) if k]
    for m in model.modules():
        rope_type = getattr(m, "rope_type", None)
        if not isinstance(rope_type, (str, dict)):
            continue
        for layer_type, kind in (rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]):
            if "dynamic" in kind:
                limit = getattr(m, "original_max_seq_len", None)
                if limit is not None and batch.max_context > limit:
                    raise _refuse(name, f"uses dynamic RoPE scaling and the batch's longest sequence "
                                        f"({batch.max_context} tokens) is past its original length ({limit})",
                                  "its frequencies are recomputed from the longest sequence in each forward, and "
                                  "the packed forward would give every sequence the batch's longest",
                                  f"Keep every sequence <= {limit} tokens, or ")
            elif kind == "longrope":
                params = cfg.rope_parameters if layer_type is None else cfg.rope_parameters[layer_type]
                limit = params.get("original_max_position_embeddings")
                short = [n for n in labelled if n <= limit] if limit is not None else []
                if short and batch.max_context > limit:
                    raise _refuse(name, f"uses LongRoPE and the batch mixes sequences of <= {limit} tokens "
                                        f"(shortest {min(short)}) with longer ones (longest {batch.max_context})",
                                  "LongRoPE switches every position of a forward to its long factors once any of its "
                                  "sequences passes the original length, so the short ones would get them too",
                                  f"Micro-batch the sequences of <= {limit} tokens apart from the longer ones, or ")


def _check_training_randomness(model, name: str, cfg) -> None:
    drawn = [f"{path} (p={m.p})" for path, m in model.named_modules()
             if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
    drawn += [f"config.{k}={v}" for k, v in cfg.to_dict().items()
              if _RANDOM_IN_TRAINING.search(k) and not k.startswith(_NOT_IN_THE_FORWARD)
              and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    if drawn:
        raise _refuse(name, f"is in training mode with random masks or noise on: {', '.join(drawn[:4])}"
                            f"{' ...' if len(drawn) > 4 else ''}",
                      "the standard layout draws them separately for each sequence's copy of a shared token and the "
                      "packed one draws them once, so there is nothing exact to share",
                      "Set them to 0 (or call model.eval()) for the packed passes, or ")


def mask_problem(name: str, kwargs: dict, max_context: int) -> str | None:
    """Why the mask the model asked transformers for (its `mask_function`) cannot be packed, or None. Evaluated over
    one sequence alone of up to `max_context` tokens, it must be plain causal: that is the only mask the packed tree
    layout reproduces. Catches sliding windows and chunked attention shorter than the sequence, bidirectional attention
    and any overlay, whether or not the model also tells its attention function about them."""
    fn = kwargs.get("mask_function")
    if fn is causal_mask_function:
        return None
    if fn is None:
        return str(_refuse(name, "asked for an attention mask without a mask function", "its mask cannot be checked"))
    device = kwargs.get("device")
    zero = torch.zeros((), dtype=torch.long, device=device)
    kv = torch.arange(max_context, device=device)
    rows = max(1, _MASK_CHECK_PAIRS // max(1, max_context))
    for r0 in range(0, max_context, rows):
        q = kv[r0:r0 + rows, None]
        causal = kv[None] <= q
        allowed = torch.broadcast_to(torch.as_tensor(fn(zero, zero, q, kv[None]), device=device), causal.shape)
        wrong = torch.nonzero(allowed != causal)
        if wrong.numel():
            qi, ki = int(wrong[0, 0]) + r0, int(wrong[0, 1])
            local = kwargs.get("local_size")
            if local is not None and local < max_context:
                window = local > 1 and bool(fn(zero, zero, kv[local], kv[1]))   # a chunk restarts at `local`
                kind = "a sliding window" if window else "attention chunks"
                return (f"{name} has {kind} of {local} tokens, shorter than the longest sequence in the batch "
                        f"({max_context} tokens); the packed stream cannot express it. Use impl='reference' or keep "
                        f"every sequence <= {local} tokens")
            sees = "sees" if bool(allowed[qi - r0, ki]) else "does not see"
            what = ("attends bidirectionally" if "allow_is_bidirectional_skip" in kwargs
                    else "asks for an attention mask that is not plain causal")
            return str(_refuse(name, f"{what} (alone, in a sequence of {max_context} tokens, query {qi} {sees} key "
                                     f"{ki})", "the packed tree layout gives every token exactly its causal past, so "
                                               "only plain causal attention over each sequence is exact"))
    return None


def check_attention_call(module, dropout: float, kwargs: dict, max_context: int) -> None:
    """One layer's call of the attention interface: refuse what the tree attention does not implement."""
    name = type(module).__name__
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError(f"{name} (layer {getattr(module, 'layer_idx', '?')}) is not causal; "
                         "shared-prompt packing is exact only for causal attention")
    if dropout and module.training:
        raise ValueError(
            f"attention dropout ({dropout}) is on: the N prompt copies of the standard layout would get "
            "different dropout masks, so there is nothing exact to share; set config.attention_dropout=0"
        )
    if kwargs.get("softcap") is not None:
        raise ValueError(f"attention logit softcapping ({kwargs['softcap']}) is not supported by DualKV")
    window = kwargs.get("sliding_window")
    if window is not None and window < max_context:
        raise ValueError(
            f"layer {getattr(module, 'layer_idx', '?')} has a sliding window of {window} tokens, shorter than the "
            f"longest sequence in the batch ({max_context} tokens); the packed stream cannot "
            f"express it. Use impl='reference' or keep every sequence <= {window} tokens"
        )
    extra = sorted(k for k, v in kwargs.items()
                   if v is not None and k not in _INERT_KWARGS and k not in ("softcap", "sliding_window", "is_causal"))
    if extra:
        raise _refuse(name, f"passes {', '.join(extra)} to its attention function",
                      "DualKV's attention does not implement them (s_aux: attention sinks) and would ignore them")


def decoder_of(model):
    """The causal LM's decoder (its base model, without the LM head), or None: transformers' get_decoder(), which
    for a few classes gives the model itself (Llama4ForCausalLM) or its output projection
    (ModernBertDecoderForCausalLM), else the `model` attribute."""
    for candidate in (model.get_decoder() if hasattr(model, "get_decoder") else None, getattr(model, "model", None)):
        if isinstance(candidate, PreTrainedModel) and candidate is not model:
            return candidate
    return None


# A causal LM's forward whose logits are exactly lm_head(decoder output) assigns these and nothing else (the Llama
# pattern): the hidden states from the decoder's output, sliced to logits_to_keep, then the head.
_STATEMENT = re.compile(r"^\s*(logits|hidden_states)\s+[-+*/]?=\s+(.*?)\s*(#.*)?$", re.M)
_PLAIN_STATEMENTS = {
    "hidden_states": re.compile(r"\w*outputs(\.last_hidden_state|\[0\])|slice_logits_to_keep\(hidden_states, "
                                r"logits_to_keep\)|hidden_states\[:, slice_indices, :\]"),
    "logits": re.compile(r"self\.lm_head\(hidden_states\)(\.float\(\)|\.contiguous\(\))?"),
}


def plain_lm_head(model) -> torch.nn.Linear | None:
    """The LM head when the model's logits are exactly lm_head(decoder output), so that the head may run apart from the
    model (DualKV's row-chunked head); else None. Read from the source of the model's forward: a softcap, a logit or
    hidden-state multiplier (Cohere, Granite, MiniCPM3, FalconH1) or a prediction head before the output projection
    (ModernBERT) shows as another statement there, whatever its config value."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or getattr(model, "lm_head", None) is not head:
        return None
    if decoder_of(model) is None:
        return None
    return head if _plain_forward(type(model)) else None


@functools.cache
def _plain_forward(cls: type) -> bool:
    """Whether `cls.forward` computes logits as lm_head(decoder output) and nothing more (read once per class)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    statements = _STATEMENT.findall(source)
    plain = all(_PLAIN_STATEMENTS[var].fullmatch(value) for var, value, _ in statements)
    return plain and any(var == "logits" for var, _, _ in statements)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder's stack of layers: the ModuleList among its children named layers/h/blocks, else the longest."""
    decoder = decoder_of(model) or model
    lists = {n: c for n, c in decoder.named_children() if isinstance(c, torch.nn.ModuleList)}
    for n in ("layers", "h", "blocks"):
        if n in lists:
            return list(lists[n])
    return list(max(lists.values(), key=len)) if lists else []


def check_every_layer_attended(model, attended: set[int]) -> None:
    """After the packed forward: every decoder layer called the tree attention (`attended`: ids of the modules that
    did). A layer that did not mixed its tokens some other way, over the packed stream as one sequence."""
    layers = decoder_layers(model)
    missed = [i for i, layer in enumerate(layers) if not any(id(m) in attended for m in layer.modules())]
    if missed:
        kinds = sorted({type(layers[i]).__name__ for i in missed})
        raise RuntimeError(
            f"{type(model).__name__}: decoder layers {missed} ({', '.join(kinds)}) ran no attention through "
            "transformers' AttentionInterface, so they mixed tokens some other way, over the packed stream as one "
            "sequence, and the result is wrong; use impl='reference' for this model"
        )
