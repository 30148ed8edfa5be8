"""docs/benchmarks.md's results tables are what scripts/results_page.py makes from
docs/results/*.json, and the script shows what a row says: the latest run of a
configuration, a pass that stepped aside as such, bold only past the noise. No TensorFlow
is imported."""
import importlib.util
import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def page():
    spec = importlib.util.spec_from_file_location(
        "results_page", os.path.join(ROOT, "scripts", "results_page.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_the_page_matches_the_json(page):
    assert page.check(), "docs/benchmarks.md is stale: run scripts/results_page.py"


def test_a_changed_row_or_an_edited_table_makes_the_check_fail(page, tmp_path):
    results = tmp_path / "results"
    shutil.copytree(page.RESULTS, results)
    doc = tmp_path / "benchmarks.md"
    shutil.copy(page.DOC, doc)
    assert page.check(str(doc), str(results))
    assert page.main(["--check", "--doc", str(doc), "--results", str(results)]) == 0

    path = results / "horovod-emulated.json"
    rows = json.loads(path.read_text())
    shown = next(r for r in rows if r["variant"] == "caramel_decoupled")
    shown["speedup"] += 0.5
    path.write_text(json.dumps(rows))
    assert not page.check(str(doc), str(results))
    assert page.main(["--check", "--doc", str(doc), "--results", str(results)]) == 1
    assert page.main(["--doc", str(doc), "--results", str(results)]) == 0   # rewrites
    assert page.check(str(doc), str(results))

    doc.write_text(doc.read_text().replace("| `caramel_decoupled` |", "| `caramel_decoupled2` |",
                                           1))
    assert not page.check(str(doc), str(results))


def test_a_row_that_cannot_be_read_is_refused_with_its_file_row_and_fields(page, tmp_path,
                                                                          capsys):
    """Every row names its API, emulation, dilation, command and date (a PS row its PS
    tasks and layout too): the page refuses one without them in one line that says which
    row lacks what, and the same for a file that is not a list of rows."""
    results = tmp_path / "results"
    shutil.copytree(page.RESULTS, results)
    doc = str(tmp_path / "benchmarks.md")
    shutil.copy(page.DOC, doc)
    for name, field in (("horovod-emulated.json", "api"), ("ps.json", "layout")):
        path = results / name
        original = path.read_text()
        rows = json.loads(original)
        del rows[3][field]
        path.write_text(json.dumps(rows))
        assert page.main(["--check", "--doc", doc, "--results", str(results)]) == 2
        error = capsys.readouterr().err
        assert error.startswith(f"results_page: {name}, row 3 (") and error.endswith(
            f"lacks {field}\n"), error
        path.write_text(original)
    (results / "ps.json").write_text('{"model": "m"}')
    assert page.main(["--doc", doc, "--results", str(results)]) == 2
    assert capsys.readouterr().err == ("results_page: ps.json is not a list of rows "
                                       "(JSON objects)\n")
    assert page.check(page.DOC, page.RESULTS)     # the repository's rows all can be read


def _row(variant, speedup, low, high, date, command="run", **fields):
    return {"model": "resnet50", "mode": "training", "workers": 8, "link": "25Gbit",
            "variant": variant, "iteration_s": 0.1, "speedup": speedup, "ci_low": low,
            "ci_high": high, "batch": 64, "ps": 1, "comm_over_comp": 1.0,
            "declined": False, "command": command, "date": date, "api": "session",
            "layout": "dedicated", "emulated": "v100", "dilation": 32.0, **fields}


def _lines(page, rows, system):
    rows = [{**row, "_index": index} for index, row in enumerate(rows)]
    table = page.table(rows, system)
    return [line for line in table.splitlines()[2:]]


def test_the_latest_row_of_a_configuration_is_shown_and_a_step_aside_says_so(page):
    ps = page.SYSTEMS[0]
    rows = [
        # a later run (by date), written first: the one to show
        _row("default", 1.0, 0.98, 1.02, "2026-01-02", "second"),
        _row("default_again", 0.99, 0.97, 1.02, "2026-01-02", "second",
             round_low=0.98, round_high=1.01),
        _row("tic", 0.93, 0.90, 0.97, "2026-01-02", "second", declined=True),
        # an earlier run of the same configuration, later in the file
        _row("default", 1.0, 0.97, 1.03, "2026-01-01", "first"),
        _row("tic", 1.30, 1.20, 1.40, "2026-01-01", "first"),
        _row("tf_recv_scheduling", 1.10, 1.05, 1.15, "2026-01-01", "first"),
    ]
    lines = _lines(page, rows, ps)
    assert len(lines) == 1
    cells = [cell.strip() for cell in lines[0].strip("|").split(" | ")]
    speedup, again, others, what = cells[6], cells[7], cells[8], cells[9]
    assert speedup.startswith("stepped aside: 0.93x (0.90-0.97)")
    assert "**" not in speedup                       # a loss beyond the CI, but no pass acted
    assert what.startswith("stepped aside")
    assert "latest of 2 runs" in what and "1.30x (1.20-1.40)" in what
    assert again == "0.99x (0.97-1.02; rounds 0.98-1.01)"        # the second run's A/A
    assert others == "TF recv scheduling 1.10x (1.05-1.15) [?]"  # the first run's, named


def test_bold_only_where_the_pass_acted_and_the_interval_excludes_one(page):
    horovod = page.SYSTEMS[2]
    rows = [
        _row("horovod", 1.0, 0.98, 1.02, "2026-01-01", workers=4),
        _row("caramel", 1.12, 1.10, 1.15, "2026-01-01", workers=4, declined=True,
             deferred_gradients=156, deferred_mb=28.7),
        _row("caramel_forced", 1.03, 0.99, 1.07, "2026-01-01", workers=4),
        _row("caramel_profiled", 1.03, 1.00004, 1.05, "2026-01-01", workers=4),
        _row("horovod", 1.0, 0.98, 1.02, "2026-01-01", workers=8),
        _row("caramel", 1.05, 1.02, 1.08, "2026-01-01", workers=8, declined=True),
    ]
    rows = [{**row, "api": "graph"} for row in rows]
    lines = {line.split(" | ")[5].strip("`"): line
             for line in _lines(page, rows, horovod) if "| 4 ranks |" in line}
    assert "**1.12x** (1.10-1.15)" in lines["caramel"]
    assert "deferred 156 gradients (28.7 MB)" in lines["caramel"]
    assert "1.03x (0.99-1.07)" in lines["caramel_forced"]
    assert "**" not in lines["caramel_forced"]
    assert "**1.03x** (1.00004-1.05)" in lines["caramel_profiled"]
    eight = next(line for line in _lines(page, rows, horovod) if "| 8 ranks |" in line)
    assert "stepped aside: 1.05x (1.02-1.08)" in eight and "**" not in eight
