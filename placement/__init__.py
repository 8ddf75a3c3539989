"""Floor 1: GPU catalog, model specs, perf model, throughput profiles and OR-Tools solvers. No I/O beyond files."""
