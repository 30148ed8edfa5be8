"""Would TicTac order the measured configurations today, and should it have?

For every configuration of a results file (docs/results/ps-emulated.json by default) that
has a ``tic`` row measured with ordering on, this builds the same model graph (the
benchmark's model, batch and PS tasks), runs the TicTac pass on it with the benchmark's
options (the workers, the emulated link and device) and prints what the pass predicts and
decides next to what TIC measured. A decision is right where it orders a configuration
that TIC made faster, or steps aside from one it made slower, judged where the measured
95% interval of the speed-up excludes 1, and (weaker) where its point estimate is more
than POINT_NOISE from 1.

    .venv/bin/python scripts/validate_tictac_decision.py [--results FILE]
"""
import argparse
import json
import sys


#: a point estimate this close to 1 is taken as no change
POINT_NOISE = 0.03


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="docs/results/ps-emulated.json")
    args = parser.parse_args(argv)

    import tensorflow as tf
    import tfoverlap
    from tfoverlap.bench.ps import EMULATED_BATCH, Configuration, variant_spec
    from tfoverlap.passes import tictac
    from tfoverlap.testbed.models import keras_model
    with open(args.results) as stream:
        rows = json.load(stream)
    measured = {}
    for row in rows:
        if row["variant"] == "tic" and row.get("emulated") and not row.get("declined"):
            key = (row["model"], row["mode"], row["workers"], row.get("ps", 1), row["link"],
                   row.get("batch") or EMULATED_BATCH[row["model"]], row["emulated"],
                   row.get("layout") or "dedicated")
            measured[key] = (row["speedup"], row["ci_low"], row["ci_high"])
    print("| model | mode | workers | PS | layout | link | TIC measured | predicted gain (low) | "
          "workers drift | decision | right |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    agreement = {"interval": [0, 0], "point": [0, 0]}   # [right, judged]
    for key, (speedup, low, high) in sorted(measured.items()):
        model_name, mode, workers, ps, link, batch, device, layout = key
        model = keras_model(model_name, batch=batch, num_ps=ps, training=mode == "training",
                            image_size=299 if model_name == "inception_v3" else 224)
        fetch = model.fetch.name.split(":")[0]
        graph_def = tf.compat.v1.graph_util.extract_sub_graph(model.graph.as_graph_def(),
                                                              [fetch])
        tictac._decisions.clear()
        # The options the benchmark's tic variant gives the pass (workers, layout).
        config = Configuration(model_name, mode == "training", batch, None, num_ps=ps,
                               num_workers=workers, layout=layout)
        given = variant_spec("tic", "", 0, config)["tfoverlap"]
        _, report = tfoverlap.optimize(graph_def, fetch=[fetch], bandwidth=link,
                                       emulate=device, **given)
        summary = next(p.summary for p in report.passes if p.name == "tictac")
        ordered = "declined" not in summary
        verdict = ""
        for basis, gained, lost in (("point", speedup > 1 + POINT_NOISE,
                                     speedup < 1 - POINT_NOISE),
                                    ("interval", low > 1, high < 1)):
            if gained or lost:
                agreement[basis][1] += 1
                agreement[basis][0] += ordered == gained
                if basis == "interval":
                    verdict = "yes" if ordered == gained else "no"
        print(f"| {model_name} | {mode} | {workers} | {ps} | {layout} | {link} | {speedup:.2f}x "
              f"({low:.2f}-{high:.2f}) | {summary['predicted_gain']:+.1%} "
              f"({summary['predicted_gain_low']:+.1%}) | "
              f"{'yes' if summary['workers_drift'] else 'no'} | "
              f"{'order' if ordered else 'step aside'} | {verdict} |", flush=True)
    print(f"\nright on {agreement['interval'][0]} of {agreement['interval'][1]} configurations "
          f"whose measured interval excludes 1, and on {agreement['point'][0]} of "
          f"{agreement['point'][1]} whose point estimate is beyond +-{POINT_NOISE:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
