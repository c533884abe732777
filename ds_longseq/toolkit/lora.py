"""LoRA through PEFT: the adapter set-up the examples share, and the merge for export.

peft is optional (``pip install -e '.[lora]'``): it is imported only when LoRA is used.

Holds:
    import_peft: peft, or an ImportError with the install command.
    parse_lora_targets: the module names of a comma-separated --lora-targets value.
    decoder_linear_names: the short names of the linear modules of a model's decoder layers.
    add_lora: freeze a model and wrap it in a PEFT LoRA model (checked targets, seeded init).
    merge_lora: the base with an adapter merged in, saved as a plain HF model.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ds_longseq.logging import get_logger, log_rank0

__all__ = ["import_peft", "parse_lora_targets", "decoder_linear_names", "add_lora", "merge_lora"]

logger = get_logger(__name__)


def import_peft():
    """peft, which only LoRA runs need (it is not an install requirement of ds_longseq)."""
    try:
        import peft
    except ImportError as err:
        raise ImportError(
            "--lora-rank needs peft, which is not installed: pip install 'peft>=0.21' (or pip install -e '.[lora]')"
        ) from err
    return peft


def parse_lora_targets(text: str) -> list[str]:
    """The names given with --lora-targets, stripped (empty names kept, for the argument checks to refuse)."""
    return [name.strip() for name in text.split(",")]


def decoder_linear_names(model: torch.nn.Module) -> list[str]:
    """Names (last component, first-seen order) of the linear modules inside ``model.model.layers``.

    PEFT's "all-linear" would pick the same modules in our families, but it writes every module's full
    path into adapter_config.json; short names keep the config readable and apply to every layer.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.Module):
        raise SystemExit(
            f"--lora-rank: {type(model).__name__} has no decoder layers at model.layers to find the projections "
            "in: name the modules to adapt with --lora-targets"
        )
    return list(dict.fromkeys(
        name.rsplit(".", 1)[-1] for name, module in layers.named_modules() if isinstance(module, torch.nn.Linear)
    ))


def add_lora(
    model: torch.nn.Module, rank: int, *, alpha: float | None = None, targets: str | Sequence[str] | None = None,
    seed: int = 0, dropout: float = 0.0,
) -> torch.nn.Module:
    """Freeze ``model`` and wrap it in a PEFT LoRA model.

    Args:
        model: a causal LM.
        rank: the adapter's rank r (> 0).
        alpha: the scale numerator (the update is (alpha / r) B A); None: 2 r.
        targets: the modules to adapt, by name or as a comma-separated string; None: every linear
            projection of the decoder layers. The LM head is refused.
        seed: seed of ``lora_A``'s initialisation (``lora_B`` starts at zero).
        dropout: PEFT's ``lora_dropout`` on each adapter's input. StreamBP and mini_seq re-forward chunks in
            backward; each re-forward draws the masks its forward drew (``ops.draws``), so the gradient is that of
            the forward's function.

    ``lora_A`` is initialised from ``seed``, so a run and its resume, and every rank, start from the same adapter.
    """
    peft = import_peft()
    names = {name for name, _ in model.named_modules()}
    head = next((name for name, module in model.named_modules() if module is model.get_output_embeddings()), None)
    if targets is None:
        targets = decoder_linear_names(model)
    else:
        targets = parse_lora_targets(targets) if isinstance(targets, str) else list(targets)
        # PEFT's rule: a target names a module whose path is that name or ends with "." + name.
        matches = {t: [n for n in names if n == t or n.endswith("." + t)] for t in targets}
        missing = [t for t, found in matches.items() if not found]
        if missing:
            raise SystemExit(
                f"--lora-targets: {', '.join(missing)} matches no module of {type(model).__name__}; "
                f"its decoder layers' linear projections are {','.join(decoder_linear_names(model))}"
            )
        if head is not None and any(head in found for found in matches.values()):
            raise SystemExit(
                f"--lora-targets must not adapt the LM head ({head}): ds_longseq's chunked loss reads "
                f"{head}.weight directly and needs it to stay a torch.nn.Linear; adapt the decoder layers only"
            )
    alpha = alpha if alpha is not None else 2 * rank
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets)
    torch.manual_seed(seed)
    model = peft.get_peft_model(model, config)
    trainable, total = model.get_nb_trainable_parameters()
    log_rank0(
        logger,
        f"LoRA rank {rank}, alpha {alpha:g}, dropout {dropout:g} on {','.join(targets)}: training {trainable:,} of "
        f"{total:,} parameters ({trainable / total:.2%}); the rest are frozen",
    )
    return model


def merge_lora(build_base: Callable[[], torch.nn.Module], adapter_dir: str, out_dir: str) -> None:
    """Write the base model with the adapter in ``adapter_dir`` merged in, as a plain HF model.

    Args:
        build_base: builds the base again as for training (the same --model, or the seeded built-in
            model): LoRA never changes it, so this is exactly what a user does with the adapter later.
        adapter_dir: the adapter in PEFT's format.
        out_dir: where the merged model is saved.
    """
    from peft import PeftModel

    merged = PeftModel.from_pretrained(build_base(), adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
