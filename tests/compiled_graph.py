"""What torch.compile traces of a module: the call_function targets of its FX graph."""

from __future__ import annotations

import torch


def compiled_graph_targets(block, *args, call_again: bool = False):
    """Compiles ``block`` (fullgraph, a backend that records the graph), runs it on ``args``
    without grad, and returns (output, the graph's call_function targets). ``call_again`` also
    runs it once more on new values of the same shapes (a recompile would record a second graph
    into the targets)."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    with torch.no_grad():
        out = compiled(*args)
        if call_again:
            compiled(*(torch.randn_like(a) for a in args))
    return out, targets
