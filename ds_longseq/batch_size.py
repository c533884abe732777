"""DeepSpeed's batch triple, read once for every entry point.

``train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel replicas``, where
the replicas are the ranks over the sequence-parallel size. A config may give any two of the three (or the micro-batch
or the global batch alone); DeepSpeed fills the rest by its own rule (``runtime/config.py``,
``_set_batch_related_parameters``: integer division, then the product checked). Read here the same way, so that the
scripts' loops, the planner, the preflight, the resume's shape check and the Trainer count what DeepSpeed counts: a
config with ``"train_batch_size": 4`` and a micro-batch of 1 accumulates 4 micro-batches per optimizer step, and the
loop must call ``engine.step()`` 4 times per step for the optimizer to step at all.

``"auto"`` is the Hugging Face Trainer's: it fills it from ``TrainingArguments`` (``per_device_train_batch_size``,
``gradient_accumulation_steps``); elsewhere it is refused with what to write instead.

Holds:
    BatchSize: the triple resolved (micro-batch, accumulation, replicas; the global batch their product).
    read_batch_size: a DeepSpeed config (and the replicas) -> BatchSize, or BatchSizeError saying what to change.
    batch_size_problems: the same check as a list of problems (the resolver's rule ``deepspeed.batch_size``).

Torch-free (the planner reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["BatchSize", "BatchSizeError", "read_batch_size", "batch_size_problems", "KEYS", "AUTO"]

AUTO = "auto"
KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
"""DeepSpeed's three batch keys: the global batch, the micro-batch per rank, the accumulation."""


class BatchSizeError(ValueError):
    """The config's batch keys do not make a batch DeepSpeed accepts: one line naming the keys and the fix."""


@dataclass(frozen=True)
class BatchSize:
    """DeepSpeed's batch triple, resolved."""

    micro_batch: int
    """Sequences per rank per forward (``train_micro_batch_size_per_gpu``)."""
    gradient_accumulation: int
    """Micro-batches per optimizer step (``gradient_accumulation_steps``): ``engine.step()`` calls per step."""
    replicas: int
    """Data-parallel replicas: the ranks over the sequence-parallel size."""

    @property
    def train_batch(self) -> int:
        """Sequences per optimizer step over all replicas (``train_batch_size``)."""
        return self.micro_batch * self.gradient_accumulation * self.replicas

    def __str__(self) -> str:
        return (f"{self.train_batch} sequence(s) per optimizer step ({self.micro_batch} per micro-batch x "
                f"{self.gradient_accumulation} accumulated x {self.replicas} replica(s))")


def _value(ds_config: Mapping[str, Any], key: str, filled: int | None) -> int | None:
    """The key's value (None: absent), ``filled`` where it is "auto"."""
    value = ds_config.get(key)
    if value == AUTO:
        if filled is None:
            raise BatchSizeError(f'{key} is "auto", which only the Hugging Face Trainer fills (from its '
                                 "TrainingArguments): give a number, or leave the key out")
        return filled
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BatchSizeError(f"{key} must be a positive integer (or left out), got {value!r}")
    return value


def read_batch_size(ds_config: Mapping[str, Any], replicas: int, *, micro_batch: int | None = None,
                    gradient_accumulation: int | None = None) -> BatchSize:
    """The batch DeepSpeed will run with ``ds_config`` on ``replicas`` data-parallel replicas.

    Args:
        ds_config: DeepSpeed's config (the batch keys are read; the rest is ignored).
        replicas: data-parallel replicas (world size over the sequence-parallel size).
        micro_batch, gradient_accumulation: what "auto" stands for (the Trainer's per_device_train_batch_size and
            gradient_accumulation_steps); a global batch of "auto" is their product with the replicas.

    Raises:
        BatchSizeError: a key that is not a positive integer, "auto" without a filler, neither the global batch nor
            the micro-batch given, or three values whose product is not the global batch (DeepSpeed's assertion,
            which it would raise inside ``deepspeed.initialize``, after the model is built).
    """
    train = ds_config.get("train_batch_size")
    micro = _value(ds_config, "train_micro_batch_size_per_gpu", micro_batch)
    accumulation = _value(ds_config, "gradient_accumulation_steps", gradient_accumulation)
    if train == AUTO and micro is not None and accumulation is not None:
        train = micro * accumulation * replicas
    train = _value({"train_batch_size": train}, "train_batch_size", None)
    # DeepSpeed's rule, in its order (runtime/config.py _set_batch_related_parameters)
    if train is not None and micro is not None and accumulation is None:
        accumulation = train // micro // replicas
    elif train is not None and accumulation is not None and micro is None:
        micro = train // replicas // accumulation
    elif train is not None and micro is None and accumulation is None:
        micro, accumulation = train // replicas, 1
    elif micro is not None and train is None:
        accumulation = accumulation or 1
        train = micro * accumulation * replicas
    elif micro is None:
        raise BatchSizeError("the DeepSpeed config gives neither train_batch_size nor train_micro_batch_size_per_gpu "
                             "(DeepSpeed needs one): add \"train_micro_batch_size_per_gpu\": 1")
    if micro < 1 or accumulation < 1 or train != micro * accumulation * replicas:
        raise BatchSizeError(_mismatch(ds_config, train, micro, accumulation, replicas))
    return BatchSize(micro, accumulation, replicas)


def _mismatch(ds_config: Mapping[str, Any], train: int, micro: int, accumulation: int, replicas: int) -> str:
    given = ", ".join(f"{key} {ds_config[key]!r}" for key in KEYS if key in ds_config)
    if all(key in ds_config for key in KEYS):
        fix = (f"set train_batch_size to {max(micro, 1) * max(accumulation, 1) * replicas}, or leave it out "
               "(DeepSpeed derives it)")
    else:
        per_step = max(micro, 1) * replicas
        lower, upper = max(train // per_step, 1) * per_step, (train // per_step + 1) * per_step
        fix = (f"set train_batch_size to a multiple of {per_step} (micro-batch x replicas): {lower} or {upper}; or "
               "give gradient_accumulation_steps instead")
    return (f"the batch keys do not fit {replicas} data-parallel replica(s): {given} (train_batch_size must equal "
            "train_micro_batch_size_per_gpu x gradient_accumulation_steps x replicas; DeepSpeed would refuse it "
            f"inside deepspeed.initialize): {fix}")


def batch_size_problems(ds_config: Mapping[str, Any], replicas: int) -> list[str]:
    """:func:`read_batch_size`'s refusal as a list (empty: the batch is fine). A config with "auto" is the
    Trainer's: it fills the keys from its TrainingArguments and checks the numbers given against them, so only the
    values' form is checked here (a script that reads "auto" refuses it in :func:`read_batch_size`). A config with
    neither the global batch nor the micro-batch is left to DeepSpeed's own one-line assertion (a dict handed to
    ``engine.initialize`` may get them later; the scripts read the triple with :func:`read_batch_size`, which names
    it)."""
    try:
        for key in KEYS:
            _value(ds_config, key, 1)  # each a positive integer, "auto" or absent
        given = [ds_config.get(key) for key in KEYS]
        if AUTO not in given and (given[0] is not None or given[1] is not None):
            read_batch_size(ds_config, replicas)
    except BatchSizeError as err:
        return [str(err)]
    return []
