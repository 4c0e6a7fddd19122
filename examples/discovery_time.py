"""How long discovery takes on a 24-layer nanoGPT-style GPT (CPU), beside one plain forward.

    python examples/discovery_time.py [--layers 24] [--width 512] [--seq 256] [--batch 4]
    python examples/discovery_time.py --layers 2 --width 16 --seq 8 --batch 1 --repeats 1   # a smoke run

Discovery runs the model once on the sample (the tracer answers shape questions from real
values), so its time is one no-grad forward plus the tracing and cutting overhead.
"""

import argparse
import time

import torch

from lightning_rotor import discover_chain
from lightning_rotor.models.as_written import GPT, Block


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = GPT(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=8, n_embd=args.width).train()
    x = torch.randint(512, (args.batch, args.seq))
    with torch.no_grad():
        model(x)  # warm-up
        t0 = time.perf_counter()
        model(x)
        forward = time.perf_counter() - t0
    for method, types in (("graph", None), ("graph", {Block}), ("modules", None)):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            found = discover_chain(model, (x,), method, types)
            times.append(time.perf_counter() - t0)
        label = method + (" + checkpoint_modules={Block}" if types else "")
        print(f"{label:38s} {len(found.stages):3d} stages  discovery {min(times):.3f} s (best of {args.repeats})")
    print(f"{'one plain no-grad forward':38s}      {forward:.3f} s   threads={torch.get_num_threads()}")


if __name__ == "__main__":
    main()
