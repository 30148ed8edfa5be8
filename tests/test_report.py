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


def test_a_variant_that_stepped_aside_says_so_and_its_number_is_noise():
    """The emulated demo row of TIC (declined, TensorFlow's own graph) once read
    "**0.85x**": now its cell says it stepped aside and why, its number is marked as noise
    and is never bold, even where the interval leaves out 1."""
    from tfoverlap.bench.report import short_reason, summary_lines, variant_cell
    aside = {"model": "resnet50", "mode": "training", "link": "10Gbit", "workers": 4,
             "variant": "tic", "speedup": 0.85, "ci_low": 0.80, "ci_high": 0.90,
             "stepped_aside": short_reason(
                 "transfers take about 1.61e+03 ms (4 workers sharing each PS link); the "
                 "workers drift apart: default 2.04e+03 ms, ordered 3.21e+03 ms: ordering "
                 "can gain -57.5%, at least -58.9% with the link and the compute off by up "
                 "to 1.5x; below min_gain 3.0%; left unchanged")}
    assert aside["stepped_aside"] == ("ordering can gain -57.5%, at least -58.9% with the "
                                      "link and...")
    assert variant_cell(aside) == f"tic (stepped aside: {aside['stepped_aside']})"
    assert speedup_cell(aside) == "noise: 0.85x (0.80-0.90)"
    again = {**aside, "variant": "default_again", "speedup": 1.02, "ci_low": 0.97,
             "ci_high": 1.06, "stepped_aside": ""}
    acted = {**aside, "variant": "tac", "speedup": 1.15, "ci_low": 1.10, "ci_high": 1.21,
             "stepped_aside": ""}
    default = {**aside, "variant": "default", "speedup": 1.0, "stepped_aside": ""}
    (line,) = summary_lines([default, again, aside, acted], "default")
    assert line.startswith("resnet50 training 4 workers 10Gbit: ")
    assert "A/A 1.02x (0.97-1.06)" in line and "tac 1.15x (1.10-1.21)" in line
    assert "tic stepped aside (ordering can gain -57.5%" in line and "is noise" in line
    assert variant_cell(acted) == "tac"


def test_the_speed_up_plot_marks_the_bars_of_variants_that_stepped_aside(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot
    from tfoverlap.bench.report import plot_speedups
    rows = [{"model": "m", "mode": "training", "link": "10Gbit", "variant": variant,
             "speedup": speedup, "ci_low": speedup - 0.05, "ci_high": speedup + 0.05,
             "stepped_aside": aside}
            for variant, speedup, aside in (("default", 1.0, ""), ("tic", 0.9, "no gain"),
                                            ("tac", 1.2, ""))]
    texts = []
    original = pyplot.Axes.text

    def recording(axes, x, y, text, *args, **kwargs):
        texts.append(text)
        return original(axes, x, y, text, *args, **kwargs)
    pyplot.Axes.text = recording
    try:
        plot_speedups(rows, str(tmp_path / "speedups.png"))
    finally:
        pyplot.Axes.text = original
    assert texts == ["stepped aside: noise"]
    assert (tmp_path / "speedups.png").stat().st_size > 0
