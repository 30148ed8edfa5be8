"""The benchmark reports' speed-up cells (tfoverlap/bench/report.py)."""
from tfoverlap.bench.report import speedup_cell


def test_a_speed_up_is_bold_only_where_its_interval_leaves_out_one():
    assert speedup_cell({"speedup": 1.21, "ci_low": 1.18, "ci_high": 1.23}) == \
        "**1.21x** (1.18-1.23)"
    assert speedup_cell({"speedup": 0.52, "ci_low": 0.49, "ci_high": 0.54}) == \
        "**0.52x** (0.49-0.54)"
    # An A/A row, or a variant that stepped aside: the interval holds 1, so no bold.
    assert speedup_cell({"speedup": 1.004, "ci_low": 0.97, "ci_high": 1.03},
                        "; rounds 0.97-1.02") == "1.00x (0.97-1.03; rounds 0.97-1.02)"
