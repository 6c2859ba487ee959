"""Benchmarks: side-by-side timings (ratios, medians over repeats), never timed tests."""
