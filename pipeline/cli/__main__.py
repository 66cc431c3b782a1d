"""``python -m pipeline.cli``: the ``attn-setup`` command line."""

import sys

from pipeline.cli import main

sys.exit(main())
