"""attn-setup installs beside sglang 0.5.23: our dependencies and ``cuda`` extra admit what sglang's install pins.

tests/data/sglang-0.5.23-requires.txt holds the Requires-Dist lines of sglang 0.5.23 and of the torch and FlashInfer
it pins (copied from the wheels' METADATA, each with its file name and sha256). For every package both sides
constrain (markers evaluated for sglang's wheel: CPython 3.11 on Linux x86_64, no extras): where the other side pins
``==v``, ``v`` must be in our specifier; where both give ranges, one of the released versions recorded in the data
file must satisfy both. No network: the check reads pyproject.toml (tomllib) and the data file (packaging).
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data" / "sglang-0.5.23-requires.txt"
ENV = {"implementation_name": "cpython", "platform_python_implementation": "CPython", "os_name": "posix",
       "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "python_version": "3.11",
       "python_full_version": "3.11.7", "extra": ""}


def their_side(text: str) -> tuple[dict[str, SpecifierSet], dict[str, list[str]], dict[str, str]]:
    """(package → every constraint sglang's install puts on it, intersected; package → recorded versions; the
    ``[name version]`` sections and their ``file sha256=…`` sources)."""
    specs: dict[str, SpecifierSet] = {}
    recorded: dict[str, list[str]] = {}
    sources: dict[str, str] = {}
    section = None
    for line in text.splitlines():
        if m := re.fullmatch(r"\[([^\]]+)\](.*)", line):
            section = m.group(1)
            sources[section] = m.group(2).strip()
        elif section == "versions" and ":" in line:
            name, versions = line.split(":", 1)
            recorded[canonicalize_name(name)] = versions.split()
        elif line.startswith("Requires-Python:"):
            specs["python"] = specs.get("python", SpecifierSet()) & SpecifierSet(line.split(":", 1)[1].strip())
        elif line.startswith("Requires-Dist:"):
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is None or req.marker.evaluate(ENV):
                name = canonicalize_name(req.name)
                specs[name] = specs.get(name, SpecifierSet()) & req.specifier
    return specs, recorded, sources


def our_side(pyproject: dict) -> dict[str, SpecifierSet]:
    """package → our specifier (``[project.dependencies]`` and the ``cuda`` extra), plus ``python``."""
    proj = pyproject["project"]
    out = {"python": SpecifierSet(proj["requires-python"])}
    for line in proj["dependencies"] + proj["optional-dependencies"]["cuda"]:
        req = Requirement(line)
        assert req.marker is None or req.marker.evaluate(ENV), line
        name = canonicalize_name(req.name)
        out[name] = out.get(name, SpecifierSet()) & req.specifier
    return out


def pinned(spec: SpecifierSet) -> str | None:
    """The version ``spec`` pins with ``==v`` (no wildcard), else None."""
    pins = [s.version for s in spec if s.operator in ("==", "===") and not s.version.endswith("*")]
    return pins[0] if pins else None


def conflicts(ours: dict[str, SpecifierSet], theirs: dict[str, SpecifierSet],
              recorded: dict[str, list[str]]) -> dict[str, str]:
    """package → why no one environment holds both (empty: co-installable), for every package both constrain."""
    out = {}
    for name in sorted(set(ours) & set(theirs)):
        pin = pinned(theirs[name])
        if pin is not None:
            if not ours[name].contains(pin, prereleases=True):
                out[name] = f"they pin {pin}, we require {ours[name]}"
            continue
        if name == "python":
            candidates = ["3.11", "3.12", "3.13", "3.14"]
        elif name not in recorded:
            out[name] = f"both give ranges (ours {ours[name]}, theirs {theirs[name] or 'any'}) and no versions are " \
                        f"recorded for {name} in {DATA.name}"
            continue
        else:
            candidates = recorded[name]
        if not any(ours[name].contains(v) and theirs[name].contains(v) for v in candidates):
            out[name] = f"no recorded version satisfies ours {ours[name]} and theirs {theirs[name]}: {candidates}"
    return out


def _load() -> tuple[dict, dict, dict, dict]:
    theirs, recorded, sources = their_side(DATA.read_text())
    return our_side(tomllib.loads((ROOT / "pyproject.toml").read_text())), theirs, recorded, sources


def test_the_pins_come_from_the_wheels_named():
    """The data file names each wheel and its sha256, and holds the pins issue 31 names."""
    _, theirs, _, sources = _load()
    assert sources["sglang 0.5.23"] == ("sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl sha256="
                                        "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937")
    assert re.fullmatch(r"torch-2\.14\.1-\S+\.whl sha256=[0-9a-f]{64}", sources["torch 2.14.1"])
    assert re.fullmatch(r"flashinfer_python-0\.7\.2-\S+\.whl sha256=[0-9a-f]{64}", sources["flashinfer-python 0.7.2"])
    assert {n: pinned(theirs[n]) for n in ("torch", "flashinfer-python", "transformers")} == {
        "torch": "2.14.1", "flashinfer-python": "0.7.2", "transformers": "5.19.0"}
    assert str(theirs["triton"]) == "~=3.8.0" and str(theirs["packaging"]) == ">=24.2"


def test_our_requirements_admit_sglang_0_5_23():
    """Every package both constrain is co-installable; torch, flashinfer-python, triton, msgspec and packaging are
    among them (transformers too once our dependencies list it: sglang pins 5.19.0)."""
    ours, theirs, recorded, _ = _load()
    assert conflicts(ours, theirs, recorded) == {}
    assert {"torch", "flashinfer-python", "triton", "msgspec", "packaging", "python"} <= set(ours) & set(theirs)


def test_a_narrowed_range_is_caught():
    """The check fails when a range is narrowed past sglang's pins (the test can fail): torch >=2.15, FlashInfer
    0.7.2.post1 only, triton below 3.8, transformers <5.19."""
    ours, theirs, recorded, _ = _load()
    for name, spec in (("torch", ">=2.15,<2.16"), ("flashinfer-python", "==0.7.2.post1"), ("triton", ">=3.6,<3.8"),
                       ("transformers", ">=5,<5.19"), ("packaging", "<24.2")):
        bad = conflicts({**ours, name: SpecifierSet(spec)}, theirs, recorded)
        assert list(bad) == [name], (name, bad)


def test_pyproject_installs_what_resolve_accepts():
    """The dependency and ``cuda`` extra ranges of torch, triton and flashinfer-python are the supported versions
    resolve checks (pipeline/backends/records.py), so pip never installs a version resolve refuses."""
    from pipeline.backends.records import PACKAGES

    ours, *_ = _load()
    assert {n: str(ours[n]) for n in PACKAGES} == {n: str(SpecifierSet(spec)) for n, (_, spec) in PACKAGES.items()}


def test_markers_are_read_for_linux_x86_64():
    """sglang's aarch64-only requirements are not counted; its x86_64 ones are."""
    assert not Marker('sys_platform == "linux" and platform_machine == "aarch64"').evaluate(ENV)
    theirs, _, _ = their_side(DATA.read_text())
    assert "decord2" not in theirs and "torchcodec" in theirs
