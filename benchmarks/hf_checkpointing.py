"""rotor against Hugging Face's own gradient checkpointing, at the memory Hugging Face's needs (issue 17).

Per model (built from a config, nothing downloaded), the same training step, `labels` passed so
that the model computes its loss in the forward (`model(input_ids=x, labels=x).loss.backward()`):

- `plain`: no checkpointing;
- `hf`: `gradient_checkpointing_enable(use_reentrant=False)`: every block's input kept, each block
  recomputed once in the backward;
- `hf, no early stop`: the same under `torch.utils.checkpoint.set_checkpoint_early_stop(False)`: each
  recomputation runs the whole block, as rotor's does (torch's stops once the backward's tensors are made);
- `rotor @ hf`: `Checkpointable(model, mem_limit=<hf's measured peak>, discover="modules")`;
- `rotor @ hf, no early stop`: the same with `early_stop=False`: each recomputation runs the whole stage
  (`Fe k`), as rotor did before its executor stopped early too;
- `rotor min`: rotor at its smallest feasible budget.

Peaks by exact tensor accounting (`MemoryProbe` through the bench's `measure_peak`, the token ids
included), independent of rotor's prediction; times interleaved (one step of each method per round),
medians, fastest runs and spread = (max - min) / median.

    python benchmarks/hf_checkpointing.py --model gpt2 --repeats 9
    python benchmarks/hf_checkpointing.py --model qwen2 --repeats 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from typing import Any

import torch
from torch.utils.checkpoint import set_checkpoint_early_stop

from lightning_rotor import Checkpointable
from lightning_rotor.bench.measure import run_interleaved, train_step
from lightning_rotor.bench.methods import Method, Row
from lightning_rotor.bench.workload import Workload, measure_peak
from lightning_rotor.checkpointable import InfeasibleBudget


def build(name: str, batch: int, seq: int, layers: int, width: int) -> torch.nn.Module:
    """GPT-2 or Qwen2 from a config, eager attention, no key-value cache (training)."""
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config: Any = transformers.GPT2Config(
            vocab_size=2048, n_positions=seq, n_embd=width, n_layer=layers, n_head=4, use_cache=False
        )
        config._attn_implementation = "eager"
        return transformers.GPT2LMHeadModel(config)
    config = transformers.Qwen2Config(
        vocab_size=2048,
        hidden_size=width,
        intermediate_size=int(width * 2.6875),
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max(512, seq),
        use_cache=False,
    )
    config._attn_implementation = "eager"
    return transformers.Qwen2ForCausalLM(config)


class _HfCheckpointing:
    """The model's forward with Hugging Face's checkpointing on for this call only (the model is shared)."""

    def __init__(self, model: torch.nn.Module, early_stop: bool = True):
        self.model = model
        self.early_stop = early_stop
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the old name, still the one most users call
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
        self.set(False)

    def set(self, on: bool) -> None:
        for m in self.layers:
            m.gradient_checkpointing = on

    def __call__(self, x: torch.Tensor) -> Any:
        self.set(True)  # the recomputation in the backward calls the block directly: off again is fine
        try:
            with set_checkpoint_early_stop(self.early_stop):  # read when the forward checkpoints
                return self.model(input_ids=x, labels=x)
        finally:
            self.set(False)


class _Bar:
    def update(self, _n: int) -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "qwen2"), default="gpt2")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 8 (gpt2), 4 (qwen2)")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--layers", type=int, default=None, help="default: 12 (gpt2), 8 (qwen2)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    batch = args.batch_size or (8 if args.model == "gpt2" else 4)
    layers = args.layers or (12 if args.model == "gpt2" else 8)
    model = build(args.model, batch, args.seq, layers, args.width).train()
    x = torch.randint(2048, (batch, args.seq), generator=torch.Generator().manual_seed(0))
    w = Workload(args.model, model, x, x, lambda out, _y: out.loss, torch.device("cpu"))
    hf = _HfCheckpointing(model)
    plain_peak = measure_peak(w, lambda x: model(input_ids=x, labels=x), 0)
    hf_peak = measure_peak(w, hf, 0)

    def rotor(budget: int, early_stop: bool = True) -> Checkpointable:
        ckpt = Checkpointable(model, budget, discover="modules", repeats=5, early_stop=early_stop)
        train_step(w, lambda x: ckpt(input_ids=x, labels=x), 0)  # profiles and plans
        return ckpt

    try:
        rotor(1)
    except InfeasibleBudget as err:
        smallest = err.min_feasible
    at_hf, at_hf_full, at_min = rotor(hf_peak), rotor(hf_peak, early_stop=False), rotor(smallest)
    methods = [
        Method(Row(args.model, "cpu", "plain"), lambda x: model(input_ids=x, labels=x)),
        Method(Row(args.model, "cpu", "hf"), hf),
        Method(Row(args.model, "cpu", "hf, no early stop"), _HfCheckpointing(model, early_stop=False)),
    ]
    for label, ckpt in (("rotor @ hf", at_hf), ("rotor @ hf, no early stop", at_hf_full), ("rotor min", at_min)):
        row = Row(args.model, "cpu", label, mem_limit=ckpt.plan.mem_limit, predicted_peak=ckpt.plan.peak)
        early = sorted(ckpt.entry.runner.early)
        row.note = f"runs {ckpt.entry.runs}, early stop {early}, predicted {ckpt.plan.time * 1e3:.0f} ms"
        methods.append(Method(row, lambda x, ckpt=ckpt: ckpt(input_ids=x, labels=x)))
    run_interleaved(w, methods, args.repeats, 1, 0, _Bar())
    plain_ms = methods[0].row.step_ms or 1.0
    hf_ms = methods[1].row.step_ms or 1.0
    print(
        f"{args.model}: {layers} layers, width {args.width}, seq {args.seq}, batch {batch}; "
        f"{args.threads} thread(s), {args.repeats} interleaved rounds; load {open('/proc/loadavg').read().split()[:3]}"
    )
    print(f"plain peak {plain_peak:,} B, hf peak {hf_peak:,} B, rotor's smallest budget {smallest:,} B")
    print("| method | measured peak | / plain | predicted | median ms (min, spread) | vs plain | vs hf | note |")
    print("|---|---|---|---|---|---|---|---|")
    for m in methods:
        r = m.row
        assert r.measured_peak is not None and r.step_ms is not None
        print(
            f"| {r.method} | {r.measured_peak:,} | {r.measured_peak / plain_peak:.3f} | "
            f"{'' if r.predicted_peak is None else f'{r.predicted_peak:,}'} | "
            f"{r.step_ms:.0f} ({r.step_ms_min:.0f}, {r.spread:.0%}) | {r.step_ms / plain_ms:.3f} | "
            f"{r.step_ms / hf_ms:.3f} | {r.note} |"
        )
    rounds = [[a / b for a, b in zip(m.row.times, methods[1].row.times, strict=True)] for m in methods[2:]]
    for m, ratios in zip(methods[2:], rounds, strict=True):
        print(f"{m.row.method}: per-round time / hf median {statistics.median(ratios):.3f} (min {min(ratios):.3f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
