"""What torch's symbolic shapes would cost to get a stage's sizes as expressions of the input's (issue 29, item 1).

    PYTHONPATH=. python benchmarks/shapes_symbolic.py

One block of the small GPT of `benchmarks/shapes.py` (64 wide, 4 heads; batch 4, length 64), its forward and
backward traced by `make_fx(..., tracing_mode="real")` and `tracing_mode="symbolic"` (the graph a law would
read its tensors' shapes from), twice each (the first pays torch's one-time setup), against the block's eager
forward and backward. A measured shape of the whole chain (7 stages) costs 7-9 plain steps of about 15-30 ms
(docs/benchmarks.md, "Changing shapes"): a symbolic trace pays where it costs less than that per stage.
"""

from __future__ import annotations

import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_rotor.models.gpt import gpt


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = gpt(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=64, dropout=0.1)
    block = next(m for m in model.modules() if type(m).__name__ == "Block")
    tensors = {**dict(block.named_parameters()), **dict(block.named_buffers())}
    trainable = [t for t in tensors.values() if t.requires_grad]

    def step(x: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        out = torch.func.functional_call(block, tensors, (x,))
        return torch.autograd.grad(out.sum(), [x, *(t for t in tensors.values() if t.requires_grad)])

    x = torch.randn(4, 64, 64, requires_grad=True)
    for mode in ("real", "symbolic"):
        for attempt in ("first", "again"):
            start = time.perf_counter()
            graph = make_fx(step, tracing_mode=mode)(x, tensors)
            took = time.perf_counter() - start
            print(f"make_fx {mode:8s} ({attempt}): {took * 1e3:7.0f} ms, {len(graph.graph.nodes)} nodes", flush=True)
    runs = 20
    start = time.perf_counter()
    for _ in range(runs):
        step(x, tensors)
    print(
        f"eager forward + backward: {(time.perf_counter() - start) / runs * 1e3:.1f} ms ({len(trainable)} parameters)"
    )


if __name__ == "__main__":
    main()
