"""Benchmarks: Spec-Bench runner (plain vs speculative, llama.cpp peers), micro-benchmarks."""
