"""Benchmarks: each module exposes `main(argv) -> int` and prints one JSON line per measurement."""
