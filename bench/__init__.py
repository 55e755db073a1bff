"""Benchmarks: ``make bench`` (``python -m bench.run``); see bench/README.md."""
