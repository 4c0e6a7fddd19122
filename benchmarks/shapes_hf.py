"""Changing shapes on Hugging Face's GPT-2 built from a config (4 layers, 64 wide, vocabulary 256, batch 4):
12 distinct lengths in 16..128, each seen twice, in a seeded random order, budget "50%", SGD.

    PYTHONPATH=. python benchmarks/shapes_hf.py rotor rotor-fit rotor-fit-predict rotor-predict

Per variant (`rotor`: the default, each later shape profiled for sizes only; `-fit`: `fit_shapes=True`;
`-predict`: `predict_shapes=True`) and round: the time of steps 2..N (the first, which profiles the first shape,
excluded), its ratio to plain's, and how many plans were fitted or predicted rather than measured. Timing only:
budgets and gradients are checked by benchmarks/shapes.py and the tests.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings

import torch
import transformers

from lightning_rotor import Checkpointable


def batches(seed: int = 0) -> list[torch.Tensor]:
    rng = random.Random(seed)
    order = sorted(rng.sample(range(16, 129), 12)) * 2
    rng.shuffle(order)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (4, n), generator=g) for n in order]


def make(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=256, n_positions=128, use_cache=False)
    model = transformers.GPT2LMHeadModel(config)
    if variant == "plain":
        return model
    return Checkpointable(model, "50%", repeats=3, fit_shapes="fit" in variant, predict_shapes="predict" in variant)


def train(model: torch.nn.Module, data: list[torch.Tensor]) -> float:
    """Wall time of steps 2..N."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = []
    for x in data:
        start = time.perf_counter()
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
    return sum(seconds[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    data = batches()
    totals: dict[str, list[float]] = {v: [] for v in ["plain", *args.variants]}
    for _ in range(args.runs):
        for variant in totals:
            model = make(variant)
            totals[variant].append(train(model, data))
            if isinstance(model, Checkpointable):
                print(f"{variant}: {len(model.entries)} plans, {len(model.fitted)} fitted, "
                      f"{len(model.predicted)} predicted", flush=True)  # fmt: skip
    plain = totals["plain"]
    for variant, seconds in totals.items():
        ratios = [round(s / p, 2) for s, p in zip(seconds, plain, strict=True)]
        print(f"{variant:18s} steps 2..N median {statistics.median(seconds):.2f} s; x plain per round {ratios}")


if __name__ == "__main__":
    main()
