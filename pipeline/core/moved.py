"""Old import paths of the modules that moved into ``pipeline``'s folders keep working (deprecated aliases).

``import pipeline.memory`` returns the module ``pipeline.backends.memory`` itself — the same object under
both names, so a class keeps one identity and patching either name patches the module — through a
meta-path finder that answers only for the names in :data:`MOVED` (every other import is untouched).
``import pipeline`` installs it (:func:`install`). New code imports the new paths; the README's module
map lists them and the CHANGELOG says what moved. ``python -m`` needs the new path (``python -m
pipeline.core.events``): runpy asks the loader for code, which an alias does not have.

Not aliased: ``pipeline.machine`` and ``pipeline.runner_machine``, whose tables are taken apart by the
redesign rather than moved, and ``pipeline.replay``, which is the public function ``pipeline.replay()``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from typing import Any, Optional, Sequence

# old dotted name → new dotted name
MOVED: dict[str, str] = {
    **{f"pipeline.{m}": f"pipeline.core.{m}" for m in (
        "contracts", "validation", "errors", "model_spec", "dtypes", "settings", "files", "events", "eventlog",
        "heartbeat", "faults", "runinfo", "pool_sizing")},
    "pipeline.profiles": "pipeline.platforms.profiles",
    "pipeline.memory": "pipeline.backends.memory",
    "pipeline.workspace": "pipeline.backends.workspace",
    "pipeline.jit": "pipeline.backends.flashinfer_jit",
    "pipeline.backends.capabilities": "pipeline.backends.records",
    **{f"pipeline.{m}": f"pipeline.setup.{m}" for m in ("build", "result", "distributed", "compat")},
    **{f"pipeline.{m}": f"pipeline.runtime.{m}" for m in ("runner", "model", "cuda_graphs", "verify", "reference")},
    "pipeline.runner_verify": "pipeline.runtime.model_steps",
    **{f"pipeline.{m}": f"pipeline.observe.{m}" for m in ("trace", "perfetto")},
    **{f"pipeline.cli_{m}": f"pipeline.cli.{m}" for m in (
        "run", "plan", "warmup", "inspect", "replay", "graph", "backends")},
    "pipeline.report": "pipeline.cli.report",
    "pipeline.wording": "pipeline.cli.wording",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the already-importable module at its new path."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: Any = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._spec  # the import system set the alias's spec: the module keeps its own


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds only the names in :data:`MOVED`."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path``, once: it answers only for :data:`MOVED` names, which no file
    of this package has any more (a stale copy of an old version elsewhere on the path must not answer them)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())
