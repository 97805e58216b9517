"""`hetrl bench tree`: every layout computes the oracle's log-probs (each trajectory alone) before anyone times it,
the trees have the shape asked for, and the FLOP count is the layouts' own arithmetic."""

import torch

from hetrl.bench import tree
from hetrl.dualkv import pack_sequences

from .dualkv.oracle import tiny_model
from .dualkv.test_trees import alone_logprobs, trie_nodes

SMALL = tree.TreeCase(3, 2, prompt=12, turn_tokens=(3, 6), tool_tokens=(2, 5), max_leaves=4)


def test_trees_have_the_asked_shape():
    seqs, masks = tree.make_tree(SMALL, 97)
    assert len(seqs) == 4                                 # K=2 at two boundaries, then the 4-leaf cap
    assert all(s[:12] == seqs[0][:12] and not any(m[:12]) for s, m in zip(seqs, masks))
    assert all(len(s) == len(m) for s, m in zip(seqs, masks))
    seqs1, _ = tree.make_tree(tree.TreeCase(3, 1, prompt=12, turn_tokens=(3, 6), tool_tokens=(2, 5)), 97)
    assert len(seqs1) == 1


def test_every_layout_gives_each_trajectory_alone():
    model = tiny_model("llama")
    seqs, masks = tree.make_tree(SMALL, model.config.vocab_size)
    with torch.no_grad():
        want = torch.cat(alone_logprobs(model, seqs, masks))
        tokens = {}
        for layout in tree.LAYOUTS:
            fn, tokens[layout] = tree.layout_logprobs(layout, model, seqs, masks)
            assert (fn() - want).abs().max().item() <= 1e-10, layout
    assert tokens["tree"] == trie_nodes(seqs) < tokens["treerow"] < tokens["prompt"] < tokens["linear"]
    # TreeRow repeats a branch point's token once per extra child: 3 binary forks here
    assert tokens["treerow"] == tokens["tree"] + 3


def test_flop_ratio_counts_the_layouts():
    model = tiny_model("qwen2")
    seqs, masks = tree.make_tree(SMALL, model.config.vocab_size)
    f = tree.flops(model, seqs, masks)
    assert f["flop_ratio"] > 1
    single = [seqs[0]], [masks[0]]
    assert abs(tree.flops(model, *single)["flop_ratio"] - 1) < 1e-12      # one trajectory: nothing shared
    assert pack_sequences(*single).num_tokens == len(seqs[0])


def test_quick_run_and_report(monkeypatch):
    monkeypatch.setattr(tree, "build_model", lambda name: tiny_model("qwen3", dtype=torch.float32))
    monkeypatch.setattr(tree, "QUICK", [SMALL])
    res = tree.run(quick=True, repeats=1, memory=False)
    (row,) = res["rows"]
    assert set(row["update_s"]) == set(tree.LAYOUTS) and all(t > 0 for t in row["update_s"].values())
    assert max(row["max_abs_logprob_diff_vs_tree"].values()) < 1e-4
    assert "| 3turns_K2_P12 | 4 |" in tree.markdown(res)


def test_cli_wires_bench_tree(monkeypatch, tmp_path):
    from hetrl.cli import main

    seen = {}

    def fake_run(quick, repeats, memory, max_leaves=None):
        seen.update(quick=quick, repeats=repeats, memory=memory, max_leaves=max_leaves)
        return {"machine": {"cpus": 2, "torch": "x", "torch_threads": 1}, "model": "m", "repeats": repeats,
                "quick": quick, "rows": [{"case": "c", "trajectories": 2, "tokens": dict.fromkeys(tree.LAYOUTS, 9),
                                          "flop_ratio": 1.5, "update_s": dict.fromkeys(tree.LAYOUTS, 1.0),
                                          "max_abs_logprob_diff_vs_tree": {"tree": 0.0}}]}

    monkeypatch.setattr(tree, "run", fake_run)
    assert main(["bench", "tree", "--quick", "--repeats", "2", "--no-memory", "--max-leaves", "8",
                 "--out", str(tmp_path)]) == 0
    assert seen == {"quick": True, "repeats": 2, "memory": False, "max_leaves": 8}
    assert (tmp_path / "tree_cpu_quick.md").read_text().startswith("# Tree engine")
