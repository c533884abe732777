"""A user's pretrained checkpoint for the examples' ``--model``: a Hugging Face directory, or a GGUF file.

Holds:
    gguf_parts: (directory, file name) of a ``.gguf`` path; None for anything else.
    load_config / load_model / load_tokenizer: transformers' ``from_pretrained`` on either form (a directory also
        quantised to 4 bits, ``--load-in-4bit``: ``toolkit.quantized``).

A GGUF file (llama.cpp's format, e.g. ``SmolLM2-135M-Instruct.Q4_1.gguf``) is read by transformers itself
(``from_pretrained(directory, gguf_file=name)``, which needs the ``gguf`` package) and dequantized to ``dtype``:
the weights trained are those floats. The loaded model is then a plain model (its GGUF quantization marker is
dropped), so the examples' HF-format export writes an ordinary checkpoint that ``from_pretrained`` loads without
``gguf``.

A GGUF file is not loaded with ``--load-in-4bit``: transformers dequantizes GGUF on load and takes no second
quantisation with it, and quantising llama.cpp's already-quantised floats again would train against a base twice
rounded; the flag checks refuse it, naming the fix (a Hugging Face directory of the model).
"""

from __future__ import annotations

import os

import torch

from ds_longseq.compat import drop_gguf_quantization_marker
from ds_longseq.toolkit.quantized import FourBit, load_4bit

__all__ = ["gguf_parts", "load_config", "load_model", "load_tokenizer"]


def gguf_parts(model: str) -> tuple[str, str] | None:
    """``(directory, file name)`` when ``model`` names a GGUF file, else None (a model directory)."""
    if not str(model).lower().endswith(".gguf"):
        return None
    if not os.path.isfile(model):
        raise FileNotFoundError(f"--model {model}: no such GGUF file")
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files through it
    except ImportError:
        raise ImportError(f"--model {model} is a GGUF file, which transformers reads with the gguf package: "
                          "pip install gguf") from None
    return os.path.dirname(os.path.abspath(model)), os.path.basename(model)


def _kwargs(model: str) -> tuple[str, dict]:
    parts = gguf_parts(model)
    return (model, {}) if parts is None else (parts[0], {"gguf_file": parts[1]})


def load_config(model: str):
    """The transformers config of ``model`` (no weights read)."""
    from transformers import AutoConfig

    path, kwargs = _kwargs(model)
    config = AutoConfig.from_pretrained(path, **kwargs)
    if kwargs:
        drop_gguf_quantization_marker(config)  # the weights are dequantized on load: train the floats
    return config


def load_model(model: str, dtype: torch.dtype, four_bit: FourBit | None = None):
    """``AutoModelForCausalLM`` of ``model`` in ``dtype`` with SDPA attention; a GGUF file dequantized; with
    ``four_bit`` (a model directory only) its decoder's linear layers quantised to 4 bits, computing in ``dtype``."""
    from transformers import AutoModelForCausalLM

    path, kwargs = _kwargs(model)
    if four_bit is not None:
        if kwargs:
            raise ValueError(f"--load-in-4bit: {model} is a GGUF file; quantise a Hugging Face model directory")
        return load_4bit(path, dtype, four_bit)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **kwargs)
    if kwargs:
        drop_gguf_quantization_marker(loaded)  # marked quantized, refused by save_pretrained; plain floats inside
    return loaded


def load_tokenizer(model: str):
    """``AutoTokenizer`` of ``model`` (a GGUF file carries its tokenizer)."""
    from transformers import AutoTokenizer

    path, kwargs = _kwargs(model)
    return AutoTokenizer.from_pretrained(path, **kwargs)
