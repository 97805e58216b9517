"""Unsupported models and bad calls raise clear errors instead of computing something else."""

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM, Gemma2Config, Gemma2ForCausalLM

from hetrl.dualkv import pack_groups, shared_prompt_logprobs

from .oracle import random_groups, standard_logprobs, tiny_model

GROUPS = random_groups(0, [6, 3], [[4, 2], [5]])


def test_unknown_impl_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'reference', 'sdpa', 'flex'\)"):
        shared_prompt_logprobs(tiny_model("llama"), pack_groups(GROUPS), impl="triton")


def test_flex_with_gradients_on_cpu_raises_and_says_what_to_use():
    with pytest.raises(ValueError, match=r"FlexAttention backward on CPU.*impl='sdpa'"):
        shared_prompt_logprobs(tiny_model("llama"), pack_groups(GROUPS), impl="flex")


def test_auto_is_sdpa_on_cpu_and_logs_it(caplog):
    model = tiny_model("qwen3")
    with caplog.at_level("INFO", logger="hetrl.dualkv.api"):
        got = shared_prompt_logprobs(model, pack_groups(GROUPS))
    assert "chose 'sdpa'" in caplog.text
    assert got.requires_grad  # sdpa runs with autograd; flex could not on CPU


@pytest.mark.parametrize("temperature", [0, -1.0, "hot", True])
def test_bad_temperature(temperature):
    with pytest.raises(ValueError, match="temperature must be a number > 0"):
        shared_prompt_logprobs(tiny_model("llama"), pack_groups(GROUPS), temperature=temperature)


def test_token_id_outside_vocabulary():
    with pytest.raises(ValueError, match=r"token id 500, but the model's vocabulary has 97"):
        shared_prompt_logprobs(tiny_model("llama"), pack_groups([([1, 500], [[2]])]))


def test_batch_must_be_packed():
    with pytest.raises(TypeError, match="PackedBatch from pack_groups"):
        shared_prompt_logprobs(tiny_model("llama"), GROUPS)


def test_model_without_attention_interface_is_refused():
    model = BloomForCausalLM(BloomConfig(vocab_size=97, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(ValueError, match="does not route its attention through transformers' AttentionInterface"):
        shared_prompt_logprobs(model, pack_groups(GROUPS), impl="sdpa")


def test_softcapping_is_refused():
    cfg = Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="logit softcapping"):
        shared_prompt_logprobs(Gemma2ForCausalLM(cfg), pack_groups(GROUPS), impl="sdpa")


def test_short_sliding_window_is_refused_but_reference_handles_it():
    model = tiny_model("mistral", sliding_window=5)  # the longest sequence below is 6 + 4 = 10 tokens
    with pytest.raises(ValueError, match=r"sliding window of 5 tokens, shorter than .* \(10"):
        shared_prompt_logprobs(model, pack_groups(GROUPS), impl="sdpa")
    assert model.config._attn_implementation == "sdpa"  # restored after the error
    got = shared_prompt_logprobs(model, pack_groups(GROUPS), impl="reference")
    assert (got - standard_logprobs(model, GROUPS)).abs().max() <= 1e-9


def test_long_enough_sliding_window_is_exact():
    model = tiny_model("mistral", sliding_window=10)
    got = shared_prompt_logprobs(model, pack_groups(GROUPS), impl="sdpa")
    assert (got - standard_logprobs(model, GROUPS)).abs().max() <= 1e-9


def test_attention_dropout_in_training_is_refused():
    model = tiny_model("llama", attention_dropout=0.1).train()
    with pytest.raises(ValueError, match="attention.dropout"):
        shared_prompt_logprobs(model, pack_groups(GROUPS), impl="sdpa")


def test_our_attention_outside_the_call_raises():
    model = tiny_model("llama")
    model.set_attn_implementation("hetrl_dualkv_sdpa")
    with pytest.raises(RuntimeError, match="outside shared_prompt_logprobs"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_not_a_hugging_face_model():
    with pytest.raises(TypeError, match="PreTrainedModel, got Linear"):
        shared_prompt_logprobs(torch.nn.Linear(2, 2), pack_groups(GROUPS), impl="sdpa")
