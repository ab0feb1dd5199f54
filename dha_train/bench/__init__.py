"""Benchmarks behind `dha-train bench ...`; each prints ratios measured within one run."""
