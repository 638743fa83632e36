"""Benchmarks for insum on a CUDA GPU; see each module's docstring."""
