"""One-off studies (profiles, investigations that decided a default): `python -m benchmarks.studies.NAME`.

Kept apart from the benchmarks a user reruns; their results pages are indexed in benchmarks/README.md.
"""
