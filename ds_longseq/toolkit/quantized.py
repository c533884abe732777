"""A 4-bit base for QLoRA (``--load-in-4bit``): how it is quantised, loaded, described and dequantized.

bitsandbytes is optional (``pip install 'ds_longseq[qlora]'``): it is imported only when a 4-bit base is asked for.

Holds:
    FourBit: the quantisation of a 4-bit base (nf4 or fp4, double quantisation), read from the scripts' flags; its
        ``BitsAndBytesConfig`` for a run's compute dtype.
    import_bitsandbytes: bitsandbytes, or an ImportError with the install command.
    load_4bit: ``from_pretrained`` of a Hugging Face model directory, quantised to 4 bits, its 4-bit weights kept
        exact (``compat.keep_4bit_weights_unpacked``).
    quantized_bytes: the bytes the base's weights take as stored (packed 4-bit weights and their scales).
    logical_numel: a parameter's number of weights (a packed 4-bit one's before packing).
    quant_state_left_out: the 4-bit linears' quantisation state kept out of ``state_dict()`` inside a ``with``
        block (a LoRA checkpoint holds the adapter alone: the base, scales included, is rebuilt from --model).
    describe: one line for the start-up summary.
    dequantized: a 4-bit (PEFT) model's base dequantized in place to its compute dtype, for a merge.

The compute dtype is the run's (``--dtype`` / the config's bf16), and the packed weights are stored in it too
(``bnb_4bit_quant_storage``): ZeRO-3 then partitions them as it partitions every other parameter of that dtype, as
PEFT documents for QLoRA with ZeRO-3. Only the linear layers of the decoder are quantised; transformers keeps the
LM head, the embeddings and the norms in the compute dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from typing import Iterator, Literal

import torch

from ds_longseq.compat import full_numel, keep_4bit_weights_unpacked

__all__ = ["FourBit", "import_bitsandbytes", "load_4bit", "quantized_bytes", "logical_numel", "quant_state_left_out",
           "describe", "dequantized"]


@dataclasses.dataclass(frozen=True, slots=True)
class FourBit:
    """How a ``--load-in-4bit`` base is quantised (bitsandbytes, as the QLoRA paper does it)."""

    quant_type: Literal["nf4", "fp4"] = "nf4"
    """nf4: the QLoRA paper's 4-bit NormalFloat; fp4: a 4-bit float (``--load-in-4bit fp4``)."""
    double_quant: bool = True
    """Quantise the per-block scales too (the paper's double quantisation, ~0.37 bit per weight saved);
    ``--no-double-quant`` turns it off."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FourBit | None:
        """The scripts' ``--load-in-4bit`` / ``--no-double-quant``; None without --load-in-4bit."""
        kind = getattr(args, "load_in_4bit", None)
        if kind is None:
            return None
        return cls(quant_type=kind, double_quant=not getattr(args, "no_double_quant", False))

    def config(self, dtype: torch.dtype):
        """transformers' ``BitsAndBytesConfig`` computing (and storing the packed weights) in ``dtype``."""
        from transformers import BitsAndBytesConfig

        import_bitsandbytes()
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=self.quant_type,
                                  bnb_4bit_use_double_quant=self.double_quant, bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_quant_storage=dtype)

    def __str__(self) -> str:
        return f"{self.quant_type}, {'double' if self.double_quant else 'no double'} quantisation"


def import_bitsandbytes():
    """bitsandbytes, which only a 4-bit base needs (it is not an install requirement of ds_longseq)."""
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError("--load-in-4bit needs bitsandbytes, which is not installed: pip install "
                          "'ds_longseq[qlora]' (or pip install 'bitsandbytes>=0.50.2')") from err
    return bitsandbytes


def load_4bit(path: str, dtype: torch.dtype, four_bit: FourBit, **kwargs):
    """``AutoModelForCausalLM`` of the model directory ``path``, its decoder's linear layers quantised to 4 bits,
    computing in ``dtype``, with SDPA attention (``kwargs``: more ``from_pretrained`` arguments).

    The quantisation is a function of the weights alone, so every rank, a resume and a merge get the same base.
    """
    from transformers import AutoModelForCausalLM

    if torch.cuda.is_available():  # bitsandbytes quantises on the device the weights are put on: this rank's GPU
        kwargs.setdefault("device_map", {"": torch.cuda.current_device()})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                 quantization_config=four_bit.config(dtype), **kwargs)
    keep_4bit_weights_unpacked(model)  # from_pretrained returns eval mode: the first no-grad forward would repack
    return model


def _quantized_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """{name: module} of ``model``'s bitsandbytes 4-bit linears (none without bitsandbytes imported: a model holding
    one imported it)."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def logical_numel(param: torch.Tensor) -> int:
    """The number of weights ``param`` holds: a packed 4-bit weight's (bitsandbytes keeps the unpacked shape in its
    quantisation state; the tensor itself has one element per 8 or 4 weights), else the full size (ZeRO-3)."""
    state = getattr(param, "quant_state", None)
    if state is not None and getattr(param, "bnb_quantized", False):
        return math.prod(state.shape)
    return full_numel(param)


@contextlib.contextmanager
def quant_state_left_out(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block, ``model.state_dict()`` leaves out the quantisation state bitsandbytes adds for each 4-bit
    linear (``<name>.weight.absmax``, ``.quant_map``, the nested ones, ``.quant_state.*``): DeepSpeed's
    ``exclude_frozen_parameters`` drops frozen parameters by name, and these are not parameters, so without this a
    LoRA checkpoint would carry the base's scales (hundreds of MB for a 7B model without double quantisation). The
    hook is removed on exit."""
    prefixes = tuple(f"{name}.weight." for name in _quantized_modules(model))
    if not prefixes:
        yield
        return

    def drop(module, state_dict, prefix, local_metadata) -> None:
        for key in [k for k in state_dict if k.startswith(prefix) and k[len(prefix):].startswith(prefixes)]:
            del state_dict[key]

    handle = model.register_state_dict_post_hook(drop)
    try:
        yield
    finally:
        handle.remove()


def quantized_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the base's weights as stored, of which the 4-bit linears' packed weights and scales), LoRA adapters
    left out. A ZeRO-3 partitioned parameter counts at its full size."""
    quantized = 0
    modules = _quantized_modules(model).values()
    for module in modules:
        quantized += full_numel(module.weight) * module.weight.element_size()
        state = module.weight.quant_state
        quantized += sum(t.numel() * t.element_size() for t in state.as_dict(packed=True).values()
                         if isinstance(t, torch.Tensor))
        if module.bias is not None:
            quantized += full_numel(module.bias) * module.bias.element_size()
    ids = {id(p) for m in modules for p in m.parameters(recurse=False)}
    rest = sum(full_numel(p) * p.element_size() for n, p in model.named_parameters()
               if id(p) not in ids and "lora_" not in n)
    return quantized + rest, quantized


def describe(model: torch.nn.Module, four_bit: FourBit) -> str:
    """The start-up summary's line for a 4-bit base: its quantisation and the bytes it takes."""
    total, packed = quantized_bytes(model)
    num = len(_quantized_modules(model))
    return (f"base: 4-bit ({four_bit}) in {num} linear layers, {packed / 2**20:,.2f} MiB packed with their scales; "
            f"the whole base {total / 2**20:,.2f} MiB as stored")


def dequantized(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a transformers model, or a PeftModel around one) with its 4-bit linears replaced by
    ``torch.nn.Linear`` holding dequant(W4) in the compute dtype, in place; LoRA layers keep their adapters and
    wrap the dequantized base, so ``merge_and_unload`` then adds the adapter to the weights it was trained
    against."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.dequantize()  # transformers' own: each Linear4bit -> nn.Linear of its dequantized weight
    return model
