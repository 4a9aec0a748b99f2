"""Benchmarks against the tools users would pick instead: ``python -m benchmarks.run`` (see run.py)."""
