"""Benchmarks for ds_longseq (run from the repo root, e.g. ``python -m benchmarks.memory``)."""
