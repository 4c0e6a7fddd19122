"""`lightning-rotor bench`: the command (arguments, the run, printing)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from lightning_rotor.bench.measure import run_compiled, run_interleaved
from lightning_rotor.bench.methods import Row, eager_methods
from lightning_rotor.bench.peers import is_peer_model
from lightning_rotor.bench.report import add_ratios, checks, markdown, read_csv, write_csv, write_plot
from lightning_rotor.bench.workload import BenchError, load_workload, parse_kwargs
from lightning_rotor.budget import BudgetError, parse_budget
from lightning_rotor.models import MODELS

DEFAULT_BUDGETS = "min,0.25,0.5,0.75,1.0"


def _budget_tokens(text: str) -> list[str]:
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    if not tokens:
        raise BenchError("--budgets is empty; give e.g. min,0.25,0.5,0.75,1.0")
    for t in tokens:
        if t != "min":
            try:
                parse_budget(t)
            except BudgetError as err:
                raise BenchError(f"bad budget {t!r} in --budgets: {err}") from None
    return tokens


def _fraction_tokens(tokens: list[str]) -> list[str]:
    out = []
    for t in tokens:
        if t == "min":
            continue
        v = parse_budget(t)
        if not isinstance(v, int) and 0 < v <= 1:
            out.append(t)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-rotor bench",
        description="Compare rotor with no checkpointing, checkpoint_sequential, recompute-all and torch.compile's "
        "activation_memory_budget on one model (hf:/timm: models: with the model's own checkpointing and torch's "
        "SAC per block): peak activation memory and step time.",
    )
    p.add_argument("--from-csv", default=None, help="re-report (table, checks, PNG) a CSV of an earlier run")
    p.add_argument(
        "--model",
        help=f"registered name ({', '.join(MODELS)}), pkg.module:factory, or hf:NAME / timm:NAME "
        "(transformers / timm, built from a config, --set sizes; nothing downloaded)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument(
        "--budgets",
        default=DEFAULT_BUDGETS,
        help="rotor budgets: fractions of the no-recomputation peak, sizes, or 'min' (smallest feasible)",
    )
    p.add_argument("--out", default="bench_out", help="folder for the CSV and the PNG")
    p.add_argument(
        "--size",
        choices=("tiny", "bench", "full"),
        default="bench",
        help="registered model's preset sizes (full: the standard network)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="model/sample size argument, e.g. --set n_layer=4 (repeatable)",
    )
    p.add_argument("--input-shape", default=None, help="input shape for a factory returning a bare nn.Sequential")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per method (interleaved)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--max-segments", type=int, default=None, help="cap checkpoint_sequential's segment counts")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument(
        "--compile",
        action="store_true",
        help="add the torch.compile rows for hf:/timm: models too (off by default there: slow, and outliers)",
    )
    p.add_argument(
        "--compile-budgets",
        default=None,
        help="activation_memory_budget fractions for torch.compile (default: the fractions in --budgets)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p  # fmt: skip


def run(args: argparse.Namespace) -> list[Row]:
    """Everything but argument parsing and printing: the rows, in table order."""
    from tqdm.auto import tqdm

    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = _budget_tokens(args.budgets)
    try:
        shape = tuple(int(s) for s in args.input_shape.split(",")) if args.input_shape else None
    except ValueError:
        raise BenchError(f"--input-shape expects integers like 8,3,224,224, got {args.input_shape!r}") from None
    w = load_workload(
        args.model, batch_size=args.batch_size, size=args.size, overrides=parse_kwargs(args.set),
        input_shape=shape, device=torch.device(args.device) if args.device else None, seed=args.seed,
    )  # fmt: skip
    for name, value in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if value < (1 if name == "--repeats" else 0):
            raise BenchError(f"{name} must be {'positive' if name == '--repeats' else 'non-negative'}, got {value}")
    compile_tokens = budgets if args.compile_budgets is None else _budget_tokens(args.compile_budgets)
    skip_compile = args.no_compile or (is_peer_model(args.model) and not args.compile)
    fractions = [] if skip_compile else _fraction_tokens(compile_tokens)
    with tqdm(total=1, desc=f"bench {args.model}: profiling", disable=args.quiet, file=sys.stderr) as bar:
        methods = eager_methods(w, budgets, args.max_segments)
        bar.update(1)
        live = sum(m.forward is not None for m in methods)
        bar.total = 1 + live * (args.warmup + 1 + args.repeats) + len(fractions) * (args.warmup + args.repeats + 2)
        bar.set_description(f"bench {args.model}: timing {live} methods")
        run_interleaved(w, methods, args.repeats, args.warmup, args.seed, bar)
        rows = [m.row for m in methods]
        if fractions:
            bar.set_description(f"bench {args.model}: torch.compile")
            rows += run_compiled(w, fractions, args.repeats, args.warmup, args.seed, bar)
    add_ratios(rows)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.from_csv:
        rows = read_csv(Path(args.from_csv))
        args.model = rows[0].model if rows else "?"
    elif not args.model:
        parser.error("--model is required (a registered name or pkg.module:factory)")
    try:
        rows = rows if args.from_csv else run(args)
    except (BenchError, BudgetError) as err:
        print(f"lightning-rotor bench: error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.model.replace(":", "_").replace(".", "_").replace("/", "_")
    csv_path, png_path = out / f"{stem}.csv", out / f"{stem}.png"
    write_csv(rows, csv_path)
    device = rows[0].device if rows else "?"
    title = (
        f"{args.model}, {device} (from {Path(args.from_csv).name})"
        if args.from_csv
        else f"{args.model}, batch {args.batch_size}, {device}, {torch.get_num_threads()} threads"
    )
    write_plot(rows, png_path, title)
    print(f"## {title}\n")
    print(markdown(rows))
    for stat, label in (("step_ms", "medians"), ("step_ms_min", "fastest runs")):
        if any(getattr(r, stat) is not None for r in rows):
            print(f"\nchecks on {label} (see the spread column for noise):")
            for line in checks(rows, stat):
                print(f"- {line}")
    print(f"\nwrote {csv_path} and {png_path}")
    return 0
