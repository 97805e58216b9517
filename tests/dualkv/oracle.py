"""Tiny config-built models and the independent oracle: the plain HF forward on each full sequence."""

from __future__ import annotations

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
