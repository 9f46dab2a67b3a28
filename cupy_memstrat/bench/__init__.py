"""Benchmarks, run as commands: ``python -m cupy_memstrat bench GROUP``."""
