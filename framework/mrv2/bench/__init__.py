"""``mrv2 bench``: throughput and latency benchmarks (absolute numbers mean something on a GPU)."""
