"""Why CUDA conv stages profile about 1.5x long: the profiler's stage times against steady-state ones, per suspect.

    cd benchmarks && PYTHONPATH=..:. python3 cuda_stage_times.py --out cuda_stage_times.md  # CUDA: under 4 minutes
    PYTHONPATH=. python benchmarks/cuda_stage_times.py --device cpu --out /tmp/cst.md     # the same code, tiny sizes

On the ResNet-18 and ResNet-50 of `benchmarks/gpu_check.py` (sections 4 and 5, the same builders and sizes), per
stage (forward, backward), it compares:

- the profiler's times, as `profile_chain` measures them now (the process's first profile of the model, timing
  rounds without the CUDA warm-up of NOTE: [warm timing rounds on CUDA]: `profile.CUDA_WARMUP_ROUNDS = 0`), and
  with that warm-up (`CUDA_WARMUP_ROUNDS` 1 and 3): one run shows the fix and the state before it;
- steady state: every stage's share of a plain training step, from CUDA events recorded at the stage boundaries
  (forward hooks, and tensor hooks where each stage input's gradient is ready) over many steps after a warm-up,
  no synchronisation inside a step ("in-step", the reference of every ratio); each stage alone, run back to back
  with CUDA events ("alone"); each stage alone timed by the profiler's own primitive (`profile._timed_run`: a
  synchronisation before and after each forward and backward) over many warm rounds ("sync per stage"), and the
  same with a synchronisation after every op (and, to tell the dispatch mode's own cost, without it);
- variations of the profile that isolate each suspect: a second profile in the same process, more timing rounds
  (not two scaled to their mean), the GPU kept busy right before the profile (clocks) or idle two seconds,
  the caching allocator emptied first; the first profile of a fresh child process, without and with the fix, and
  with `torch.backends.cudnn.benchmark` on from its start (against in-step times in that process: cuDNN caches
  the algorithm it found for a shape either way, so only a fresh process shows what the flag changes); and the
  cudaMalloc calls and SM clock around the timing rounds;
- the whole step: predicted (simulator) against measured for the plain step, recompute-only and offloading plans
  at `--fraction` of the no-recomputation peak, on the chain profiled as now and with the warm-up.

It prints one markdown report (and writes it to `--out`): per model a per-stage table, a table of variants with
their ratios to the in-step times, the factors of the gap, the plans' table, and a conclusion line naming the
suspect whose removal brings the ratio nearest 1. Every part runs in its own try/except and within the time left
(`--limit`); a part that fails says so in one line and the next runs. `--device cpu` runs the very same code at
gpu_check's tiny CPU sizes (its times say nothing about CUDA; it exercises the script).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import CPU_SIZES, CUDA_SIZES, SectionTimeout, error_line, time_limit  # noqa: E402

from lightning_rotor import profile as profile_mod  # noqa: E402
from lightning_rotor._torch_compat import TorchDispatchMode  # noqa: E402
from lightning_rotor.bench.measure import train_step  # noqa: E402
from lightning_rotor.bench.workload import Workload, load_workload  # noqa: E402
from lightning_rotor.budget import format_bandwidth, format_bytes  # noqa: E402
from lightning_rotor.chain import Chain  # noqa: E402
from lightning_rotor.engine import backward_from_edges, backward_pairs, output_edges, tensors_of  # noqa: E402
from lightning_rotor.execute import PlanRunner  # noqa: E402
from lightning_rotor.offload import measure_bandwidth  # noqa: E402
from lightning_rotor.ops import Op, OpKind  # noqa: E402
from lightning_rotor.planner import min_feasible_budget, plan  # noqa: E402
from lightning_rotor.profile import Untouched, profile_chain  # noqa: E402
from lightning_rotor.simulate import no_recompute_peak, simulate  # noqa: E402

MODELS = (("ResNet-18", "resnet18"), ("ResNet-50", "resnet50"))  # gpu_check's section 4 and 5 models
NEAR = 0.10  # a ratio within 10% of 1 is "near"


@dataclass(frozen=True)
class Counts:
    """How many times each measurement runs: CUDA figures that settle, CPU ones that only exercise the code."""

    iters: int  # in-step steps, and back-to-back runs of each stage alone (after `warm`)
    warm: int
    sync_rounds: int  # rounds of the profiler's primitive (sync per stage)
    op_rounds: int  # rounds with a dispatch mode (sync per op, and without the sync)
    plan_steps: int  # timed steps per plan (interleaved)
    many_repeats: int  # timing rounds of the "more rounds" profile
    idle_s: float  # seconds idle before the "idle" profile
    busy_s: float  # seconds of matmuls before the "busy" profile
    limit: float  # seconds for the whole run


CUDA_COUNTS = Counts(iters=20, warm=3, sync_rounds=7, op_rounds=3, plan_steps=10, many_repeats=10, idle_s=1.0,
                     busy_s=0.5, limit=180.0)  # fmt: skip
CPU_COUNTS = Counts(iters=2, warm=1, sync_rounds=2, op_rounds=1, plan_steps=2, many_repeats=6, idle_s=0.01,
                    busy_s=0.01, limit=900.0)  # fmt: skip


# -- clocks: CUDA events, or the host's clock on CPU -----------------------------------------------------------
class Stamps:
    """Points on the device's timeline: CUDA events recorded on the current stream (no synchronisation), or
    `time.perf_counter()` on CPU, where every op has ended when it returns."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from stamp `a` to stamp `b` (after `settle`)."""
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def settle(self) -> None:
        sync(self.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def malloc_count(device: torch.device) -> int | None:
    """cudaMalloc calls so far (the caching allocator's segments allocated); None off CUDA."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("segment.all.allocated", 0))


def sm_clock(device: torch.device) -> int | None:
    """The SM clock in MHz where torch can read it (pynvml), else None."""
    if device.type != "cuda":
        return None
    try:
        return int(torch.cuda.clock_rate(device))
    except Exception:  # noqa: BLE001 - no NVML here: the figure is left out
        return None


# -- per-stage times and what measured them --------------------------------------------------------------------
@dataclass
class Times:
    """Per stage forward and backward seconds (None: not measured), and how they were measured."""

    label: str
    suspect: str  # what this variant isolates ("" for a reference)
    fwd: list[float | None]
    bwd: list[float | None]
    rounds: int = 0  # timing rounds (profiles) or runs (steady figures)
    mallocs: int | None = None  # cudaMalloc calls inside the timing rounds
    clocks: str = ""  # SM clock before / after the timing rounds
    ops: int = 0  # ops dispatched per round, under `OpSync`
    note: str = ""

    @property
    def total(self) -> float:
        return math.fsum(t for t in [*self.fwd, *self.bwd] if t is not None)


def medians(samples: list[list[float]]) -> list[float | None]:
    return [statistics.median(s) if s else None for s in samples]


@dataclass
class RawRounds:
    """One call of the profiler's `_timed_rounds`: its per-stage runs, and what happened around it."""

    fwd: list[list[float]]
    bwd: list[list[float]]
    mallocs: int | None
    clocks: tuple[int | None, int | None]


@contextlib.contextmanager
def recorded_rounds(device: torch.device, calls: list[RawRounds]) -> Iterator[None]:
    """Record every call of `profile._timed_rounds` (warm-up rounds and timing rounds, in order) in `calls`."""
    original = getattr(profile_mod, "_timed_rounds", None)
    if original is None:  # another tree: the profile still runs, its raw rounds are not recorded
        yield
        return

    def recording(*args: Any, **kwargs: Any) -> tuple[list[list[float]], list[list[float]]]:
        before, clock = malloc_count(device), sm_clock(device)
        fwd, bwd = original(*args, **kwargs)
        after = malloc_count(device)
        mallocs = None if before is None or after is None else after - before
        calls.append(RawRounds([list(r) for r in fwd], [list(r) for r in bwd], mallocs, (clock, sm_clock(device))))
        return fwd, bwd

    profile_mod._timed_rounds = recording  # type: ignore[assignment]
    try:
        yield
    finally:
        profile_mod._timed_rounds = original  # type: ignore[assignment]


@contextlib.contextmanager
def patched(name: str, value: Any) -> Iterator[bool]:
    """`lightning_rotor.profile.<name>` set to `value` inside; yields False (nothing set) where the tree lacks it."""
    if not hasattr(profile_mod, name):
        yield False
        return
    before = getattr(profile_mod, name)
    setattr(profile_mod, name, value)
    try:
        yield True
    finally:
        setattr(profile_mod, name, before)


def profiled(w: Workload, label: str, suspect: str, warm: int = 0, repeats: int = 5) -> tuple[Times, Chain]:
    """`profile_chain` as the executor's callers run it (`offload=True`, as benchmarks/offload_gpu.py), with
    `warm` CUDA warm-up rounds (0: as before the fix) and `repeats` timing rounds at most (more than 5: every
    one of them run, `PROFILE_STEPS` lifted)."""
    calls: list[RawRounds] = []
    with contextlib.ExitStack() as stack:
        if not stack.enter_context(patched("CUDA_WARMUP_ROUNDS", warm)) and warm:
            raise RuntimeError("this tree has no CUDA warm-up rounds (lightning_rotor.profile.CUDA_WARMUP_ROUNDS)")
        if repeats > 5:
            stack.enter_context(patched("PROFILE_STEPS", 10**6))
            stack.enter_context(patched("_settled", lambda *_: False))  # never settled: every round runs
        stack.enter_context(recorded_rounds(w.x.device, calls))
        measured = profile_chain(w.stages, w.x, names=w.stage_names, repeats=repeats, offload=True)
    chain = measured.chain
    times = Times(label, suspect, list(chain.fwd_time), list(chain.bwd_time), rounds=measured.repeats)
    times.note = f"profile {measured.seconds:.2f} s"
    if calls:
        timed = calls[-1]
        times.mallocs = timed.mallocs
        times.clocks = "/".join("-" if c is None else str(c) for c in timed.clocks)
        if len(calls) > 1:
            times.note += f", {len(calls) - 1} warm-up call(s), {sum(c.mallocs or 0 for c in calls[:-1])} mallocs"
        rounds = [math.fsum(f[r] + b[r] for f, b in zip(timed.fwd, timed.bwd, strict=True)) for r in
                  range(len(timed.fwd[0]) if timed.fwd else 0)]  # fmt: skip
        times.note += "; rounds " + ", ".join(f"{1e3 * r:.2f}" for r in rounds) + " ms"
    return times, chain


def unscaled(label: str, suspect: str, raw: RawRounds) -> Times:
    """Each stage's fastest run of the recorded timing rounds, not scaled to the median round."""
    return Times(label, suspect, [min(r) for r in raw.fwd], [min(r) for r in raw.bwd], rounds=len(raw.fwd[0]))


def profiled_raw(w: Workload) -> tuple[Times, Chain, Times | None]:
    """The first profile (as now) and, from its raw rounds, the fastest runs without the median-round scale."""
    calls: list[RawRounds] = []
    with recorded_rounds(w.x.device, calls):
        first, chain = profiled(w, "profile as now (first in the process)", "")
    raw = unscaled("as now, fastest runs unscaled", "median-round scale of 2 rounds", calls[-1]) if calls else None
    return first, chain, raw


def workload(name: str, device: torch.device) -> Workload:
    """gpu_check's model `name` at its sizes for `device` (CUDA: sections 4 and 5; CPU: tiny)."""
    sizes = CUDA_SIZES if device.type == "cuda" else CPU_SIZES
    kwargs, batch = getattr(sizes, name), getattr(sizes, f"{name}_batch")
    return load_workload(name, batch_size=batch, size="full", overrides=dict(kwargs), device=device)


def fresh_run(name: str, device: torch.device, options: list[str], timeout: float) -> list[dict[str, Any]]:
    """The JSON lines of a child process (`--child`) that profiles the model as its first work: nothing warmed by
    what this process ran before, as the profile on a training's first batch."""
    root = str(Path(profile_mod.__file__).resolve().parents[1])  # the child imports this very package
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--device", device.type, *options]
    env = dict(os.environ, PYTHONPATH=path)
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise RuntimeError(f"the child process exited with {done.returncode}: {last}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def fresh_profile(name: str, device: torch.device, warm: int, label: str, suspect: str, timeout: float) -> Times:
    """A fresh process's first profile, with `warm` CUDA warm-up rounds."""
    fields = fresh_run(name, device, ["--warm", str(warm)], timeout)[0]
    fields.update(label=label, suspect=suspect, note="fresh process; " + fields["note"])
    return Times(**fields)


def fresh_benchmark(name: str, device: torch.device, timeout: float) -> tuple[Times, Times]:
    """(profile, in-step times) of a fresh process with `torch.backends.cudnn.benchmark` on from its start: cuDNN
    caches the algorithm it found for a shape, by benchmark or by heuristics alike, so only a process that has run
    nothing before shows what the flag changes."""
    profile, steady = fresh_run(name, device, ["--cudnn-benchmark"], timeout)
    profile.update(label="fresh process, cudnn.benchmark on",
                   suspect="cuDNN algorithm choice (cudnn.benchmark on, against in-step also on)",
                   note="fresh process; " + profile["note"])  # fmt: skip
    steady.update(label="in-step, cudnn.benchmark on (the same fresh process)")
    return Times(**profile), Times(**steady)


def child(name: str, device: torch.device, warm: int, benchmark: bool) -> int:
    """`--child`: profile the model once, as the process's first work, and print its times as one JSON line; with
    `benchmark`, cudnn.benchmark on from the start, and the in-step times after as a second line."""
    torch.backends.cudnn.benchmark = benchmark
    w = workload(name, device)
    times, _ = profiled(w, "", "", warm=warm)
    print(json.dumps(dataclasses.asdict(times)))
    if benchmark:
        c = CUDA_COUNTS if device.type == "cuda" else CPU_COUNTS
        print(json.dumps(dataclasses.asdict(in_step_times(w, c.iters, c.warm, ""))))
    return 0


# -- steady state ---------------------------------------------------------------------------------------------
def stage_inputs(w: Workload) -> list[Any]:
    """a_0 … a_{L-1}, made without grad (the profiler's inputs)."""
    values = [w.x]
    with torch.no_grad():
        for stage in w.stages[:-1]:
            values.append(stage(values[-1]))
    return values


def stage_forward(w: Workload, inputs: list[Any], k: int) -> Callable[..., tuple[Any, Any]]:
    """Stage k's forward as the profiler's timing rounds run it (`profile._stage_forward`)."""
    grad_in = k > 0 or any(t.requires_grad for t in tensors_of(w.x))
    return functools.partial(profile_mod._stage_forward, w.stages[k], inputs[k], grad_in, k, w.stage_names[k])


class OpSync(TorchDispatchMode):
    """Every aten op dispatched through Python, and synchronised after when `sync` (launch latency made visible)."""

    def __init__(self, device: torch.device, sync: bool):
        super().__init__()
        self.device, self.sync, self.ops = device, sync, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        if self.sync:
            sync(self.device)
        return out


def synced_times(w: Workload, inputs: list[Any], rounds: int, label: str, mode: str = "") -> Times:
    """Each stage timed by the profiler's primitive (`_timed_run`: a sync before and after each F and B), in
    rounds over the chain after one warm round, median per stage; `mode` "sync"/"nosync": inside `OpSync`."""
    device, n = w.x.device, len(w.stages)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    ops = 0
    with profile_mod.collector_paused(), Untouched(w.stages, [device]) as untouched:  # as the profiler: no gc pause
        for r in range(rounds + 1):
            for k in range(n):
                hook = OpSync(device, mode == "sync") if mode else contextlib.nullcontext()
                with hook:
                    f, b = profile_mod._timed_run(stage_forward(w, inputs, k), device, untouched)
                if r:
                    fwd[k].append(f)
                    bwd[k].append(b)
                    ops += hook.ops if isinstance(hook, OpSync) else 0
    times = Times(label, "", medians(fwd), medians(bwd), rounds=rounds)
    if mode:
        times.ops = ops // max(rounds, 1)
        times.note = f"{times.ops} ops dispatched per round (timed F and B, and the untimed restore after)"
    return times


def alone_times(w: Workload, inputs: list[Any], iters: int, warm: int) -> Times:
    """Each stage's F and B run back to back `warm + iters` times as `_timed_run` runs them but without its
    synchronisations, stamped by CUDA events; median of the last `iters`."""
    device, n = w.x.device, len(w.stages)
    clock = Stamps(device)
    fwd: list[list[float]] = [[] for _ in range(n)]
    bwd: list[list[float]] = [[] for _ in range(n)]
    with profile_mod.collector_paused(), Untouched(w.stages, [device]) as untouched:
        for k in range(n):
            forward, marks = stage_forward(w, inputs, k), []
            for i in range(warm + iters):
                a = clock.now()
                inp, out = forward(True)
                b = clock.now()
                outs, gs = backward_pairs(out, [torch.ones_like(t) for t in tensors_of(out)])
                edges = output_edges(outs)
                del out, outs
                c = clock.now()
                with torch.autocast(device.type, enabled=False):
                    backward_from_edges(edges, gs, free_grads=True)
                d = clock.now()
                del inp, edges, gs
                untouched.clear_grads()
                if i >= warm:
                    marks.append((a, b, c, d))
            clock.settle()
            fwd[k] = [clock.seconds(a, b) for a, b, _, _ in marks]
            bwd[k] = [clock.seconds(c, d) for _, _, c, d in marks]
            untouched.restore_buffers()
    return Times("each stage alone, back to back (events)", "", medians(fwd), medians(bwd), rounds=iters)


class StageClock:
    """Stamps at the stage boundaries of a plain step, without synchronising: a stage's forward starts and ends
    (module hooks); its backward starts when its output's gradient is ready and ends when its input's is (tensor
    hooks), the first stage's when `loss.backward()` returns."""

    def __init__(self, w: Workload):
        self.w, self.stamps = w, Stamps(w.x.device)
        self.steps: list[dict[str, Any]] = []
        self.handles = []
        for k, stage in enumerate(w.stages):
            self.handles.append(stage.register_forward_pre_hook(functools.partial(self._pre, k)))
            self.handles.append(stage.register_forward_hook(functools.partial(self._post, k)))

    def _pre(self, k: int, *_: Any) -> None:
        self.steps[-1][f"f{k}"] = self.stamps.now()

    def _post(self, k: int, _module: Any, _args: Any, out: Any) -> None:
        self.steps[-1][f"e{k}"] = self.stamps.now()
        first = next((t for t in tensors_of(out) if t.requires_grad), None)
        if first is not None:  # the gradient of a_{k+1}: B k+1 has ended, B k starts
            step = self.steps[-1]
            first.register_hook(functools.partial(self._grad_ready, step, k + 1))

    def _grad_ready(self, step: dict[str, Any], j: int, _grad: torch.Tensor) -> None:
        step.setdefault(f"g{j}", self.stamps.now())

    def step(self, seed: int) -> None:
        """One plain step (forward through the stages, the workload's loss, backward), stamped."""
        self.steps.append({})
        self.w.model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        value = self.w.x
        for stage in self.w.stages:
            value = stage(value)
        loss = self.w.loss(value, self.w.y)
        loss.backward()
        self.steps[-1]["g0"] = self.stamps.now()
        del loss, value

    def times(self, skip: int) -> tuple[list[list[float]], list[list[float]], list[float]]:
        """Per stage the forward and backward seconds of each step after the first `skip`, and the loss's."""
        self.stamps.settle()
        n = len(self.w.stages)
        fwd: list[list[float]] = [[] for _ in range(n)]
        bwd: list[list[float]] = [[] for _ in range(n)]
        loss = []
        for s in self.steps[skip:]:
            for k in range(n):
                fwd[k].append(self.stamps.seconds(s[f"f{k}"], s[f"e{k}"]))
                if f"g{k + 1}" in s and (k == 0 or f"g{k}" in s):
                    bwd[k].append(self.stamps.seconds(s[f"g{k + 1}"], s[f"g{k}"]))
            if f"g{n}" in s:
                loss.append(self.stamps.seconds(s[f"e{n - 1}"], s[f"g{n}"]))
        return fwd, bwd, loss

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def in_step_times(w: Workload, iters: int, warm: int, label: str) -> Times:
    """Every stage's share of plain training steps (`StageClock`), median over `iters` steps after `warm`."""
    clock = StageClock(w)
    try:
        with Untouched(w.stages, [w.x.device]):
            for i in range(warm + iters):
                clock.step(i)
        fwd, bwd, loss = clock.times(warm)
    finally:
        clock.close()
        w.model.zero_grad(set_to_none=True)
    times = Times(label, "", medians(fwd), medians(bwd), rounds=iters)
    if loss:
        times.note = f"loss {1e3 * statistics.median(loss):.2f} ms between the last forward and B L-1"
    return times


def plain_step_seconds(w: Workload, iters: int, warm: int) -> list[float]:
    """Wall seconds of plain steps (a sync before and after each, as the bench times them)."""
    out = []
    with Untouched(w.stages, [w.x.device]):
        for i in range(warm + iters):
            sync(w.x.device)
            start = time.perf_counter()
            train_step(w, w.model, i)
            sync(w.x.device)
            if i >= warm:
                out.append(time.perf_counter() - start)
    w.model.zero_grad(set_to_none=True)
    return out


# -- conditions before a profile -------------------------------------------------------------------------------
def keep_busy(device: torch.device, seconds: float) -> None:
    """Matmuls for `seconds` (the GPU's clocks up), ended just before what follows; on CPU a sleep."""
    if device.type != "cuda":
        time.sleep(seconds)
        return
    a = torch.randn(4096, 4096, device=device)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(8):
            a = torch.tanh(a @ a)
        sync(device)
    del a


# -- whole steps: predicted against measured --------------------------------------------------------------------
@dataclass
class PlanRun:
    label: str
    ops: list[Op]
    predicted: float
    forward: Callable[[torch.Tensor], Any]
    times: list[float] = field(default_factory=list)

    @property
    def offloads(self) -> int:
        return sum(op.kind in (OpKind.OFFLOAD, OpKind.OFFLOAD_SAVED) for op in self.ops)


def budget_of(chain: Chain, fraction: float) -> int:
    """`fraction` of the chain's no-recomputation peak, or its smallest feasible budget where that is larger."""
    return max(int(fraction * no_recompute_peak(chain)), min_feasible_budget(chain))


def plan_runs(
    w: Workload, chains: dict[str, Chain], fraction: float, bandwidth: float, errors: list[str]
) -> list[PlanRun]:
    """Per chain: the plain step (predicted: every stage's F and B), the planner's recompute-only plan and its plan
    with offloading allowed, within `budget_of` the chain (a chain that cannot be planned: a line in `errors`)."""
    runs = []
    for name, chain in chains.items():
        plain = math.fsum(chain.fwd_time) + math.fsum(chain.bwd_time)
        runs.append(PlanRun(f"{name}: plain step", [], plain, w.model))
        nbytes, moving = budget_of(chain, fraction), chain.with_transfer(bandwidth)
        for label, c in (("recompute only", chain), ("offloading allowed", moving)):
            try:
                ops = plan(c, nbytes).ops
                runner = PlanRunner(w.stages, ops, w.stage_names, in_free=chain.in_free, sizes=chain.sizes,
                                    offloadable=chain.offloadable)  # fmt: skip
                runs.append(
                    PlanRun(f"{name}: {label} within {format_bytes(nbytes)}", ops, simulate(c, ops).time, runner)
                )
            except Exception as err:  # noqa: BLE001 - the other plans still run
                errors.append(f"- FAIL plan {name}, {label}: {error_line(err)}")
    return runs


def timed_step(w: Workload, forward: Callable[[torch.Tensor], Any], seed: int) -> float:
    """Wall seconds of one step through `forward`; parameter gradients stored beforehand (zeros), as
    benchmarks/offload_gpu.py's steps."""
    for p in w.model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
    torch.manual_seed(seed)
    sync(w.x.device)
    start = time.perf_counter()
    loss = w.loss(forward(w.x), w.y)
    loss.backward()
    del loss
    sync(w.x.device)
    return time.perf_counter() - start


def measure_plans(w: Workload, runs: list[PlanRun], steps: int) -> None:
    """One warm-up step each, then `steps` rounds interleaved (drift hits every plan alike)."""
    with Untouched(w.stages, [w.x.device]):
        for run in runs:
            timed_step(w, run.forward, 0)
        for r in range(steps):
            for run in runs:
                run.times.append(timed_step(w, run.forward, r + 1))
    w.model.zero_grad(set_to_none=True)


def plan_table(runs: list[PlanRun]) -> str:
    rows = []
    for run in runs:
        measured = statistics.median(run.times) if run.times else None
        rows.append([
            run.label, str(run.offloads) if run.ops else "-", f"{1e3 * run.predicted:.2f}",
            "-" if measured is None else f"{1e3 * measured:.2f}",
            "-" if measured is None or run.predicted <= 0 else f"{measured / run.predicted:.2f}",
        ])  # fmt: skip
    return table(["step", "offloads", "pred ms", "meas ms (median)", "meas/pred"], rows)


# -- the report --------------------------------------------------------------------------------------------------
def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def ms(t: float | None) -> str:
    return "-" if t is None else f"{1e3 * t:.3f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b <= 0 else f"{a / b:.2f}"


COLUMNS = {"first": "P", "fresh-fix": "P fix", "sync": "S", "alone": "L", "in-step": "E"}  # the per-stage table's


def stage_table(names: list[str], columns: list[tuple[str, Times]], ref: Times) -> str:
    """Per stage: each column's forward, then backward, milliseconds, and the first two columns' ratios to `ref`."""
    header = ["stage"]
    for part in ("F", "B"):
        header += [f"{part} {short}" for short, _ in columns] + [f"{part} {s}/E" for s, _ in columns[:2]]
    times = [c for _, c in columns]
    rows = []
    for k, name in enumerate(names):
        row = [name]
        for part in ("fwd", "bwd"):
            row += [ms(getattr(c, part)[k]) for c in times]
            row += [ratio(getattr(c, part)[k], getattr(ref, part)[k]) for c in times[:2]]
        rows.append(row)
    rows.append(["**sum**", *sum_cells(times, ref)])
    return table(header, rows)


def sum_cells(columns: list[Times], ref: Times) -> list[str]:
    cells = []
    for part in ("fwd", "bwd"):
        sums = [math.fsum(t for t in getattr(c, part) if t is not None) for c in columns]
        ref_sum = math.fsum(t for t in getattr(ref, part) if t is not None)
        cells += [ms(s) for s in sums] + [ratio(s, ref_sum) for s in sums[:2]]
    return cells


def row_of(t: Times, ref: Times | None, plain: float | None) -> list[str]:
    return [
        t.label, t.suspect or "-", f"{1e3 * t.total:.2f}", ratio(t.total, ref.total if ref else None),
        ratio(t.total, plain), str(t.rounds), "-" if t.mallocs is None else str(t.mallocs), t.clocks or "-", t.note,
    ]  # fmt: skip


def suspects(t: dict[str, Times]) -> list[tuple[str, float]]:
    """(suspect, ratio to the in-step times with it removed) for each suspect measured; the last three are
    computed from the factors P/S (the profile against its own primitive, warm), S/L (a sync per stage) and L/E
    (a stage alone against its share of a step)."""
    ref = t.get("in-step")
    if ref is None or ref.total <= 0:
        return []
    out = []
    fix = "fresh-fix" if "fresh-fix" in t else "fix"  # the third profile is warm anyway: the fresh process's is fair
    for key in (fix, "second", "more", "unscaled", "busy"):
        if key in t:
            out.append((t[key].suspect, t[key].total / ref.total))
    if "bench" in t and "bench-in-step" in t and t["bench-in-step"].total > 0:
        out.append((t["bench"].suspect, t["bench"].total / t["bench-in-step"].total))
    if all(k in t for k in ("first", "sync", "alone")) and t["sync"].total > 0 and t["alone"].total > 0:
        p, s, a = t["first"].total, t["sync"].total, t["alone"].total
        out.append(("the profile's own rounds (cold, few, scaled), computed: S/E", s / ref.total))
        out.append(("a sync before and after each F and B, computed: (P/S)(L/E)", p / s * a / ref.total))
        out.append(("each stage timed alone (no overlap with its neighbours), computed: P/L", p / a))
    return out


def conclusion(label: str, t: dict[str, Times]) -> str:
    found = suspects(t)
    if "first" not in t or "in-step" not in t or not found:
        return f"**Conclusion ({label})**: not enough parts ran to name a suspect (see the errors above)."
    now = t["first"].total / t["in-step"].total
    if abs(now - 1) <= NEAR:
        return (
            f"**Conclusion ({label})**: no gap to explain: the profiled stages add up to {now:.2f}x their in-step time."
        )
    name, best = min(found, key=lambda s: abs(math.log(max(s[1], 1e-9))))
    near = "within" if abs(best - 1) <= NEAR else "still not within"
    return (
        f"**Conclusion ({label})**: as now the profiled stages add up to {now:.2f}x their in-step time; removing "
        f"*{name}* brings it nearest 1: {best:.2f}x ({near} {NEAR:.0%})."
    )


def factors(t: dict[str, Times], plain: float | None) -> list[str]:
    """The gap as a product of factors, and what a synchronisation costs (from the per-op runs)."""
    lines = []
    if all(k in t for k in ("first", "sync", "alone", "in-step")):
        p, s, a, e = (t[k].total for k in ("first", "sync", "alone", "in-step"))
        lines.append(
            f"- P/E = {ratio(p, e)} = P/S {ratio(p, s)} (the profile against its own primitive, warm) x S/L "
            f"{ratio(s, a)} (a sync before and after each F and B) x L/E {ratio(a, e)} (a stage alone against its "
            f"share of a step); E against the plain step's wall time: {ratio(e, plain)}"
        )
    if "first" in t and t["first"].mallocs is not None:
        lines.append(f"- cudaMalloc calls inside the first profile's timing rounds: {t['first'].mallocs} (0: the "
                     "caching allocator had every block already)")  # fmt: skip
    ref = t.get("in-step")
    pairs = (("first", "fix", "the first profile against the third"), ("fresh", "fresh-fix", "each in a fresh process"),
             ("idle", "idle-fix", "each after idle"))  # fmt: skip
    for off, on, where in pairs:
        if off in t and on in t and ref is not None:
            lines.append(f"- the fix, {where}: {ratio(t[off].total, ref.total)}x the in-step time without it, "
                         f"{ratio(t[on].total, ref.total)}x with it")  # fmt: skip
    if "op-sync" in t and "op-nosync" in t:
        ops = t["op-sync"].ops
        cost = (t["op-sync"].total - t["op-nosync"].total) / max(ops, 1)
        lines.append(f"- a synchronisation after each op costs at least {1e6 * cost:.1f} us ({ops} ops per round; the "
                     f"dispatch mode alone: {ratio(t['op-nosync'].total, t['sync'].total) if 'sync' in t else '-'}x "
                     f"the sync-per-stage times)")  # fmt: skip
    return lines


# -- one model -------------------------------------------------------------------------------------------------
@dataclass
class ModelReport:
    label: str
    lines: list[str] = field(default_factory=list)  # errors, skips
    blocks: list[str] = field(default_factory=list)
    plans: str = ""  # the plans' table, shown after the variants
    times: dict[str, Times] = field(default_factory=dict)


class Budget:
    """The run's time: each part within what is left, its failure one line of the report."""

    def __init__(self, limit: float):
        self.deadline = time.perf_counter() + limit

    def part(self, rep: ModelReport, label: str, fn: Callable[[], Any], need: float) -> Any:
        left = self.deadline - time.perf_counter()
        if left < need:
            rep.lines.append(f"- SKIP {label}: {left:.0f} s left of the run, it needs about {need:.0f} s")
            return None
        print(f"cuda_stage_times: {rep.label}: {label}", file=sys.stderr, flush=True)
        try:
            with time_limit(left):
                return fn()
        except SectionTimeout:
            rep.lines.append(f"- FAIL {label}: ran past the run's time limit")
        except Exception as err:  # noqa: BLE001 - a failure is a result, recorded, and the next part runs
            rep.lines.append(f"- FAIL {label}: {error_line(err)}")
        return None


def keep(rep: ModelReport, key: str, value: Times | None) -> None:
    if value is not None:
        rep.times[key] = value


def profiles(rep: ModelReport, w: Workload, budget: Budget, c: Counts) -> dict[str, Chain]:
    """The profile variants (the first one first: the process's first profile of this model)."""
    chains: dict[str, Chain] = {}
    first = budget.part(rep, "profile as now", lambda: profiled_raw(w), 10)
    if first is not None:
        keep(rep, "first", first[0])
        chains["as now"] = first[1]
        keep(rep, "unscaled", first[2])
    second = budget.part(
        rep, "second profile", lambda: profiled(w, "second profile", "first profile in the process"), 10
    )
    keep(rep, "second", second[0] if second else None)
    fixed = budget.part(rep, "profile with the fix", lambda: profiled(w, "profile with the fix (1 warm-up round)",
                        "cold timing rounds: 1 warm-up round (the fix), the third profile", warm=1), 10)  # fmt: skip
    if fixed is not None:
        keep(rep, "fix", fixed[0])
        chains["with the fix"] = fixed[1]
    fix3 = budget.part(rep, "profile with 3 warm-up rounds", lambda: profiled(w, "profile, 3 warm-up rounds",
                       "cold timing rounds: 3 warm-up rounds before them", warm=3), 10)  # fmt: skip
    keep(rep, "fix3", fix3[0] if fix3 else None)
    more = budget.part(rep, "profile with more rounds", lambda: profiled(w, f"profile, {c.many_repeats} timing rounds",
                       "too few timing rounds (2, scaled to their mean)", repeats=c.many_repeats), 10)  # fmt: skip
    keep(rep, "more", more[0] if more else None)
    return chains


def conditions(rep: ModelReport, w: Workload, budget: Budget, c: Counts) -> None:
    """Profiles after the GPU was busy, idle, or its allocator emptied; and with cudnn.benchmark on."""
    device = w.x.device

    def after(prepare: Callable[[], None], label: str, suspect: str, warm: int = 0) -> Times:
        prepare()
        return profiled(w, label, suspect, warm=warm)[0]

    busy = budget.part(rep, "profile after a busy GPU", lambda: after(lambda: keep_busy(device, c.busy_s),
                       "profile right after a busy GPU", "clocks ramping up (GPU busy right before)"), 10)  # fmt: skip
    keep(rep, "busy", busy)
    idle = budget.part(rep, "profile after idle", lambda: after(lambda: time.sleep(c.idle_s),
                       f"profile after {c.idle_s:g} s idle", ""), 10 + c.idle_s)  # fmt: skip
    keep(rep, "idle", idle)
    idle_fix = budget.part(rep, "profile with the fix after idle", lambda: after(lambda: time.sleep(c.idle_s),
                           f"fix (1 warm-up round) after {c.idle_s:g} s idle", "", warm=1), 10 + c.idle_s)  # fmt: skip
    keep(rep, "idle-fix", idle_fix)
    empty = torch.cuda.empty_cache if device.type == "cuda" else (lambda: None)
    cold = budget.part(rep, "profile after empty_cache", lambda: after(empty, "profile after empty_cache()", ""), 10)
    keep(rep, "cold-alloc", cold)


def steady(rep: ModelReport, w: Workload, budget: Budget, c: Counts) -> float | None:
    """The steady-state figures; returns the plain step's median wall seconds."""
    keep(rep, "in-step", budget.part(rep, "in-step times", lambda: in_step_times(w, c.iters, c.warm, "in-step"), 10))
    inputs = budget.part(rep, "stage inputs", lambda: stage_inputs(w), 5)
    if inputs is not None:
        keep(rep, "alone", budget.part(rep, "stages alone", lambda: alone_times(w, inputs, c.iters, c.warm), 10))
        keep(rep, "sync", budget.part(rep, "sync per stage", lambda: synced_times(
            w, inputs, c.sync_rounds, "sync per stage (profiler's _timed_run), warm"), 10))  # fmt: skip
        keep(rep, "op-sync", budget.part(rep, "sync per op", lambda: synced_times(
            w, inputs, c.op_rounds, "sync per op (dispatch mode)", "sync"), 15))  # fmt: skip
        keep(rep, "op-nosync", budget.part(rep, "dispatch mode without sync", lambda: synced_times(
            w, inputs, c.op_rounds, "dispatch mode, no sync", "nosync"), 10))  # fmt: skip
    inputs = None  # a_0 … a_{L-1} freed before the next parts
    plain = budget.part(rep, "plain steps", lambda: plain_step_seconds(w, c.iters, c.warm), 10)
    return statistics.median(plain) if plain else None


def plans(rep: ModelReport, w: Workload, budget: Budget, c: Counts, chains: dict[str, Chain], fraction: float) -> None:
    def run() -> None:
        chain = next(iter(chains.values()))
        largest = max(chain.sizes[1 : chain.length], default=0)
        bandwidth = measure_bandwidth(w.x.device, min(max(largest, 2**20), 2**28))
        runs = plan_runs(w, chains, fraction, bandwidth, rep.lines)
        measure_plans(w, runs, c.plan_steps)
        rep.plans = (
            f"Steps within {fraction:.0%} of the no-recomputation peak {format_bytes(no_recompute_peak(chain))} (or "
            f"the smallest feasible budget if larger), bandwidth {format_bandwidth(bandwidth)} (measured), "
            f"{c.plan_steps} interleaved steps each after one:\n\n" + plan_table(runs)
        )

    if chains:
        budget.part(rep, "plans", run, 15)


def fresh_parts(rep: ModelReport, name: str, device: torch.device, budget: Budget) -> None:
    """The profiles of fresh child processes: as now, with the fix, and with cudnn.benchmark on."""
    for warm, key, what in ((0, "fresh", "as now"), (1, "fresh-fix", "with the fix (1 warm-up round)")):
        suspect = "cold timing rounds: the fix, each in a fresh process" if warm else ""
        keep(rep, key, budget.part(rep, f"fresh process {what}", lambda warm=warm, what=what, suspect=suspect:
             fresh_profile(name, device, warm, f"fresh process, {what}", suspect,
                           budget.deadline - time.perf_counter()), 30))  # fmt: skip
    bench = budget.part(rep, "fresh process with cudnn.benchmark", lambda: fresh_benchmark(
        name, device, budget.deadline - time.perf_counter()), 40)  # fmt: skip
    if bench is not None:
        keep(rep, "bench", bench[0])
        keep(rep, "bench-in-step", bench[1])


def study(label: str, name: str, batch: int, kwargs: dict[str, Any], device: torch.device, c: Counts,
          budget: Budget, fraction: float, fresh: bool = True) -> ModelReport:  # fmt: skip
    rep = ModelReport(label)
    w = budget.part(rep, "build", lambda: workload(name, device), 5)
    if w is None:
        return rep
    rep.blocks.append(f"{name}, batch {batch}, input {tuple(w.x.shape)}, {len(w.stages)} stages, {kwargs}")
    chains = profiles(rep, w, budget, c)
    plain = steady(rep, w, budget, c)
    conditions(rep, w, budget, c)
    plans(rep, w, budget, c, chains, fraction)
    if fresh:
        fresh_parts(rep, name, device, budget)
    render_model(rep, w, plain)
    del w
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rep


def render_model(rep: ModelReport, w: Workload, plain: float | None) -> None:
    t, ref = rep.times, rep.times.get("in-step")
    shown = {k if k in t or k != "fresh-fix" else "fix": short for k, short in COLUMNS.items()}  # a fix: fresh first
    columns = [(short, t[k]) for k, short in shown.items() if k in t]
    if len(columns) > 2 and ref is not None:
        legend = "; ".join(f"{short}: {t[k].label}" for k, short in shown.items() if k in t)
        rep.blocks.append(
            f"Per stage, milliseconds (F: forward, B: backward; {legend}):\n\n"
            + stage_table(w.stage_names, columns, ref)
        )
    header = ["variant", "isolates", "F+B ms", "/ in-step", "/ plain step", "rounds", "mallocs in rounds",
              "SM MHz before/after", "note"]  # fmt: skip
    rows = [row_of(v, ref, plain) for v in t.values()]
    rows.append(["plain step (wall, a sync per step)", "-", ms(plain), ratio(plain, ref.total if ref else None), "1.00"
                 if plain else "-", "", "", "", "what gpu_check's 'none' row measures"])  # fmt: skip
    rep.blocks.append(
        "Variants (sums over every stage's F and B; ratios to the in-step times):\n\n" + table(header, rows)
    )
    lines = factors(t, plain)
    lines += [f"- removing *{s}*: {r:.2f}x" for s, r in suspects(t)]
    if "in-step" in t and t["in-step"].total > 0:  # the warm-up in the third profile: warm anyway, not a candidate
        lines += [f"- (not a candidate) *{t[k].suspect}*: {t[k].total / t['in-step'].total:.2f}x" for k in
                  ("fix", "fix3") if k in t and "fresh-fix" in t]  # fmt: skip
    if lines:
        rep.blocks.append("\n".join(lines))
    if rep.plans:
        rep.blocks.append(rep.plans)
    rep.blocks.append(conclusion(rep.label, t))


# -- the run ---------------------------------------------------------------------------------------------------
def describe(device: torch.device) -> list[str]:
    lines = [f"- torch {torch.__version__}, Python {platform.python_version()}, {torch.get_num_threads()} threads"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"- device: {props.name}, {props.total_memory / 2**30:.2f} GiB, CUDA {torch.version.cuda}, "
                     f"cuDNN {torch.backends.cudnn.version()}; cudnn.benchmark {torch.backends.cudnn.benchmark}, "
                     f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}, TF32 cuDNN "
                     f"{torch.backends.cudnn.allow_tf32}; SM clock {sm_clock(device) or '-'} MHz at the "
                     "start")  # fmt: skip
    else:
        lines.append("- device: CPU (--device cpu): the same code at tiny sizes; its times say nothing about CUDA")
    fix = getattr(profile_mod, "CUDA_WARMUP_ROUNDS", None)
    lines.append(f"- this tree's profile.CUDA_WARMUP_ROUNDS: {fix if fix is not None else 'absent (no fix)'}")
    return lines


def render(reports: list[ModelReport], header: list[str], wall: float) -> str:
    parts = ["# CUDA conv stage times: the profiler against steady state", "", *header, ""]
    for rep in reports:
        parts += [f"## {rep.label}", "", *rep.lines, "", *("\n\n".join(rep.blocks).splitlines()), ""]
    found = [b for rep in reports for b in rep.blocks if b.startswith("**Conclusion")]
    parts.append("## Conclusions\n\n" + "\n".join(f"- {b}" for b in found))
    parts.append(f"\nTotal wall time: {wall:.0f} s.")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    parser.add_argument("--models", nargs="+", default=[m for _, m in MODELS], choices=[m for _, m in MODELS])
    parser.add_argument("--fraction", type=float, default=0.5, help="budget of the plans: a share of the plain peak")
    parser.add_argument("--limit", type=float, default=None, help="seconds for the parts of the run (180 on CUDA)")
    parser.add_argument("--no-fresh", action="store_true", help="leave out the fresh child processes' profiles")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a fresh process's first profile
    parser.add_argument("--warm", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cudnn-benchmark", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_stage_times.py: CUDA is not available here; --device cpu runs the same code at tiny sizes",
              file=sys.stderr)  # fmt: skip
        return 2
    cuda = args.device == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # a smoke run on a shared machine
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.child:
        return child(args.child, device, args.warm, args.cudnn_benchmark)
    sizes, counts = (CUDA_SIZES, CUDA_COUNTS) if cuda else (CPU_SIZES, CPU_COUNTS)
    budget = Budget(args.limit if args.limit is not None else counts.limit)
    header = describe(device)
    reports = []
    for label, name in MODELS:
        if name in args.models:
            kwargs, batch = getattr(sizes, name), getattr(sizes, f"{name}_batch")
            reports.append(study(label, name, batch, kwargs, device, counts, budget, args.fraction, not args.no_fresh))
    report = render(reports, header, time.perf_counter() - started)
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
