"""Measuring the step on a device: timing loops, kernel timelines from profiler traces,
XLA schedule reports, synthetic steady-state batches, and the record every result file
carries. Shared by the benchmarks (nanojax/bench) and the search's profiler (search/)."""
