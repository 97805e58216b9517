"""The benchmark's layouts compute the same log-probs as the oracle before anyone times them."""

import torch

from hetrl.bench import dualkv_grid
from hetrl.bench.dualkv_grid import Case, build_model, make_group, variant_logprobs


def test_every_layout_gives_the_oracle_logprobs():
    model = build_model("qwen3-shaped")
    case = Case("qwen3-shaped", 3, 17, 5)
    prompt, responses = make_group(case, model.config.vocab_size)
    with torch.no_grad():
        ref = variant_logprobs("reference", model, prompt, responses)()
        for v in ("padded", "packed", "dualkv"):
            assert (variant_logprobs(v, model, prompt, responses)() - ref).abs().max() < 1e-4, v


def test_flop_ratio_is_rho_for_linear_layers_and_more_with_attention():
    model = build_model("qwen3-shaped")
    case = Case("qwen3-shaped", 8, 1024, 64)
    assert dualkv_grid.flop_ratio(model, case) > 1
    assert abs(case.rho - 8 * 1088 / (1024 + 512)) < 1e-12
