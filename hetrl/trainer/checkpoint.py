"""Checkpoints that survive a crash at any moment and never write outside out_dir.

A checkpoint directory `checkpoints/step_NNNNNN` holds the policy (safetensors + config; a LoRA run: the adapter
in peft's format), the tokenizer,
the run config, `trainer_state.pt` (optimizer state, step, data-stream position, RNG states; loaded back
with `torch.load(..., weights_only=True)`), a PPO run's `critic.pt` (the critic's weights, value head and
optimizer state; written by whichever process holds the critic, `stage`d under a hidden name and moved in
before the manifest) and `manifest.json` (every file's size and SHA-256, written
last). It is written under a fresh hidden name created exclusively (a planted file or symlink is never
followed) and renamed into place; a checkpoint of the same step is moved aside, not deleted, until its
replacement is in place. `checkpoints/latest` names the newest one; it may only name a `step_NNNNNN`
directory inside `checkpoints/`. On resume, a checkpoint that is missing, truncated or altered (its
manifest disagrees) is skipped for the newest intact one, renamed `step_NNNNNN.unreadable` for
inspection, and the fallback is said.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import pickle
import random
import re
import shutil
import tempfile

import numpy as np
import torch
import yaml
from transformers.utils import logging as hf_logging

from hetrl.fsmode import as_open_would
from hetrl.trainer import files

MANIFEST = "manifest.json"
STATE = "trainer_state.pt"
CRITIC = "critic.pt"
_PENDING = re.compile(r"\.pending\..+")
CONFIG = "run_config.yaml"
_NAME = re.compile(r"step_(\d{6})")
_TEMP = re.compile(r"\.step_\d{6}\..+")


def resume_command(cfg) -> str:
    """The command that continues the run of RunConfig `cfg` from its latest intact checkpoint: from Python with
    the same arguments where the run was given data, rewards or tools from Python (the command line has none)."""
    from hetrl.trainer.config import from_python

    passed = from_python(cfg)
    if passed:
        return f"hetrl.train(..., {', '.join(f'{a}=...' for a in passed)}, out_dir={cfg.out_dir!r}, resume=True)"
    return f"hetrl train --resume out_dir={cfg.out_dir}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (missing, truncated, altered files)."""


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


def _digest(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())    # on disk before the directory is renamed into place
    return h.hexdigest()


def _write_manifest(folder: pathlib.Path, step: int) -> None:
    entries = {p.name: {"bytes": p.stat().st_size, "sha256": _digest(p)}
               for p in sorted(folder.iterdir()) if p.is_file() and not p.is_symlink()}
    files.write_text(folder / MANIFEST, json.dumps({"step": step, "files": entries}, indent=1))


def _clean_stale_temps(root: pathlib.Path, keep: set[str]) -> None:
    """Hidden directories left by a save that was killed (or a replaced checkpoint not yet removed), and staged
    files no save took in (other than those of this save, `keep`)."""
    for p in root.iterdir():
        if _TEMP.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        elif _PENDING.fullmatch(p.name) and p.name not in keep and (p.is_file() or p.is_symlink()):
            p.unlink(missing_ok=True)


def stage(run_dir: pathlib.Path, name: str, state: dict) -> pathlib.Path:
    """Write `state` (tensors and plain values) for the next `save` to take in as file `name`, from a process other
    than the one that saves (the Ray executor's critic actor): `checkpoints/.pending.<name>.<random>`, created
    exclusively. -> its path, for `save(..., staged={name: path})`."""
    root = files.real_subdir(pathlib.Path(run_dir), "checkpoints")
    fd, path = tempfile.mkstemp(dir=root, prefix=f".pending.{name}.")   # its mode is set where save() takes it in
    with os.fdopen(fd, "wb") as f:
        torch.save(state, f)
    return pathlib.Path(path)


def read_staged(path: pathlib.Path, name: str) -> dict:
    """File `name` of the checkpoint at `path`, as `stage` wrote it (loaded with weights_only=True)."""
    try:
        with open(pathlib.Path(path) / name, "rb") as f:
            return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {name}") from None
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as e:
        raise CheckpointError(f"checkpoint {path}: {name} cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None


def save(run_dir: pathlib.Path, step: int, model, tokenizer, optimizer, extra: dict, config: dict, *,
         gathered: tuple[dict, dict] | None = None, staged: dict[str, pathlib.Path] | None = None) -> pathlib.Path:
    """`gathered`: (model state dict, optimizer state dict) gathered from sharded learners, saved instead of the
    model's and the optimizer's own (same files, same format). `staged`: {file name: path from `stage`}, files
    moved into the checkpoint."""
    root = files.real_subdir(pathlib.Path(run_dir), "checkpoints")
    staged = {name: pathlib.Path(p) for name, p in (staged or {}).items()}
    for fname, p in staged.items():
        if p.parent.resolve() != root.resolve() or not _PENDING.fullmatch(p.name) or p.is_symlink() or \
                not p.is_file() or fname in (STATE, CONFIG, MANIFEST) or "/" in fname:
            raise ValueError(f"checkpoint: {p} is not a file staged for this run's checkpoints (checkpoint.stage)")
    _clean_stale_temps(root, {p.name for p in staged.values()})
    name = f"step_{step:06d}"
    tmp = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=f".{name}."))   # fresh and exclusive
    try:
        hf_logging.disable_progress_bar()  # a bar per checkpoint would bury the training bar
        try:
            model.save_pretrained(tmp, safe_serialization=True, **({"state_dict": gathered[0]} if gathered else {}),
                                  **_adapter_options(model))
        finally:
            hf_logging.enable_progress_bar()
        tokenizer.save_pretrained(tmp)
        files.write_text(tmp / CONFIG, yaml.safe_dump(config, sort_keys=False))
        with open(tmp / STATE, "xb") as f:
            torch.save({"step": step, "optimizer": gathered[1] if gathered else optimizer.state_dict(),
                        "rng": _rng_state(), **extra}, f)
        for fname, p in staged.items():
            os.replace(p, tmp / fname)
        _write_manifest(tmp, step)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)   # a half-written checkpoint would hold the space it ran out of
        if _out_of_space(e):
            raise OSError(errno.ENOSPC, f"no space left on the device writing checkpoint {name} (the earlier "
                          "checkpoints are intact); free space and resume the run with --resume", str(root)) from e
        raise
    final = _put_in_place(tmp, root / name)
    files.write_text(root / "latest", name + "\n")
    _remove_replaced(root, name)
    return final


EMBEDDINGS = ("embed_tokens", "lm_head")   # peft's EMBEDDING_LAYER_NAMES among the modules LoRA can target here


def _adapter_options(model) -> dict:
    """A peft adapter's save options: its embedding layers saved only where LoRA targets them. peft's default
    ("auto") looks for the base model's config.json by the model's name, on the Hub where it is not a local folder,
    and warns that it could not find one for the embedded model (read from a package, offline)."""
    config = getattr(model, "peft_config", {}).get("default")
    if config is None:
        return {}
    targets = config.target_modules or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    return {"save_embedding_layers": any(t in EMBEDDINGS for t in targets)}


def _out_of_space(e: BaseException | None) -> bool:
    """Whether `e` or what it was raised from is a full disk or quota (torch.save reports one as a RuntimeError
    raised while handling the OSError)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        e = e.__cause__ or e.__context__
    return False


def _put_in_place(tmp: pathlib.Path, final: pathlib.Path) -> pathlib.Path:
    """Rename directory `tmp` to `final`. An existing `final` (the same step saved again after a fallback) is moved
    aside first and kept until `_remove_replaced`, so at no moment is there neither. Its files and folders get
    the mode open() and mkdir() would give them (mkdtemp's 0700, and the 0600 some writers use, would hide the
    checkpoint from other users)."""
    for p in [tmp, *tmp.rglob("*")]:
        if not p.is_symlink():
            as_open_would(p, directory=p.is_dir())
    if os.path.lexists(final):
        if final.is_symlink() or not final.is_dir():
            os.unlink(final)
        else:
            os.replace(final, pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.replaced.")))
    os.replace(tmp, final)
    return final


def _remove_replaced(root: pathlib.Path, name: str) -> None:
    for p in root.glob(f".{name}.replaced.*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def problem(path: pathlib.Path) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from, or None when it is intact."""
    if path.is_symlink() or not path.is_dir():
        return "not a directory"
    for need in (STATE, CONFIG):
        if not (path / need).is_file():
            return f"{need} is missing"
    if not list(path.glob("*.safetensors")):
        return "no *.safetensors weights"
    manifest = path / MANIFEST
    if not manifest.is_file():
        return None   # written before manifests existed: the load itself will tell
    try:
        entries = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST} is unreadable ({e})"
    for fname, want in entries.items():
        f = path / fname
        if not f.is_file() or f.is_symlink():
            return f"{fname} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{fname} has {f.stat().st_size} bytes, {want['bytes']} were written"
        if _digest(f) != want["sha256"]:
            return f"{fname} differs from what was written (SHA-256)"
    return None


def _candidates(root: pathlib.Path) -> list[pathlib.Path]:
    """The directory `latest` names (if it names a step directory inside `root`), then every step directory,
    newest first."""
    steps = sorted((p for p in root.iterdir() if _NAME.fullmatch(p.name)), key=lambda p: p.name, reverse=True)
    pointer = root / "latest"
    first = []
    if pointer.is_file() and not pointer.is_symlink():
        named = pointer.read_text(errors="replace").strip()
        if _NAME.fullmatch(named):
            first = [root / named]
    return first + [p for p in steps if p not in first]


def any_saved(run_dir: pathlib.Path) -> bool:
    """Whether the run in `run_dir` has written a checkpoint (intact or not; `*.unreadable` ones set aside do
    not count)."""
    root = pathlib.Path(run_dir) / "checkpoints"
    return root.is_dir() and not root.is_symlink() and any(_NAME.fullmatch(p.name) for p in root.iterdir())


def keep_newest(run_dir: pathlib.Path, keep: int) -> list[pathlib.Path]:
    """Delete all but the newest `keep` step checkpoints of the run in `run_dir` (`keep_checkpoints`), after a save:
    the newest is the one just written and named by `latest`, so a resume point always remains. Set-aside
    `*.unreadable` ones and anything that is not a step directory are left alone. -> the deleted paths."""
    root = pathlib.Path(run_dir) / "checkpoints"
    if keep < 1 or root.is_symlink() or not root.is_dir():
        return []
    steps = sorted((p for p in root.iterdir() if _NAME.fullmatch(p.name) and p.is_dir() and not p.is_symlink()),
                   key=step_of)
    old = steps[:-keep]
    for p in old:
        shutil.rmtree(p)
    return old


def step_of(path: pathlib.Path) -> int:
    """The training step a `step_NNNNNN` checkpoint was written after."""
    return int(_NAME.fullmatch(pathlib.Path(path).name).group(1))


def latest(run_dir: pathlib.Path, say=print) -> pathlib.Path | None:
    """The newest intact checkpoint of the run in `run_dir` (what `latest` names, else the newest intact step
    directory), or None. Unreadable ones are renamed `*.unreadable` and reported through `say`."""
    root = pathlib.Path(run_dir) / "checkpoints"
    if root.is_symlink() or not root.is_dir():
        return None
    for path in _candidates(root):
        why = problem(path) if os.path.lexists(path) else "missing"
        if why is None:
            return path
        say(f"checkpoint {path} cannot be resumed from ({why}); trying the previous one")
        if os.path.lexists(path) and not path.is_symlink():
            os.replace(path, path.with_name(path.name + ".unreadable"))
    return None


def read(path: pathlib.Path) -> tuple[dict, dict]:
    """(weights, trainer state) of the checkpoint at `path`, read in full before anything is applied."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = {}
        for f in sorted(path.glob("*.safetensors")):
            weights.update(load_file(f))
        with open(path / STATE, "rb") as f:
            state = torch.load(f, weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError) as e:
        raise CheckpointError(f"checkpoint {path} cannot be read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None
    return weights, state


def saved_config(path: pathlib.Path) -> dict:
    """The run config a checkpoint was written with."""
    data = yaml.safe_load((path / CONFIG).read_text())
    if not isinstance(data, dict):
        raise CheckpointError(f"{path / CONFIG} does not hold a run config")
    return data


def save_merged(run_dir: pathlib.Path, model, tokenizer) -> pathlib.Path:
    """`run_dir/merged`: a LoRA run's final policy with the adapter merged in, as a plain transformers model
    directory (written under a fresh name and renamed into place; an older one is replaced only then)."""
    run_dir = pathlib.Path(run_dir)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=run_dir, prefix=".merged."))
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(tmp)
    final = _put_in_place(tmp, run_dir / "merged")
    _remove_replaced(run_dir, "merged")
    return final


def _load_adapter(path: pathlib.Path, peft_model, weights: dict) -> None:
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(peft_model, weights)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(f"checkpoint {path} does not match the model's LoRA adapter (lora_rank, lora_target_modules): "
                         f"missing {missing[:4]}, unexpected {list(result.unexpected_keys)[:4]}")


def load(path: pathlib.Path, model, optimizer) -> dict:
    """Restore the policy weights (a peft model: its adapter), optimizer state and RNG from `path`; returns the
    trainer state. An FSDP2-sharded model takes its shards of the full states, a ZeRO-1 rank its partition of the
    optimizer's (every rank calls this)."""
    weights, state = read(path)
    from hetrl.trainer import sharding

    if hasattr(model, "peft_config"):
        _load_adapter(path, model, weights)
        sharding.load_optimizer(optimizer, state["optimizer"])
    elif sharding.is_sharded(model):
        _check_keys(path, model, *sharding.load_full_state(model, weights))
        sharding.load_optimizer_state(model, optimizer, state["optimizer"])
    else:
        _load_weights(path, model, weights)
        sharding.load_optimizer(optimizer, state["optimizer"])
    _set_rng_state(state["rng"])
    return state


def _load_weights(path: pathlib.Path, model, weights: dict) -> None:
    _check_keys(path, model, *model.load_state_dict(weights, strict=False))
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def _check_keys(path: pathlib.Path, model, missing, unexpected) -> None:
    tied = {k for k in missing if getattr(model.config, "tie_word_embeddings", False) and "lm_head" in k}
    if set(missing) - tied or unexpected:
        raise ValueError(f"checkpoint {path} does not match the model: missing {sorted(set(missing) - tied)}, "
                         f"unexpected {sorted(unexpected)}")
