"""The emulate pass: the workers' heavy compute becomes emulated-accelerator kernels.

It runs last, after TicTac and Caramel, which plan on the original graph. Running it on
its own output changes nothing (emulated kernels are never replaced again). The process
that runs the graph needs the kernel registered (:func:`tfoverlap.load`; the plugin's
process has it, :func:`tfoverlap.optimize` loads it).
"""
from __future__ import annotations

from tfoverlap.passes.base import PassContext, PassResult
from tfoverlap.planning.emulation import plan_emulation
from tfoverlap.rewriters.emulated_ops import replace_with_emulated_ops

__all__ = ["emulate_pass"]


def emulate_pass(graph_def, context: PassContext) -> PassResult:
    """Replaces heavy worker ops by ``TfOverlapEmulatedCompute`` kernels."""
    options = context.options
    plan = plan_emulation(graph_def, options, context.preserved_nodes)
    summary = {
        "device": plan.device.name,
        "dilation": options.dilation,
        "streams": options.emulate_streams,
        "emulated_ops": len(plan.emulations),
        "emulated_op_types": dict(sorted(plan.original_ops.items())),
        "emulated_ms": {device or "(unplaced)": round(seconds * 1e3, 3)
                        for device, seconds in sorted(plan.emulated_seconds.items())},
        "kept_heavy_ops": plan.kept_heavy,
    }
    if not plan.emulations:
        return PassResult(graph_def, modified=False, summary=summary)
    return PassResult(replace_with_emulated_ops(graph_def, plan.emulations), modified=True,
                      summary=summary)
