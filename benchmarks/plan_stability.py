"""Is the quickstart's plan reproducible, and does its predicted step time hold, quiet and under load?

Each run is a fresh process, as two `lightning-rotor fit --config configs/quickstart.yaml`
runs are: it builds the quickstart model (ResNet-18 style, width 32, 10 classes, batch 32
of 32x32 images, budget 75% of the no-recomputation peak), lets `Checkpointable` profile
and plan on the first training step, then times `--steps` further steps (forward, loss,
backward) and reports the plan, its predicted step time and the measured median.

`--load N` runs N busy-loop processes beside every run (started by this script, stopped
when it ends, and bounded in time in any case), as a loaded machine.

    python benchmarks/plan_stability.py --runs 5 --load 0 --load 1 --threads 1 --baseline /work/main

`--baseline DIR` runs another checkout's lightning_rotor alternately with this one.

docs/benchmarks.md ("Plan stability") records the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter

BUSY = "import time, sys\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


def worker(steps: int, threads: int) -> dict:
    """One quickstart run in this process: profile and plan on the first step, then time `steps` steps."""
    import torch
    import torch._dynamo  # noqa: F401  imported by Lightning in the quickstart; lazily (seconds) by the first probe otherwise
    import torch.nn.functional as F

    from lightning_rotor import Checkpointable
    from lightning_rotor.models import get_model
    from lightning_rotor.ops import forward_counts

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = get_model("resnet18", width=32, num_classes=10)
    model.train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(10, (32,), generator=g)
    rotor = Checkpointable(model, "75%")

    def step() -> float:
        rotor.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(rotor(x), y).backward()
        return time.perf_counter() - t0

    first = step()  # profiles and plans
    times = [step() for _ in range(steps)]
    chosen, chain = rotor.plan, rotor.chain
    runs = forward_counts(chosen.ops, chain.length)
    return {
        "plan": " ".join(str(op) for op in chosen.ops),
        "recomputed": [chain.names[k] for k, r in enumerate(runs) if r > 1],
        "predicted_ms": chosen.time * 1e3,
        "measured_ms": statistics.median(times[1:]) * 1e3,  # the first timed step still warms up
        "measured_min_ms": min(times) * 1e3,
        "measured_max_ms": max(times) * 1e3,
        "profile_s": rotor.profile_seconds,
        "first_step_s": first,
        "spread": rotor.profile.spread,
        "threads": torch.get_num_threads(),
        "rounds_ms": [t * 1e3 for t in getattr(rotor.profile, "round_seconds", [])],
        "chain": chain.to_dict(),
        "plan_dict": chosen.to_dict(),
    }


def run_one(steps: int, threads: int, tree: str | None = None) -> dict:
    """One run in a fresh process; `tree`: import lightning_rotor from that checkout instead."""
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    out = subprocess.run(
        [sys.executable, __file__, "--worker", "--steps", str(steps), "--threads", str(threads)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _spread(samples: list[float]) -> str:
    if not samples:
        return "-"
    return f"{(max(samples) - min(samples)) / statistics.median(samples):.0%} ({len(samples)})"


def _at_fastest_round(r: dict) -> str:
    """predicted/measured had the stage times been scaled to the fastest round instead of the median one (the plan
    is the same: a common factor)."""
    rounds = r["rounds_ms"]
    if not rounds:
        return "-"
    return f"{r['predicted_ms'] * min(rounds) / statistics.median(rounds) / r['measured_ms']:.2f}"


def report(load: int, results: list[dict], label: str = "") -> str:
    plans = Counter(r["plan"] for r in results)
    modal, same = plans.most_common(1)[0]
    recomputed = next(r["recomputed"] for r in results if r["plan"] == modal)
    lines = [
        f"### {label}background load: {load} busy process(es), {len(results)} runs, "
        f"{results[0]['threads']} intra-op thread(s)",
        "",
        f"- same plan: {same} of {len(results)} ({len(plans)} distinct); most common recomputes "
        f"{len(recomputed)} stage(s): {', '.join(recomputed) or 'none'}",
        "",
        "| run | recomputed | predicted ms | measured median ms | min | max | predicted/measured | "
        "profiling s | = steps | rounds spread | worst stage spread | predicted/measured, fastest round |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results):
        lines.append(
            f"| {i + 1} | {len(r['recomputed'])} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} | "
            f"{r['measured_min_ms']:.1f} | {r['measured_max_ms']:.1f} | {r['predicted_ms'] / r['measured_ms']:.2f} | "
            f"{r['profile_s']:.2f} | {r['profile_s'] * 1e3 / r['measured_ms']:.1f} | {_spread(r['rounds_ms'])} | "
            f"{r['spread']:.0%} | {_at_fastest_round(r)} |"
        )
    ratios = [r["predicted_ms"] / r["measured_ms"] for r in results]
    # how far apart the distinct plans are: each run's plan priced with every run's profile, against that run's own
    from lightning_rotor.chain import Chain
    from lightning_rotor.planner import Plan
    from lightning_rotor.simulate import simulate

    try:
        chains = [Chain.from_dict(r["chain"]) for r in results]
        ops = [Plan.from_dict(r["plan_dict"]).ops for r in results]
        pairs = [(c, own, o) for c, own in zip(chains, ops, strict=True) for o in ops]
        gap = f"{max(simulate(c, o).time / simulate(c, own).time - 1 for c, own, o in pairs):.1%}"
    except ValueError:  # a baseline's chains in a format this tree does not read
        gap = "n/a"
    predicted = [r["predicted_ms"] for r in results]
    lines += [
        "",
        f"- predicted/measured: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
        f"{max(ratios):.2f}; predicted step median {statistics.median(predicted):.1f} ms, range "
        f"{min(predicted):.1f}-{max(predicted):.1f} ms",
        f"- distinct plans priced on the same profile differ by at most {gap} (near-ties when small)",
        f"- load average while running: {os.getloadavg()[0]:.1f}",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="fresh processes per load level")
    parser.add_argument("--load", type=int, action="append", help="busy-loop processes beside the runs (repeatable)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run after the first")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--max-seconds", type=float, default=1800, help="the busy loops stop by then in any case")
    parser.add_argument("--baseline", help="another checkout (e.g. main), run alternately with this one")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.steps, args.threads)))
        return
    print(f"plan stability, quickstart model; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    for load in args.load or [0, 1]:
        busy = [subprocess.Popen([sys.executable, "-c", BUSY, str(args.max_seconds)]) for _ in range(load)]
        results: list[dict] = []
        baseline: list[dict] = []
        try:
            for _ in range(args.runs):  # alternately, so that the load other jobs add hits both alike
                results.append(run_one(args.steps, args.threads))
                if args.baseline:
                    baseline.append(run_one(args.steps, args.threads, args.baseline))
        finally:
            for p in busy:
                p.terminate()
                p.wait()
        print(report(load, results, "this tree, " if args.baseline else ""), flush=True)
        if args.baseline:
            print(report(load, baseline, f"baseline {args.baseline}, "), flush=True)


if __name__ == "__main__":
    main()
