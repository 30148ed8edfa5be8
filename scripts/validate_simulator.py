"""How well the simulator predicts the testbed: every configuration of a PS benchmark run.

For each configuration in ``results.json`` of ``tfoverlap.bench.ps`` it loads the model graph
and worker 0's profile that the run saved, simulates one iteration with the benchmark's
scenario (workers, link bandwidth, inter-op threads) for TensorFlow's default, TIC and
TAC, and compares with the measured median iteration. Prints a table, the median absolute
error and the worst error per variant; ``--markdown`` writes it for docs/benchmarks.md.
Runs on emulated accelerators are compared in emulated time (the simulator gets the
shaped link rate and one compute stream; the profile holds the emulated kernels' times).

Each row also says which phase the simulator assumed for the workers (lock step or drifted
apart, see tfoverlap/sim/ps.py) and the measured medians of the first step of every block
and of the later ones: the benchmark starts every block on all workers at once, so its
first steps run in lock step, and the workers drift apart only after that. Runs of the
"colocated" layout (a PS task on every worker's host, ``layout`` in the run's config) are
simulated in that layout (see tfoverlap/sim/ps.py), and the table marks them.

Each measured variant is compared with the prediction of what ran: a second default
("default_again") with the default's, and a TIC or TAC variant whose pass declined to
order (its report says why, and it added no ordering edge) with the default's too, marked
"declined" in the table with what the simulator predicts for the ordered graph.

    .venv/bin/python scripts/validate_simulator.py out/benchmarks [--markdown FILE]
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

ALGORITHMS = ("default", "tic", "tac")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", help="directory of a benchmark run (results.json)")
    parser.add_argument("--markdown", help="also write the table here")
    parser.add_argument("--latency-us", type=float, default=100.0)
    args = parser.parse_args(argv)

    from tensorflow.core.framework import graph_pb2
    from tfoverlap.costs.profile import load_profile
    from tfoverlap.sim.whatif import Scenario, predict
    with open(os.path.join(args.results, "results.json")) as stream:
        results = json.load(stream)
    lines = ["| model | mode | workers | PS | variant | phase | measured s | first / later "
             "steps s | predicted s | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    errors, seconds, worst = [], [], {}
    for result in results:
        config = result["config"]
        mode = "training" if config["training"] else "inference"
        workdir = result.get("workdir") or os.path.join(args.results, "work",
                                                        f"{config['model']}-{mode}")
        graph_def = graph_pb2.GraphDef()
        with open(os.path.join(workdir, "graph.pb"), "rb") as stream:
            graph_def.ParseFromString(stream.read())
        fetch = result.get("fetch") or ("GradientDescent" if config["training"] else "Mean")
        profile_path = os.path.join(workdir, "tac-profile-worker0.json")
        # Emulated runs: the links were shaped to 1/K of their emulated rate, and measured
        # and profiled times are wall times (K times emulated ones); one stream computes.
        dilation = result.get("dilation", 1.0)
        emulated = bool(config.get("emulate"))
        scenario = Scenario(workers=config["num_workers"],
                            bandwidth=config["bandwidth"] / dilation,
                            threads=1 if emulated else config["inter_op"],
                            latency=args.latency_us * 1e-6,
                            layout=config.get("layout") or "dedicated")
        profile = load_profile(profile_path)
        predictions = predict(graph_def, scenario, ALGORITHMS, profile=profile,
                              profile_path=profile_path, fetches=[fetch])
        # Speed: one TIC prediction with one seed is three simulations (iteration, comm-only,
        # comp-only) plus building the tasks.
        started = time.perf_counter()
        predict(graph_def, dataclasses.replace(scenario, seeds=1), ["tic"], profile=profile,
                fetches=[fetch])
        seconds.append((time.perf_counter() - started) / 3)
        by_algorithm = {prediction.algorithm: prediction for prediction in predictions}
        for variant, times in result["times"].items():
            algorithm = simulated_as(variant, result.get("passes", {}).get(variant) or {})
            if algorithm not in by_algorithm:
                continue
            prediction = by_algorithm[algorithm]
            label = variant
            if algorithm != variant and variant != "default_again":
                ordered = by_algorithm.get(variant)
                label += " (declined: the default ran" + (
                    f"; ordered: {ordered.iteration / dilation:.3f} s)" if ordered else ")")
            measured = statistics.median(times) / dilation
            predicted = prediction.iteration / dilation
            error = (predicted - measured) / measured
            errors.append(abs(error))
            key = variant if algorithm == variant or variant == "default_again" else (
                f"{variant} declined")
            worst[key] = max(worst.get(key, 0.0), abs(error))
            ps = str(config["num_ps"]) + (" colocated" if scenario.layout == "colocated"
                                          else "")
            blocks = result.get("blocks", {}).get(variant)
            lines.append(f"| {config['model']} | {mode} | {config['num_workers']} | {ps} | "
                         f"{label} | {prediction.phase} | {measured:.3f} | "
                         f"{block_steps(times, blocks, dilation)} | {predicted:.3f} | "
                         f"{100 * error:+.1f}% |")
    summary = (f"median absolute error {100 * statistics.median(errors):.1f}% over "
               f"{len(errors)} predictions (max {100 * max(errors):.1f}%; worst per variant: "
               + ", ".join(f"{name} {100 * value:.1f}%" for name, value in worst.items())
               + f"); about {max(seconds):.2f} s per simulated iteration at most")
    table = "\n".join(lines) + "\n\n" + summary + "\n"
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as stream:
            stream.write(table)
    return 0


def simulated_as(variant: str, pass_summary: dict) -> str:
    """The algorithm whose prediction a measured variant is compared with: its own, but
    the default's for a second default ("default_again") and for a TicTac variant whose
    pass declined to order (the gain estimate stepped aside: no ordering edge was added,
    so TensorFlow's default order ran)."""
    if variant == "default_again":
        return "default"
    if variant in ("tic", "tac") and (pass_summary.get("declined")
                                      or str(pass_summary.get("ordering_edges", "")) == "0"):
        return "default"
    return variant


def block_steps(times: list[float], blocks: list[list[float]] | None, dilation: float) -> str:
    """The median of the first step of every worker's block and of its other steps, as
    "first / later" (``times`` holds each worker's steps block after block, ``blocks`` one
    entry per worker and block); "" where the run did not keep its blocks."""
    answers = sum(len(block) for block in blocks or [])
    if not answers or len(times) % answers:
        return ""
    from tfoverlap.bench.metrics import after_first_steps
    steps = len(times) // answers
    first = statistics.median(times[::steps]) / dilation
    if steps < 2:
        return f"{first:.3f}"
    later = after_first_steps(times, steps)
    return f"{first:.3f} / {statistics.median(later) / dilation:.3f}"


if __name__ == "__main__":
    sys.exit(main())
