"""Tiny config-built models and the independent oracle: the plain HF forward on each full sequence."""

from __future__ import annotations

import random

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

VOCAB = 97
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, attention_dropout=0.0)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}


class Float64RMSNorm(torch.nn.Module):
    """HF's RMSNorms compute in fp32 even on fp64 inputs, so their backward rounds each prompt copy's
    gradient to fp32 separately in the standard layout but the N-fold sum once in the packed one: a
    ~1e-7 relative difference that says nothing about the layouts. fp64 tests use this in-dtype norm in
    both layouts so that they compare the layouts alone."""

    def __init__(self, norm):
        super().__init__()
        self.weight = norm.weight
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _use_float64_norms(model):
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child).__name__.endswith("RMSNorm"):
                setattr(module, child_name, Float64RMSNorm(child))


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
