"""Benchmarks: workloads, offline throughput, online serving."""
