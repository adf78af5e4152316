"""Benchmark client pieces: datasets, backends, statistics, the oracle hit rate, reports."""
