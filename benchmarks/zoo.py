"""Rotor against every uniform checkpointing scheme on the model zoo, side by side in one run.

For each model: the plain step, `checkpoint_sequential` at every segment count, checkpointing
every stage, and rotor planned at its smallest feasible budget, at each uniform scheme's
measured peak and at the plain peak. Peaks are measured with exact tensor accounting
(`MemoryProbe`, chain input included); step times are medians over rounds in which every
configuration runs once, interleaved, so machine noise hits all of them alike. Each
uniform schedule also runs through rotor's executor (`exec:` rows) to price the executor
itself on the very same schedule.

    python benchmarks/zoo.py --models mobilenet gpt hetero resnet50 --repeats 7 --out benchmarks/results/zoo.md

docs/benchmarks.md records the figures and what they mean.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_rotor.bench.measure import measure_peak, train_step
from lightning_rotor.bench.methods import _each_checkpointed, _segments
from lightning_rotor.bench.uniform import checkpoint_every_stage_ops, checkpoint_sequential_ops
from lightning_rotor.bench.workload import Workload, load_workload
from lightning_rotor.execute import PlanRunner
from lightning_rotor.planner import min_feasible_budget, plan
from lightning_rotor.profile import profile_chain

BATCH = {"mobilenet": 8, "gpt": 4, "hetero": 32, "resnet50": 8, "resnet18": 8, "mlp": 32}


@dataclass
class Config:
    """One way to run a training step: its name, forward, budget, predicted and measured peaks, times."""

    name: str
    forward: Any
    budget: int | None = None
    predicted: int | None = None
    recomputed: int | None = None
    measured: int | None = None
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def spread(self) -> float:
        return (max(self.times) - min(self.times)) / self.median


def configs_for(
    w: Workload, repeats: int, warmup: int, min_seconds: float = 0.0
) -> tuple[list[Config], dict[str, Any]]:
    """Measure every configuration of one workload; returns the configs and a summary.

    Rounds: `repeats`, or more when a round is short, so that every configuration runs for
    at least `min_seconds` in all (short steps are the noisiest).
    """
    length = len(w.stages)
    chain = profile_chain(w.stages, w.x, names=w.stage_names, loss_tmp=lambda out: w.loss(out, w.y)).chain
    seq = nn.Sequential(*w.stages)
    plain = Config("plain", w.model)
    uniform = [Config(f"cs{s}", _segments(seq, s)) for s in range(2, length + 1)]
    uniform.append(Config("every", _each_checkpointed(w.stages)))
    ops_of = {
        c.name: (
            checkpoint_sequential_ops(length, int(c.name[2:]))
            if c.name.startswith("cs")
            else checkpoint_every_stage_ops(length)
        )
        for c in uniform
    }
    for c in [plain, *uniform]:
        train_step(w, c.forward, 0)  # warm-up, then the peak of one step
        c.measured = measure_peak(w, c.forward, 0)
    smallest = min_feasible_budget(chain)
    rotor: dict[tuple, Config] = {}  # one config per distinct plan
    targets = [("min", smallest), ("plain", plain.measured)] + [(c.name, c.measured) for c in uniform]
    at: dict[str, Config | None] = {}
    for label, budget in targets:
        try:
            p = plan(chain, budget)
        except ValueError:
            at[label] = None
            continue
        key = tuple(p.ops)
        if key not in rotor:
            runner = PlanRunner(w.stages, p.ops, w.stage_names, in_free=chain.in_free)
            rotor[key] = Config(f"rotor@{label}", runner, budget, p.peak, p.recomputed_stages)
            train_step(w, rotor[key].forward, 0)
            rotor[key].measured = measure_peak(w, rotor[key].forward, 0)
        at[label] = rotor[key]
    # the executor on torch's own schedule: the cheapest uniform scheme by memory, and sqrt(L) segments
    middle = f"cs{max(2, round(math.sqrt(length)))}"
    executed = [
        Config(f"exec:{name}", PlanRunner(w.stages, ops_of[name], w.stage_names, in_free=chain.in_free))
        for name in dict.fromkeys([middle, min(uniform, key=lambda c: c.measured).name])
    ]
    for c in executed:
        train_step(w, c.forward, 0)
    every = [plain, *uniform, *rotor.values(), *executed]
    round_start = time.perf_counter()
    for _ in range(max(1, warmup)):
        for c in every:
            train_step(w, c.forward, 0)
    round_seconds = (time.perf_counter() - round_start) / max(1, warmup)
    rounds = max(repeats, math.ceil(min_seconds * len(every) / round_seconds))
    for _ in range(rounds):
        for c in every:
            start = time.perf_counter()
            train_step(w, c.forward, 0)
            c.times.append(time.perf_counter() - start)
    return every, {
        "chain": chain,
        "plain": plain,
        "uniform": uniform,
        "at": at,
        "smallest": smallest,
        "executed": executed,
    }


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def report(name: str, w: Workload, every: list[Config], s: dict[str, Any]) -> tuple[list[str], list[float], dict]:
    plain, uniform, at = s["plain"], s["uniform"], s["at"]
    lines = [
        f"### {name} ({len(w.stages)} stages, batch {w.x.shape[0]}, {len(plain.times)} interleaved rounds)",
        "",
        "| config | budget MiB | predicted MiB | measured MiB | meas/pred | recomputed | median ms | spread |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in every:
        ratio = f"{c.measured / c.predicted:.3f}" if c.predicted else "-"
        lines.append(
            f"| {c.name} | {mib(c.budget)} | {mib(c.predicted)} | {mib(c.measured)} | {ratio} | "
            f"{'-' if c.recomputed is None else c.recomputed} | {c.median * 1e3:.1f} | {c.spread:.0%} |"
        )
    lowest = min(uniform, key=lambda c: c.measured)
    ratios = []
    worst = (0.0, "")
    for c in uniform:
        r = at.get(c.name)
        if r is not None:
            ratio = r.median / c.median
            ratios.append(ratio)
            worst = max(worst, (ratio, c.name))
    executed = ", ".join(
        f"{c.name[5:]} {c.median / next(u for u in uniform if u.name == c.name[5:]).median:.3f}x" for c in s["executed"]
    )
    summary = {
        "model": name,
        "min_budget": s["smallest"],
        "lowest_uniform": lowest.measured,
        "lowest_name": lowest.name,
        "plain": plain.measured,
        "plain_recomputed": at["plain"].recomputed if at.get("plain") else None,
        "geomean": math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else None,
        "worst": worst,
        "points": len(ratios),
        "planned": sum(1 for c in uniform if at.get(c.name)),
        "within_2pct": sum(1 for r in ratios if r <= 1.02),
        "meas_pred": [c.measured / c.predicted for c in every if c.predicted],
        "over_budget": [c.name for c in every if c.budget is not None and c.measured > c.budget],
        "executed": executed,
    }
    lines += [
        "",
        f"- smallest feasible budget {mib(s['smallest'])} MiB vs lowest uniform peak "
        f"{mib(lowest.measured)} MiB ({lowest.name}): {s['smallest'] / lowest.measured:.3f}",
        f"- plain peak {mib(plain.measured)} MiB; rotor planned there recomputes {summary['plain_recomputed']} stages",
        f"- rotor at each uniform scheme's peak: {summary['planned']} of {len(uniform)} planned, "
        f"median time ratio geomean {summary['geomean']:.3f}, worst {worst[0]:.3f} ({worst[1]}), "
        f"{summary['within_2pct']} of {len(ratios)} within 1.02x",
        f"- measured/predicted over rotor's plans: {min(summary['meas_pred']):.3f}–"
        f"{max(summary['meas_pred']):.3f}; above budget: {summary['over_budget'] or 'none'}",
        f"- rotor's executor on torch's own schedule vs torch: {executed}",
        "",
    ]
    return lines, ratios, summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mobilenet", "gpt", "hetero", "resnet50"])
    parser.add_argument("--size", default="bench", choices=["tiny", "bench"])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=0.0,
        help="run more rounds than --repeats until each configuration has run this long in all",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = [
        f"Run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"`python benchmarks/zoo.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
        "",
    ]
    all_ratios: list[float] = []
    summaries = []
    for name in args.models:
        w = load_workload(name, batch_size=BATCH.get(name, 8), size=args.size, device=torch.device("cpu"))
        every, s = configs_for(w, args.repeats, args.warmup, args.min_seconds)
        lines, ratios, summary = report(name, w, every, s)
        all_ratios += ratios
        summaries.append(summary)
        out += lines
        print("\n".join(lines), flush=True)
    out += [
        "### Summary",
        "",
        "| model | min budget / lowest uniform | plain: recomputed | time ratio geomean "
        "| worst | within 1.02x | meas/pred |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in summaries:
        out.append(
            f"| {m['model']} | {m['min_budget'] / m['lowest_uniform']:.3f} | {m['plain_recomputed']} | "
            f"{m['geomean']:.3f} | {m['worst'][0]:.3f} ({m['worst'][1]}) | {m['within_2pct']}/{m['points']} | "
            f"{min(m['meas_pred']):.3f}–{max(m['meas_pred']):.3f} |"
        )
    if all_ratios:
        out.append(
            f"\nAll points: geomean {math.exp(statistics.fmean(math.log(r) for r in all_ratios)):.3f} "
            f"over {len(all_ratios)} points."
        )
    print("\n".join(out[-len(summaries) - 5 :]))
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
