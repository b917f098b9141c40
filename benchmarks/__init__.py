"""Benchmarks: one module each, run as `python -m benchmarks.<name>` or in-process through its run()."""
