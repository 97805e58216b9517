"""Tiny config-built models and the independent oracle: the plain HF forward on each full sequence."""

from __future__ import annotations

import contextlib
import random

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hetrl.models import float64_norms

VOCAB = 97
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


def _use_float64_norms(model):
    """hetrl.models.float64_norms: the fp64 tests compare layouts, not HF's fp32 norms (see there)."""
    float64_norms(model)


def tiny_model(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(TINY | extra | overrides))).to(dtype)
    if dtype == torch.float64:
        _use_float64_norms(model)
    return model


def random_groups(seed: int, prompt_lens: list[int], response_lens: list[list[int]]):
    rng = random.Random(seed)
    return [([rng.randrange(VOCAB) for _ in range(p)], [[rng.randrange(VOCAB) for _ in range(r)] for r in rs])
            for p, rs in zip(prompt_lens, response_lens)]


def standard_logprobs(model, groups, temperature: float = 1.0, entropy: bool = False):
    """The oracle: each [prompt, response] run alone through the model's own forward."""
    out, ent = [], []
    for prompt, resps in groups:
        for r in resps:
            if len(r) == 0:
                continue
            ids = torch.tensor([list(prompt) + list(r)], device=model.device)
            logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1] / temperature
            logp_all = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
            out.append(logp_all.gather(-1, torch.tensor(r, device=model.device)[:, None]).squeeze(-1))
            ent.append(-(logp_all.exp() * logp_all).sum(-1))
    return (torch.cat(out), torch.cat(ent)) if entropy else torch.cat(out)


# -- any transformers family, built tiny from its config ------------------------------------------------------------

# The sizes every family is built at, each applied only where the config has the field (MLA, MoE and seq2seq-decoder
# families add their own in tests/dualkv/test_families.py). GQA: 4 query heads over 2 key/value heads.
TINY_ANY = dict(TINY, head_dim=16, max_position_embeddings=256, moe_intermediate_size=32, num_experts=4,
                num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, shared_expert_intermediate_size=32,
                n_shared_experts=1, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def tiny_config_model(model_cls, seed: int = 0, **overrides):
    """`model_cls` (a transformers causal LM) with random weights at TINY_ANY's sizes, fp64, in eval mode; an override
    of `...` drops a size the config computes itself. MoE experts run as plain loops (the grouped-GEMM kernel has no
    fp64)."""
    config_cls = model_cls.config_class
    defaults = config_cls()
    kwargs = {k: v for k, v in TINY_ANY.items() if hasattr(defaults, k)} | overrides
    config = config_cls(**{k: v for k, v in kwargs.items() if v is not ...})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float64).eval()
    if model._can_set_experts_implementation():
        model.set_experts_implementation("eager")
    float64_norms(model)
    return model


@contextlib.contextmanager
def fp64_inside():
    """Every fp32 cast inside the model computes in fp64 instead: transformers runs norms, MoE routers, rotary
    frequencies and some softmaxes in fp32 even in an fp64 model (hetrl.models.float64_norms covers Llama-style norms
    only), and the backward of such a cast rounds each standard-layout copy of a shared token's gradient separately
    but the packed sum once: a ~1e-7 difference that says nothing about the layouts. The fp64 tests compare layouts,
    so for their duration `Tensor.float/.to/.type(float32)` and `dtype=float32` of sum and softmax mean fp64."""
    T, F = torch.Tensor, torch.nn.functional

    def no_fp32(dtype):
        fp32 = dtype is torch.float32 or isinstance(dtype, str) and dtype in ("torch.FloatTensor", "torch.float32")
        return torch.float64 if fp32 else dtype

    def with_dtype(fn):
        def call(*args, **kwargs):
            if "dtype" in kwargs:
                kwargs["dtype"] = no_fp32(kwargs["dtype"])
            return fn(*args, **kwargs)
        return call

    saved = [(T, "float"), (T, "to"), (T, "type"), (T, "softmax"), (T, "log_softmax"), (F, "softmax"),
             (F, "log_softmax"), (torch, "softmax"), (torch, "sum")]
    originals = [getattr(owner, name) for owner, name in saved]
    to, type_ = T.to, T.type
    T.float = lambda self, *args, **kwargs: self.double()
    T.to = lambda self, *args, **kwargs: to(self, *(no_fp32(a) for a in args),
                                            **{k: no_fp32(v) if k == "dtype" else v for k, v in kwargs.items()})
    T.type = lambda self, dtype=None, *args, **kwargs: (type_(self) if dtype is None
                                                         else type_(self, no_fp32(dtype), *args, **kwargs))
    for owner, name in saved[3:]:
        setattr(owner, name, with_dtype(getattr(owner, name)))
    try:
        yield
    finally:
        for (owner, name), fn in zip(saved, originals):
            setattr(owner, name, fn)
