"""What deriving a new shape's plan costs, alone: the small GPT of `benchmarks/shapes.py` trained on its 40 steps
(20 lengths, `"60%"`), then every shape it derived (`fit_shapes`) derived again `--rounds` times, no step run.

    PYTHONPATH=. python benchmarks/shapes_derivation.py --rounds 20

Per derived shape the fastest round (the machine is shared: the fastest is the least disturbed), then the median
over shapes, for the whole derivation (`ChainState._fitted_entry`: the chain evaluated from the traces, its times
by FLOPs, its budget, the planner, the runner) and for the planner call alone (`pipeline.plan_chain`). In plain
steps: the median of plain training's steps 2..40 of the same data in the same process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.shapes import batches, make, train
from lightning_rotor import pipeline
from lightning_rotor.chain_state import ChainState


def fastest(rounds: int, run: object) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        run()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = argparse.Namespace(
        n_layer=4, n_embd=64, vocab=256, batch=4, lengths=20, steps=40, min_len=16, max_len=128,
        budget="60%", repeats=3, buckets=[32, 64, 128], **vars(parser.parse_args()),
    )  # fmt: skip
    torch.set_num_threads(1)
    data = batches(args)
    plain = statistics.median(train(make(args, "plain"), data)[1:])
    model = make(args, "rotor")
    train(model, data)
    state: ChainState = model.chain_state
    derived = [x for x, _ in data if any(k == state.call_input(x).key for k in state.fitted)]
    calls = {state.call_input(x).key: state.call_input(x) for x in derived}
    whole, planner = [], []
    for key, call in calls.items():
        whole.append(fastest(args.rounds, lambda call=call: state._fitted_entry(call)))
        entry = model.entries[key]
        planner.append(fastest(args.rounds, lambda e=entry: pipeline.plan_chain(e.chain, e.plan.budget, state.slots)))
    told = ", ".join(
        f"{name} {statistics.median(t) * 1e3:.2f} ms ({statistics.median(t) / plain:.3f} plain steps)"
        for name, t in (("a derivation", whole), ("its planner call", planner))
    )
    print(f"{len(calls)} derived shapes, fastest of {args.rounds} each, median over shapes: {told}")
    print(f"a plain step {plain * 1e3:.1f} ms (median of steps 2..{args.steps})")


if __name__ == "__main__":
    main()
