"""hetrl: RL post-training of LLMs on heterogeneous hardware (HetRL planning + DualKV training)."""

__version__ = "0.1.0"
