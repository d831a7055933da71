"""Programmatic dependent launch (sm_90): a kernel that depends on the one
before it in the stream may start before that one has finished.

``launch_dependents()``: this thread block lets the next kernel in the
stream start (``griddepcontrol.launch_dependents``); once every block of
this grid has done so or exited, the dependent grid's blocks are scheduled
as resources free up. ``wait_for_primary()``: wait until the grid this one
depends on has completed and its memory writes are visible
(``griddepcontrol.wait``); a no-op for a grid launched without the
dependency. The dependent kernel must be launched with the programmatic
stream serialisation attribute (:class:`paged_numba._launch.PackedLaunch`
with ``programmatic=True``); otherwise both instructions do nothing, and the
launches keep their ordinary stream order.

A split-K decode and its merge use it: the decode blocks let the merge
launch early, and each merge block waits for every partial state before it
reads one. What it can save is the gap between the two kernels (the merge
kernel's launch and the scheduling of its first blocks), not the work of
either.

Under the simulator both are no-ops: its kernels run one after another.
"""
from numba import config

if config.ENABLE_CUDASIM:
    def launch_dependents():
        """No-op under the simulator."""

    def wait_for_primary():
        """No-op under the simulator."""
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _statement(text):
        @intrinsic
        def statement(typingctx):
            def codegen(context, builder, sig, args):
                fnty = ir.FunctionType(ir.VoidType(), [])
                builder.call(ir.InlineAsm(fnty, text, "~{memory}", side_effect=True), [])
                return context.get_dummy_value()
            return types.void(), codegen
        return statement

    launch_dependents = _statement("griddepcontrol.launch_dependents;")
    wait_for_primary = _statement("griddepcontrol.wait;")
