"""Benchmarks and harnesses of every service: each `kvmesh bench <part>` is a module here."""
