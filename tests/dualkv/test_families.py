"""Every causal-LM family of the installed transformers that DualKV was run against (docs/dualkv.md, "Families
checked"), built tiny from its config with random weights (nothing downloaded), fp64. The supported ones give every
sequence's log-probs and every parameter's gradient as running it alone does, through the shared-prompt API (three
groups, ragged responses with R = 0 and R = 1) and the tree API (branches at several depths), impl sdpa and reference,
flex forward, and the row-chunked LM head where the model's head is plain; the others raise an error that says what
and why instead of computing something else."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from hetrl.dualkv import api, pack_groups, pack_sequences, sequence_logprobs, shared_prompt_logprobs, support

from .oracle import VOCAB, fp64_inside, tiny_config_model

LOGP_TOL = 1e-10
GRAD_REL_TOL = 1e-10      # per parameter, |got - want| / |want| (norms)
# A parameter whose true gradient is zero (a key bias: it shifts all of a query's scores alike) has only rounding
# noise there; its error is measured against this fraction of the whole model's gradient norm instead.
ZERO_GRAD_FLOOR = 1e-8

MLA = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
           v_head_dim=16, head_dim=8, n_group=1, topk_group=1)
MAMBA = dict(mamba_d_ssm=None, mamba_d_state=8, mamba_n_heads=4, mamba_d_head=32, mamba_chunk_size=8,
             mamba_n_groups=1, mamba_expand=2, mamba_d_conv=4)
SEQ2SEQ_DECODER = dict(d_model=64, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64, encoder_layers=2,
                       encoder_attention_heads=4, encoder_ffn_dim=64, dropout=0.0, activation_dropout=0.0)
GPT2_STYLE = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
HEAD_DIM = 16


def _rope(kind: str, **params):
    return {"rope_parameters": {"rope_type": kind, "rope_theta": 10000.0, **params}}


def _longrope(original: int):
    return dict(original_max_position_embeddings=original, **_rope(
        "longrope", short_factor=[1.0] * (HEAD_DIM // 2), long_factor=[1.0 + 0.5 * i for i in range(HEAD_DIM // 2)],
        original_max_position_embeddings=original))


# family -> (transformers class, config overrides beyond oracle.TINY_ANY). Sequences below are at most 16 tokens, so a
# window or chunk of 64 covers them.
SUPPORTED = {
    "apertus": ("ApertusForCausalLM", {}),
    "arcee": ("ArceeForCausalLM", {}),
    "aria-text": ("AriaTextForCausalLM", {}),
    "axk1": ("AXK1ForCausalLM", MLA),
    "bert-decoder": ("BertLMHeadModel", dict(is_decoder=True)),
    "biogpt": ("BioGptForCausalLM", {}),
    "bitnet": ("BitNetForCausalLM", {}),
    "cohere": ("CohereForCausalLM", {}),
    "cohere2": ("Cohere2ForCausalLM", {}),
    "cohere2-moe": ("Cohere2MoeForCausalLM", {}),
    "ctrl": ("CTRLLMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, dff=64, n_positions=256, resid_pdrop=0.0,
                                     embd_pdrop=0.0)),
    "cwm": ("CwmForCausalLM", {}),
    "deepseek-v2": ("DeepseekV2ForCausalLM", MLA),
    "deepseek-v3": ("DeepseekV3ForCausalLM", MLA),
    "diffllama": ("DiffLlamaForCausalLM", {}),
    "dots1": ("Dots1ForCausalLM", {}),
    "emu3": ("Emu3ForCausalLM", {}),
    "ernie4.5": ("Ernie4_5ForCausalLM", {}),
    "ernie4.5-moe": ("Ernie4_5_MoeForCausalLM", {}),
    "exaone4": ("Exaone4ForCausalLM", {}),
    "exaone-moe": ("ExaoneMoeForCausalLM", {}),
    "flex-olmo": ("FlexOlmoForCausalLM", {}),
    "gemma": ("GemmaForCausalLM", {}),
    "gemma3-text": ("Gemma3ForCausalLM", dict(sliding_window=64)),
    "glm": ("GlmForCausalLM", {}),
    "glm4": ("Glm4ForCausalLM", {}),
    "glm4-moe": ("Glm4MoeForCausalLM", {}),
    "glm4-moe-lite": ("Glm4MoeLiteForCausalLM", MLA),
    "gpt2": ("GPT2LMHeadModel", GPT2_STYLE),
    "gpt-bigcode": ("GPTBigCodeForCausalLM", {}),
    "gpt-neox": ("GPTNeoXForCausalLM", {}),
    "gpt-neox-rotary-pct-0.25": ("GPTNeoXForCausalLM", dict(rotary_pct=0.25)),
    "granite": ("GraniteForCausalLM", {}),
    "granite-moe": ("GraniteMoeForCausalLM", {}),
    "granite-moe-shared": ("GraniteMoeSharedForCausalLM", {}),
    "helium": ("HeliumForCausalLM", {}),
    "hrm-text": ("HrmTextForCausalLM", {}),
    "hunyuan-dense": ("HunYuanDenseV1ForCausalLM", {}),
    "hunyuan-moe": ("HunYuanMoEV1ForCausalLM", {}),
    "hy-v3": ("HYV3ForCausalLM", {}),
    "hyperclovax": ("HyperCLOVAXForCausalLM", {}),
    "jais2": ("Jais2ForCausalLM", {}),
    "jetmoe": ("JetMoeForCausalLM", {}),
    "kolibri1": ("Kolibri1ForCausalLM", MLA),
    "laguna": ("LagunaForCausalLM", {}),
    "lfm2-attention-only": ("Lfm2ForCausalLM", {}),
    "llama": ("LlamaForCausalLM", {}),
    "llama-rope-dynamic": ("LlamaForCausalLM", _rope("dynamic", factor=2.0)),       # every sequence within 256
    "llama-rope-linear": ("LlamaForCausalLM", _rope("linear", factor=2.0)),
    "llama-rope-llama3": ("LlamaForCausalLM", _rope("llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                    original_max_position_embeddings=8)),
    "llama-rope-yarn": ("LlamaForCausalLM", _rope("yarn", factor=4.0, original_max_position_embeddings=8)),
    "llama4-text": ("Llama4ForCausalLM", dict(attention_chunk_size=64)),
    "longcat-flash": ("LongcatFlashForCausalLM", MLA),
    "mellum": ("MellumForCausalLM", {}),
    "minicpm3": ("MiniCPM3ForCausalLM", MLA),
    "minimax-m2": ("MiniMaxM2ForCausalLM", {}),
    "ministral": ("MinistralForCausalLM", {}),
    "ministral3": ("Ministral3ForCausalLM", {}),
    "mistral": ("MistralForCausalLM", dict(sliding_window=None)),
    "mistral-window-64": ("MistralForCausalLM", dict(sliding_window=64)),
    "mixtral": ("MixtralForCausalLM", {}),
    "modernbert-decoder": ("ModernBertDecoderForCausalLM", {}),
    "nemotron": ("NemotronForCausalLM", {}),
    "olmo": ("OlmoForCausalLM", {}),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3ForCausalLM", {}),
    "olmoe": ("OlmoeForCausalLM", {}),
    "opt": ("OPTForCausalLM", {}),
    "persimmon": ("PersimmonForCausalLM", {}),
    "phi": ("PhiForCausalLM", {}),
    "phi3": ("Phi3ForCausalLM", {}),
    "phi3-longrope": ("Phi3ForCausalLM", dict(_longrope(64), max_position_embeddings=256)),
    "phimoe": ("PhimoeForCausalLM", {}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    "qwen3-moe": ("Qwen3MoeForCausalLM", dict(norm_topk_prob=True)),
    "seed-oss": ("SeedOssForCausalLM", {}),
    "smollm3": ("SmolLM3ForCausalLM", {}),
    "solar-open": ("SolarOpenForCausalLM", {}),
    "stablelm": ("StableLmForCausalLM", {}),              # partial rotary (25%)
    "starcoder2": ("Starcoder2ForCausalLM", {}),
    "youtu": ("YoutuForCausalLM", MLA),
}

# One family per mechanism the others share (run by default; the rest are marked slow): plain Llama; biases; qk-norm;
# a sliding window within the sequence; Gemma's (1 + w) norms and embedding scale; sliding + full layer types with a
# rope per type; a parallel block with a logit scale; multipliers; partial rotary (three ways); learned positions
# (with an offset); post-norms; MLA + MoE; MoE with shared experts and an unused sliding mask; a chunked mask within
# the sequence; RoPE scalings; two attention calls per layer; hidden-state scaling before the head; NoPE layers; an
# encoder stack as a decoder (BERT) and a prediction head before the output projection.
CORE = {"llama", "qwen2", "qwen3", "mistral-window-64", "gemma", "gemma3-text", "cohere", "granite", "phi", "stablelm",
        "gpt-neox-rotary-pct-0.25", "gpt2", "opt", "olmo2", "deepseek-v3", "qwen3-moe", "qwen2-moe", "mixtral",
        "llama4-text", "llama-rope-yarn", "llama-rope-dynamic", "phi3-longrope", "diffllama", "minicpm3", "smollm3",
        "bert-decoder", "modernbert-decoder", "glm4"}

# family -> (transformers class, config overrides, training mode, the error's text).
REFUSED = {
    # token mixers other than attention
    "bamba": ("BambaForCausalLM", MAMBA, False, r"layers that are not softmax attention: 'linear_attention'"),
    "falcon-h1": ("FalconH1ForCausalLM", MAMBA, False, r"layers that are not softmax attention: 'hybrid'"),
    "qwen3-next": ("Qwen3NextForCausalLM", {}, False, r"'linear_attention' \(layers 0, 1\)"),
    "lfm2-conv": ("Lfm2MoeForCausalLM", dict(layer_types=["conv", "full_attention"]), False,
                  r"layers that are not softmax attention: 'conv' \(layers 0\)"),
    "deepseek-v3.2": ("DeepseekV32ForCausalLM", MLA, False, r"'indexed_attention'.*learned sparse index"),
    # attention DualKV does not compute
    "gpt-oss": ("GptOssForCausalLM", {}, False, r"_supports_sdpa = False\).*attention sinks"),
    "gemma2": ("Gemma2ForCausalLM", {}, False, r"attention logit softcapping \(50.0\)"),
    "nanochat": ("NanoChatForCausalLM", {}, False, r"final logit softcapping \(15.0\)"),
    "gemma3-bidirectional": ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), False,
                             r"not plain causal \(alone, in a sequence of 1[56] tokens, query 0 sees key 1\)"),
    "electra": ("ElectraForCausalLM", {}, False, r"attends bidirectionally"),
    "doge": ("DogeForCausalLM", {}, False, r"uses its attention mask as a tensor itself \(reads \.dtype\)"),
    "bloom": ("BloomForCausalLM", {}, False, r"does not route its attention through transformers' AttentionInterface"),
    # windows and chunks shorter than the batch's longest sequence (16 tokens), through the mask alone or also
    # through the attention call
    "mistral-window-4": ("MistralForCausalLM", dict(sliding_window=4), False, r"sliding window of 4 tokens.*\(1[56]"),
    "qwen2-moe-window-4": ("Qwen2MoeForCausalLM", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2),
                           False, r"Qwen2MoeForCausalLM has a sliding window of 4 tokens.*\(1[56] tokens\)"),
    "phimoe-window-4": ("PhimoeForCausalLM", dict(sliding_window=4), False, r"sliding window of 4 tokens.*\(1[56]"),
    "llama4-chunk-4": ("Llama4ForCausalLM", dict(attention_chunk_size=4), False,
                       r"attention chunks of 4 tokens, shorter than .* \(1[56] tokens\)"),
    # positions
    "bart-decoder": ("BartForCausalLM", SEQ2SEQ_DECODER, False, r"takes no position_ids \(BartForCausalLM\.forward\)"),
    "roberta-decoder": ("RobertaForCausalLM", dict(is_decoder=True), False, r"numbers positions from its padding id"),
    "llama-rope-dynamic-past-original": ("LlamaForCausalLM", dict(_rope("dynamic", factor=2.0),
                                                                  max_position_embeddings=8), False,
                                         r"dynamic RoPE scaling .* \(1[56] tokens\) is past its original length \(8\)"),
    "phi3-longrope-straddling": ("Phi3ForCausalLM", dict(_longrope(12), max_position_embeddings=64), False,
                                 r"LongRoPE and the batch mixes sequences of <= 12 tokens \(shortest \d+\)"),
    # randomness in training
    "phi-resid-dropout": ("PhiForCausalLM", dict(resid_pdrop=0.1), True,
                          r"training mode with random masks or noise on: model\.layers\.0\.resid_dropout \(p=0.1\)"),
    "starcoder2-residual-dropout": ("Starcoder2ForCausalLM", dict(residual_dropout=0.1), True,
                                    r"config\.residual_dropout=0.1"),
    "mixtral-router-jitter": ("MixtralForCausalLM", dict(router_jitter_noise=0.1), True,
                              r"config\.router_jitter_noise=0.1"),
    "llama-attention-dropout": ("LlamaForCausalLM", dict(attention_dropout=0.1), True,
                                r"config\.attention_dropout=0.1"),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models run fastest on one thread; on two shared cores with two threads each small op waits for the
    other (measured: the Llama case 0.19 s on one thread, 15 s on two beside another busy process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _groups():
    """Three groups: ragged responses with R = 0 and R = 1, prompts of 7, 3 and 12 tokens; at most 16 tokens."""
    rng = random.Random(0)
    spec = [(7, [5, 0, 1, 4]), (3, [1, 3]), (12, [4, 2, 0])]
    return [([rng.randrange(3, VOCAB) for _ in range(p)], [[rng.randrange(3, VOCAB) for _ in range(r)] for r in rs])
            for p, rs in spec]


def _tree():
    """Sequences branching at depths 6, 9 and 10, one a prefix of others, and a tree sharing only its first token."""
    rng = random.Random(1)

    def tokens(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    root = tokens(6)
    a, b = root + tokens(3), root + tokens(4)
    return [a + tokens(2), a + tokens(3), a, b + tokens(1), b + tokens(5), root + tokens(2), tokens(5),
            [root[0]] + tokens(3)]


def _model(cls_name: str, overrides: dict):
    return tiny_config_model(getattr(transformers, cls_name), **overrides)


def _alone(model, batch) -> torch.Tensor:
    """The oracle: every sequence with a label alone through the model's own forward, its labels' log-probs."""
    out = []
    for ids, mask in batch.sequences():
        if bool(mask[1:].any()):
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            logp = torch.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
            out.append(logp[mask[1:]])
    return torch.cat(out)


def _grads(model, loss) -> dict:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
            for n, p in model.named_parameters()}


def _assert_grads_close(got: dict, want: dict, where: str) -> None:
    total = sum(float(w.norm()) ** 2 for w in want.values()) ** 0.5
    assert total > 0
    for name, w in want.items():
        rel = float((got[name] - w).norm()) / max(float(w.norm()), ZERO_GRAD_FLOOR * total)
        assert rel <= GRAD_REL_TOL, f"{where}: {name}: |diff| / |grad| = {rel:.3e} > {GRAD_REL_TOL:g}"


def _cases():
    """(family, impl) for every supported family; beyond CORE (one family per mechanism) they are marked slow."""
    return [pytest.param(family, impl, marks=() if family in CORE else pytest.mark.slow)
            for family in sorted(SUPPORTED) for impl in ("sdpa", "reference", "flex")]


@pytest.mark.parametrize("family, impl", _cases())
def test_supported_family_equals_each_sequence_alone(family, impl, monkeypatch):
    """impl sdpa and reference: log-probs and every parameter's gradient; flex: log-probs (on CPU forward only); sdpa
    also through the row-chunked LM head where the model's head is plain."""
    grad = impl != "flex"
    with fp64_inside(), torch.set_grad_enabled(grad):
        model = _model(*SUPPORTED[family])
        for api_name, batch in (("shared prompt", pack_groups(_groups())), ("tree", pack_sequences(_tree()))):
            where = f"{family}, {api_name}, impl={impl}"
            want = _alone(model, batch)
            weights = torch.linspace(-1.0, 2.0, want.numel(), dtype=torch.float64)
            want_grads = _grads(model, (want * weights).sum()) if grad else None
            if api_name == "tree":
                got = torch.cat(sequence_logprobs(model, batch, impl=impl))
            else:
                got = shared_prompt_logprobs(model, batch, impl=impl)
            assert got.shape == want.shape and (got - want).abs().max().item() <= LOGP_TOL, where
            if grad:
                _assert_grads_close(_grads(model, (got * weights).sum()), want_grads, where)
        assert model.config._attn_implementation == "sdpa"

        if impl == "sdpa" and support.plain_lm_head(model) is not None:   # the chunked head, forced on, 5-row chunks
            monkeypatch.setattr(api, "CHUNK_LOGITS_ABOVE_BYTES", 0)
            monkeypatch.setattr(api, "CHUNK_BYTES", 5 * 4 * VOCAB)
            batch = pack_groups(_groups())
            want = _alone(model, batch)
            weights = torch.linspace(-1.0, 2.0, want.numel(), dtype=torch.float64)
            want_grads = _grads(model, (want * weights).sum())
            got = shared_prompt_logprobs(model, batch, impl="sdpa")
            assert (got - want).abs().max().item() <= LOGP_TOL, f"{family}, chunked LM head"
            _assert_grads_close(_grads(model, (got * weights).sum()), want_grads, f"{family}, chunked LM head")


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_with_what_and_why(family):
    cls_name, overrides, train, text = REFUSED[family]
    model = _model(cls_name, overrides).train(train)
    own = model.config._attn_implementation
    for impl in ("sdpa", "flex"):
        with torch.no_grad(), pytest.raises((ValueError, RuntimeError, AttributeError), match=text):
            shared_prompt_logprobs(model, pack_groups(_groups()), impl=impl)
        assert model.config._attn_implementation == own          # restored after the error
    with pytest.raises((ValueError, RuntimeError, AttributeError), match=text):
        sequence_logprobs(model, pack_sequences(_tree()), impl="sdpa")


@pytest.mark.parametrize("family, plain", [("llama", True), ("opt", True), ("gpt-neox", True), ("cohere", False),
                                           ("granite", False), ("minicpm3", False), ("hyperclovax", False),
                                           ("modernbert-decoder", False), ("bert-decoder", False)])
def test_lm_head_runs_apart_only_where_logits_are_plain_lm_head_of_the_decoder(family, plain):
    """The row-chunked head bypasses the model's own forward after its decoder: only where that forward computes
    logits = lm_head(decoder output) and nothing else (Cohere's logit scale, Granite's and MiniCPM3's multipliers,
    ModernBERT's and BERT's prediction heads before the output projection would be skipped)."""
    model = _model(*SUPPORTED[family])
    assert (support.plain_lm_head(model) is not None) == plain


def test_a_mask_no_layer_uses_is_not_refused():
    """Qwen2-MoE builds a sliding-window mask (window 0 when sliding is off) for every forward though no layer
    uses it: refusing at mask creation would refuse the whole model."""
    model = _model("Qwen2MoeForCausalLM", {})
    assert "sliding_attention" not in model.config.layer_types
    with torch.no_grad():
        batch = pack_groups(_groups())
        assert (shared_prompt_logprobs(model, batch, impl="sdpa") - _alone(model, batch)).abs().max() <= 1e-9
