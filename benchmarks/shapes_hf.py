"""Changing shapes on a Hugging Face model built from a config (GPT-2 or Llama: `--layers` 4, `--width` 64, 4 heads,
vocabulary 256, `--batch` 4): `--lengths` distinct lengths in 16..128 over `--steps` steps in a seeded random order
(each length as often), budget "50%", SGD.

    PYTHONPATH=. python benchmarks/shapes_hf.py rotor rotor-measure --model gpt2 --runs 2
    PYTHONPATH=. python benchmarks/shapes_hf.py rotor --model llama --runs 2
    PYTHONPATH=. python benchmarks/shapes_hf.py rotor --model gpt2 --layers 8 --width 256 --batch 8 --runs 2

Variants: `rotor` (the default: a later shape along one size of three measured ones gets its sizes exactly
from their traced profiles, no run; others are profiled for sizes only); `rotor-measure` (`fit_shapes=False`:
every later shape profiled for sizes); `rotor-predict` (`predict_shapes=True` too). Per variant and round: the
time of steps 2..N (the first, which profiles the first shape, excluded), its ratio to plain's, how many plans
were derived rather than measured, and per kind of step (the first, a measured shape, a derived one) its time
above plain's same step, in plain steps. Timing only: budgets and gradients are checked by benchmarks/shapes.py
and the tests.
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


def batches(lengths: int, steps: int, batch: int = 4, seed: int = 0) -> list[torch.Tensor]:
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(16, 129), lengths))
    order = [chosen[i % lengths] for i in range(steps)]
    rng.shuffle(order)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (batch, n), generator=g) for n in order]


def make(variant: str, model: str, layers: int = 4, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(0)
    if model == "gpt2":
        config = transformers.GPT2Config(
            n_layer=layers, n_embd=width, n_head=4, vocab_size=256, n_positions=128, use_cache=False
        )
        module: torch.nn.Module = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(
            num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=256, max_position_embeddings=128, use_cache=False,
        )  # fmt: skip
        module = transformers.LlamaForCausalLM(config)
    if variant == "plain":
        return module
    return Checkpointable(
        module, "50%", repeats=3, fit_shapes=variant != "rotor-measure", predict_shapes="predict" in variant
    )


def train(model: torch.nn.Module, data: list[torch.Tensor]) -> tuple[list[float], list[str]]:
    """Per step, its wall time and what made its plan ("first", "derived", "measured", "" for a shape seen before)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds, kinds, plans, derived = [], [], 0, 0
    for i, x in enumerate(data):
        start = time.perf_counter()
        opt.zero_grad()
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        now = len(getattr(model, "entries", {}))
        now_derived = len(getattr(model, "fitted", {})) + len(getattr(model, "predicted", {}))
        kinds.append("first" if i == 0 else "derived" if now_derived > derived else "measured" if now > plans else "")
        plans, derived = now, now_derived
    return seconds, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2")
    parser.add_argument("--lengths", type=int, default=20)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=64, help="the hidden size (4 heads)")
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    data = batches(args.lengths, args.steps, args.batch)
    runs: dict[str, list[list[float]]] = {v: [] for v in ["plain", *args.variants]}
    kinds: dict[str, list[str]] = {}
    derivations: dict[str, list[float]] = {v: [] for v in runs}
    for _ in range(args.runs):
        for variant in runs:
            model = make(variant, args.model, args.layers, args.width)
            seconds, kinds[variant] = train(model, data)
            runs[variant].append(seconds)
            entries = getattr(model, "entries", {})  # shapes derived without a run: their chain and plan's seconds
            derived = {**getattr(model, "fitted", {}), **getattr(model, "predicted", {})}
            derivations[variant] += [entries[k].profile.seconds for k in derived if k in entries]
    plain = runs["plain"]
    step = statistics.median(t for r in plain for t in r[1:])
    for variant, rounds in runs.items():
        totals = [sum(r[1:]) for r in rounds]
        ratios = [round(sum(r[1:]) / sum(p[1:]), 2) for r, p in zip(rounds, plain, strict=True)]
        line = f"{variant:14s} steps 2..{args.steps} median {statistics.median(totals):.2f} s; x plain {ratios}"
        for kind in ("first", "measured", "derived"):
            idx = [i for i, k in enumerate(kinds[variant]) if k == kind]
            if idx and variant != "plain":
                extra = statistics.median(
                    statistics.mean(r[i] - p[i] for i in idx) for r, p in zip(rounds, plain, strict=True)
                )
                line += f"; {len(idx)} {kind} +{extra / step:.2f} plain steps each"
        if derivations[variant]:
            line += f"; a derivation {statistics.median(derivations[variant]) * 1e3:.1f} ms (median)"
        print(line + (f" (a plain step {step * 1e3:.0f} ms)" if variant == "plain" else ""), flush=True)


if __name__ == "__main__":
    main()
