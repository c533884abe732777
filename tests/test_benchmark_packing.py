"""benchmarks/packing.py on a tiny model: the packed row trains exactly what the padded rows train
(the same loss), attends less, and its report is written."""

import json
import math

from benchmarks import packing


def test_packed_and_padded_layouts_train_the_same_targets(tmp_path):
    out = tmp_path / "packing"
    packing.main(["--seq-len", "300", "--doc-len", "8", "96", "--hidden", "32", "--layers", "1", "--heads", "4",
                  "--kv-heads", "2", "--vocab", "64", "--chunk", "64", "--kv-block", "32", "--repeats", "1",
                  "--out", str(out)])
    rows = {r["layout"]: r for r in map(json.loads, (tmp_path / "packing.jsonl").read_text().splitlines())}
    assert set(rows) == set(packing.LAYOUTS)
    packed, padded, one = rows["packed"], rows["padded"], rows["one_document"]
    assert packed["real_tokens"] == padded["real_tokens"] == one["real_tokens"] == 300
    # no target crosses a document boundary in either layout: the same targets, the same mean loss
    assert math.isclose(packed["loss"], padded["loss"], rel_tol=1e-5), (packed["loss"], padded["loss"])
    assert not math.isclose(packed["loss"], one["loss"], rel_tol=1e-4)  # attending across documents differs
    assert packed["attention_pairs"] < one["attention_pairs"]
    assert packed["tiles_without_bounds"] == one["tiles"]
    report = (tmp_path / "packing.md").read_text()
    assert "| packed | 1 x 300 |" in report and "float32 on cpu" in report
