"""tests/gpu: CUDA-only checks (fused kernels against the math tile, models on the GPU, offload).

Every test here is marked ``gpu`` and skipped where CUDA is unavailable, so the CPU suite collects
them at no cost. On a GPU machine: ``python -m pytest -q tests/gpu``.
"""

import os

import pytest
import torch

# Deterministic cuBLAS for the bitwise offload tests (read when the first cuBLAS handle is made).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)
