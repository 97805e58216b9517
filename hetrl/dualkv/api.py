"""Log-probs of a Hugging Face causal LM over a packed tree batch: `sequence_logprobs` (any TreeBatch from
pack_sequences) and `shared_prompt_logprobs` (the depth-one PackedBatch from pack_groups) are one code path.

The model runs once on the packed stream (batch 1, shared position ids, no KV cache). Its
attention goes through transformers' AttentionInterface under a name registered here, with a
matching AttentionMaskInterface entry that builds the shared-prompt mask once per forward (not
once per layer). The model's own attention implementation is switched only for the duration
of the call and restored afterwards, even on error (with activation checkpointing on, the backward
re-runs each layer's forward after the call has returned, so the model stays on hetrl's attention:
the recompute receives the same shared-prompt layout object as its mask and takes the DualKV path,
and every other call, such as generation, is handed to the model's own implementation, remembered
per config). The LM head runs only on the rows that
predict response tokens (`logits_to_keep`), and log-probs are gathered without materialising
a second [rows, vocab] tensor; when those logits would be large, the head and the log-softmax run
in row chunks recomputed in the backward (written by hand: torch has no fused linear + log-softmax
gather with a recomputing backward; Liger's fused linear cross-entropy computes a loss, not per-token
log-probs that feed a PPO ratio).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import sys
import weakref
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from . import support
from .impl import flex, reference, sdpa
from .packing import TreeBatch

log = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "sdpa", "flex")
_ATTN_NAME = {"sdpa": "hetrl_dualkv_sdpa", "flex": "hetrl_dualkv_flex"}


@dataclass
class _Active:
    """What the registered attention/mask functions need during one packed forward."""

    batch: TreeBatch
    impl: str
    max_context: int
    model_name: str = "the model"
    mask: object = None
    calls: int = 0
    attended: set = field(default_factory=set)      # ids of the attention modules that called the tree attention


@dataclass(frozen=True)
class _Layout:
    """What transformers hands a layer as its attention mask: the forward's `_Active`, and why the mask the model
    asked for cannot be packed (`problem`, None if it can). A model may build masks its layers never use (Qwen2-MoE
    builds a sliding-window one with no sliding layer), so the problem is raised when a layer attends with it. A
    model that uses its mask as a tensor itself (adds it to scores, reads its dtype) instead of only handing it to
    its attention function gets a clear error from it, not a stray AttributeError."""

    active: _Active
    problem: str | None = None

    def _misuse(self, what: str) -> str:
        return (f"{self.active.model_name} uses its attention mask as a tensor itself ({what}) instead of only "
                "handing it to its attention function; DualKV hands it a tree layout, not a [T, T] mask, so it "
                "cannot run this model. Use impl='reference' (each sequence run alone)")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(self._misuse(f"reads .{name}"))

    def __getitem__(self, index):
        raise TypeError(self._misuse("indexes it"))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        layout = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, cls))
        raise TypeError(layout._misuse(f"passes it to {getattr(func, '__name__', func)}"))

    def _arithmetic(self, *_):
        raise TypeError(self._misuse("does arithmetic with it"))

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __and__ = __rand__ = __or__ = __ror__ = _arithmetic


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar("hetrl_dualkv_active", default=None)
# id(config) -> (weak reference to it, the model's own attention implementation), for models left on hetrl's
# attention (activation checkpointing): their calls outside shared_prompt_logprobs go there. Configs are not
# hashable, hence ids, each entry removed when its config is collected.
_OWN_IMPL: dict[int, tuple[weakref.ref, str]] = {}


def _own_impl(config) -> str | None:
    entry = _OWN_IMPL.get(id(config))
    return entry[1] if entry is not None and entry[0]() is config else None


def _remember_own_impl(config, impl: str) -> None:
    key = id(config)
    _OWN_IMPL[key] = (weakref.ref(config, lambda _: _OWN_IMPL.pop(key, None)), impl)


def _mask_interface(**kwargs) -> _Layout:
    """Called by transformers once per forward (per mask type); builds our mask once and hands it on."""
    active = _ACTIVE.get()
    if active is None:
        own = _own_impl(kwargs.get("config"))
        if own is not None:       # a checkpointed model's own call (e.g. generate): its own mask
            return ALL_MASK_ATTENTION_FUNCTIONS[own](**kwargs)
        raise RuntimeError(
            "a model is set to a hetrl DualKV attention implementation outside shared_prompt_logprobs(); "
            "call the model through hetrl.dualkv.shared_prompt_logprobs or set its attention back"
        )
    problem = support.mask_problem(active.model_name, kwargs, active.max_context)
    if active.mask is None:
        active.mask = (sdpa.build_masks(active.batch) if active.impl == "sdpa"
                       else flex.build_block_mask(active.batch))
    return _Layout(active, problem)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """AttentionInterface entry: query [1, H, T, d], key/value [1, H_kv, T, d] -> ([1, T, H, d], None)."""
    if not isinstance(attention_mask, _Layout):
        own = _own_impl(module.config)
        if own is not None:       # a checkpointed model's own call: its own attention
            eager = sys.modules[type(module).__module__].eager_attention_forward
            return ALL_ATTENTION_FUNCTIONS.get_interface(own, eager)(
                module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        inside = _ACTIVE.get()
        if inside is not None:
            raise ValueError(
                f"{inside.model_name}'s {type(module).__name__} got an attention mask of its own "
                f"({type(attention_mask).__name__}), not the tree layout transformers' mask interface hands out: it "
                "builds or changes its mask itself, so DualKV cannot give it the packed layout; use impl='reference'")
        raise RuntimeError(
            "hetrl DualKV attention got no shared-prompt layout (attention_mask is "
            f"{type(attention_mask).__name__}); call the model through hetrl.dualkv.shared_prompt_logprobs"
        )
    active = attention_mask.active
    if attention_mask.problem is not None:
        raise ValueError(attention_mask.problem)
    if query.shape[0] != 1:
        raise ValueError(f"the packed stream has batch size 1, got query of shape {tuple(query.shape)}")
    support.check_attention_call(module, dropout, kwargs, active.max_context)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if active.impl == "sdpa":
        out = sdpa.attend(query, key, value, active.mask, active.batch.tree_bounds, scale)
    else:
        out = flex.attend(query, key, value, active.mask, scale)
    active.calls += 1
    active.attended.add(id(module))
    return out.transpose(1, 2).contiguous(), None


for _impl, _name in _ATTN_NAME.items():
    AttentionInterface.register(_name, _attention)
    AttentionMaskInterface.register(_name, _mask_interface)


@contextlib.contextmanager
def _attention_implementation(model: PreTrainedModel, name: str, keep: bool = False):
    """The model on hetrl's attention `name` for the call; with `keep` (activation checkpointing: the backward
    re-runs the layers later) it stays there, its own implementation remembered for its other calls."""
    original = model.config._attn_implementation
    if keep:
        configs = {id(c): c for c in [model.config, *(m.config for m in model.modules()
                                                        if isinstance(getattr(m, "config", None), type(model.config)))]}
        for c in configs.values():
            if c._attn_implementation not in _ATTN_NAME.values():
                _remember_own_impl(c, c._attn_implementation)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        if not keep:
            model.set_attn_implementation(original)


def _resolve_impl(impl: str, device: torch.device, needs_grad: bool) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        chosen = "flex" if device.type == "cuda" else "sdpa"
        log.info("shared_prompt_logprobs: impl='auto' chose %r on %s", chosen, device.type)
        return chosen
    if impl == "flex" and device.type == "cpu" and needs_grad:
        raise ValueError(
            "impl='flex' cannot run here: torch refuses FlexAttention backward on CPU, and this call "
            "tracks gradients. Use impl='sdpa' (exact, CPU default), or call under torch.no_grad() "
            "for a forward-only pass"
        )
    return impl


def _token_logprobs(logits: torch.Tensor, row_of_label: torch.Tensor, labels: torch.Tensor,
                    temperature: float, return_entropy: bool):
    """logits [U, V], row_of_label [K], labels [K] -> logp [K] (and entropy [K], with its gradient).
    Computed in fp32 at least (bf16 logits are promoted chunk by chunk, never as a whole [U, V] copy)."""
    logp, entropy = _GatheredLogSoftmax.apply(logits, row_of_label, labels, float(temperature), return_entropy)
    return (logp, entropy[row_of_label]) if return_entropy else logp


# Rows of [U, V] logits the log-softmax works through at once: about this many bytes of fp32, so that the several
# elementwise passes over a chunk (scale, max, exp, sums) run in cache instead of each streaming all [U, V] through
# memory. 3 MiB was the fastest chunk measured (benchmarks/README.md, "Numbers behind constants in the code").
CACHE_CHUNK_BYTES = 3 << 20


def _scaled_rows(z: torch.Tensor, c: int, rows: int, work: torch.dtype, inv: float) -> torch.Tensor:
    """z[c:c + rows] / T as a new tensor in `work` (fp32 at least): one pass, the cast and the scale together."""
    chunk = z[c:c + rows]
    return chunk.to(work).mul_(inv) if chunk.dtype != work else chunk * inv


class _GatheredLogSoftmax(torch.autograd.Function):
    """log-softmax(z / T)[row_of_label, labels] without a [U, V] log-softmax tensor or its gradient, and
    (when asked) each row's entropy from the same scaled logits, with its gradient (an entropy bonus):
    dH/dz_j = -p_j (log p_j + H) / T, added in the same pass over each chunk.

    autograd through logsumexp + advanced indexing costs ~8 passes over [U, V] in the backward (two
    zero fills, an index_put, the logsumexp grad, their sum, a copy); this one writes the gradient in
    one pass per row chunk (scale, subtract, exp and multiply while the chunk is in cache) plus a
    K-element scatter, and the forward likewise works chunk by chunk (CACHE_CHUNK_BYTES). z stays in its
    own dtype (bf16 logits are not copied to fp32 whole); the arithmetic is fp32 at least, and the
    gradient comes back in z's dtype (what autograd's cast back to bf16 would give).
    """

    @staticmethod
    def forward(ctx, z, row_of_label, labels, temperature: float, with_entropy: bool):
        work = torch.promote_types(z.dtype, torch.float32)
        inv = 1.0 / temperature
        rows = max(1, CACHE_CHUNK_BYTES // (4 * max(1, z.shape[-1])))
        lse = torch.empty(z.shape[0], dtype=work, device=z.device)
        entropy = torch.empty_like(lse) if with_entropy else lse.new_empty(0)
        for c in range(0, z.shape[0], rows):
            zt = _scaled_rows(z, c, rows, work, inv)
            m = torch.logsumexp(zt, dim=-1)
            lse[c:c + rows] = m
            if with_entropy:
                entropy[c:c + rows] = m - (zt - m[:, None]).exp_().mul_(zt).sum(-1)
        logp = z[row_of_label, labels].to(work) * inv - lse[row_of_label]
        ctx.save_for_backward(z, row_of_label, labels, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        ctx.set_materialize_grads(False)   # an entropy only logged has no gradient to add
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        z, row_of_label, labels, lse, entropy = ctx.saved_tensors
        inv, rows = 1.0 / ctx.temperature, ctx.rows
        if grad_logp is None:
            grad_logp = torch.zeros(labels.shape, dtype=lse.dtype, device=lse.device)
        g_row = torch.zeros_like(lse).index_add_(0, row_of_label, grad_logp)   # a row may predict several labels
        scale = g_row.mul_(-inv)                                                  # d logp / dz = (onehot - softmax) / T
        onehot = grad_logp.to(lse.dtype) * inv
        g_ent = None if grad_entropy is None else grad_entropy.to(lse.dtype) * -inv   # dH/dz = -p (log p + H) / T
        order = torch.argsort(row_of_label, stable=True)      # the labels of each chunk's rows, for its scatter
        sorted_rows = row_of_label[order]
        bounds = torch.searchsorted(sorted_rows, torch.arange(0, z.shape[0] + rows, rows, device=z.device)).tolist()
        dz = torch.empty_like(z)
        for i, c in enumerate(range(0, z.shape[0], rows)):
            zt = _scaled_rows(z, c, rows, lse.dtype, inv)
            if g_ent is None:
                zt.sub_(lse[c:c + rows, None]).exp_().mul_(scale[c:c + rows, None])
            else:
                log_p = zt.sub_(lse[c:c + rows, None])
                p = log_p.exp()
                bonus = log_p.add_(entropy[c:c + rows, None]).mul_(p).mul_(g_ent[c:c + rows, None])
                zt = p.mul_(scale[c:c + rows, None]).add_(bonus)
            k = order[bounds[i]:bounds[i + 1]]
            zt.index_put_((row_of_label[k] - c, labels[k]), onehot[k], accumulate=True)   # in fp32, then one rounding
            dz[c:c + rows] = zt
        return dz, None, None, None, None


# Above this many bytes of [rows, vocab] logits, the LM head and the log-softmax run in row chunks that are
# recomputed in the backward (_ChunkedLogProbs), so no [rows, vocab] tensor is kept for autograd. Below it
# the single pass is faster (no recompute). A chunk is CHUNK_BYTES of fp32 logits: each one recomputes its rows'
# head GEMM in the backward and accumulates the head's gradient in place, so small chunks at a large vocabulary
# cost GEMM efficiency and a pass over the [V, D] gradient apiece (4 GEMMs against 3 is the floor of recomputing).
# Both sizes were measured: benchmarks/README.md, "Numbers behind constants in the code".
CHUNK_LOGITS_ABOVE_BYTES = 256 << 20
CHUNK_BYTES = 128 << 20


class _ChunkedLogProbs(torch.autograd.Function):
    """log-softmax(h W^T + b)[label] / T per row, chunk by chunk; the backward recomputes each chunk's logits.

    h [K, D] (the hidden state that predicts each label), weight [V, D], bias [V] or None, labels [K]
    -> logp [K] and entropy [K] (empty unless with_entropy; with its gradient, as _GatheredLogSoftmax's).
    """

    @staticmethod
    def forward(ctx, h, weight, bias, labels, temperature: float, chunk: int, with_entropy: bool):
        logp, entropy, lse = [], [], []
        with torch.no_grad():
            for c in range(0, h.shape[0], chunk):
                z = _scaled_logits(h[c:c + chunk], weight, bias, temperature)
                m = torch.logsumexp(z, dim=-1)
                logp.append(z.gather(1, labels[c:c + chunk, None]).squeeze(1) - m)
                if with_entropy:
                    p_times_z = torch.softmax(z, dim=-1).mul_(z)       # one more [chunk, V] buffer, not two
                    entropy.append(m - p_times_z.sum(-1))
                lse.append(m)
        out_entropy = torch.cat(entropy) if with_entropy else h.new_zeros(0)
        ctx.save_for_backward(h, weight, bias, labels, torch.cat(lse), out_entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)   # an entropy only logged has no gradient to add
        return torch.cat(logp), out_entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        h, weight, bias, labels, lse, entropy = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros(labels.shape, dtype=lse.dtype, device=lse.device)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias) if bias is not None and ctx.needs_input_grad[2] else None
        for c in range(0, h.shape[0], ctx.chunk):
            hc, g = h[c:c + ctx.chunk], grad_logp[c:c + ctx.chunk, None]
            dz = _scaled_logits(hc, weight, bias, ctx.temperature)      # in place from here: one buffer
            if grad_entropy is None:
                dz.sub_(lse[c:c + ctx.chunk, None]).exp_().mul_(-g)      # d logp / dz = onehot - softmax
            else:                                                        # + dH/dz = -p (log p + H)
                log_p = dz.sub_(lse[c:c + ctx.chunk, None])
                p = log_p.exp()
                bonus = log_p.add_(entropy[c:c + ctx.chunk, None]).mul_(p).mul_(-grad_entropy[c:c + ctx.chunk, None])
                dz = p.mul_(-g).add_(bonus)
            dz.scatter_add_(1, labels[c:c + ctx.chunk, None], g)
            if ctx.temperature != 1.0:
                dz.div_(ctx.temperature)
            dz = dz.to(weight.dtype)
            if grad_h is not None:
                grad_h[c:c + ctx.chunk] = dz @ weight
            if grad_w is not None:       # accumulated inside the GEMM: no [V, D] temporary per chunk
                grad_w.addmm_(dz.T, hc)
            if grad_b is not None:
                grad_b += dz.sum(0)
        return grad_h, grad_w, grad_b, None, None, None, None


def _scaled_logits(h, weight, bias, temperature: float) -> torch.Tensor:
    z = torch.nn.functional.linear(h, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


def sequence_logprobs(model, batch: TreeBatch, *, impl: str = "auto", temperature: float = 1.0,
                      return_entropy: bool = False):
    """Per sequence of `batch`, log π(token_t | tokens_<t) of its labelled tokens (t = 1..L-1 without loss masks),
    exactly as running each sequence alone gives; every shared token computed once.

    Args:
      model, impl, temperature, return_entropy: as for `shared_prompt_logprobs`.
      batch: from `pack_sequences` (or `pack_groups`: per response); moved to the model's device.

    Returns:
      a list of S 1-D tensors, one per sequence in input order (with return_entropy, a list of (logp, entropy)
      pairs). They are views of one packed tensor: a token shared by several sequences is one computed row, and
      the gradient through it is the sum of every sequence's term.
    """
    out = shared_prompt_logprobs(model, batch, impl=impl, temperature=temperature, return_entropy=return_entropy)
    if return_entropy:
        return list(zip(batch.split_sequences(out[0]), batch.split_sequences(out[1])))
    return batch.split_sequences(out)


def shared_prompt_logprobs(model, batch: TreeBatch, *, impl: str = "auto", temperature: float = 1.0,
                           return_entropy: bool = False):
    """Log π(token | prefix) of every response token of `batch`, exactly as the standard layout gives.

    Args:
      model: a Hugging Face causal LM whose attention goes through AttentionInterface.
      batch: from `pack_groups` (or any TreeBatch: its labels); moved to the model's device.
      impl: "auto" (flex on CUDA, sdpa elsewhere), "reference", "sdpa" or "flex".
      temperature: logits are divided by it before the softmax (> 0).
      return_entropy: also return the entropy of each predicting row's distribution (with its gradient).

    Returns:
      logp [K] (autograd-enabled when grad is on), K = total response tokens (labels), ordered group by
      group, response by response, token by token (sequence by sequence for a TreeBatch); with return_entropy,
      (logp [K], entropy [K]).
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    batch, impl, needs_grad, device = _prepare(model, batch, impl)
    dtype = model.get_input_embeddings().weight.dtype
    if batch.labels.numel() == 0:
        empty = torch.zeros(0, dtype=torch.promote_types(dtype, torch.float32), device=device)
        return (empty, empty.clone()) if return_entropy else empty

    if impl == "reference":
        logits = reference.standard_logits(model, batch)
        row_of_label = torch.arange(batch.labels.numel(), device=device)
    else:
        head = support.plain_lm_head(model)
        vocab_out = head.out_features if head is not None else 0
        chunked = head is not None and batch.labels.numel() * vocab_out * 4 > CHUNK_LOGITS_ABOVE_BYTES
        out = _packed_forward(model, batch, impl, needs_grad, decoder_only=chunked)
        if chunked:
            h = out.last_hidden_state[0][batch.logit_rows[batch.row_of_label]]
            chunk = max(1, CHUNK_BYTES // (vocab_out * 4))
            logp, entropy = _ChunkedLogProbs.apply(h, head.weight, head.bias, batch.labels, float(temperature), chunk,
                                                   return_entropy)
            return (logp, entropy) if return_entropy else logp
        logits = out.logits.squeeze(0)                   # a view: select() would zero-fill a [U, V] grad
        if logits.shape[0] != batch.logit_rows.numel():  # a model without logits_to_keep: every row's logits
            logits = logits[batch.logit_rows]
        row_of_label = batch.row_of_label
    return _token_logprobs(logits, row_of_label, batch.labels, temperature, return_entropy)


def _packed_forward(model, batch: TreeBatch, impl: str, needs_grad: bool, decoder_only: bool):
    """The model (or only its decoder) once on the packed stream under hetrl's tree attention; checks
    that every layer's attention went through it. An all-ones attention mask says "no padding" (what each sequence
    alone has) and keeps transformers from reading the stream's restarting position ids as packed documents, so the
    mask functions the model asks for reach `support.mask_problem` as they are."""
    active = _Active(batch=batch, impl=impl, max_context=batch.max_context, model_name=type(model).__name__)
    token = _ACTIVE.set(active)
    checkpointed = needs_grad and model.training and getattr(model, "is_activation_checkpointing", False)
    inputs = dict(input_ids=batch.input_ids[None], position_ids=batch.position_ids[None],
                  attention_mask=torch.ones_like(batch.input_ids)[None], use_cache=False)
    try:
        with _attention_implementation(model, _ATTN_NAME[impl], keep=checkpointed):
            if decoder_only:
                out = support.decoder_of(model)(**inputs)
            elif support.takes(type(model), "logits_to_keep"):
                out = model(**inputs, logits_to_keep=batch.logit_rows)
            else:
                out = model(**inputs)
    finally:
        _ACTIVE.reset(token)
    support.check_every_layer_attended(model, active.attended)
    return out


def _prepare(model, batch: TreeBatch, impl: str):
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a Hugging Face PreTrainedModel, got {type(model).__name__}")
    if not isinstance(batch, TreeBatch):
        raise TypeError(f"batch must be a PackedBatch from pack_groups() or a TreeBatch from pack_sequences(), "
                        f"got {type(batch).__name__}")
    device = model.get_input_embeddings().weight.device
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters())
    impl = _resolve_impl(impl, device, needs_grad)
    vocab = model.get_input_embeddings().num_embeddings
    top = int(batch.input_ids.max()) if batch.input_ids.numel() else 0
    if top >= vocab:
        raise ValueError(f"batch holds token id {top}, but the model's vocabulary has {vocab} entries")
    if impl != "reference":
        support.check_model(model, batch)
    return batch.to(device), impl, needs_grad, device


def shared_prompt_head(model, batch: TreeBatch, head: torch.nn.Module, *, impl: str = "auto") -> torch.Tensor:
    """`head` on the model's last hidden state at every row that predicts a response token, exactly as the
    standard layout gives: the value head of a PPO critic (values of the states before each response token,
    the positions verl and OpenRLHF read values at), or any per-token head. The LM head is not run.

    Args:
      model: a Hugging Face model with a decoder (a causal LM such as Llama, Qwen2/3, Mistral: the critic
        is typically the policy's architecture) whose attention goes through AttentionInterface.
      batch: from `pack_groups` or `pack_sequences` (rows of its labels); moved to the model's device.
      head: maps hidden states [K, D] to [K, ...] (e.g. torch.nn.Linear(D, 1) for values).
      impl: as for shared_prompt_logprobs ("reference" runs each full sequence alone: the oracle).

    Returns:
      head(h) [K, ...] (autograd-enabled when grad is on), K = total response tokens, in label order.
    """
    batch, impl, needs_grad, device = _prepare(model, batch, impl)
    if support.decoder_of(model) is None:
        raise ValueError(f"{type(model).__name__} has no decoder to run without its LM head (get_decoder() gives "
                         f"{type(model.get_decoder()).__name__}); give a causal LM whose decoder is its base model")
    if batch.labels.numel() == 0:
        hidden = model.config.get_text_config().hidden_size
        dtype = model.get_input_embeddings().weight.dtype
        return head(torch.zeros(0, hidden, dtype=dtype, device=device))
    if impl == "reference":
        h = reference.standard_hidden(model, batch)
    else:
        out = _packed_forward(model, batch, impl, needs_grad, decoder_only=True)
        h = out.last_hidden_state[0][batch.logit_rows[batch.row_of_label]]
    return head(h)
