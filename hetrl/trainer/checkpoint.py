"""Checkpoints that survive a crash mid-write: written under a temporary name, then renamed into place.

A checkpoint directory holds the policy (safetensors + config), the tokenizer, the run config,
and `trainer_state.pt` (optimizer state, step, data-stream position, RNG states), loaded back
with `torch.load(..., weights_only=True)`. `checkpoints/latest` names the newest one and is
itself replaced atomically, so it never points at a half-written directory.
"""

from __future__ import annotations

import os
import pathlib
import random
import shutil

import numpy as np
import torch
import yaml
from transformers.utils import logging as hf_logging


def _rng_state() -> dict:
    py = random.getstate()
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]]}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy(), *rest))


def save(run_dir: pathlib.Path, step: int, model, tokenizer, optimizer, extra: dict, config: dict) -> pathlib.Path:
    ckpt_root = run_dir / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    hf_logging.disable_progress_bar()  # a bar per checkpoint would bury the training bar
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    (tmp / "run_config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng": _rng_state(), **extra},
               tmp / "trainer_state.pt")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / ".latest.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, ckpt_root / "latest")
    return final


def latest(run_dir: pathlib.Path) -> pathlib.Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if path.is_dir() else None


def load(path: pathlib.Path, model, optimizer) -> dict:
    """Restore the policy weights, optimizer state and RNG from `path`; returns the trainer state."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(path.glob("*.safetensors")):
        weights.update(load_file(f))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = {k for k in missing if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    state = torch.load(path / "trainer_state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    return state
