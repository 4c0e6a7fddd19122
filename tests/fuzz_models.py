"""Random DAG models for fuzzing the executor (tests/test_fuzz.py, benchmarks/fuzz.py).

A model is described by a `Spec`: a small frozen data structure (its repr is the
reproducer: `check(Spec(...))`) that `build` turns into an `nn.Module` written as users write them. The three
discovery methods each get their own shape of model:

- `"graph"`: a `forward` over submodules and functional ops, with skip tensors pushed on a
  stack and consumed many ops later (`torch.cat`, additions, in place or not), views,
  in-place activations, BatchNorm, dropout, blocks of their own, and several outputs;
- `"sequential"`: an `nn.Sequential` of layers, activations, views and blocks;
- `"modules"`: a stem, a `ModuleList` of blocks called in a loop, and heads.

`check(spec, fractions)` is the property: plain training against rotor at budgets from the
smallest feasible one to the plain peak, every plan executed: loss, parameter gradients,
input gradient and buffers bitwise equal, the measured peak within the budget. A crash
(segfault) would kill the process that runs it, so `Worker` runs cases in a child process
and reports a dead child as a crash, with the budget it was running.

An op is a tuple whose first item names it:

| op | what it does |
|---|---|
| `("layer",)` | `Linear(W, W)` or `Conv2d(C, C, 3, padding=1)` |
| `("act", kind, how)` | relu, tanh, sigmoid (saving their output), silu, gelu (their input); how: see `HOWS` |
| `("bn",)` | BatchNorm over dimension 1 |
| `("dropout", p, how)` | `nn.Dropout`, `F.dropout` or `nn.Dropout(inplace=True)` |
| `("view", kind)` | transpose, flatten (view of a view), chunk (two views, concatenated swapped), reshape |
| `("scale_",)` | `x.mul_(0.5)` in place |
| `("save",)` | push `x` on the skip stack |
| `("cat", j)` | pop skip `j` (from the top), `x = proj(torch.cat([x, skip]))` |
| `("add", j, inplace, keep)` | `x = x + skip` (`x += skip` when inplace); `keep`: the skip stays on the stack |
| `("out", head)` | an extra model output: `head(x)`, or `x` itself |
| `("block", ops)` | a `Block` submodule running `ops` (skips inside it) |

Skips left on the stack at the end are added to the output.
"""

from __future__ import annotations

import copy
import faulthandler
import multiprocessing
import random
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SIDE = 4, 8  # linear models: (BATCH, SIDE, SIDE), Linear and BatchNorm1d on SIDE features
CONV_BATCH, CHANNELS, PIXELS = 2, 4, 6  # conv models: (CONV_BATCH, CHANNELS, PIXELS, PIXELS)
ACTIVATIONS = ("relu", "tanh", "sigmoid", "silu", "gelu")
HOWS = ("module", "functional", "inplace")
VIEWS = ("transpose", "flatten", "chunk", "reshape")
FRACTIONS = (0.0, 0.05, 0.15, 0.3, 0.5, 0.75, 1.0)  # of the way from the smallest feasible budget to the plain peak


@dataclass(frozen=True)
class Spec:
    """A random model: how it is discovered, linear or conv, its ops (graph) or its blocks."""

    discover: str  # "graph", "sequential" or "modules"
    conv: bool
    ops: tuple = ()  # graph and sequential: the model's ops (the table in the module docstring)
    blocks: tuple = ()  # modules: one op tuple per block of the ModuleList
    outputs: int = 1  # sequential and modules: outputs of the head
    skip_over: bool = False  # modules: the stem's output is added to the head's (used after the run)
    input_grad: bool = False  # the input requires grad: δ_0 is compared too
    seed: int = 0


# -- the modules ------------------------------------------------------------------------------
def _layer(conv: bool, cin: int | None = None, kernel: int = 3) -> nn.Module:
    if conv:
        cin = cin or CHANNELS
        return nn.Conv2d(cin, CHANNELS, kernel, padding=kernel // 2)
    return nn.Linear(cin or SIDE, SIDE)


def _activation(kind: str, how: str, x: torch.Tensor) -> torch.Tensor:
    inplace = how == "inplace"
    if kind == "relu":
        return F.relu_(x) if inplace else F.relu(x)
    if kind == "tanh":
        return x.tanh_() if inplace else torch.tanh(x)
    if kind == "sigmoid":
        return x.sigmoid_() if inplace else torch.sigmoid(x)
    if kind == "silu":
        return F.silu(x, inplace=inplace)
    return F.gelu(x)  # no in-place GELU


def _activation_module(kind: str, how: str) -> nn.Module | None:
    """The torch module for an activation, None where it is applied functionally."""
    if how == "functional":
        return None
    inplace = how == "inplace"
    if kind == "relu":
        return nn.ReLU(inplace=inplace)
    if kind == "silu":
        return nn.SiLU(inplace=inplace)
    if inplace:
        return None  # tanh_/sigmoid_ have no module form: functional, in place
    return {"tanh": nn.Tanh, "sigmoid": nn.Sigmoid, "gelu": nn.GELU}[kind]()


def _view(kind: str, x: torch.Tensor) -> torch.Tensor:
    """Shape-preserving view ops: the last two dimensions are equal in every model here."""
    if kind == "transpose":
        return x.transpose(-1, -2)
    if kind == "flatten":
        return x.flatten(-2).unflatten(-1, x.shape[-2:])
    if kind == "chunk":
        a, b = x.chunk(2, dim=-1)
        return torch.cat([b, a], dim=-1)
    return x.transpose(-1, -2).reshape(x.shape)


class Program(nn.Module):
    """Runs a list of ops on one value, with a stack of skips; the modules it needs are `self.layers`."""

    def __init__(self, ops: Sequence[tuple], conv: bool):
        super().__init__()
        self.ops = tuple(ops)
        self.conv = conv
        self.layers = nn.ModuleDict()
        for i, op in enumerate(self.ops):
            module = _op_module(op, conv)
            if module is not None:
                self.layers[str(i)] = module

    def run(self, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        skips: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        dim = 1 if self.conv else -1
        for i, op in enumerate(self.ops):
            name, layer = op[0], self.layers[str(i)] if str(i) in self.layers else None
            if name in ("layer", "bn", "block"):
                x = layer(x)
            elif name == "act":
                x = layer(x) if layer is not None else _activation(op[1], op[2], x)
            elif name == "dropout":
                x = layer(x) if layer is not None else F.dropout(x, op[1], self.training)
            elif name == "view":
                x = _view(op[1], x)
            elif name == "scale_":
                x.mul_(0.5)
            elif name == "save":
                skips.append(x)
            elif name == "cat":
                skip = skips.pop(-1 - op[1])
                x = layer(torch.cat([x, skip], dim=dim))
            elif name == "add":
                skip = skips[-1 - op[1]] if op[3] else skips.pop(-1 - op[1])
                if op[2]:
                    x += skip
                else:
                    x = x + skip
            elif name == "out":
                outs.append(layer(x) if layer is not None else x)
            else:
                raise ValueError(f"unknown op {op!r}")
        for skip in skips:
            x = x + skip
        return x, outs


def _op_module(op: tuple, conv: bool) -> nn.Module | None:
    name = op[0]
    if name == "layer":
        return _layer(conv)
    if name == "act":
        return _activation_module(op[1], op[2])
    if name == "bn":
        return nn.BatchNorm2d(CHANNELS) if conv else nn.BatchNorm1d(SIDE)
    if name == "dropout":
        return None if op[2] == "functional" else nn.Dropout(op[1], inplace=op[2] == "inplace")
    if name == "cat":
        return _layer(conv, 2 * (CHANNELS if conv else SIDE), kernel=1)
    if name == "out":
        return _layer(conv, kernel=1) if op[1] else None
    if name == "block":
        return Block(op[1], conv)
    return None


class Block(Program):
    """A submodule of the user's: its own ops and skips, one tensor in and out."""

    def __init__(self, ops: Sequence[tuple], conv: bool):
        super().__init__(ops, conv)
        self.inplace = _writes_input(self.ops)  # as torch's in-place modules say

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, outs = self.run(x)
        for o in outs:
            y = y + o
        return y


def _writes_in_place(op: tuple) -> bool:
    if op[0] in ("act", "dropout"):
        return op[2] == "inplace" and op[1] != "gelu"  # no in-place GELU
    return op[0] == "scale_" or (op[0] == "add" and op[2])


def _writes_input(ops: Sequence[tuple]) -> bool:
    """Whether running `ops` writes into their input (in place, directly or through a view)."""
    for op in ops:
        if _writes_in_place(op):
            return True
        if op[0] not in ("save", "out") and not (op[0] == "view" and op[1] in ("transpose", "flatten")):
            return False  # x is a new tensor from here on
    return False


class GraphNet(Program):
    """The graph-discovery model: the whole forward is the chain."""

    def forward(self, x: torch.Tensor) -> Any:
        y, outs = self.run(x)
        return (y, *outs) if outs else y


class SequentialOp(nn.Module):
    """A functional op as a module, for the nn.Sequential variant (`inplace` says so, like torch's)."""

    def __init__(self, op: tuple):
        super().__init__()
        self.op = op
        self.inplace = _writes_in_place(op)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = self.op[0]
        if name == "act":
            return _activation(self.op[1], self.op[2], x)
        if name == "dropout":
            return F.dropout(x, self.op[1], self.training)
        if name == "view":
            return _view(self.op[1], x)
        return x.mul_(0.5)  # scale_


class Heads(nn.Module):
    """Several outputs from one value: the value itself and `count - 1` heads."""

    def __init__(self, count: int, conv: bool):
        super().__init__()
        self.heads = nn.ModuleList(_layer(conv, kernel=1) for _ in range(count - 1))

    def forward(self, x: torch.Tensor) -> Any:
        return (x, *(h(x) for h in self.heads)) if len(self.heads) else x


class Looped(nn.Module):
    """The module-discovery model: stem, a loop over a ModuleList of blocks, heads."""

    def __init__(self, spec: Spec):
        super().__init__()
        self.skip_over = spec.skip_over
        self.stem = _layer(spec.conv)
        self.blocks = nn.ModuleList(Block(ops, spec.conv) for ops in spec.blocks)
        self.heads = Heads(spec.outputs, spec.conv)

    def forward(self, x: torch.Tensor) -> Any:
        x = self.stem(x)
        h = x
        for block in self.blocks:
            x = block(x)
        if self.skip_over:
            x = x + h
        return self.heads(x)


def build(spec: Spec) -> nn.Module:
    """The model of `spec`, its parameters drawn from `spec.seed`."""
    torch.manual_seed(spec.seed)
    if spec.discover == "graph":
        return GraphNet(spec.ops, spec.conv)
    if spec.discover == "sequential":
        layers = [_op_module(op, spec.conv) or SequentialOp(op) for op in spec.ops]
        return nn.Sequential(*layers, Heads(spec.outputs, spec.conv))
    return Looped(spec)


def sample_input(spec: Spec) -> torch.Tensor:
    """The training input, the same for plain and rotor (the last two dimensions equal: views keep shapes)."""
    gen = torch.Generator().manual_seed(spec.seed + 1)
    shape = (CONV_BATCH, CHANNELS, PIXELS, PIXELS) if spec.conv else (BATCH, SIDE, SIDE)
    return torch.randn(shape, generator=gen).requires_grad_(spec.input_grad)


def loss_of(output: Any) -> torch.Tensor:
    """Cross-entropy of every output over its last dimension, summed (the model's several outputs)."""
    outs = output if isinstance(output, tuple) else (output,)
    total = 0
    for o in outs:
        flat = o.reshape(-1, o.shape[-1])
        target = torch.arange(flat.shape[0]) % flat.shape[1]
        total = total + F.cross_entropy(flat, target)
    return total


# -- the property -----------------------------------------------------------------------------
@dataclass
class Step:
    """What one training step leaves: loss, parameter and input gradients, buffers."""

    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    peak: int | None = None  # measured activation bytes, when measured

    def differences(self, other: Step) -> list[str]:
        diffs = [] if torch.equal(self.loss, other.loss) else [f"loss {self.loss.item()!r} != {other.loss.item()!r}"]
        for name, g in self.grads.items():
            h = other.grads[name]
            if (g is None) != (h is None) or (g is not None and not torch.equal(g, h)):
                diffs.append(f"gradient of {name}")
        diffs += [f"buffer {n}" for n, b in self.buffers.items() if not torch.equal(b, other.buffers[n])]
        return diffs


def train_step(model: nn.Module, x: torch.Tensor, state: dict[str, torch.Tensor], measure: bool = False) -> Step:
    """One step from `state` with the same random numbers every time; `.peak` set when measured."""
    model.load_state_dict(state)
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.manual_seed(7)
    if measure:
        with model.measure_step() as m:
            loss = loss_of(model(x))
            loss.backward()
    else:
        loss = loss_of(model(x))
        loss.backward()
    return Step(
        loss.detach(),
        {**{n: p.grad for n, p in model.named_parameters()}, "(input)": x.grad},
        {n: b.clone() for n, b in model.named_buffers()},
        m.peak if measure else None,
    )


@dataclass
class Outcome:
    """One case's result: stages found, plans executed and the failures, each a line."""

    spec: Spec
    stages: int = 0
    plans: int = 0
    skipped: str = ""  # why the model was not a case (plain training fails, no chain), empty otherwise
    failures: list[tuple[str, str]] = field(default_factory=list)  # (class, line)
    alone: list[str] | None = None  # failure classes when run again alone in a fresh process (benchmarks/fuzz.py)


def check(spec: Spec, fractions: Sequence[float] = FRACTIONS, report: Any = None) -> Outcome:
    """Plain training against rotor at every budget of `fractions` (0: the smallest feasible, 1: the plain peak).

    `report(line)`, when given, hears which budget runs next (the worker tells its parent,
    so that a crash is pinned on a budget).
    """
    from lightning_rotor import Checkpointable, InplaceError, min_feasible_budget
    from lightning_rotor.discovery import DiscoveryError
    from lightning_rotor.simulate import no_recompute_peak

    torch.set_num_threads(1)
    outcome = Outcome(spec)
    plain = build(spec)
    plain.train()
    x = sample_input(spec)
    state = copy.deepcopy(plain.state_dict())
    try:
        want = train_step(plain, x, state)
    except RuntimeError as err:
        outcome.skipped = f"plain training fails: {str(err).splitlines()[0]}"
        return outcome
    # the step's own loss is measured: on the chain output, or for a module-level chain on the module's output after
    # the rest of the forward (a stand-in cross-entropy, without the `0 +` scalar, measured 4 bytes less)
    rotor = Checkpointable(copy.deepcopy(plain), None, discover=spec.discover, loss_fn=loss_of, repeats=1, warmup=0)
    say = report or (lambda line: None)
    say("profile")
    try:
        got = train_step(rotor, x, state)  # discovers, profiles, plans for the plain peak
    except DiscoveryError as err:
        outcome.skipped = f"no chain: {str(err).splitlines()[0]}"
        return outcome
    except InplaceError as err:  # a refusal, which must be one clear line (tests/test_fuzz.py checks)
        outcome.failures.append(("refused", str(err)))
        return outcome
    except Exception as err:  # noqa: BLE001 - every other error is a finding
        outcome.failures.append(("error", f"first step: {_error_line(err)}"))
        return outcome
    outcome.stages = len(rotor.stages)
    diffs = want.differences(got)
    if diffs:
        outcome.failures.append(("not bitwise", f"first step (profiling): {', '.join(diffs)}"))
    _fix_times(rotor, spec.seed)
    chain = _entry(rotor).chain
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    budgets = sorted({low + int(f * (high - low)) for f in fractions})
    for budget in budgets:
        where = f"budget {budget} ({_fraction(budget, low, high)})"
        say(where)
        try:
            rotor.replan(budget)
            ops = " ".join(op.label for op in _entry(rotor).plan.ops)
            got = train_step(rotor, x, state)
            measured = train_step(rotor, x, state, measure=True)
        except Exception as err:  # noqa: BLE001
            outcome.failures.append(("error", f"{where}: {_error_line(err)}"))
            continue
        outcome.plans += 1
        for label, step in (("step", got), ("measured step", measured)):
            diffs = want.differences(step)
            if diffs:
                outcome.failures.append(("not bitwise", f"{where}, {label}: {', '.join(diffs)}; plan {ops}"))
        if measured.peak > budget:
            outcome.failures.append(("over budget", f"{where}: measured {measured.peak} > budget; plan {ops}"))
    return outcome


def _fix_times(rotor: Any, seed: int) -> None:
    """Stage times drawn from `seed` instead of measured ones, so that a `Spec` gives the same plans on every run.

    Which schedule the planner picks among those within a budget depends on the stage times;
    measured ones move with machine noise, and a failing case would come and go. The memory
    figures stay the measured ones (`plan_state` / `load_plan_state`, the saved-plan path).
    """
    draw = random.Random(seed)
    state = rotor.plan_state()
    for item in state["entries"]:
        chain = item["chain"]
        chain["fwd_time"] = [draw.uniform(0.5, 2.0) for _ in chain["fwd_time"]]
        chain["bwd_time"] = [t * draw.uniform(1.0, 3.0) for t in chain["fwd_time"]]
    rotor.load_plan_state(state)


def _entry(rotor: Any) -> Any:
    """The one signature's profile and plan (`Checkpointable.plan` is the last one used, stale after a reload)."""
    (entry,) = rotor.entries.values()
    return entry


def _fraction(budget: int, low: int, high: int) -> str:
    if budget == low:
        return "the smallest feasible"
    return f"{budget / high:.0%} of the plain peak"


def _error_line(err: BaseException) -> str:
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} ({frame.filename}:{frame.lineno})"


# -- a child process that runs cases ------------------------------------------------------------
def _serve(conn: Any) -> None:
    faulthandler.enable()  # a segfault prints the Python stack of every thread to stderr
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        spec, fractions = job
        try:
            outcome = check(spec, fractions, report=lambda line: conn.send(("at", line)))
        except Exception as err:  # noqa: BLE001 - a harness error is a finding too
            outcome = Outcome(spec, failures=[("error", f"harness: {_error_line(err)}")])
        conn.send(("done", outcome))


class Worker:
    """Runs `check` in a spawned child; a child that dies is reported as a crash and replaced."""

    def __init__(self, timeout: float = 300.0):
        self.timeout = timeout
        self.context = multiprocessing.get_context("spawn")
        self.process: Any = None
        self.conn: Any = None

    def _start(self) -> None:
        self.conn, child = self.context.Pipe()
        self.process = self.context.Process(target=_serve, args=(child,), daemon=True)
        self.process.start()
        child.close()

    def run(self, spec: Spec, fractions: Sequence[float] = FRACTIONS) -> Outcome:
        if self.process is None or not self.process.is_alive():
            self._start()
        self.conn.send((spec, tuple(fractions)))
        at = "starting"
        while True:
            try:
                if not self.conn.poll(self.timeout):
                    self.close()
                    return Outcome(spec, failures=[("hang", f"no answer for {self.timeout:.0f} s at {at}")])
                kind, payload = self.conn.recv()
            except (EOFError, ConnectionError):
                self.process.join(10)
                code = self.process.exitcode
                self.process = None
                return Outcome(spec, failures=[("crash", f"child died (exit code {code}) at {at}")])
            if kind == "done":
                return payload
            at = payload

    def close(self) -> None:
        if self.process is not None:
            if self.process.is_alive():
                try:
                    self.conn.send(None)
                except (OSError, ValueError):
                    pass
                self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self.process = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# -- hypothesis strategies --------------------------------------------------------------------
def specs(
    max_ops: int = 18,
    max_blocks: int = 5,
    discover: Sequence[str] = ("graph", "sequential", "modules"),
    skip_over: Sequence[bool] = (False, True),
) -> Any:
    """A hypothesis strategy of `Spec`s (hypothesis is imported here: a test dependency only).

    `skip_over`: the values drawn for `Spec.skip_over` (a module-level run's input used after the run).
    """
    from hypothesis import strategies as st

    leaf = st.one_of(
        st.just(("layer",)),
        st.tuples(st.just("act"), st.sampled_from(ACTIVATIONS), st.sampled_from(HOWS)),
        st.just(("bn",)),
        st.tuples(st.just("dropout"), st.sampled_from((0.1, 0.5)), st.sampled_from(HOWS)),
        st.tuples(st.just("view"), st.sampled_from(VIEWS)),
        st.just(("scale_",)),
    )
    skip_ops = st.one_of(
        st.just(("save",)),
        st.tuples(st.just("cat"), st.integers(0, 3)),
        st.tuples(st.just("add"), st.integers(0, 3), st.booleans(), st.booleans()),
    )
    block_ops = st.lists(st.one_of(leaf, skip_ops), min_size=1, max_size=6).map(_valid_skips)
    block = st.tuples(st.just("block"), block_ops)
    graph_ops = st.lists(
        st.one_of(leaf, skip_ops, skip_ops, st.tuples(st.just("out"), st.booleans()), block),
        min_size=2,
        max_size=max_ops,
    ).map(lambda ops: _valid_skips([("layer",), *ops]))
    sequential_ops = st.lists(st.one_of(leaf, block), min_size=2, max_size=max_ops).map(lambda ops: (("layer",), *ops))
    common = {"conv": st.booleans(), "input_grad": st.booleans(), "seed": st.integers(0, 2**16)}
    graph = st.builds(Spec, discover=st.just("graph"), ops=graph_ops, **common)
    sequential = st.builds(
        Spec, discover=st.just("sequential"), ops=sequential_ops, outputs=st.integers(1, 3), **common
    )
    modules = st.builds(
        Spec,
        discover=st.just("modules"),
        blocks=st.lists(block_ops, min_size=2, max_size=max_blocks).map(tuple),
        outputs=st.integers(1, 3),
        skip_over=st.sampled_from(tuple(skip_over)),
        **common,
    )
    chosen = {"graph": graph, "sequential": sequential, "modules": modules}
    return st.one_of(*(chosen[d] for d in discover))


def _valid_skips(ops: Sequence[tuple]) -> tuple:
    """Drop the ops that would pop an empty skip stack; skip indices wrap around the stack."""
    depth, kept = 0, []
    for op in ops:
        if op[0] == "save":
            depth += 1
        elif op[0] in ("cat", "add"):
            if depth == 0:
                continue
            op = (op[0], op[1] % depth, *op[2:])
            if op[0] == "cat" or not op[3]:
                depth -= 1
        kept.append(op)
    return tuple(kept)
