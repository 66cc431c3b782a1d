"""Trial 13's command-line findings 4-9: remedies that are true, one check for a flag and its variable, values
shown as given, help text in full, README commands that end quietly."""

from __future__ import annotations

import json
import re

import pytest

from pipeline.platforms.profiles import names as profile_names


def _json(proc) -> dict:
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("value", ["bogus", "torch,bogus", "Foo,bar"])
def test_installed_remedy_is_true_and_readable(value):
    """Finding 4: ``plan --installed bogus`` suggested ``--installed ''``, which a GPU profile then refused (exit 3,
    capability_mismatch), in a garbled sentence. The remedy's value now plans on every profile."""
    from conftest import run_main

    for profile in profile_names():
        err = _json(run_main("plan", "--installed", value, "--device-profile", profile, "--json"))["error"]
        assert err["code"] == "out_of_domain"
        remedy = err["remedy"]
        assert "the names of the list" not in remedy
        assert re.search(r"'(bogus|Foo)'.* (is not a package|are not packages) a plan reads", remedy), remedy
        fixed = re.search(r"pass --installed (\S+) to plan", remedy).group(1)
        assert fixed == "torch,triton,flashinfer"
        assert run_main("plan", "--installed", fixed, "--device-profile", profile).returncode == 0, profile
