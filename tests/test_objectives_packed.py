"""Per-token log-probs of packed rows (several completions per row, restarting position ids): each
document's log-probs and their gradients equal the document run alone through the stock model,
float64 to 1e-10; no log-prob crosses a document boundary."""

import pytest
import torch

import ds_longseq
from tests.helpers import clone, compare, grads_of, make_model
from tests.test_objectives import CONFIGS
from tests.test_packing import packed_batch

DOCS = [[7, 9, 1, 6], [11, 12]]  # a 1-token document too


@pytest.mark.parametrize("config", ["streambp", "mini_seq"])
def test_packed_token_logprobs_equal_documents_alone(config):
    model = make_model("qwen3", torch.float64)
    batch, documents = packed_batch(DOCS, "position_ids", collator_labels=False)
    g = torch.Generator().manual_seed(5)
    weights = torch.randn(batch["input_ids"].shape, generator=g, dtype=torch.float64)
    flat_w = weights.flatten()

    def alone():
        total, offset = 0.0, 0
        per_token = torch.zeros(flat_w.shape, dtype=torch.float64)
        for ids in documents:
            n = ids.numel()
            logits = model(input_ids=ids.unsqueeze(0), use_cache=False).logits.double()[0]
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None]).squeeze(-1)  # (n - 1,)
            total = total + (lp * flat_w[offset : offset + n - 1]).sum()
            per_token[offset : offset + n - 1] = lp.detach()
            offset += n
        alone.per_token = per_token
        return total

    embeds = []

    def keep(module, inputs, output):
        output.retain_grad()
        embeds.append(output)

    handle = model.get_input_embeddings().register_forward_hook(keep)
    try:
        loss, grads, _ = grads_of(model, alone)
    finally:
        handle.remove()
    ref = (loss, grads, torch.cat([e.grad[0] for e in embeds]))
    ours = ds_longseq.enable(clone(model), CONFIGS[config])

    def packed():
        lp = ours(**batch, return_token_logprobs=True)
        packed.per_token = lp.logprobs.detach().flatten()
        return (lp.logprobs * weights).sum()

    got = grads_of(ours, packed)
    torch.testing.assert_close(packed.per_token, alone.per_token, rtol=0, atol=1e-12)
    errs = compare((got[0], got[1], got[2].reshape(-1, got[2].shape[-1])), ref)
    assert max(errs.values()) < 1e-10, errs
