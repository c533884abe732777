"""DeepSpeed's known slips, put right on the instance: ZeRO-3's gradient average under sequence parallelism, and what
its universal-checkpoint load leaves wrong in the optimizer.

Holds:
    ZERO3_SP_AVERAGE_VERSIONS, zero3_sequence_parallel_problem, fix_zero3_sequence_parallel_average: DeepSpeed
        ZeRO-3's gradient average under sequence parallelism, corrected on the versions where it is known
        wrong and refused on versions nobody checked.
    repair_universal_load: what DeepSpeed's universal-checkpoint load leaves wrong in the optimizer (ZeRO-3: a step
        count shared by its sub-groups, the first group's hyperparameters in every group; ZeRO-1/2 on 0.18: the
        fp32 views), put right.

Where a workaround depends on a third-party bug being present, it is keyed on the exact versions checked
(``ZERO3_SP_AVERAGE_VERSIONS``), never on a version range or the library's source text, so a release that fixes the
bug is refused until checked instead of corrected twice; where the state itself tells, it is decided on the state.
"""

from __future__ import annotations

from typing import Any

from ds_longseq.compat.deepspeed_shims import deepspeed_version
from ds_longseq.compat.versions import release

__all__ = [
    "ZERO3_SP_AVERAGE_VERSIONS",
    "zero3_sequence_parallel_problem",
    "fix_zero3_sequence_parallel_average",
    "repair_universal_load",
]


_Z3_SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"

ZERO3_SP_AVERAGE_VERSIONS: dict[str, bool] = {"0.18.9": True, "0.19.8": True}
"""DeepSpeed releases whose ZeRO-3 gradient average under sequence parallelism was checked, and whether
it needs correcting (0.18.9 by the floor run's ZeRO-3 parity test, with the same correction). In 0.19.8 (as in
0.18.9) ``reduce_scatter_coalesced`` divides by the world size and
``__avg_scatter_grads`` never multiplies ``sequence_parallel_size`` back, while every other reduction
(ZeRO-1/2, ZeRO-3's contiguous all-reduce path) divides by world / SP: gradients SP times too small.
A release not listed is refused for ZeRO-3 + sequence parallelism (``zero3_sequence_parallel_problem``)
until a test (tests/test_sequence_parallel_engine.py's ZeRO-3 parity) has been run on it and it is added."""


def zero3_sequence_parallel_problem(version: str | None = None) -> str | None:
    """Why ZeRO-3 + sequence parallelism cannot run exactly on this DeepSpeed (None when it can)."""
    if version is None:
        version = deepspeed_version()
    if release(version) in ZERO3_SP_AVERAGE_VERSIONS:
        return None
    checked = ", ".join(sorted(ZERO3_SP_AVERAGE_VERSIONS))
    return (
        f"ZeRO stage 3 with sequence parallelism on DeepSpeed {version}: ds_longseq checked ZeRO-3's gradient "
        f"average under sequence parallelism on DeepSpeed {checked} only (they average over the world "
        "instead of world / sequence_parallel_size and are corrected); use ZeRO stage 2, or DeepSpeed " + checked
    )


def fix_zero3_sequence_parallel_average(optimizer, sp_size: int, version: str | None = None) -> bool:
    """Make a ZeRO-3 optimizer's reduce-scatter average over data-parallel replicas (world / SP).

    Under sequence parallelism each rank's gradient is its share of its replica's loss, so the
    replicas' gradients are the sums over their SP ranks and DeepSpeed must divide by world / SP, as
    its other reduction paths do. On the releases :data:`ZERO3_SP_AVERAGE_VERSIONS` marks as wrong,
    this wraps that method on the given optimizer instance only, multiplying its partitions by ``sp_size``.

    Returns:
        Whether the fix was applied (False with ``sp_size`` 1 or a release checked to be right).

    Raises:
        RuntimeError: this DeepSpeed release was never checked (see :func:`zero3_sequence_parallel_problem`),
            or the optimizer is not DeepSpeed's ZeRO-3 optimizer.
    """
    if sp_size <= 1:
        return False
    if version is None:
        version = deepspeed_version()
    problem = zero3_sequence_parallel_problem(version)
    if problem is not None:
        raise RuntimeError(problem)
    if not ZERO3_SP_AVERAGE_VERSIONS[release(version)]:
        return False
    if not hasattr(optimizer, _Z3_SCATTER):
        raise RuntimeError(
            f"expected DeepSpeed's ZeRO-3 optimizer, got {type(optimizer).__name__}: cannot correct its gradient "
            "average under sequence parallelism"
        )
    original = getattr(optimizer, _Z3_SCATTER)

    def avg_scatter_grads(params, communication_data_type):
        return [g.mul(sp_size) for g in original(params, communication_data_type)]

    object.__setattr__(optimizer, _Z3_SCATTER, avg_scatter_grads)
    return True


def _same(a: Any, b: Any) -> bool:
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    return a == b


def _relinked_zero12_fragments(optimizer: Any) -> list[str]:
    """Point each parameter's fp32 fragment and optimizer-state fragments (``_hp_mapping.hp_fragment`` /
    ``optim_fragment``, what ``deepspeed.utils.safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state``
    read and ``safe_set_*`` write) back into the ZeRO-1/2 optimizer's fp32 partition and its state.

    DeepSpeed 0.18 (0.18.9 checked): its universal load (``map_to_flat_opt_states``) re-points ``hp_fragment`` at
    each new optimizer-state buffer in turn, so it ends on the last one (``exp_avg_sq`` read as the fp32 weight),
    and leaves ``optim_fragment`` copies that the steps do not update; 0.19 sets the state fragments instead. The
    step itself uses the partition and its state, so training was right and only these reads were wrong."""
    lp_groups = getattr(optimizer, "bit16_groups", None)
    if lp_groups is None:
        return []
    inner = optimizer.optimizer
    relinked = 0
    for index, group in enumerate(inner.param_groups):
        flat = group["params"][0]
        state = inner.state.get(flat, {})
        for lp in lp_groups[index]:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:
                continue
            where = mapping.get_hp_fragment_address()
            right = flat.narrow(0, where.start, where.numel)
            if mapping.hp_fragment.data_ptr() != right.data_ptr():
                mapping.hp_fragment = right
                mapping.optim_fragment = {key: value.narrow(0, where.start, where.numel)
                                          for key, value in state.items()
                                          if getattr(value, "shape", None) == flat.shape}
                relinked += 1
    return [f"the fp32 and optimizer-state views of {relinked} parameters relinked"] if relinked else []


def repair_universal_load(engine: Any, universal_dir: str) -> list[str]:
    """Undo two slips of DeepSpeed ZeRO-3's universal-checkpoint load (``DeepSpeedZeroOptimizer_Stage3.
    load_hp_checkpoint_state_from_checkpoint_dir_stage3``, 0.19.8) on ``engine``'s optimizer, right after
    ``engine.load_checkpoint`` read ``universal_dir``; returns what was repaired (empty: nothing to).

    - It gives every sub-group's optimizer state the same ``step`` tensor object. torch's Adam increments its step
      in place, once per sub-group per step, so with two sub-groups (the Trainer's decay / no-decay groups, or a model
      larger than ``sub_group_size``) the shared count runs ahead and Adam's bias correction is off from the first
      step after the load (seen: 9e-4 on every LayerNorm weight after one step). Each state gets its own copy.
    - It copies the first parameter group's hyperparameters (``weight_decay``, ``lr``, ...) into every group, so a
      no-decay group would decay. Each group gets its own back from the checkpoint's ``optimizer_state.pt``.

    Under ZeRO-1/2 it relinks what DeepSpeed 0.18's load left pointing elsewhere (``_relinked_zero12_fragments``).

    The repairs restore what the checkpoint holds, so on a DeepSpeed that loads right they change nothing: keyed
    on what the load left, not on a version."""
    if engine.zero_optimization_stage() in (1, 2):
        return _relinked_zero12_fragments(engine.optimizer)
    if engine.zero_optimization_stage() != 3:
        return []
    import os

    import torch

    optimizer = engine.optimizer.optimizer  # the torch optimizer ZeRO-3 steps, one sub-group at a time
    repaired, seen, untied = [], set(), 0
    for state in optimizer.state.values():
        step = state.get("step")
        if torch.is_tensor(step):
            if id(step) in seen:
                state["step"] = step.clone()
                untied += 1
            seen.add(id(state["step"]))
    if untied:
        repaired.append(f"the Adam step count {untied + 1} sub-groups shared untied")
    saved = torch.load(os.path.join(universal_dir, "zero", "optimizer_state.pt"), map_location="cpu",
                       weights_only=False)["optimizer_state_dict"]["param_groups"]
    if len(saved) != len(optimizer.param_groups):
        raise RuntimeError(f"{universal_dir} has {len(saved)} optimizer parameter groups, this run's optimizer "
                           f"{len(optimizer.param_groups)}: resume with the optimizer settings that wrote it")
    for index, (group, loaded) in enumerate(zip(optimizer.param_groups, saved, strict=True)):
        wrong = sorted(k for k, v in loaded.items() if k != "params" and not _same(group.get(k), v))
        for key in wrong:
            group[key] = loaded[key]
        if wrong:
            repaired.append(f"group {index}'s {', '.join(wrong)} restored")
    return repaired
