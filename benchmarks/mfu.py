"""Model-FLOPs utilisation of a training step: the FLOPs a model must do, over a device's dense peak.

Holds:
    PEAK_TFLOPS and peak_tflops: dense bf16 peaks by device name (``torch.cuda.get_device_name()``).
    matmul_params: the parameters that take part in matrix products (every layer's projections and the LM head;
        not the input embedding, a lookup).
    step_flops: one training step's model FLOPs, and ``mfu``: a measured tokens/s as a fraction of a peak.

Pure arithmetic (no torch import), so the report tools and the tests start fast.

The count (T tokens, P = matmul_params, L layers, h = heads x head dim, the attention's width):
    forward                    2 P T  +  2 x 2 x (T^2 / 2) x L x h     (causal: half the score and value products)
    backward, input gradients  2 P T  +  2 x (the forward's attention)  (dQ, dK, dV and dP: four products against
                                                                        the forward's two; all of attention's
                                                                        backward is input gradients)
    backward, weight gradients 2 P T, only when the base is trained (``weight_gradients=True``)
so a frozen-base (LoRA) step counts 4 P T + 6 T^2 L h. LoRA's own products (rank r on the seven projections:
r x (in + out) per adapter, 0.6% of a Llama-3-8B layer's weights, over three passes) are about 1% of the total
and are left out, as is recomputation (checkpointing's, StreamBP's replay): model FLOPs count the work the model
needs, not the work a method chooses to redo. This reproduces issue 61's figures for the Llama-3-8B shape on an
H200 (26% for 4647 tokens/s at 32K, 27.5% for 2043 at 128K; ``tests/test_gpu_gap_smoke.py``); counting the
attention backward as only "the same again" (4 T^2 L h in all) would give 22% and 20% instead.
"""

from __future__ import annotations

from benchmarks.recipes import ModelShape

__all__ = ["PEAK_TFLOPS", "peak_tflops", "matmul_params", "step_flops", "mfu"]

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from NVIDIA's datasheets, TFLOP/s. Matched in order, first hit
# wins, so the specific names (NVL, PCIe) come before the plain ones; an H100 named only "H100" is the SXM part
# ("NVIDIA H100 80GB HBM3"), an H200 named only "H200" likewise ("NVIDIA H200").
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200 NVL", 835.0),
    ("H200", 989.0),
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
)


def peak_tflops(device_name: str) -> tuple[float, str] | None:
    """(dense bf16 peak TFLOP/s, the table key that matched) for a CUDA device name, or None if unknown (the CPU).

    Accepts benchmarks.run's device column too ("NVIDIA H200 (PYTORCH_CUDA_ALLOC_CONF=...)")."""
    name = device_name.split(" (")[0]
    for key, peak in PEAK_TFLOPS:
        if key in name:
            return peak, key
    return None


def matmul_params(shape: ModelShape) -> int:
    """Weights that take part in matrix products: q/k/v/o and the MLP's three per layer, plus the LM head (tied or
    not, it is a product). Norm weights and biases are not products; the input embedding is a lookup."""
    head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    q_out = shape.num_attention_heads * head_dim
    kv_out = shape.num_key_value_heads * head_dim
    attention = shape.hidden_size * (2 * q_out + 2 * kv_out)  # q and o, k and v
    mlp = 3 * shape.hidden_size * shape.intermediate_size  # gate, up, down
    return shape.num_hidden_layers * (attention + mlp) + shape.vocab_size * shape.hidden_size


def step_flops(shape: ModelShape, seq_len: int, *, batch_size: int = 1, weight_gradients: bool = False) -> float:
    """Model FLOPs of one training step on ``batch_size`` sequences of ``seq_len`` tokens (module docstring)."""
    head_dim = shape.head_dim or shape.hidden_size // shape.num_attention_heads
    width = shape.num_attention_heads * head_dim
    tokens = seq_len * batch_size
    matmul = 2.0 * matmul_params(shape) * tokens  # one pass over every weight
    attention = 2.0 * 2.0 * (seq_len**2 / 2) * shape.num_hidden_layers * width * batch_size  # causal forward
    flops = (matmul + attention) + (matmul + 2 * attention)  # forward, then backward's input gradients
    if weight_gradients:
        flops += matmul
    return flops


def mfu(tokens_per_s: float, shape: ModelShape, seq_len: int, peak: float, **kwargs) -> float:
    """Model-FLOPs utilisation (a fraction) of a step that ran at ``tokens_per_s`` against ``peak`` TFLOP/s."""
    steps_per_s = tokens_per_s / (seq_len * kwargs.get("batch_size", 1))
    return step_flops(shape, seq_len, **kwargs) * steps_per_s / (peak * 1e12)
