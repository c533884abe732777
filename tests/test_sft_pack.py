"""examples/sft.py --pack: the packer (first-fit decreasing), the packed row form, and packed runs end to end.

The packed form is transformers' ``DataCollatorWithFlattening`` with fixed row length: input_ids,
position_ids restarting at 0 per document, labels -100 at each document's first token and on
prompts, no attention_mask, a pad tail as one more all-ignored document.
"""

import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ds_longseq.engine import shard_batch
from ds_longseq.resolver import Launch, RunCannotStart, RunShape, resolve
from ds_longseq.toolkit import (
    JsonlData,
    PackedData,
    first_fit_decreasing,
    micro_batch,
    micro_batch_indices,
    pack_jsonl,
)
from tests.test_sft import ROOT, _config, _tiny_hf_model_with_tokenizer, losses, run_sft


def _naive_first_fit_decreasing(lengths, capacity):
    """The textbook O(n^2) loop: longest first (ties in input order), first open bin with room."""
    bins, free = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, room in enumerate(free):
            if room >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(capacity - lengths[i])
    return bins


def test_first_fit_decreasing_matches_the_naive_loop():
    assert first_fit_decreasing([5, 4, 3, 3, 2, 1], 8) == [[0, 2], [1, 3, 5], [4]]
    assert first_fit_decreasing([8], 8) == [[0]] and first_fit_decreasing([], 8) == []
    rng = random.Random(0)
    for _ in range(200):
        capacity = rng.randint(1, 64)
        lengths = [rng.randint(1, capacity) for _ in range(rng.randint(1, 70))]
        bins = first_fit_decreasing(lengths, capacity)
        assert bins == _naive_first_fit_decreasing(lengths, capacity)
        assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"item 1 has length {bad}: lengths must be in \\[1, 8\\]"):
            first_fit_decreasing([3, bad], 8)


def _segments(row):
    """Split a packed row where position_ids restart: [(input_ids, labels)] per document."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [len(row["input_ids"])]
    bounds = zip(starts[:-1], starts[1:], strict=True)
    return [(row["input_ids"][s:e].tolist(), row["labels"][s:e].tolist()) for s, e in bounds]


# bitwise by construction: integer ids and labels
def test_packed_rows_boundaries_positions_labels_tail_and_efficiency():
    pad = 0
    # (input_ids, labels): -100 on prompt tokens, as JsonlData.tokenize returns them.
    docs = [
        ([11, 12, 13], [-100, -100, 13]),  # 2 prompt tokens
        ([21, 22], [21, 22]),
        ([31] * 12, [31] * 12),  # longer than seq_len 8: cut to 8
        ([], []),  # empty: skipped
        ([41, 42, 43, 44, 45], [41, 42, 43, 44, 45]),
        ([51], [51]),
    ]
    data = PackedData(docs, seq_len=8, pad_id=pad)
    st = data.stats
    # First-fit decreasing over lengths 3, 2, 8, 5, 1: [31*8], [41..45, 11..13], [21 22, 51].
    assert (st.num_documents, st.num_rows, st.num_truncated, st.num_empty) == (5, 3, 1, 1)
    assert st.num_real_tokens == 3 + 2 + 8 + 5 + 1
    assert st.efficiency == pytest.approx(19 / 24, abs=1e-12)

    rows = [data[i] for i in range(len(data))]
    for row in rows:
        assert set(row) == {"input_ids", "position_ids", "labels"}  # no attention_mask: packed rows have none
        assert all(t.shape == (8,) and t.dtype == torch.long for t in row.values())
    by_first = {tuple(_segments(r)[0][0]): r for r in rows}
    full = by_first[(31,) * 8]
    assert full["position_ids"].tolist() == list(range(8))  # exactly full: no tail
    assert full["labels"].tolist() == [-100] + [31] * 7
    two = by_first[(41, 42, 43, 44, 45)]
    assert two["input_ids"].tolist() == [41, 42, 43, 44, 45, 11, 12, 13]
    assert two["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    # -100 at each document's first token (so 45 never learns to predict 11) and on the prompt 11 12.
    assert two["labels"].tolist() == [-100, 42, 43, 44, 45, -100, -100, 13]
    tail = by_first[(21, 22)]
    assert tail["input_ids"].tolist() == [21, 22, 51, pad, pad, pad, pad, pad]
    # The pad tail is one more document: positions restart, nothing is trained on.
    assert tail["position_ids"].tolist() == [0, 1, 0, 0, 1, 2, 3, 4]
    assert tail["labels"].tolist() == [-100, 22, -100, -100, -100, -100, -100, -100]
    assert [data.num_real_tokens(i) for i in range(3)] == [8 - int((r["input_ids"] == pad).sum()) for r in rows]

    # Every document comes back exactly once (truncated), with the first label and prompt masked.
    got = sorted(seg for r in rows for seg in _segments(r) if set(seg[0]) != {pad})
    want = sorted((ids[:8], [-100] + labels[1:8]) for ids, labels in docs if ids)
    assert got == want
    # Indices wrap (epochs) and packing is deterministic; the seed changes only the row order.
    assert torch.equal(data[3]["input_ids"], rows[0]["input_ids"])
    again = PackedData(docs, seq_len=8, pad_id=pad)
    assert all(torch.equal(again[i]["labels"], rows[i]["labels"]) for i in range(3))
    other = PackedData(docs, seq_len=8, pad_id=pad, seed=1)
    assert sorted(other.rows) == sorted(data.rows)
    with pytest.raises(ValueError, match="no document holds any token"):
        PackedData([([], [])], seq_len=8, pad_id=pad)


def test_pack_jsonl_tokenises_prompts_and_texts(tmp_path):
    class CharTokenizer:
        pad_token_id, eos_token_id = 0, 0

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [ord(c) for c in text]}

    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "completion": "cd"}) + "\n" + json.dumps({"text": "xyz"}) + "\n")
    data = pack_jsonl(JsonlData(str(path), CharTokenizer(), seq_len=8))
    assert len(data) == 1
    row = data[0]
    # first-fit decreasing: the 4-token document first
    assert row["input_ids"].tolist() == [97, 98, 99, 100, 120, 121, 122, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 0]
    assert row["labels"].tolist() == [-100, -100, 99, 100, -100, 121, 122, -100]


# bitwise by construction: integer positions and labels
def test_packed_batches_keep_position_ids_through_micro_batch_and_shard_batch():
    data = PackedData([([5, 6, 7], [5, 6, 7]), ([8, 9], [8, 9]), ([4] * 4, [4] * 4)], seq_len=6, pad_id=0)
    batch = micro_batch(data.__getitem__, step=0, micro=0, gas=1, rank=0, world=1, micro_bs=2)
    assert set(batch) == {"input_ids", "position_ids", "labels"} and batch["position_ids"].shape == (2, 6)
    shards = [shard_batch(batch, r, 2) for r in range(2)]
    for r, shard in enumerate(shards):
        assert set(shard) == {"input_ids", "position_ids", "shift_labels"}  # still no attention_mask
        assert torch.equal(shard["position_ids"], batch["position_ids"][:, 3 * r : 3 * r + 3])
    shifted = torch.cat([s["shift_labels"] for s in shards], dim=1)
    assert torch.equal(shifted[:, :-1], batch["labels"][:, 1:])


def test_a_packed_row_trains_each_document_as_if_alone():
    """The stock HF model given a packed row (restarting position_ids, no mask) computes, for each
    document, exactly the loss of that document alone: the row form keeps documents apart."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=50, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).double().eval()
    g = torch.Generator().manual_seed(1)
    docs = []
    for n, prompt in ((7, 2), (5, 0), (9, 3), (4, 1)):
        ids = torch.randint(1, 50, (n,), generator=g).tolist()
        docs.append((ids, [-100] * prompt + ids[prompt:]))
    data = PackedData(docs, seq_len=16, pad_id=0)
    batch = micro_batch(data.__getitem__, 0, 0, 1, 0, 1, micro_bs=len(data))
    packed_sum = 0.0
    for b in range(len(data)):
        # use_cache=False as in training: transformers reads restarting positions as documents only without a cache.
        row = {k: v[b : b + 1] for k, v in batch.items() if k != "labels"}
        logits = model(**row, use_cache=False).logits
        packed_sum += F.cross_entropy(logits[0, :-1], batch["labels"][b, 1:], reduction="sum", ignore_index=-100)
    alone_sum, num_valid = 0.0, 0
    for ids, labels in docs:
        logits = model(input_ids=torch.tensor([ids])).logits
        targets = torch.tensor(labels[1:])
        alone_sum += F.cross_entropy(logits[0, :-1], targets, reduction="sum", ignore_index=-100)
        num_valid += int((targets != -100).sum())
    assert int((batch["labels"] != -100).sum()) == num_valid
    # float64: any attention across a document boundary would move the sum by far more than 1e-10.
    torch.testing.assert_close(packed_sum, alone_sum, rtol=1e-10, atol=0)


def _sft_fails(*argv):
    """examples/sft.py ``argv`` as a plain python run (no launcher): the output of a run refused before start-up."""
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "sft.py"), *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=pythonpath))
    assert proc.returncode != 0
    return proc.stderr


def test_pack_argument_checks():
    assert "--pack packs the documents of --data: add --data FILE.jsonl --model PATH" in _sft_fails("--pack")
    assert "--seq-len must be positive, got -1" in _sft_fails("--seq-len", "-1", "--pack")
    # the length against the sequence-parallel layout: a start rule (ds_longseq.resolver), which the scripts'
    # start_distributed and setup_run run
    fits(255, sp=1, world=2)
    with pytest.raises(RunCannotStart, match="not divisible by sequence_parallel size 2: use --seq-len 256"):
        fits(255, sp=2, world=2)
    # packed rows pad like any other (shard_batch pads them with one more, ignored, document)
    fits(255, sp=2, world=2, pad_for_sp=True)
    # under a ring (Ulysses x ring) the sequence is cut into 2 x ring zigzag blocks: 2 P must divide it
    fits(256, sp=2, world=2, ring=2)
    with pytest.raises(RunCannotStart, match=r"sequence length 258 is not divisible by 2 x sequence_parallel size 2 "
                                             r"\(a ring of 2: its zigzag blocks\): use --seq-len 260, or pad"):
        fits(258, sp=2, world=2, ring=2)
    fits(258, sp=2, world=2, ring=2, pad_for_sp=True)
    with pytest.raises(RunCannotStart, match="sequence_parallel size 2 does not divide the 3 ranks"):
        fits(256, sp=2, world=3)


def fits(seq_len: int, *, sp: int, world: int, pad_for_sp: bool = False, ring: int | None = None):
    """``resolve`` of a config of sequence-parallel size ``sp`` for ``world`` ranks and ``seq_len`` tokens (the
    ring degree as the run knows it once chosen from the model's heads)."""
    return resolve({"long_seq": {"sequence_parallel": {"size": sp}}}, launch=Launch(world=world),
                   run=RunShape(seq_len=seq_len, pad_for_sp=pad_for_sp, ring=ring))


# ---------------------------------------------------------------------------------------------
# End to end: 2 CPU ranks through the DeepSpeed launcher

WORDS = "the quick brown fox jumps over the lazy dog".split()


def _documents(num=14, seed=0):
    rng = random.Random(seed)
    records = []
    for i in range(num):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        records.append({"prompt": "the fox ", "completion": words} if i % 3 == 0 else {"text": words})
    records.append({"text": "the lazy dog sleeps " * 80})  # longer than --seq-len 256: truncated
    return records


def _mst_config(tmp_path):
    with open(os.path.join(ROOT, "ds_configs", "zero2_mst.json")) as f:
        config = json.load(f)
    config["long_seq"]["mini_seq"]["mlp_num_chunks"] = 3
    config["long_seq"]["lm_head"]["chunk_size"] = 5
    path = tmp_path / "zero2_mst.json"
    path.write_text(json.dumps(config))
    return str(path)


def _reference_first_loss(model_dir, data_path, seq_len=256, num_ranks=2):
    """Step 1's logged loss, computed here from the initial weights: each rank's micro-batch loss is
    its row's summed token losses over its valid tokens, each document run alone through stock HF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").float().eval()
    data = pack_jsonl(JsonlData(str(data_path), AutoTokenizer.from_pretrained(model_dir), seq_len), seed=0)
    rank_losses = []
    with torch.no_grad():
        for rank in range(num_ranks):
            (index,) = micro_batch_indices(0, 0, 1, rank, num_ranks, 1)
            total, count = 0.0, 0
            for ids, labels in _segments(data[index]):
                targets = torch.tensor(labels[1:])
                if (targets != -100).any():
                    logits = model(input_ids=torch.tensor([ids])).logits
                    total += float(F.cross_entropy(logits[0, :-1], targets, reduction="sum", ignore_index=-100))
                    count += int((targets != -100).sum())
            rank_losses.append(total / count)
    return sum(rank_losses) / num_ranks, data.stats


def _packed_run(tmp_path, config):
    model_dir = tmp_path / "model"
    _tiny_hf_model_with_tokenizer(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in _documents()) + "\n")
    out = tmp_path / "out"
    proc = run_sft(config, out, "--model", str(model_dir), "--data", str(data), "--pack", "--max-steps", "2")
    expected, stats = _reference_first_loss(model_dir, data)
    log = proc.stdout + proc.stderr
    assert (f"--pack: {stats.num_documents} documents in {stats.num_rows} rows of 256 tokens (first-fit decreasing): "
            f"packing efficiency {stats.efficiency:.1%}") in log
    assert (f"--pack: 1 of {stats.num_documents} documents were longer than --seq-len 256 and were truncated to "
            "their first 256 tokens") in log
    assert stats.num_rows >= 2 and stats.efficiency > 0.9  # several documents per row
    got = losses(out)
    assert len(got) == 2
    # float32; chunked LM head and MLP chunks vs one stock forward per document: round-off only.
    assert abs(got[0] - expected) <= 1e-5 * expected, (got, expected)


@pytest.mark.slow  # CI time: the default run keeps the packed run through StreamBP
def test_packed_run_with_stock_attention_trains_each_document_alone(tmp_path):
    """ds_configs/zero2_mst.json (mini-seq MLP, chunked LM head, stock attention): transformers builds the
    block-diagonal mask from the restarting position_ids."""
    _packed_run(tmp_path, _mst_config(tmp_path))


def test_packed_run_through_streambp_trains_each_document_alone(tmp_path):
    """ds_configs/zero2_streambp.json (chunks of 96): needs ds_longseq's StreamBP to support packed rows
    (document-local attention); until it does, the library refuses them (check_not_packed)."""
    _packed_run(tmp_path, _config(tmp_path))
