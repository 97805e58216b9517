import pytest
import torch

from hetrl.dualkv import pack_groups, split_by_token_budget


def test_layout_of_a_hand_example():
    batch = pack_groups([([1, 2, 3], [[4, 5], [6], [], [7, 8, 9]]), ([10], [[11, 12, 13]])])
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    assert batch.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 5, 0, 1, 2, 3]
    assert batch.group_ids.tolist() == [0] * 9 + [1] * 4
    assert batch.segment_ids.tolist() == [0, 0, 0, 1, 1, 2, 4, 4, 4, 0, 1, 1, 1]
    assert batch.labels.tolist() == [4, 5, 6, 7, 8, 9, 11, 12, 13]
    # first token of every response is predicted by its prompt's last row (2 and 9)
    assert batch.predict_index.tolist() == [2, 3, 2, 2, 6, 7, 9, 10, 11]
    assert torch.equal(batch.logit_rows[batch.row_of_label], batch.predict_index)
    assert batch.logit_rows.tolist() == sorted(set(batch.predict_index.tolist()))
    assert batch.num_tokens == 13 and batch.num_standard_tokens == 4 * 3 + 6 + 1 + 3
    assert batch.rho == pytest.approx(22 / 13)
    assert batch.max_context == 6
    assert [t.tolist() for t in batch.split_responses(batch.labels)] == [[4, 5], [6], [], [7, 8, 9], [11, 12, 13]]


def test_groups_round_trip_and_tensor_inputs():
    groups = [(torch.tensor([5, 6], dtype=torch.int32), [torch.tensor([1, 2, 3]), torch.tensor([4])]),
              ([7], torch.tensor([[8, 9], [10, 11]]))]
    back = pack_groups(groups).groups()
    assert back[0][0].tolist() == [5, 6] and [r.tolist() for r in back[0][1]] == [[1, 2, 3], [4]]
    assert back[1][0].tolist() == [7] and [r.tolist() for r in back[1][1]] == [[8, 9], [10, 11]]
    assert pack_groups(groups).input_ids.dtype == torch.long


def test_rho_matches_formula_for_equal_lengths():
    n, p, r = 8, 50, 20
    batch = pack_groups([(list(range(p)), [list(range(r))] * n)])
    assert batch.rho == pytest.approx(n * (p + r) / (p + n * r))


@pytest.mark.parametrize("groups, match", [
    ([([], [[1]])], "group 0 prompt is empty"),
    ([([1], [[1]]), ([1.5, 2.0], [[1]])], "group 1 prompt must hold integer"),
    ([([1], [[1, -3]])], "group 0 response 0 holds a negative"),
    ([([1], [[[1, 2]]])], "group 0 response 0 must be 1-D"),
    ([([1], [[1], [[2], [3]]])], "group 0 response 1 must be 1-D"),
    ([([1], [[1, [2, 3]]])], "group 0 response 0 must be a flat list"),
    ([(torch.tensor([[1, 2]]), [[1]])], "group 0 prompt must be 1-D"),
    ([([1], [torch.tensor([1.0])])], "group 0 response 0 must hold integer"),
    ([([True, False], [[1]])], "group 0 prompt must hold integer"),
    ([([1], [])], "group 0 has no responses"),
    ([([1], torch.tensor([1, 2]))], "group 0 responses must be a list"),
    ([([1],)], "group 0 must be a pair"),
    ([("abc", [[1]])], "group 0 prompt must be a list of ints"),
    ([], "non-empty list"),
])
def test_bad_input_names_group_and_field(groups, match):
    with pytest.raises(ValueError, match=match):
        pack_groups(groups)


def test_split_responses_checks_length():
    batch = pack_groups([([1], [[2, 3]])])
    with pytest.raises(ValueError, match="expects 2 rows"):
        batch.split_responses(torch.zeros(3))


def _sizes(micro):
    return [sum(len(p) + sum(len(r) for r in rs) for p, rs in mb) for mb in micro]


def _flat_responses(micro):
    return [r.tolist() for mb in micro for _, rs in mb for r in rs]


def test_budget_keeps_groups_whole_and_in_order():
    groups = [([1] * 10, [[2] * 5] * 4), ([3] * 4, [[4] * 2] * 2), ([5] * 20, [[6] * 10])]  # sizes 30, 8, 30
    micro = split_by_token_budget(groups, 40)
    assert _sizes(micro) == [38, 30]
    assert [len(mb) for mb in micro] == [2, 1]
    assert _flat_responses(micro) == [r for _, rs in groups for r in rs]


def test_budget_splits_only_an_oversized_group_and_each_part_carries_the_prompt():
    prompt = [7] * 10
    groups = [([1] * 3, [[1]]), (prompt, [[i] * 6 for i in range(5)]), ([2] * 3, [[2]])]  # middle: 40 tokens
    micro = split_by_token_budget(groups, 25)
    assert all(s <= 25 for s in _sizes(micro))
    assert _flat_responses(micro) == [r for _, rs in groups for r in rs]
    middle = [g for mb in micro for g in mb if g[0].tolist() == prompt]
    assert len(middle) == 3 and [len(rs) for _, rs in middle] == [2, 2, 1]


def test_budget_errors_say_what_to_change():
    with pytest.raises(ValueError, match=r"raise max_tokens to at least 15"):
        split_by_token_budget([([1] * 10, [[2] * 5])], 12)
    with pytest.raises(ValueError, match="positive int"):
        split_by_token_budget([([1], [[2]])], 0)


def test_cuda_flex_asks_for_the_standard_triton_kernel_at_every_length(monkeypatch):
    """Left to choose, flex sends a stream under 128 tokens to its decoding kernel, which failed to compile a bf16
    training pass at head dim 16 on the first lent GPU; `attend` names the standard kernel in a form this torch
    knows. (The compile itself: tests/dualkv/test_gpu.py.)"""
    from torch.nn.attention.flex_attention import FlexKernelOptions

    from hetrl.dualkv.impl import flex

    options = flex._kernel_options()
    assert set(options) <= set(FlexKernelOptions.__annotations__) and options in (
        {"BACKEND": "TRITON"}, {"FORCE_USE_FLEX_ATTENTION": True})
    seen = {}

    class CudaLike:           # a query that says it is on CUDA, so attend takes the compiled branch
        is_cuda, shape = True, (1, 4, 98, 16)

    monkeypatch.setattr(flex, "_compiled_flex", lambda: lambda *a, **kw: seen.update(kw))
    flex.attend(CudaLike(), CudaLike(), CudaLike(), block_mask=None, scale=0.25)
    assert seen["kernel_options"] == options
