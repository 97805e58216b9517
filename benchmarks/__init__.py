"""Benchmarks a user reruns on their machine: `python -m benchmarks.NAME` from the repository root.

Each script is the experiment; the timing, the machine and the results files come from hetrl/bench/harness.py.
What each measured, and the command that made each results page: benchmarks/README.md.
"""
