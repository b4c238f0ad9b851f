"""Benchmarks that run SIE and its baselines side by side and report ratios."""
