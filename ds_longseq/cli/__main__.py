"""``python -m ds_longseq.cli``: the ``ds-longseq`` command where its console script is not on PATH."""

import sys

from ds_longseq.cli import main

sys.exit(main())
