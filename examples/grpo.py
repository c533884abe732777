"""GRPO on precomputed rollouts for a Hugging Face causal LM on long sequences with ds_longseq + DeepSpeed.

The same training as the ``ds-longseq grpo`` command (its code is :mod:`ds_longseq.cli.grpo`, whose docstring says
what it trains, what --data holds and what it writes), as a script to launch the DeepSpeed way:

    deepspeed --num_gpus 2 examples/grpo.py --ds_config ds_configs/zero2_streambp.json
    deepspeed --num_gpus 2 examples/grpo.py --ds_config ds_configs/zero3_streambp.json \
        --model /path/to/model --data rollouts.jsonl --num-iterations 2 --beta 0.04
    python examples/grpo.py                  # no launcher: one process

Exit status: 0 done, 1 the step does not fit (the memory preflight), 2 bad input (one line on stderr).
"""

import sys

from ds_longseq.cli.grpo import DEFAULT_LR, build_parser, check_args, main, parse_args
from ds_longseq.toolkit.args import exit_status

__all__ = ["DEFAULT_LR", "build_parser", "parse_args", "check_args", "main"]

if __name__ == "__main__":
    sys.exit(exit_status(main))
