"""The Triton Approx-BP kernels (ops/approx_triton.py) against the torch path, through Triton's interpreter.

No GPU here: the kernels run on CPU tensors under ``TRITON_INTERPRET=1``. Triton reads that setting
when a kernel is defined, so the checks run in a child process whose environment has it from the
start (setting it in this process would depend on whether some other test defined the kernels first).

Checked, for RESILU2 and REGELU2: ``pack_step_codes`` gives the bytes of ``pack_codes(step_codes(x))``
and the Triton ``step_backward`` the bits of the torch one, on sizes N = 1, 2, 3 (one partial byte),
4k and 4k + 1..3, sizes that span several programs (4096 elements each) with a ragged tail, and values
at the thresholds (rounded to the dtype), one ulp either side of them, signed zeros, huge, tiny,
infinite and NaN inputs; grads include float32's largest value (its product overflows to inf).

Interpreter caveat: it converts float32 to bfloat16 by dropping the low 16 bits (round toward
zero; ``runtime/interpreter.py`` ``cast_impl``), where GPUs and torch round to nearest even, so the
bfloat16 ``step_backward`` is off by one ulp there and is left to the GPU. bfloat16 and float16
*inputs* are compared exactly (widened to float32, no rounding), and float32 -> float16 goes through
numpy's correctly rounded cast, so those are checked.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from ds_longseq.ops import approx_triton  # noqa: E402
from ds_longseq.ops.approx_autograd import RESILU2, pack_codes, step_codes  # noqa: E402

_CHILD = textwrap.dedent(
    """
    import torch

    from ds_longseq.ops import approx_autograd as ab
    from ds_longseq.ops import approx_triton as tri

    INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    SIZES = [1, 2, 3, 4, 5, 7, 8, 33, 4096, 4096 * 2 + 3]  # 4096 elements = one program
    failures = []


    def special_values(step, dtype):
        # Each threshold as rounded to dtype, one ulp below and above it, and the awkward values.
        inf = torch.tensor(float("inf"), dtype=dtype)
        vals = []
        for c in step.thresholds:
            t = torch.tensor(c, dtype=dtype)
            vals += [t, torch.nextafter(t, -inf), torch.nextafter(t, inf)]
        fi = torch.finfo(dtype)
        vals += [torch.tensor(v, dtype=dtype) for v in (0.0, -0.0, 1.0, -1.0, fi.max, -fi.max, fi.tiny, -fi.tiny,
                                                        1e30, -1e30, float("inf"), float("-inf"), float("nan"))]
        return torch.stack(vals)


    def inputs(step, dtype, n, gen):
        x = (torch.randn(n, generator=gen) * 8).to(dtype)
        special = special_values(step, dtype)
        k = min(n, special.numel())
        x[:k] = special[:k]
        if n > 2 * k:  # the special values also at the end, in the last (partial) byte
            x[-k:] = special[:k]
        return x


    def grads(dtype, n, gen):
        g = (torch.randn(n, generator=gen) * 3).to(dtype)
        g[: min(n, 2)] = torch.finfo(dtype).max  # the product overflows to inf
        return g


    def check(step, dtype, x, backward):
        name = f"{step.name} {dtype} shape={tuple(x.shape)}"
        packed = tri.pack_step_codes(x, step)
        ref = ab.pack_codes(ab.step_codes(x, step))
        if not (packed.dtype == torch.uint8 and torch.equal(packed, ref)):
            bad = (packed != ref).nonzero()[:4].flatten().tolist()
            failures.append(f"pack_step_codes {name}: bytes {bad}: {packed[bad].tolist()} != {ref[bad].tolist()}")
            return
        if not backward:
            return
        g = grads(dtype, x.numel(), gen).view(x.shape)
        got, want = tri.step_backward(packed, g, step), ab.step_backward(packed, g, step)
        if not (got.shape == want.shape and got.dtype == want.dtype
                and torch.equal(got.view(INT_VIEW[dtype]), want.view(INT_VIEW[dtype]))):
            bad = (got != want).nonzero()[:4].flatten().tolist()
            failures.append(f"step_backward {name}: differs at {bad}")


    gen = torch.Generator().manual_seed(0)
    # bfloat16 backward: the interpreter's float32 -> bfloat16 cast truncates (see the test's docstring).
    for dtype, backward in ((torch.float32, True), (torch.float16, True), (torch.bfloat16, False)):
        for step in (ab.RESILU2, ab.REGELU2):
            for n in SIZES:
                check(step, dtype, inputs(step, dtype, n, gen), backward)
            # Several dims, and a non-contiguous view (codes follow the row-major order of x).
            x = inputs(step, dtype, 3 * 5 * 7, gen).view(3, 5, 7)
            check(step, dtype, x, backward)
            check(step, dtype, x.transpose(0, 2), backward)
            check(step, dtype, torch.empty(0, 4, dtype=dtype), backward)

    print("\\n".join(failures) if failures else "ok")
    raise SystemExit(1 if failures else 0)
    """
)


# bitwise by construction: codes, and one multiply per element
def test_kernels_match_torch_path_in_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[:4000] + proc.stderr[-4000:]
    assert proc.stdout.strip() == "ok"


def test_available():
    assert approx_triton.available() is True


def test_float64_and_bad_codes_raise_clearly():
    # Checked before any kernel is defined or launched: safe in this process, without the interpreter.
    x = torch.randn(9, dtype=torch.float64)
    with pytest.raises(ValueError, match="float64.*torch path"):
        approx_triton.pack_step_codes(x, RESILU2)
    packed = pack_codes(step_codes(x, RESILU2))
    with pytest.raises(ValueError, match="float64.*torch path"):
        approx_triton.step_backward(packed, torch.randn(9, dtype=torch.float64), RESILU2)
    with pytest.raises(ValueError, match="at least 3 bytes"):
        approx_triton.step_backward(packed[:2], torch.randn(9), RESILU2)
