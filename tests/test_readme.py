"""README contracts: the two commands, the CI test command, the exit-code table, the event catalogue."""

from __future__ import annotations

import re

from conftest import ROOT
from pipeline.core import events as ev

README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    """.ci/run runs exactly the README's test command, after the README's install steps."""
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.+?)\n```", README)
    assert len(blocks) == 2, blocks
    run_cmd, test_cmd = blocks
    assert run_cmd.endswith("attn-setup run --device cpu")
    parts = test_cmd.split(" && ")
    assert parts[-1] == "python3 -m pytest -q"
    for part in parts:
        assert part in ci, part


def test_event_catalogue_matches_the_structs():
    """The README event table is exactly what the event Structs generate."""
    block = re.search(r"<!-- events:begin -->\n(.*?)\n<!-- events:end -->", README, re.S).group(1)
    assert block == ev.catalogue_markdown()


def test_exit_code_table():
    """The exit-code table lists 0-3 with the documented meanings."""
    from pipeline.core import errors

    assert (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE, errors.EXIT_REFUSED) == (0, 1, 2, 3)
    for code, word in ((0, "success"), (1, "failed"), (2, "usage"), (3, "refused")):
        assert re.search(rf"\| {code} \| [^\n]*{word}", README)
