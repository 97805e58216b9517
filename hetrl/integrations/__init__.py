"""Bridges from hetrl to the engines teams already run: `hetrl plan --export verl | openrlhf` writes what that
engine's user launches, says what the engine cannot express, and predicts the plan as the engine will run it
(`export.py`); `hetrl plan --import verl DIR` reads an export back as a hetrl plan (round trip)."""

ENGINES = ("verl", "openrlhf")
