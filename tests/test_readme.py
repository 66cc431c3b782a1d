"""README and docs/ contracts: the two commands, the CI test command, the exit-code table, the event catalogue in
docs/events.md, README's length, and every path, dotted name and relative link the user docs name."""

from __future__ import annotations

import re

from conftest import ROOT, user_docs
from pipeline.core import events as ev

README = (ROOT / "README.md").read_text()
DOCS = user_docs()


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
    """docs/events.md's event table is exactly what the event Structs generate."""
    text = (ROOT / "docs" / "events.md").read_text()
    block = re.search(r"<!-- events:begin -->\n(.*?)\n<!-- events:end -->", text, re.S).group(1)
    assert block == ev.catalogue_markdown()


def test_exit_code_table():
    """The exit-code table lists 0-3 with the documented meanings."""
    from pipeline.core import errors

    assert (errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE, errors.EXIT_REFUSED) == (0, 1, 2, 3)
    for code, word in ((0, "success"), (1, "failed"), (2, "usage"), (3, "refused")):
        assert re.search(rf"\| {code} \| [^\n]*{word}", README)


def test_every_source_path_the_readme_names_exists():
    """Every ``pipeline/…`` / ``states/…`` / ``tests/…`` / ``benchmarks/…`` / ``examples/…`` path README or docs/
    names exists."""
    paths = set(re.findall(r"(?<![\w./-])((?:pipeline|states|tests|benchmarks|examples|docs)/[\w./-]*\w)", DOCS))
    assert "pipeline/core/dtypes.py" in paths and "pipeline/backends/memory.py" in paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == [], missing


def test_every_dotted_pipeline_name_the_readme_names_resolves():
    """Every ```pipeline.x.y``` README or docs/ names is a module or a name in one."""
    import importlib

    bad = []
    for ref in sorted(set(re.findall(r"`(pipeline(?:\.\w+)+)", DOCS))):
        parts = ref.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                bad.append(ref)
            break
    assert bad == [], bad


def test_readme_gives_the_cpu_install_command_with_ci_s_torch_pin():
    """The CPU-only install is spelled out: torch from PyTorch's CPU index, pinned to the
    version the two commands above (and CI) install, followed by the package install."""
    pin = re.search(r"pip install (torch==[\d.]+) &&", README).group(1)
    cmd = re.search(r"`(python3 -m pip install torch[^`]*--index-url https://download\.pytorch\.org/whl/cpu[^`]*)`",
                    README)
    assert cmd, "no CPU install command"
    assert f"install {pin} --index-url" in cmd.group(1) and cmd.group(1).endswith("python3 -m pip install -e '.[test]'")


def test_config_readme_points_at_modules_that_exist():
    """examples/configs/README.md names modules and rule tables that exist (it named ``LAYER_RULES`` in
    ``pipeline/model_spec.py`` after both had moved): every module path it names exists."""
    from conftest import ROOT

    text = (ROOT / "examples" / "configs" / "README.md").read_text()
    for path in re.findall(r"`(pipeline/[\w/.]+\.py)`", text):
        assert (ROOT / path).is_file(), path
    for dotted in re.findall(r"`(pipeline(?:\.\w+)+)`", text):
        module, _, attr = dotted.rpartition(".")
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), dotted
        assert f"def {attr}" in (ROOT / (module.replace(".", "/") + ".py")).read_text(), dotted
    assert "`OWN_FAMILIES` and `modeling_overrides` in `pipeline/core/layer_rules.py`" in text
    rules = (ROOT / "pipeline" / "core" / "layer_rules.py").read_text()
    assert "OWN_FAMILIES: dict" in rules and "def modeling_overrides" in rules
    assert "--dtype auto` gives float16" in text  # gpt-oss: no torch_dtype


def test_readme_is_a_front_page():
    """README stays the user's front page (at most 250 lines); the reference lives in docs/."""
    assert len(README.splitlines()) <= 250


def _anchors(text: str) -> set[str]:
    out = set(re.findall(r'<a id="([^"]+)"', text))
    in_code = False
    for line in text.splitlines():
        in_code ^= line.startswith("```")
        if not in_code and re.match(r"#{1,6} ", line):
            out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out


def test_every_relative_link_in_the_user_docs_resolves():
    """Every relative link of README.md, docs/*.md and benchmarks/README.md points at a file that exists, and its
    ``#anchor`` at a heading (or ``<a id>``) of that file."""
    bad = []
    for page in [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                bad.append(f"{page.name}: {target} (no such heading)")
    assert bad == [], bad
