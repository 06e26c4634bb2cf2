"""Benchmarks run by ``verl-async-rm bench ...`` (measurements, never tests)."""
