"""Fuzz the executor: random DAG models x budgets from the smallest feasible to the plain peak.

Each model (tests/fuzz_models.py: graph, Sequential and ModuleList-loop variants, with skips
carried across stages, `torch.cat`, views, in-place ops, BatchNorm, dropout and several
outputs) is trained plainly and with rotor at every budget of `--fractions`; every plan is
executed. Cases run in a child process, so a segfault is counted as a crash (and the case is
run again in a fresh process to tell whether it reproduces alone) instead of ending the run.

    python benchmarks/fuzz.py --examples 500 --seconds 1200 --out benchmarks/results/fuzz.md
    python benchmarks/fuzz.py --examples 300 --shrink        # also shrink one case per failure class

Counts: cases, plans executed, and per failure class (crash, hang, error, not bitwise, over
budget, refused) the cases that show it, with their `Spec`s (each is a reproducer:
`fuzz_models.check(Spec(...))`). docs/benchmarks.md, "Fuzzing the executor", records runs.
"""

from __future__ import annotations

import argparse
import collections
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # one copy of the models: the tests'

from fuzz_models import FRACTIONS, Outcome, Spec, Worker, specs  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402

CLASSES = ("crash", "hang", "error", "not bitwise", "over budget", "refused")
RERUN = ("crash", "hang", "not bitwise")  # run again alone in a fresh process: do they reproduce on their own?


def fuzz(
    examples: int, seconds: float, fractions: tuple[float, ...], start: int, kinds: list[str], worker: Worker
) -> list[Outcome]:
    """Run up to `examples` generated cases (or until `seconds` have passed); no shrinking."""
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + seconds

    @seed(start)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(specs(discover=kinds))
    def case(spec: Spec) -> None:
        if time.monotonic() > deadline:
            return
        outcome = worker.run(spec, fractions)
        if any(c in RERUN for c, _ in outcome.failures):
            with Worker(worker.timeout) as fresh:  # does it reproduce alone, in a process of its own?
                again = fresh.run(spec, fractions)
            outcome.alone = sorted({c for c, _ in again.failures})
        outcomes.append(outcome)
        mark = "".join(sorted({c[0].upper() for c, _ in outcome.failures})) or "."
        print(mark, end="", flush=True)

    case()
    print()
    return outcomes


def shrink(
    cls: str, examples: int, fractions: tuple[float, ...], start: int, kinds: list[str], worker: Worker
) -> Spec | None:
    """The smallest case hypothesis finds failing with `cls` (None when none is found in `examples`)."""
    found: list[Spec] = []

    @seed(start)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(specs(discover=kinds))
    def case(spec: Spec) -> None:
        outcome = worker.run(spec, fractions)
        if any(c == cls for c, _ in outcome.failures):
            found.append(spec)
            raise AssertionError(cls)

    try:
        case()
    except AssertionError:
        return found[-1]
    return None


def report(
    outcomes: list[Outcome],
    args: argparse.Namespace,
    seconds: float,
    minimal: dict[str, tuple[Spec, Outcome]],
    commit: str,
) -> str:
    cases = [o for o in outcomes if not o.skipped]
    by_class: dict[str, list[Outcome]] = collections.defaultdict(list)
    for o in cases:
        for cls in sorted({c for c, _ in o.failures}):
            by_class[cls].append(o)
    kinds = collections.Counter(o.spec.discover for o in cases)
    lines = [
        f"# Fuzzing the executor: {len(cases)} cases in {seconds:.0f} s",
        "",
        f"`python benchmarks/fuzz.py --examples {args.examples} --seconds {args.seconds:g} --seed {args.seed}`"
        f" at commit {commit or '?'}; Python {platform.python_version()}, torch {_torch_version()}.",
        "",
        "| | count |",
        "|---|---|",
        f"| cases (models trained plainly and with rotor) | {len(cases)} |",
        f"| by discovery | {', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))} |",
        f"| generated but not cases (plain training fails, or no chain) | {len(outcomes) - len(cases)} |",
        f"| stages per case (median, max) | {_median([o.stages for o in cases])}, "
        f"{max((o.stages for o in cases), default=0)} |",
        f"| plans executed (each: one step plain-compared, one measured) | {sum(o.plans for o in cases)} |",
    ]
    for cls in CLASSES:
        lines.append(f"| cases with: {cls} | {len(by_class.get(cls, []))} |")
    again = [o for o in cases if o.alone is not None]
    lines.append(
        f"| crash, hang or not bitwise, run again alone in a fresh process: the same class again | "
        f"{sum(any(c in o.alone for c, _ in o.failures if c in RERUN) for o in again)} of {len(again)} |"
    )
    for cls in CLASSES:
        found = by_class.get(cls, [])
        if not found:
            continue
        lines += ["", f"## {cls}: {len(found)} cases", ""]
        kinds = collections.Counter(_signature(o, cls) for o in found)
        lines += ["| cases | discovery: what |", "|---|---|"]
        lines += [f"| {n} | {what} |" for what, n in kinds.most_common()]
        lines.append("")
        if cls in minimal:
            spec, outcome = minimal[cls]
            lines += ["Smallest case hypothesis shrank to:", "", "```python", repr(spec), "```", ""]
            lines += [f"- {line}" for c, line in outcome.failures if c == cls][:3]
            lines.append("")
        lines.append(f"The first {min(len(found), args.show)}:")
        for o in found[: args.show]:
            note = "" if o.alone is None else f" (alone in a fresh process: {', '.join(o.alone) or 'passes'})"
            stages = f"{o.stages} stages" if o.stages else "stages unknown (the case died)"
            lines += ["", "```python", repr(o.spec), "```", f"{stages}{note}"]
            lines += [f"- {line}" for c, line in o.failures if c == cls][:3]
    return "\n".join(lines) + "\n"


def _signature(outcome: Outcome, cls: str) -> str:
    """What a failure looks like, for grouping: the discovery method, and for errors the message's start."""
    line = next(line for c, line in outcome.failures if c == cls)
    if cls == "error":
        return f"{outcome.spec.discover}: {re.sub(r'^.*?: (?=[A-Z][A-Za-z]*(Error|Exception))', '', line)[:90]}"
    return outcome.spec.discover


def _median(values: list[int]) -> int:
    return sorted(values)[len(values) // 2] if values else 0


def _torch_version() -> str:
    import torch

    return torch.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=500, help="cases generated at most")
    parser.add_argument("--seconds", type=float, default=1200, help="stop generating after this many seconds")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (the same seed: the same cases)")
    parser.add_argument(
        "--discover", nargs="+", default=["graph", "sequential", "modules"], choices=["graph", "sequential", "modules"]
    )
    parser.add_argument(
        "--fractions",
        type=float,
        nargs="+",
        default=list(FRACTIONS),
        help="budgets, as fractions of the way from the smallest feasible to the plain peak",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds a case may run before it is a hang")
    parser.add_argument("--shrink", action="store_true", help="also shrink one case per failure class found")
    parser.add_argument("--show", type=int, default=5, help="failing cases listed per class")
    parser.add_argument("--out", type=Path, help="also write the report (markdown) here")
    parser.add_argument("--failures", type=Path, help="write every failing case here, one per line: class, Spec, lines")
    args = parser.parse_args()
    fractions = tuple(args.fractions)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    began = time.monotonic()
    with Worker(args.timeout) as worker:
        outcomes = fuzz(args.examples, args.seconds, fractions, args.seed, args.discover, worker)
        minimal = {}
        if args.shrink:
            for cls in sorted({c for o in outcomes for c, _ in o.failures}):
                spec = shrink(cls, args.examples, fractions, args.seed, args.discover, worker)
                if spec is not None:
                    minimal[cls] = (spec, worker.run(spec, fractions))
    text = report(outcomes, args, time.monotonic() - began, minimal, commit)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if args.failures:
        with args.failures.open("w") as f:
            for o in outcomes:
                for cls in sorted({c for c, _ in o.failures}):
                    lines = [line for c, line in o.failures if c == cls]
                    alone = "" if o.alone is None else f"alone: {', '.join(o.alone) or 'passes'}"
                    f.write(f"{cls}\t{o.spec!r}\t{' | '.join(lines)}\t{alone}\n")


if __name__ == "__main__":
    main()
