"""Old import paths of moved modules: each one is the module at its new path (same object), in a fresh process."""

from __future__ import annotations

import subprocess
import sys

from pipeline.core.moved import MOVED


def test_every_old_path_is_the_new_module_and_the_readme_paths_work():
    """import of each old name gives the new module object itself; the paths the README showed keep working;
    names outside the table (and pipeline.replay, the public function) are not answered by the alias finder."""
    code = (
        "import importlib, sys, pipeline\n"
        f"moved = {dict(MOVED)!r}\n"
        "for old, new in moved.items():\n"
        "    a, b = importlib.import_module(old), importlib.import_module(new)\n"
        "    assert a is b and sys.modules[old] is b, old\n"
        "    assert b.__name__ == new and b.__spec__.name == new, (old, b.__spec__)\n"
        "from pipeline.memory import KVPool, ReqToTokenPool\n"
        "from pipeline.backends.memory import KVPool as K2\n"
        "assert KVPool is K2\n"
        "import pipeline.distributed, pipeline.faults, pipeline.contracts\n"
        "assert pipeline.distributed.init_from_env and pipeline.faults.Faults and pipeline.contracts.PoolFacts\n"
        "assert callable(pipeline.replay)\n"
        "try:\n"
        "    import pipeline.no_such_module\n"
        "except ModuleNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('an unknown name imported')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_targets_exist_and_old_files_are_gone():
    """Every alias points at a module file that exists, and no old module file is left behind to shadow it."""
    from conftest import ROOT

    for old, new in MOVED.items():
        assert (ROOT / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old


def test_readme_says_what_moved():
    """README's "What moved" table names every aliased old module and the folder it moved to."""
    from conftest import ROOT

    text = (ROOT / "README.md").read_text()
    section = text[text.index("### What moved"):text.index("## Log events")]
    for old, new in MOVED.items():
        short = old.rsplit(".", 1)[1].removeprefix("cli_")
        assert f"`{old}`" in section or f"`{short}`" in section, old
        assert new.rsplit(".", 1)[0] in section, new
