"""The README's Python blocks run as pasted: the first (a model, a batch, ``enable``) and each other one after it
(they are alternatives: DeepSpeed's engine, the Trainer), each in a subprocess from the repository root (their
config paths are the repository's), as one process of a DeepSpeed job (the rank variables a launcher sets, set
here)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"^```python\n(.*?)^```", f.read(), flags=re.S | re.M)


def _run(tmp_path, name: str, source: str) -> subprocess.CompletedProcess:
    from tests.dist_utils import free_port

    script = tmp_path / f"{name}.py"
    # the Trainer writes its output_dir ("out") relative to the working directory: kept out of the checkout
    script.write_text(source.replace('output_dir="out"', f'output_dir="{tmp_path}/out"'))
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow  # ~45 s (a DeepSpeed engine and a Trainer run); the default run keeps the docs-link checks
def test_readme_python_blocks_run_as_pasted(tmp_path):
    blocks = readme_blocks()
    assert len(blocks) >= 3
    # the first block runs at the start of each run
    runs = {f"block{i}": blocks[0] + "\n" + block for i, block in enumerate(blocks[1:], start=2)}
    for name, source in runs.items():
        proc = _run(tmp_path, name, source)
        assert proc.returncode == 0, (name, proc.stderr[-5000:])
