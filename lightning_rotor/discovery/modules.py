"""Module-level discovery: runs of sibling blocks seen in one real forward.

Where tracing fails (Hugging Face transformers models, Python control flow on
values), rotor can still checkpoint the part of the model that is a chain: a run
of sibling blocks (children of one module, typically a `ModuleList`) called one
after another, where each call's first argument is the previous call's output,
the other arguments are the same objects for every call of the run, and nothing
but the next block uses a block's output. `find_runs` observes one forward with
hooks and a `TorchFunctionMode` (which sees every use of a block's output) and
returns such runs.

At run time (`ModuleRun.install`), the first block's call runs the whole chain
(the caller's plan over the stages) and every later call is checked: its input
must be what the previous call returned and its other arguments the same; any
divergence raises `ChainDiverged`. Intermediate calls return a placeholder
tensor that refuses every torch operation, so a forward that uses a block's
output elsewhere (e.g. `output_hidden_states=True`) fails loudly instead of
reading a wrong value. The last call returns the chain output.

What the blocks record besides their output through the model's own hooks (a Mixture-of-Experts
model's router logits, with `output_router_logits=True`) are side outputs of the stages: each stage
records into a collector of its own and carries what its blocks recorded, with the previous stages',
to the end of the chain, where the last call hands them to the model's collector
(lightning_rotor/side_outputs.py, `ModuleRun.side`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_rotor import side_outputs
from lightning_rotor._torch_compat import (
    forward_hooks,
    inside_checkpoint,
    make_subclass,
    tensor_version,
    tree_flatten,
    tree_unflatten,
)
from lightning_rotor.sharded import passes_outer_calls
from lightning_rotor.stages import Stages


class ChainDiverged(RuntimeError):
    """A forward called the blocks of a module-level chain differently from the observed forward."""


class _Pending(torch.Tensor):
    """What an intermediate block call returns: any torch operation on it raises (see module docstring)."""

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Iterable[type], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        raise ChainDiverged(
            "the output of a block inside a module-level rotor chain was used outside the next block "
            f"({getattr(func, '__name__', func)}); rotor runs the whole run of blocks at once, so only the last "
            "block's output exists. Turn off what reads intermediate outputs (e.g. output_hidden_states) or "
            "checkpoint_modules that exclude those blocks"
        )


def _pending() -> torch.Tensor:
    return make_subclass(_Pending, torch.empty(0))


def _same(a: Any, b: Any) -> bool:
    """The same object, or equal plain values (ints, strings, None)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 (objects whose == is not a plain bool are not the same constant)
        return False


@dataclass
class _Call:
    name: str
    module: nn.Module
    parent: str
    depth: int
    args: tuple
    kwargs: dict
    output: Any = None
    index: int = 0
    writes_input: bool = False  # wrote into its first argument in place (seen on the sample)
    checkpointed: bool = False  # called inside torch.utils.checkpoint: a block rotor cannot call on its own


class _Uses(TorchFunctionMode):
    """Which open block calls the block outputs were used in, by torch operations.

    Only outputs of finished calls are followed (`outputs`, kept alive by their `_Call`),
    so an id is never that of a dead temporary reused by Python.
    """

    def __init__(self, open_calls: list[int]):
        super().__init__()
        self.open_calls = open_calls
        self.outputs: dict[int, torch.Tensor] = {}
        self.uses: dict[int, list[tuple[int, ...]]] = {}  # id(output) -> open-call stacks of its uses

    def __torch_function__(
        self, func: Callable[..., Any], types: Iterable[type], args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        stack = tuple(self.open_calls)
        for t in _argument_leaves(args, kwargs):
            if isinstance(t, torch.Tensor) and self.outputs.get(id(t)) is t:
                self.uses.setdefault(id(t), []).append(stack)
        return func(*args, **kwargs)


# leaves to pytree (no registered node type), as torch calls' arguments mostly are
_ATOMS = frozenset({int, float, bool, str, complex, type(None), slice, type(Ellipsis), torch.dtype, torch.device})


def _argument_leaves(args: tuple, kwargs: dict) -> list[Any]:
    """The leaves `tree_flatten((args, kwargs))` finds, in its order: found here where every argument is a tensor, an
    atom or a plain list or tuple of those (most torch calls; pytree's cost per node was half of module-level
    discovery's forward), else by pytree itself (nested or registered containers, named tuples, other objects)."""
    leaves: list[Any] = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) in _ATOMS or isinstance(a, torch.Tensor):
            leaves.append(a)
        elif type(a) in (tuple, list) and all(type(b) in _ATOMS or isinstance(b, torch.Tensor) for b in a):
            leaves.extend(a)
        else:
            return tree_flatten((args, kwargs))[0]
    return leaves


@dataclass
class ModuleRun:
    """A run of sibling blocks: a stage is `blocks[k](x, *args, **kwargs)` with this forward's other arguments,
    or several blocks one after another where a block writes into its input (`starts`)."""

    parent: str
    names: list[str]
    blocks: list[nn.Module]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    starts: list[int] | None = None  # the first block of each stage (None: one block per stage)
    side: tuple[str, ...] | None = None  # names the blocks record from inside (side outputs); None: not called yet
    slots: dict[int, tuple[str, ...]] = field(default_factory=dict)  # per stage: the name of each side output it adds
    _state: dict = field(default_factory=dict, repr=False)
    _bound: list | None = field(default=None, repr=False)  # what the blocks read in place of the side tensors
    # blocks returning a tuple (T5's hidden state and position biases): per element after the hidden state, the
    # position of the argument it is (in the flattened other arguments) or None and the constant it is
    passed: tuple[tuple[int | None, Any], ...] | None = None

    def stages(self) -> Stages:
        starts = self.starts or list(range(len(self.blocks)))
        bounds = [*starts, len(self.blocks)]
        spans = list(zip(bounds[:-1], bounds[1:], strict=True))
        notes = [f"module-level run under {self.parent or '<root>'}: {len(self.blocks)} blocks, checked on every call"]
        joined = ["+".join(self.names[lo:hi]) for lo, hi in spans if hi - lo > 1]
        if joined:
            notes.append("one stage (a block writes in place into the previous one's output): " + ", ".join(joined))
        return Stages(
            tuple("+".join(self.names[lo:hi]) for lo, hi in spans),
            tuple(_BlockStage(self, lo, hi) for lo, hi in spans),
            kind="modules",
            notes=tuple(notes),
            sides=self,
        )

    # -- side inputs (lightning_rotor/stages.py, `SideInputs`) ----------------------------------
    def tensors(self) -> list[torch.Tensor]:
        """The tensors among this call's other arguments that require grad (an encoder output): side inputs."""
        return [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, torch.Tensor) and t.requires_grad]

    def bind(self, values: Sequence[torch.Tensor] | None) -> None:
        """The blocks read `values` in place of `tensors()` from now on (None: the call's own arguments)."""
        self._bound = None if values is None else list(values)

    def arguments(self) -> tuple[tuple, dict]:
        """The blocks' other arguments, with the bound side values in place of the side tensors."""
        if self._bound is None:
            return self.args, self.kwargs
        flat, spec = tree_flatten((self.args, self.kwargs))
        bound = iter(self._bound)
        flat = [next(bound) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in flat]
        args, kwargs = tree_unflatten(flat, spec)
        return args, kwargs

    # -- run time -----------------------------------------------------------------------------
    def install(self, run_chain: Callable[[Any], Any]) -> None:
        """Replace the blocks' forwards: block 0 runs `run_chain(x)` over the stages, later calls are checked."""
        if self._state.get("installed"):
            raise RuntimeError("this module-level chain is installed already")
        originals = [b.__dict__.get("forward") for b in self.blocks]
        self._state.update(
            installed=True, originals=originals, next=0, inside=0, token=None, output=None, run_chain=run_chain
        )
        for k, block in enumerate(self.blocks):
            if any(block is b for b in self.blocks[:k]):
                raise ChainDiverged(
                    f"block {self.names[k]} is the same module as an earlier block of the run; "
                    "a module-level chain cannot tell its calls apart"
                )
            # the block's own forward: an instance-level one (accelerate's hooks, rotor's own_checkpointing) first
            own = originals[k]
            block.forward = _Patched(self, k, own if own is not None else type(block).forward.__get__(block))

    def uninstall(self) -> None:
        for block, original in zip(self.blocks, self._state.get("originals", []), strict=False):
            if original is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = original
        self._state.clear()

    @contextmanager
    def _inside(self) -> Iterator[None]:
        self._state["inside"] += 1
        try:
            yield
        finally:
            self._state["inside"] -= 1

    def _call(self, k: int, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        try:
            return self._checked_call(k, original, args, kwargs)
        except ChainDiverged:
            self._state.update(next=0, token=None, output=None)  # the next forward starts afresh
            raise

    def _checked_call(self, k: int, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        state = self._state
        # a block's own eval mode is the user's (frozen statistics): still the chain's; only no_grad is not
        if state["inside"] or not torch.is_grad_enabled():
            if state["next"] != 0 and not state["inside"]:
                raise ChainDiverged(
                    f"{self.names[k]} ran without grad while the chain expected {self.names[state['next']]} next"
                )
            return original(*args, **kwargs)
        if not args:
            raise ChainDiverged(
                f"{self.names[k]} was called without a positional input; the chain observed "
                "the hidden state as the first positional argument"
            )
        x, rest = args[0], args[1:]
        if k != state["next"]:
            raise ChainDiverged(
                f"{self.names[k]} was called while the chain expected "
                f"{self.names[state['next']]} (blocks must run in the observed order, each once)"
            )
        if k == 0:
            check_arguments(self.names[0], rest, kwargs)
            self.side = side_names(self)
            self.args, self.kwargs = rest, dict(kwargs)
            state["output"] = state["run_chain"](x)
        else:
            if x is not state["token"]:
                raise ChainDiverged(
                    f"{self.names[k]} got an input that is not the previous block's output; "
                    "the forward changes the hidden state between blocks"
                )
            if (
                len(rest) != len(self.args)
                or set(kwargs) != set(self.kwargs)
                or not all(_same(a, b) for a, b in zip(rest, self.args, strict=True))
                or not all(_same(kwargs[n], self.kwargs[n]) for n in kwargs)
            ):
                raise ChainDiverged(
                    f"{self.names[k]} got other arguments than {self.names[0]} in the same "
                    "forward; a module-level chain needs the same non-hidden arguments for every block"
                )
        last = k == len(self.blocks) - 1
        if not last and sees_block_output(self.blocks[k]):
            raise ChainDiverged(
                f"a forward hook on {self.names[k]} would see its output, which a module-level rotor chain does not "
                "make (only the last block's output exists); turn off what records block outputs "
                "(e.g. output_hidden_states) while training with rotor"
            )
        state["next"] = 0 if last else k + 1
        if last:
            out, state["output"], state["token"] = state["output"], None, None
            if self.side:
                out = hand_side_outputs(self, out)
            return self._returned(out, rest, kwargs)
        state["token"] = _pending()
        return self._returned(state["token"], rest, kwargs)

    def _returned(self, hidden: Any, args: tuple, kwargs: dict) -> Any:
        """What a block call returns: the hidden state, or the observed tuple of it and the arguments it passes on."""
        if self.passed is None:
            return hidden
        flat = tree_flatten((args, kwargs))[0]
        return (hidden, *(flat[where] if where is not None else value for where, value in self.passed))


class _Patched:
    """A block's instance-level forward while its chain is installed."""

    def __init__(self, run: ModuleRun, k: int, original: Callable[..., Any]):
        self.run, self.k, self.original = run, k, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run._call(self.k, self.original, args, kwargs)


class _BlockStage(nn.Module):
    """A stage of a module-level run: the user's block (and the blocks `joined` to it, NOTE: [in-place block
    start] in lightning_rotor/discovery/graph.py), with the current forward's other arguments."""

    run: ModuleRun  # set past nn.Module's __setattr__: the run is no submodule of its stage

    def __init__(self, run: ModuleRun, lo: int, hi: int):
        super().__init__()
        self.block = run.blocks[lo]
        self.joined = nn.ModuleList(run.blocks[lo + 1 : hi])  # empty unless a block writes into its input
        object.__setattr__(self, "run", run)
        self.k = lo

    def forward(self, x: Any) -> Any:
        run = self.run
        if not run._state.get("installed"):
            return self._blocks(x)
        with run._inside():
            return self._blocks(x)

    def _blocks(self, x: Any) -> Any:
        run = self.run
        if not run.side:
            with side_outputs.recording(()):  # a recomputation records nothing (NOTE: [side outputs])
                return self._block_calls(x)
        carried: tuple = ()
        if self.k > 0:  # (hidden state, side outputs of the stages before)
            x, carried = x[0], tuple(x[1:])
        with side_outputs.recording(run.side) as recorded:
            x = self._block_calls(x)
        names, values = side_values(run, self.k, recorded)
        run.slots[self.k] = names
        return (x, *carried, *values)

    def _block_calls(self, x: Any) -> Any:
        args, kwargs = self.run.arguments()
        x = _hidden(self.block(x, *args, **kwargs))
        for block in self.joined:
            x = _hidden(block(x, *args, **kwargs))
        return x


def find_runs(
    module: nn.Module,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    checkpoint_modules: Sequence[type] | None = None,
    min_blocks: int = 2,
) -> list[ModuleRun]:
    """Runs of sibling blocks in one observed forward of `module` (no trace left: buffers and RNG restored)."""
    kwargs = kwargs or {}
    calls: list[_Call] = []
    open_calls: list[int] = []
    uses = _Uses(open_calls)
    names = {id(m): n for n, m in module.named_modules(remove_duplicate=False) if n}
    handles = []

    versions: list[int | None] = []  # per open call: its first argument's version before the call

    def pre(mod: nn.Module, a: tuple, kw: dict) -> None:
        name = names.get(id(mod), "?")
        parent = calls[open_calls[-1]].name if open_calls else ""
        calls.append(
            _Call(name, mod, parent, len(open_calls), a, kw, index=len(calls), checkpointed=inside_checkpoint())
        )
        open_calls.append(len(calls) - 1)
        versions.append(tensor_version(a[0]) if a and isinstance(a[0], torch.Tensor) else None)

    def post(mod: nn.Module, a: tuple, kw: dict, out: Any) -> None:
        before = versions.pop()  # read before the pop: `_version` is a torch function, a use inside this call
        writes = before is not None and tensor_version(a[0]) != before
        call = calls[open_calls.pop()]
        call.output, call.writes_input = out, writes
        hidden = _hidden(out)
        if hidden is not None:
            uses.outputs[id(hidden)] = hidden

    seen: set[int] = set()
    for _, sub in module.named_modules():
        if sub is module or id(sub) in seen:
            continue
        seen.add(id(sub))
        handles.append(sub.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(sub.register_forward_hook(post, with_kwargs=True))
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad(), uses:
            module(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
    runs = _runs(calls, uses.uses, checkpoint_modules, min_blocks)
    if not runs:
        _refuse_checkpointed_blocks(module, calls)
    return runs


def _refuse_checkpointed_blocks(module: nn.Module, calls: list[_Call]) -> None:
    """Blocks the forward calls through `torch.utils.checkpoint` (`checkpoint(block, x)` in a loop): rotor's run
    would call them outside the checkpoint, which then saves and recomputes other tensors than it recorded."""
    checkpointed = [c for c in calls if c.checkpointed]
    if checkpointed:
        outermost = min(c.depth for c in checkpointed)
        wrapped = [c.name for c in checkpointed if c.depth == outermost]
        more = f" and {len(wrapped) - 1} more" if len(wrapped) > 1 else ""
        raise NotImplementedError(
            f"{type(module).__name__}'s forward calls {wrapped[0]}{more} through torch.utils.checkpoint, which "
            "module-level discovery cannot run in rotor's plan: give discover='graph' (or 'auto'), which traces "
            "through the call, or remove it and let rotor plan the recomputation"
        )


def _runs(
    calls: list[_Call], uses: dict[int, list[tuple[int, ...]]], types: Sequence[type] | None, min_blocks: int
) -> list[ModuleRun]:
    by_parent: dict[tuple[str, int], list[_Call]] = {}
    for c in calls:
        by_parent.setdefault((c.parent, c.depth), []).append(c)
    alone = _called_once_per_parent(calls)
    runs: list[ModuleRun] = []
    for (parent, _), siblings in by_parent.items():
        current: list[_Call] = []
        for call in [*siblings, None]:  # None: the end, closing the last run
            usable = call if call is not None and _usable(call, alone, types) else None
            if usable is not None and current and _continues(current[-1], usable, uses):
                current.append(usable)
                continue
            run = _joined_run(parent, current, min_blocks)
            if run is not None:
                runs.append(run)
            current = [usable] if usable is not None else []
    # most parameters first (the run covering the model's blocks, not one block's inner layers)
    runs.sort(key=lambda r: (-_parameters(r.blocks), -len(r.blocks), r.parent.count(".")))
    return runs


def _usable(c: _Call, alone: Callable[[_Call], bool], types: Sequence[type] | None) -> bool:
    """Whether the call can be a block of a run: its module called once per parent call, of a class asked
    for, a tensor in and the hidden state out, and what else it returns passed on from its arguments."""
    return (
        alone(c)
        and (types is None or isinstance(c.module, tuple(types)))
        and bool(c.args)
        and isinstance(c.args[0], torch.Tensor)
        and _hidden(c.output) is not None
        and _passed(c) is not _NOT_PASSED
        and not c.checkpointed
    )


def _called_once_per_parent(calls: list[_Call]) -> Callable[[_Call], bool]:
    """Whether a call's module is called once per call of its parent, and nowhere else.

    A module called twice inside one parent call (diffusers' `ResnetBlock2D.nonlinearity`, one
    activation module applied after `norm1`, to `temb` and after `norm2`) cannot be a block of a run:
    the run replaces the block's forward, so its other calls would reach the chain out of order.
    Such a module ends a run where it stands, at discovery, rather than failing at run time.
    """
    of_module: dict[int, int] = {}
    of_name: dict[str, int] = {}
    for c in calls:
        of_module[id(c.module)] = of_module.get(id(c.module), 0) + 1
        of_name[c.name] = of_name.get(c.name, 0) + 1
    return lambda c: of_module[id(c.module)] == (of_name.get(c.parent, 0) if c.parent else 1)


def _joined_run(parent: str, calls: list[_Call], min_stages: int) -> ModuleRun | None:
    """The run of `calls` with each block that writes into its input in one stage with the block before
    (NOTE: [in-place block start] in lightning_rotor/discovery/graph.py). Blocks writing into the run's
    input have no producer in the run to join: they are left out and run as written, before the chain."""
    starts = [i for i, c in enumerate(calls) if i == 0 or not c.writes_input]
    if calls and calls[0].writes_input:
        first = starts[1] if len(starts) > 1 else len(calls)
        calls, starts = calls[first:], [s - first for s in starts[1:]]
    if len(starts) < min_stages:
        return None
    passed = _passed(calls[0])
    return ModuleRun(
        parent,
        [c.name for c in calls],
        [c.module for c in calls],
        starts=None if len(starts) == len(calls) else starts,
        passed=None if passed is _NOT_PASSED else passed,
    )


# NOTE: [side outputs] a block may record more than its output through the model's own forward hooks
# (transformers: router logits, attention weights). Each stage runs with a collector of its own
# (side_outputs.recording), so what it records is the value of this very run: recorded in `Fe`, plain
# in `Fn`/`Fc`, and a recomputation in the backward records into a collector nobody reads, never twice
# into the model's. The stage returns it after its hidden state, with the side outputs of the stages
# before passed on untouched: `a_{k+1} = (h_{k+1}, side outputs of stages 0..k)`. So they are part of
# the chain's values (charged as such in the memory model, their gradients as part of δ), they reach
# the loss through the chain output, and their gradients come back to the stage that made them, whose
# backward takes them with δ of its hidden state in one call, as plain autograd would.
def side_names(run: ModuleRun) -> tuple[str, ...]:
    """The names the running forward records from inside the run's blocks (checked at the run's first block).

    Refuses a name recorded from the blocks themselves (`output_hidden_states`: every block's output,
    which the chain never makes) and a change from the names the chain was profiled with.
    """
    names = side_outputs.recorded_names()
    for name, block in zip(run.names, run.blocks, strict=True):
        on_block = [n for n in side_outputs.recorders(block) if n in names]
        if on_block:
            raise ChainDiverged(
                f"output_{on_block[0]}=True records the output of every block of the chain ({name} first), which "
                "a module-level rotor chain never makes (only the last block's output exists); train with "
                f"output_{on_block[0]}=False (compute what you need from the model's output) or without rotor"
            )
    inside = side_outputs.names_recorded_inside(run.blocks, names)
    if run.side is not None and inside != run.side:
        raise ChainDiverged(
            f"this training call records {list(inside)} from inside the chain's blocks, the first one recorded "
            f"{list(run.side)}; rotor profiled the chain with the first call's side outputs: keep output_* "
            "(e.g. output_router_logits) the same for every training call"
        )
    return inside


def side_values(run: ModuleRun, k: int, recorded: dict[str, list[Any]]) -> tuple[tuple[str, ...], list[Any]]:
    """What stage k's blocks recorded, flat: the name of each value and the values, name by name."""
    names: list[str] = []
    values: list[Any] = []
    for name, found in recorded.items():
        for value in found:
            if not isinstance(value, torch.Tensor):
                raise ChainDiverged(
                    f"{run.names[k]} records a {type(value).__name__} as {name}; rotor carries only tensors a block "
                    f"records: train with output_{name}=False or without rotor"
                )
            names.append(name)
            values.append(value)
    return tuple(names), values


def hand_side_outputs(run: ModuleRun, out: Any) -> Any:
    """The chain output's hidden state; its side outputs go to the model's collector, as its hooks would put them."""
    hidden, values = out[0], list(out[1:])
    names = [n for k in sorted(run.slots) for n in run.slots[k]]
    collector = side_outputs.active_collector()
    if len(names) != len(values) or collector is None:
        raise ChainDiverged(
            f"the chain under {run.parent or '<root>'} carried {len(values)} side outputs for {len(names)} recorded "
            "names, or the model records nothing now; keep output_* the same for every training call"
        )
    for name, value in zip(names, values, strict=True):
        collector.setdefault(name, []).append(value)
    return hidden


def sees_block_output(block: nn.Module) -> bool:
    """Would a forward hook see `block`'s output? The model's recording hooks do only while their name is recorded."""
    recorded = side_outputs.recorded_names()
    for hook in forward_hooks(block):
        if passes_outer_calls(hook):  # FSDP2's, off for the calls that would see it (lightning_rotor/sharded.py)
            continue
        name = side_outputs.recorder_name(hook)
        if name is None or name in recorded:
            return True
    return False


def check_arguments(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse a key-value cache among a block's other arguments: each call appends to it, so a recomputed
    block would append twice (Hugging Face models build one unless `use_cache=False`)."""
    for value in [*args, *kwargs.values()]:
        if value is not None and type(value).__name__.endswith("Cache"):
            raise ChainDiverged(
                f"{name} is called with a {type(value).__name__}, which every block call appends to, so a "
                "recomputed block would append twice; train with use_cache=False (e.g. model.config.use_cache = "
                "False), as gradient checkpointing requires"
            )


def _parameters(blocks: list[nn.Module]) -> int:
    seen: dict[int, int] = {}
    for b in blocks:
        for p in b.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


_NOT_PASSED = object()  # a block output that is neither a tensor nor the hidden state and arguments passed on


def _hidden(out: Any) -> torch.Tensor | None:
    """The hidden state a block returns: its output, or the first element of the tuple it returns (T5)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _passed(c: _Call) -> Any:
    """`ModuleRun.passed` of a call: None for a tensor output; for a tuple, each later element as the position of the
    argument it is (the same object) or a constant (None, numbers); `_NOT_PASSED` when an element is neither (a
    tensor the block made, such as the position bias T5's first block computes)."""
    if isinstance(c.output, torch.Tensor):
        return None
    flat = tree_flatten((c.args[1:], c.kwargs))[0]
    passed = []
    for value in c.output[1:]:
        where = next((i for i, a in enumerate(flat) if a is value), None)
        if where is None and (isinstance(value, torch.Tensor) or not _same(value, copy_constant(value))):
            return _NOT_PASSED
        passed.append((where, None if where is not None else value))
    return tuple(passed)


def copy_constant(value: Any) -> Any:
    """`value` itself when it is a plain constant (None, a number, a string); a fresh object otherwise."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else object()


def _continues(prev: _Call, c: _Call, uses: dict[int, list[tuple[int, ...]]]) -> bool:
    if c.args[0] is not _hidden(prev.output) or any(c.module is b for b in (prev.module,)):
        return False
    if _passed(prev) != _passed(c):
        return False
    rest_a, rest_b = prev.args[1:], c.args[1:]
    if len(rest_a) != len(rest_b) or set(prev.kwargs) != set(c.kwargs):
        return False
    if not all(_same(a, b) for a, b in zip(rest_a, rest_b, strict=True)):
        return False
    if not all(_same(prev.kwargs[n], c.kwargs[n]) for n in c.kwargs):
        return False
    # the previous output may be used only inside the next call, or inside the previous one itself: a block's output
    # may be its last inner module's, which the block still reads (BART's `hidden_states.dtype` check) before returning
    return all(c.index in stack or prev.index in stack for stack in uses.get(id(_hidden(prev.output)), []))
