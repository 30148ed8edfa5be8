"""The docs cannot drift: docs/options.md's table is what scripts/options_table.py makes
from tfoverlap/options.py, and every relative link of README.md and docs/*.md points to a
file that exists. No TensorFlow is imported."""
import dataclasses
import glob
import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))

# [text](target) and [text](target "title"); images too. Reference-style links are not used.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _script():
    spec = importlib.util.spec_from_file_location(
        "options_table", os.path.join(ROOT, "scripts", "options_table.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_options_table_is_generated_from_options_py():
    script = _script()
    with open(script.DOC) as stream:
        page = stream.read()
    assert script.table_in(page) == script.table(), (
        "docs/options.md's options table is stale: run scripts/options_table.py --write")


def test_options_table_names_every_option_with_its_default():
    from tfoverlap.options import OPTION_NAMES, Options
    table = _script().table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [re.match(r"\| `(\w+)`", row).group(1) for row in rows] == list(OPTION_NAMES)
    defaults = Options()
    assert f'| `schedule` | `"{defaults.schedule}"` |' in table
    assert f"| `window` | `{defaults.window}` |" in table


def test_a_changed_default_makes_the_table_differ(monkeypatch):
    """The comparison above can fail: a default changed in options.py changes the table."""
    import tfoverlap.options as options
    script = _script()
    before = script.table()
    changed = dataclasses.make_dataclass(
        "Options", [("window", int, dataclasses.field(default=options.Options().window + 1))],
        bases=(options.Options,), frozen=True)
    changed.__doc__ = options.Options.__doc__
    monkeypatch.setattr(options, "Options", changed)
    assert script.table() != before


def _links(path: str) -> list[str]:
    with open(path) as stream:
        text = stream.read()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)      # code blocks hold no links
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def _broken(path: str) -> list[str]:
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue                                             # http:, mailto:, anchors
        file = target.split("#", 1)[0]
        if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(path), file))):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=[os.path.relpath(p, ROOT) for p in PAGES])
def test_relative_links_point_to_existing_files(page):
    assert not _broken(page), f"{os.path.relpath(page, ROOT)} links to missing files"


def test_the_link_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok too](there.md#a) [web](https://x.org) [anchor](#a)\n"
                    "[gone](docs/missing.md) `[in code](nowhere.md)`\n"
                    "```\n[in a block](nowhere.md)\n```\n")
    assert _broken(str(page)) == ["docs/missing.md"]


def test_readme_is_at_most_200_lines():
    with open(os.path.join(ROOT, "README.md")) as stream:
        assert len(stream.read().splitlines()) <= 200
