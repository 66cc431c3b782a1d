"""Shared fixtures: bundled model specs, small CPU pools, fake platforms."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def user_docs() -> str:
    """README.md and every page of docs/, joined: the user documentation tests check statements against."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return "\n\n".join(p.read_text(encoding="utf-8") for p in pages)

try:  # Triton's interpreter mode is fixed when triton is first imported: decide it before any test does.
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover - torch is a hard dependency
    pass
CONFIGS = ROOT / "examples" / "configs"


def gpu_backends(arch: "str | None" = None, installed_only: bool = False) -> list[str]:
    """The registered backends whose capability record serves CUDA, the reference backend left out (it runs
    everywhere and is tested on its own), in the registry's order: those serving ``arch`` (``"sm90"``) when given,
    and whose packages are installed with ``installed_only``. Derived from the registry, so a new backend is
    tested without editing the tests."""
    from pipeline.backends import packages, registry

    out = []
    for name in registry.names():
        cap = registry.get(name).capability
        if name == registry.reference_name() or "cuda" not in cap.devices:
            continue
        if arch is not None and cap.archs is not None and arch not in cap.archs:
            continue
        if installed_only and not all(packages.installed(cap.packages).values()):
            continue
        out.append(name)
    return out


# `pytest -m smoke`: a one-minute subset over the main paths (contracts and resolve, the pipeline on CPU, the torch
# reference against float64, plan, run, replay, the docs' contracts).
SMOKE_FILES = {"test_pipeline.py", "test_resolve_table.py", "test_torch_native.py", "test_plan_cli.py", "test_cli_run.py",
               "test_replay.py", "test_readme.py"}


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the smoke marker must be on the items by then
def pytest_collection_modifyitems(config, items):
    """Mark the smoke subset; skip GPU-marked tests when torch sees no CUDA device (reported as skipped, never
    silent)."""
    for item in items:
        if item.path.name in SMOKE_FILES:
            item.add_marker(pytest.mark.smoke)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the H200 with `pytest -m gpu`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _reset_structlog():
    """In-process CLI calls configure structlog (as applications do); undo it after each test."""
    yield
    import structlog

    structlog.reset_defaults()


@pytest.fixture(scope="session")
def llama():
    from pipeline.core.model_spec import load_model_spec

    return load_model_spec(CONFIGS / "llama-3.1-8b.json")


@pytest.fixture(scope="session")
def small_pool():
    from pipeline.core.contracts import PoolFacts

    return PoolFacts(max_reqs=8, max_context_len=256, num_token_slots=512, page_size=1)


def cuda_facts(arch=(9, 0), name="NVIDIA H200 (fake)"):
    from pipeline.core.contracts import DeviceFacts

    return DeviceFacts(type="cuda", index=0, name=name, vendor="nvidia", compute_capability=arch, sm_count=132,
                       total_memory_bytes=141 << 30, cuda_version="13.0", source="test")


def npu_facts():
    from pipeline.core.contracts import DeviceFacts

    return DeviceFacts(type="npu", index=0, name="Ascend 910B (fake)", vendor="huawei", sm_count=24,
                       total_memory_bytes=64 << 30, source="test")


def run_json(command: str, *args: str) -> tuple[int, dict]:
    """``attn-setup COMMAND --json ARGS`` in this process (:func:`run_main`): (exit code, the last JSON line)."""
    import json

    proc = run_main(command, *(("--device", "cpu") if command == "run" else ()), "--json", *args)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def run_main(*args: str) -> "subprocess.CompletedProcess[str]":
    """``attn-setup ARGS`` in this process (``pipeline.cli.main`` with stdout/stderr captured), as a
    CompletedProcess. For tests of what a command does; the few tests of process-level behaviour
    (imports, signals, torchrun) start a real subprocess instead. Saves ~3 s of interpreter and
    torch start-up per call on a 2-core CI machine."""
    import contextlib
    import io
    import subprocess

    from pipeline.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())
