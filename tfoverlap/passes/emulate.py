"""The emulate pass: the workers' heavy compute becomes emulated-accelerator kernels.

It runs last, after TicTac and Caramel, which plan on the original graph. Running it on
its own output changes nothing (emulated kernels are never replaced again). The process
that runs the graph needs the kernel registered (:func:`tfoverlap.load`; the plugin's
process has it, :func:`tfoverlap.optimize` loads it).
"""
from __future__ import annotations

from tfoverlap.passes.base import PassContext, PassResult
from tfoverlap.planning.emulation import emulate_until_done, wait_across_streams
from tfoverlap.rewriters.emulated_ops import insert_stream_waits

__all__ = ["emulate_pass"]


def emulate_pass(graph_def, context: PassContext) -> PassResult:
    """Replaces heavy worker ops by ``TfOverlapEmulatedCompute`` kernels."""
    options = context.options
    emulated_graph, plans = emulate_until_done(graph_def, options, context.preserved_nodes)
    emulated_graph, waits = insert_stream_waits(emulated_graph)
    emulated_graph, ordered = wait_across_streams(emulated_graph)
    seconds, originals = {}, {}
    for plan in plans:
        for device, device_seconds in plan.emulated_seconds.items():
            seconds[device] = seconds.get(device, 0.0) + device_seconds
        for op_type, count in plan.original_ops.items():
            originals[op_type] = originals.get(op_type, 0) + count
    emulated = sum(len(plan.emulations) for plan in plans)
    summary = {
        "device": plans[0].device.name,
        "dilation": options.dilation,
        "streams": options.emulate_streams,
        "emulated_ops": emulated,
        "launch": "blocking" if options.emulate_blocking else "ahead",
        "stream_waits": waits,
        "cross_stream_waits": ordered,
        "emulated_op_types": dict(sorted(originals.items())),
        "emulated_ms": {device or "(unplaced)": round(device_seconds * 1e3, 3)
                        for device, device_seconds in sorted(seconds.items())},
        "kept_heavy_ops": plans[-1].kept_heavy,
    }
    if not emulated and not waits and not ordered:
        return PassResult(graph_def, modified=False, summary=summary)
    return PassResult(emulated_graph, modified=True, summary=summary)
