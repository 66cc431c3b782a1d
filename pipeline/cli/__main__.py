"""``python -m pipeline.cli``: the ``attn-setup`` command line (:func:`pipeline.cli.entry`: main, then a fast exit)."""

from pipeline.cli import entry

entry()
