"""Graph discovery: trace a module with torch.fx on its sample input and cut the graph into stages.

The tracer (`ShapeTracer`) runs every traced op on the real sample alongside the
symbolic trace, so Python control flow on shapes (`assert T <= block_size`,
`if x.dim() == 4`, `B, T = idx.size()`) is answered from the sample. Each answer
becomes a guard node in the graph, checked on every call: a later input that
would take the other branch raises `GuardFailed` instead of running the wrong
code. A size handed to any torch function (`torch.ones(b, 1)`, `torch.eye(t)`, `mask.expand(b, -1)`)
is recorded as the size, with no guard: traced integers are `torch.SymInt`s to torch's argument
parser, and a torch-function mode records every call holding a traced value (`_TracedCalls`), and
every random draw, even from constants; a recorded write into a tensor the forward made from
constants is refused (NOTE: [constants written in place]). `torch.is_tensor` on a traced value is answered from the
sample too (diffusers' timestep handling). A branch on tensor values inside a submodule makes that submodule one
opaque stage part (a leaf, run as the user's module); one in the top-level
forward raises `ValueBranch` with the file and line.

Cuts go where at most `max_carry` tensors cross and no later op writes in place
into what crosses (nor into anything sharing its storage). Parameters and
buffers are read inside stages (`get_attr` is repeated in every stage that needs
it), never carried. Each stage is a `GraphModule` built on the user's module, so
it calls the user's own submodules and parameters. torch.export is not used: it
would turn BatchNorm into a plain op whose running-stat updates escape the
executor's recomputation guard.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import inspect
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import fx, nn
from torch.fx.node import Target, map_aggregate, map_arg
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from lightning_rotor._torch_compat import TorchDispatchMode, disabled_torch_function, tensor_version, tree_flatten
from lightning_rotor.frames import first_outside

_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
DEFAULT_MAX_CARRY = 8  # a diffusion U-Net carries its time embedding and text context beside the skips


class DiscoveryError(RuntimeError):
    """No chain could be found the way asked (the message says why)."""


class ValueBranch(DiscoveryError):
    """Python control flow on tensor values in the top-level forward: no single graph holds for all inputs."""


class GuardFailed(RuntimeError):
    """An input takes another branch than the sample the chain was discovered on."""


class _SubmoduleBranch(Exception):  # internal: retry with `qualname` as a leaf
    def __init__(self, qualname: str):
        self.qualname = qualname


def _user_frame() -> str:
    """file:line of the innermost frame outside torch and this package (the user's code)."""
    frame = first_outside(inspect.currentframe(), (_HERE, _TORCH))
    return f"{frame.f_code.co_filename}:{frame.f_lineno}" if frame is not None else "<unknown>"


def _guard_bool(value: Any, expected: bool, where: str) -> None:
    if bool(value) != expected:
        raise GuardFailed(
            f"input takes the other branch at {where} (was {expected} on the sample the chain was discovered on); "
            "run discovery again on such an input, or make the branch independent of the input"
        )


def _guard_eq(value: Any, expected: Any, where: str) -> None:
    if value != expected:
        raise GuardFailed(
            f"input gives {value!r} at {where} where the sample gave {expected!r} (fixed into the traced graph); "
            "run discovery again on such an input"
        )


_GUARDS = (_guard_bool, _guard_eq)
_SHAPE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}
_SHAPE_METHODS = {
    "size",
    "dim",
    "numel",
    "ndimension",
    "nelement",
    "is_floating_point",
    "is_contiguous",
    "get_device",
    "element_size",
}


class ShapeProxy(fx.Proxy):
    """A proxy whose concrete sample value answers Python questions on shapes (with a guard)."""

    tracer: ShapeTracer  # fx.Proxy declares the base class; a ShapeProxy is only ever made by a ShapeTracer

    def _value(self) -> Any:
        return self.tracer.values[self.node]

    def _shape_only(self, what: str) -> Any:
        tracer = self.tracer
        if tracer.data[self.node]:
            where = _user_frame()
            if tracer.branch_stack:
                raise _SubmoduleBranch(tracer.branch_stack[-1])
            raise ValueBranch(
                f"{where}: {what} depends on tensor values in the top-level forward, so no single traced graph "
                "holds for every input; move the branch into a submodule (it then runs whole inside one stage), "
                "or use module-level discovery (discover='modules')"
            )
        return self._value()

    def __bool__(self) -> bool:
        answer = bool(self._shape_only("a Python branch"))
        self.tracer.create_proxy("call_function", _guard_bool, (self, answer, _user_frame()), {})
        return answer

    def __index__(self) -> int:
        answer = operator.index(self._shape_only("a Python integer"))
        self.tracer.create_proxy("call_function", _guard_eq, (self, answer, _user_frame()), {})
        return answer

    def __int__(self) -> int:
        return self.__index__()

    def __len__(self) -> int:
        n = len(self._value())  # a length is structure or shape, never tensor values
        length = self.tracer.create_proxy("call_function", builtins.len, (self,), {})
        self.tracer.create_proxy("call_function", _guard_eq, (length, n, _user_frame()), {})
        return n

    def __iter__(self) -> Iterator[fx.Proxy]:
        # self[i] as fx's Proxy.__getitem__ records it (fx adds that at run time, unseen by the type checker)
        tracer = self.tracer
        return iter([tracer.create_proxy("call_function", operator.getitem, (self, i), {}) for i in range(len(self))])

    # `x += y` on a tensor writes x in place (and every alias of x sees it); fx's Proxy has no in-place
    # operators, so Python would fall back to `x = x + y` and the traced graph would compute otherwise
    def __iadd__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.iadd, (self, other), {})

    def __isub__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.isub, (self, other), {})

    def __imul__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.imul, (self, other), {})

    def __itruediv__(self, other: Any) -> fx.Proxy:
        return self.tracer.create_proxy("call_function", operator.itruediv, (self, other), {})

    # `round(t * 0.75)`: recorded (Python hands back what `__round__` gives), so each call rounds its own size
    def __round__(self, ndigits: int | None = None) -> fx.Proxy:
        return self.tracer.create_proxy("call_method", "__round__", (self,) if ndigits is None else (self, ndigits), {})

    def __getattr__(self, attr: str) -> Any:
        if attr in _SHAPE_ATTRS:
            return self.tracer.create_proxy("call_function", builtins.getattr, (self, attr), {})
        return super().__getattr__(attr)


def _has_proxy(value: Any) -> bool:
    found: list[bool] = []
    map_aggregate(value, lambda v: found.append(isinstance(v, fx.Proxy)))
    return any(found)


def _is_data(node_value: Any) -> bool:
    return any(isinstance(v, torch.Tensor) for v in _leaves(node_value))


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in _leaves(value) if isinstance(v, torch.Tensor)]


def _leaves(value: Any) -> list[Any]:
    out: list[Any] = []
    map_aggregate(value, out.append)
    return out


class _answer_is_tensor:
    """`torch.is_tensor(proxy)` answered from the sample while tracing (a proxy is no `torch.Tensor`).

    diffusers' U-Nets read `if not torch.is_tensor(timesteps): timesteps = torch.tensor([timesteps])`:
    plain fx takes the branch meant for Python numbers and fails on the proxy. Whether a value is a
    tensor is structure, not data: the chain input's tensors stay tensors (`GraphChain.chain_input`
    refuses anything else), and every traced op gives what it gave on the sample.
    """

    def __enter__(self) -> None:
        self.original = original = torch.is_tensor

        def is_tensor(obj: Any) -> bool:
            if isinstance(obj, ShapeProxy):
                return isinstance(obj._value(), torch.Tensor)
            return original(obj)

        torch.is_tensor = is_tensor  # type: ignore[assignment]  # torch's returns a TypeIs; ours a plain bool

    def __exit__(self, *exc: Any) -> None:
        torch.is_tensor = self.original


class _SizeProxy(ShapeProxy, torch.SymInt):  # fx's operators first, then SymInt's (see below)
    """A traced integer (`x.shape[0]`, `T // 2`): a `torch.SymInt` to torch's argument parser.

    The parser then takes it wherever it takes an integer: a size among sizes given one by one
    (`torch.ones(b, 1)`, `t.expand(b, -1)`), a count (`torch.eye(n)`), a scalar (`torch.arange(t)`),
    without asking its value; and, having no `__torch_function__`, it never stands for a whole
    argument list (which made `torch.ones(b, 1)` refuse its second size). The call then reaches
    `_TracedCalls`, which records it with the integer's node. Python's own uses of it as a number
    (`range(n)`, `if T > 8`) ask the sample and leave a guard, as every `ShapeProxy` does.
    """

    __torch_function__ = disabled_torch_function
    __hash__ = object.__hash__  # by identity, as any proxy (SymInt's would ask a symbolic node)


def _recorded_method(name: str) -> Callable[..., Any]:
    def method(self: _SizeProxy, *args: Any) -> Any:
        return self.tracer.create_proxy("call_method", name, (self, *args), {})  # run on each call's integer

    method.__name__ = name
    return method


# what SymInt alone defines (`math.ceil(n)`, `n.bit_length()`, its symbolic hooks) is the integer's method, recorded
for _name in [
    n for n in vars(torch.SymInt) if n not in ("__init__", "__dict__", "__weakref__", "__doc__", "__module__")
]:
    if getattr(_SizeProxy, _name) is getattr(torch.SymInt, _name) and _name != "__hash__":
        setattr(_SizeProxy, _name, _recorded_method(_name))


class _TracedCalls(TorchFunctionMode):
    """While tracing, a torch function called with a traced value among its arguments, or drawing random
    numbers, is recorded as an op of the graph; any other call (on constants) runs once, its result a constant.

    A traced integer (`_SizeProxy`) is no tensor-like argument, so the parser dispatches such a call
    only to a mode: `torch.eye(n)`, `torch.ones(b, t)`, `mask.expand(b, -1)`, `pe[:t]` on a plain tensor,
    `from torch import ones; ones(b)`, each then computes with each call's own sizes. One rule for every
    function, as fx's `Proxy` records calls on traced tensors (which this records the same way). A random
    tensor made from constants (`torch.randn(16)`, `torch.rand(1) < p`) would be one draw frozen into the
    graph: recorded, it is drawn anew at every call, as in plain training. Real runs on the sample (a leaf
    block, an op's sample value: `ShapeTracer.running`) run as they are.
    """

    def __init__(self, tracer: ShapeTracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.tracer.running:
            return func(*args, **kwargs)
        if not _has_proxy((args, kwargs)):
            made = [t for t in _tensors((args, kwargs)) if _storage(t) in self.tracer.made]
            before = [tensor_version(t) for t in made]
            with _DrawsRandom() as watch:
                value = func(*args, **kwargs)
            if before != [tensor_version(t) for t in made]:
                raise _constant_written(func)
            if not watch.drew:
                return value
        if torch.overrides.is_tensor_method_or_property(func):
            return self.tracer.create_proxy("call_method", func.__name__, args, kwargs)
        return self.tracer.create_proxy("call_function", func, args, kwargs)


def _constant_written(op: Any) -> DiscoveryError:
    """NOTE: [constants written in place] A tensor the forward makes from constants alone (`torch.ones(16, 16)`)
    is one constant of the traced graph, shared by every call; an in-place write into it after the graph read it
    (`mask[t:] = 0`, `mask.masked_fill_(x > 0, 0)`) would carry over from one call to the next, and a constant
    computed from it would keep the sample's write. Refused, so no call computes what another call wrote."""
    name = getattr(op, "__name__", None) or str(getattr(op, "target", op))
    return DiscoveryError(
        f"{_user_frame()}: the forward writes in place ({name}) into a tensor it made from constants, which the traced "
        "graph keeps as one constant for every call; make it from the input's sizes (torch.ones(t, t)) or write out of "
        "place, or use discover='modules'"
    )


class _DrawsRandom(TorchDispatchMode):
    """Notes whether an op run under it draws random numbers (aten's tag `nondeterministic_seeded`)."""

    def __init__(self) -> None:
        super().__init__()
        self.drew = False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        self.drew = self.drew or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


class ShapeTracer(fx.Tracer):
    """torch.fx tracer that runs each op on the sample (see the module docstring)."""

    def __init__(
        self,
        sample: dict[str, Any],
        leaves: set[str],
        leaf_types: tuple[type, ...],
        through: AbstractSet[str] = frozenset(),
        reused: _LeafRuns | None = None,
    ):
        super().__init__(autowrap_functions=())
        self.reused = reused  # submodule calls of an earlier trace of the same module (NOTE: [leaf runs reused])
        self.sample = sample
        self.leaves = leaves
        self.leaf_types = leaf_types
        self.through = through  # of leaf_types, traced into all the same (they write into their input)
        self.values: dict[fx.Node, Any] = {}
        self.data: dict[fx.Node, bool] = {}
        self.writes: dict[fx.Node, list[fx.Node]] = {}  # node -> inputs it wrote into in place, on the sample
        self.branch_stack: list[str] = []
        self.running = 0  # > 0 while a real module call runs on the sample (`_running_real`)
        self.made: set[int] = set()  # storages of tensors the forward made from constants (graph constants)

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return ShapeProxy(node, self)

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        with _answer_is_tensor(), _TracedCalls(self):
            return super().trace(root, concrete_args)

    def create_arg(self, a: Any) -> Any:
        """fx makes every dict a plain dict; a model output class (diffusers' `UNet2DOutput`, a Hugging Face
        `ModelOutput`: dataclasses that are dicts) is rebuilt as such, so `model(x).sample` still works.

        Only classes registered as pytree nodes (both libraries register theirs): the executor finds the
        tensors of a stage's output by flattening it. Others stay plain dicts, as fx makes them. A
        `torch.Size` holding traced integers (`x.new_zeros(torch.Size([b, t]))`) becomes a tuple: a
        `torch.Size` holds no graph node, and every op takes sizes as a tuple alike.
        """
        if isinstance(a, torch.Size) and _has_proxy(a):
            return super().create_arg(tuple(a))
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and a not in self.tensor_attrs:
            node = super().create_arg(a)
            made = _storage(a) if a in self.tensor_attrs and a.numel() else None  # fx stowed it away: a constant
            if made is not None:  # of the graph, which the forward made (NOTE: [constants written in place])
                self.made.add(made)
            return node
        if isinstance(a, dict) and type(a) is not dict and dataclasses.is_dataclass(a) and _has_proxy(a):
            leaves = tree_flatten(a)[0]
            if not (len(leaves) == 1 and leaves[0] is a):
                return self.create_proxy("call_function", type(a), (), dict(a)).node
        return super().create_arg(a)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaves:
            return True
        if self.leaf_types and isinstance(m, self.leaf_types) and qualname not in self.through:
            return True
        return super().is_leaf_module(m, qualname)

    @contextlib.contextmanager
    def _running_real(self) -> Iterator[None]:
        """Module calls and attributes as outside tracing, for a real run on the sample (a leaf's call).

        fx patches `nn.Module.__call__` and `__getattr__` while it traces, and both come here (`call_module`,
        `getattr`); answering them as the originals would is what putting the originals back would do,
        without assigning `nn.Module`'s methods: each assignment makes Python update every subclass of
        `nn.Module` loaded (0.2-0.35 ms a call with timm's or litgpt's classes loaded, several per leaf).
        """
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, fx.Proxy]) -> Any:
        if self.running:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m: nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.running:  # `forward` is the original `nn.Module.__call__` of `m`
            return forward(*args, **kwargs)
        try:
            qualname = self.path_of_module(m)
        except NameError:  # made inside the forward, not a submodule (litgpt's `clamp_head = nn.Identity()`):
            return forward(*args, **kwargs)  # its ops are traced inline, as if written in the forward
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        self.branch_stack.append(qualname)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.branch_stack.pop()

    def _attr_value(self, node: fx.Node) -> None:
        value = self.root
        with self._running_real():  # fx patches Module.__getattr__ to make proxies of parameters while tracing
            for part in str(node.target).split("."):
                value = getattr(value, part)
        self.values[node], self.data[node] = value, isinstance(value, torch.Tensor)

    def create_proxy(
        self,
        kind: str,
        target: Target,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        name: str | None = None,
        type_expr: Any | None = None,
        proxy_factory_fn: Callable[[fx.Node], fx.Proxy] | None = None,
    ) -> fx.Proxy:
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        node = proxy.node
        if kind == "placeholder":
            if isinstance(target, str) and target in self.sample:  # concrete (non-tensor) arguments: no sample value
                value = self.sample[target]
                self.values[node], self.data[node] = value, _is_data(value)
            return proxy
        if kind == "get_attr":
            self._attr_value(node)
            return proxy
        for a in node.all_input_nodes:  # fx makes get_attr nodes for tensor constants (buffers) without a proxy
            if a.op == "get_attr" and a not in self.values:
                self._attr_value(a)
        if any(a not in self.values for a in node.all_input_nodes):  # fx's own checks on concrete args
            return proxy  # no value: `_cut` drops these (`GraphChain.chain_input` checks the constants)
        value = self._sample_value(node)
        if kind == "call_function" and target is builtins.getattr and node.args[1] in _SHAPE_ATTRS:
            self.data[node] = False
        elif kind == "call_method" and target in _SHAPE_METHODS:
            self.data[node] = False
        elif _is_data(value):
            self.data[node] = True
        else:
            self.data[node] = any(self.data.get(n, False) for n in node.all_input_nodes)
        return _SizeProxy(node, self) if type(value) is int else proxy

    def _sample_value(self, node: fx.Node) -> Any:
        """`node`'s op run on the sample values of its inputs, as a real run (nothing it calls is traced);
        the inputs it wrote into in place are noted in `writes`."""
        vals = map_arg((node.args, node.kwargs), self.values.__getitem__)
        inputs: list[fx.Node] = []
        map_arg((node.args, node.kwargs), inputs.append)
        with self._running_real():
            before = [[tensor_version(t) for t in _tensors(self.values[a])] for a in inputs]
            with torch.no_grad():
                value = self._run_op(node.op, node.target, vals[0], vals[1])
            changed = [
                a
                for a, v in zip(inputs, before, strict=True)
                if v != [tensor_version(t) for t in _tensors(self.values[a])]
            ]
        written = [a for a in changed if a.op != "get_attr"]
        if any(_storage(self.values[a]) in self.made for a in changed if a.op == "get_attr"):
            raise _constant_written(node)
        self.values[node] = value
        if written:  # seen on the sample: any op, a whole submodule too (`x.add_(1)` inside a leaf block)
            self.writes[node] = written
        return value

    def _run_op(self, kind: str, target: Target, args: Any, kwargs: Any) -> Any:
        """A new node's op run on the sample values of its arguments (a submodule as outside tracing, or
        an earlier trace's run of it reused: NOTE: [leaf runs reused])."""
        if kind != "call_module":
            return _run_node(self.root, kind, target, args, kwargs)
        inputs = _leaves((args, kwargs))
        earlier = self.reused.find(str(target), inputs) if self.reused is not None else None
        if earlier is not None:
            return earlier[0]
        versions = [tensor_version(t) for t in _tensors(inputs)]
        with self._running_real():
            value = _run_node(self.root, kind, target, args, kwargs)
        if self.reused is not None and versions == [tensor_version(t) for t in _tensors(inputs)]:
            self.reused.keep(str(target), inputs, versions, value)
        return value


class _LeafRuns:
    """Submodule calls run on the sample by one trace, for the next trace of the same module to reuse.

    NOTE: [leaf runs reused] The floor split (NOTE: [floor split]) traces the model again for each
    level it goes into, and a trace runs every op on the sample: the blocks left whole (every other
    resolution level, the stem, the head) would run again on the same inputs. A call is reused when
    its module gets inputs equal to an earlier call's (each tensor of the same layout and values, the
    earlier one unchanged since) and the earlier output is unchanged since; only calls that wrote into
    none of their inputs, gave a tensor or a tuple of them (nothing a later op could change unseen),
    and whose output shares no storage with their inputs (it would be a view of the earlier trace's
    input) are kept. The reused output has the sizes, layout and aliasing a run would give, which is
    all discovery reads of values; user forward hooks of a reused call do not run again. Only earlier
    traces' calls are looked up: a model whose floor is not split (one trace) compares no inputs.
    """

    def __init__(self) -> None:
        self.runs: dict[str, list[tuple[list[Any], list[int], Any, list[int]]]] = {}  # earlier traces'
        self.latest: dict[str, list[tuple[list[Any], list[int], Any, list[int]]]] = {}  # this trace's

    def next_trace(self) -> None:
        """A new trace begins: the calls of the one before can be reused from now on."""
        for qualname, runs in self.latest.items():
            self.runs.setdefault(qualname, []).extend(runs)
        self.latest = {}

    def find(self, qualname: str, inputs: list[Any]) -> tuple[Any] | None:
        """The output of an earlier trace's call of `qualname` on inputs equal to `inputs` (in a 1-tuple), if any."""
        for old, versions, out, out_versions in self.runs.get(qualname, ()):
            unchanged = out_versions == [tensor_version(t) for t in _tensors(out)]
            if unchanged and _same_inputs(old, versions, inputs):
                return (out,)
        return None

    def keep(self, qualname: str, inputs: list[Any], versions: list[int], out: Any) -> None:
        """Keep a call that wrote into none of `inputs` (their tensors' `versions` as before it), if its output can
        be reused (see the note)."""
        if not _immutable_tensors(out):
            return
        taken = {_storage(t) for t in _tensors(inputs)}
        if any(_storage(t) in taken for t in _tensors(out)):
            return
        self.latest.setdefault(qualname, []).append((inputs, versions, out, [tensor_version(t) for t in _tensors(out)]))


def _immutable_tensors(value: Any) -> bool:
    """A tensor, a number, a string, None, or a tuple of these (a list or dict could be changed by a later op)."""
    if isinstance(value, tuple):
        return all(_immutable_tensors(v) for v in value)
    return isinstance(value, (torch.Tensor, int, float, bool, str, type(None)))


def _same_inputs(old: list[Any], versions: list[int], new: list[Any]) -> bool:
    """`new` equal to `old` (leaves of a call's arguments): tensors of the same layout and values, `old`'s
    unchanged since (`versions`), anything else the same object or equal and of the same type."""
    if len(old) != len(new):
        return False
    version = iter(versions)
    for a, b in zip(old, new, strict=True):
        if isinstance(a, torch.Tensor):
            if not (isinstance(b, torch.Tensor) and tensor_version(a) == next(version) and _same_tensor(a, b)):
                return False
        elif not (a is b or (type(a) is type(b) and _equal(a, b))):
            return False
    return True


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.layout != torch.strided or b.layout != torch.strided:
        return False
    same_layout = (a.dtype, a.device, a.shape, a.stride(), a.storage_offset(), a.requires_grad) == (
        b.dtype,
        b.device,
        b.shape,
        b.stride(),
        b.storage_offset(),
        b.requires_grad,
    )
    return same_layout and a.untyped_storage().nbytes() == b.untyped_storage().nbytes() and torch.equal(a, b)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (an object whose == fails or is no bool: not reused)
        return False


def _run_node(root: nn.Module, kind: str, target: Target, args: Any, kwargs: Any) -> Any:
    """A node's op run on values (fx's targets: a callable for call_function, a name for call_method and
    call_module), as its `GraphModule`'s code runs it."""
    if kind == "call_function":
        assert callable(target)
        return target(*args, **kwargs)
    if kind == "call_method":
        assert isinstance(target, str)
        return getattr(args[0], target)(*args[1:], **kwargs)
    if kind == "call_module":
        assert isinstance(target, str)
        return root.get_submodule(target)(*args, **kwargs)
    return None


# -- cutting ---------------------------------------------------------------------------------
_INPLACE_FUNCTIONS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.imatmul,
    operator.setitem,
}
_AUGMENTED = _INPLACE_FUNCTIONS - {operator.setitem}  # `x op= y`: in place only where x's type defines it so
_IMMUTABLE = (tuple, int, float, complex, str, bytes, frozenset, type(None))


def _writes_into(node: fx.Node, root: nn.Module, values: dict[fx.Node, Any]) -> fx.Node | None:
    """The node whose value `node` overwrites in place, if any.

    `x += y` on a tuple or a number (diffusers' `down_block_res_samples += res_samples`) makes a new
    value, as Python does for every immutable: no write, so no reason to keep the span in one stage.
    """
    if not node.args or not isinstance(node.args[0], fx.Node):
        return None
    first = node.args[0]
    if node.op == "call_function" and node.target in _AUGMENTED and isinstance(values.get(first), _IMMUTABLE):
        return None
    if node.op == "call_method" and str(node.target).endswith("_") and not str(node.target).endswith("__"):
        return first
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if node.target in _INPLACE_FUNCTIONS or node.kwargs.get("inplace") is True:
            return first
        if name.endswith("_") and not name.endswith("__"):
            return first
    if node.op == "call_module" and getattr(root.get_submodule(str(node.target)), "inplace", False) is True:
        return first
    return None


def _describe(node: fx.Node, root: nn.Module) -> str:
    if node.op == "call_module":
        return f"{node.target}, a {type(root.get_submodule(str(node.target))).__name__}"
    if node.op == "call_method":
        return f".{node.target}()"
    return getattr(node.target, "__name__", str(node.target))


def _storage(value: Any) -> int | None:
    if isinstance(value, torch.Tensor):
        try:
            return value.untyped_storage().data_ptr()
        except RuntimeError:
            return None
    return None


def _is_weighty(node: fx.Node) -> bool:
    """Worth a stage of its own: a submodule call, or a matrix product or convolution."""
    if node.op == "call_module":
        return True
    name = getattr(node.target, "__name__", str(node.target))
    return any(w in name for w in ("matmul", "linear", "conv", "bmm", "mm", "attention", "einsum"))


@dataclass
class GraphChain:
    """The traced graph cut into stages, and how call arguments become the chain input."""

    stages: list[nn.Module]
    names: list[str]
    cuts: list[str] = field(default_factory=list)  # per boundary: what crosses it
    guards: int = 0
    leaves: list[str] = field(default_factory=list)
    tensor_args: list[str] = field(default_factory=list)  # forward parameters that are the chain input, in order
    constants: dict[str, Any] = field(default_factory=dict)  # non-tensor arguments fixed at discovery
    stage_modules: list[list[str]] = field(default_factory=list)  # per stage, the submodules it calls
    floor_split: list[str] = field(default_factory=list)  # kept-whole blocks traced into to lower the floor

    def chain_input(self, bound: dict[str, Any]) -> Any:
        """a_0 from the forward's bound arguments; non-tensor arguments must equal the sample's."""
        for name, expected in self.constants.items():
            got = bound.get(name, expected)
            if not (got is expected or (type(got) is type(expected) and got == expected)):
                raise GuardFailed(
                    f"argument {name}={got!r} differs from {expected!r} given when the chain was "
                    "discovered (non-tensor arguments are fixed into the traced graph)"
                )
        values = [bound[n] for n in self.tensor_args]
        for name, value in zip(self.tensor_args, values, strict=True):
            if not isinstance(value, torch.Tensor):  # the trace answered `torch.is_tensor(name)` with True
                raise GuardFailed(
                    f"argument {name}={value!r} is not a tensor, but was one when the chain was discovered "
                    "(the traced graph holds the tensor path); pass a tensor, as on the first call"
                )
        return values[0] if len(values) == 1 else tuple(values)


def trace_chain(
    module: nn.Module,
    bound: dict[str, Any],
    *,
    leaf_types: Sequence[type] = (),
    max_carry: int = DEFAULT_MAX_CARRY,
    max_retries: int = 32,
    trace_into_writers: bool = False,
    split_floor: bool = False,
) -> GraphChain:
    """Trace `module` on the bound sample arguments (name -> value) and cut it into stages.

    NOTE: [in-place block start] A block that writes into its input in place (`ReLU(inplace=True)`
    or `x.add_(1)` first) must share a stage with what produced that input: as a stage input, the
    write would corrupt the checkpoint a recomputation starts from. Cuts are never placed between a
    value and a write into it (seen on the sample, whatever op or submodule wrote), so such a block,
    kept whole, joins the stage before. With `trace_into_writers` (the blocks were chosen by
    `block_types`, not by the user), such blocks are traced into instead, so the cut can go right
    after the in-place op, inside the block.

    With `split_floor` (blocks chosen by `block_types`), the blocks kept whole in the heaviest
    stages are traced into while that lowers the floor (NOTE: [floor split]).
    """
    tensor_args = [n for n, v in bound.items() if isinstance(v, torch.Tensor)]
    constants = {n: v for n, v in bound.items() if not isinstance(v, torch.Tensor)}
    leaves: set[str] = set()
    through: set[str] = set()
    reused = _LeafRuns() if split_floor else None  # the floor split traces again (NOTE: [leaf runs reused])
    graph, tracer = _trace(
        module, bound, tensor_args, constants, leaf_types, leaves, through, max_retries, trace_into_writers, reused
    )
    cut = _cut(module, graph, tracer, max_carry)
    if split_floor:
        cut = _split_floor(
            module,
            bound,
            tensor_args,
            constants,
            leaf_types,
            leaves,
            through,
            cut,
            _leaf_sizes(tracer),
            max_carry,
            max_retries,
            reused,
        )
    chain = cut.chain(module)
    chain.leaves = sorted(leaves)
    chain.tensor_args = tensor_args
    chain.constants = constants
    return chain


def _trace(
    module: nn.Module,
    bound: dict[str, Any],
    tensor_args: list[str],
    constants: dict[str, Any],
    leaf_types: Sequence[type],
    leaves: set[str],
    through: set[str],
    max_retries: int,
    trace_into_writers: bool,
    reused: _LeafRuns | None = None,
) -> tuple[fx.Graph, ShapeTracer]:
    """One trace; `leaves` (value branches found) and `through` (writers traced into) grow in place;
    `reused`: submodule calls of earlier traces (NOTE: [leaf runs reused]), and this one's added."""
    rng = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    saved = {n: b.detach().clone() for n, b in module.named_buffers()}
    for _ in range(max_retries):
        if reused is not None:
            reused.next_trace()
        tracer = ShapeTracer({n: bound[n] for n in tensor_args}, leaves, tuple(leaf_types), through, reused)
        try:
            with torch.random.fork_rng(devices=rng):
                graph = tracer.trace(module, concrete_args=constants or None)
            writers = {str(n.target) for n in tracer.writes if n.op == "call_module"} - leaves - through
            writers = {q for q in writers if isinstance(module.get_submodule(q), tuple(leaf_types))}
            if not (trace_into_writers and writers):
                return graph, tracer
            through |= writers  # NOTE: [in-place block start] below
        except _SubmoduleBranch as branch:
            leaves.add(branch.qualname)
        finally:
            _put_back_buffers(module, saved)
    raise DiscoveryError(f"tracing {type(module).__name__} kept finding value-dependent branches")


def _split_floor(
    module: nn.Module,
    bound: dict[str, Any],
    tensor_args: list[str],
    constants: dict[str, Any],
    leaf_types: Sequence[type],
    leaves: set[str],
    through: set[str],
    chain: _Cut,
    leaf_sizes: dict[str, int],
    max_carry: int,
    max_retries: int,
    reused: _LeafRuns | None = None,
) -> _Cut:
    """`chain` with the blocks kept whole in its heaviest stages traced into, while that lowers the floor.

    NOTE: [floor split] The heaviest stage sets the floor of every schedule: even recomputing
    everything, its backward holds its input, all it saves and the gradients at both ends. A
    ConvNeXt stage (`stages.0`, a class used four times, so kept whole) holds its blocks, so the
    floor is a whole resolution level. While every heaviest stage (estimated on the sample:
    `_stage_costs`) calls a kept-whole block, those blocks are traced into (their own blocks then
    kept whole, one level down) and the chain is cut again; the finer chain is kept when every
    piece of the split stages is strictly lighter than they were and no stage got heavier. A
    heaviest stage without such a block (a ResNet stem convolution, a GPT head's logits) ends the
    search: no cut inside the blocks can lower the floor there.
    """
    types = tuple(leaf_types)
    sizes = dict(leaf_sizes)  # output bytes of submodule calls on the sample; the runs below add the inner ones
    if not any(_unbalanced(module, q, types, sizes) for called in chain.called for q in called):
        return chain  # blocks alike (a transformer's layers): nothing to split, nothing to measure
    known: dict[tuple[str, ...], int] = {}  # cost by the submodules a stage calls: the stages a split leaves alone
    costs = _stage_costs(module, chain, known, types, sizes)
    for _ in range(max_retries):
        top = max(costs)
        heavy = [k for k, c in enumerate(costs) if c == top]
        blocks = [
            [q for q in chain.called[k] if q not in leaves and _unbalanced(module, q, types, sizes)] for k in heavy
        ]
        if not all(blocks):
            break
        finer = {q for b in blocks for q in b}
        graph, tracer = _trace(
            module, bound, tensor_args, constants, leaf_types, leaves, through | finer, max_retries, True, reused
        )
        split = _cut(module, graph, tracer, max_carry, through | finer)
        split_costs = _stage_costs(module, split, known)
        kept = {chain.names[k] for k in range(len(costs)) if k not in heavy}  # stages the split left as they were
        pieces = [c for n, c in zip(split.names, split_costs, strict=True) if n not in kept]
        if max(split_costs) > top or max(pieces, default=top) >= top:
            break
        through |= finer
        split.floor_split = sorted({*chain.floor_split, *finer})
        chain, costs = split, split_costs
    return chain


def _leaf_sizes(tracer: ShapeTracer) -> dict[str, int]:
    """Output bytes of each submodule call in the traced graph, by qualified name."""
    return {
        str(n.target): sum(t.untyped_storage().nbytes() for t in _tensors(v))
        for n, v in tracer.values.items()
        if n.op == "call_module"
    }


def _unbalanced(module: nn.Module, qualname: str, types: tuple[type, ...], sizes: dict[str, int]) -> bool:
    """Worth tracing into for the floor: a kept-whole block holding a run of blocks (a ConvNeXt stage's
    Sequential of blocks; two norms of one class in a transformer block are no run),
    or one whose output is at least twice another of its class's (a block at a higher resolution).

    Blocks of a class alike in size (a transformer's layers) are left whole: each is then as heavy
    as the model's own per-block checkpointing keeps, and their plans stay as they were.
    """
    block = module.get_submodule(qualname)
    if not isinstance(block, types):
        return False
    for run in block.modules():  # a Sequential or ModuleList of two or more blocks of one class
        if isinstance(run, (nn.Sequential, nn.ModuleList)):
            inner = [type(m) for m in run.children() if isinstance(m, types)]
            if any(inner.count(t) >= 2 for t in set(inner)):
                return True
    alike = [n for q, n in sizes.items() if type(module.get_submodule(q)) is type(block)]
    return qualname in sizes and sizes[qualname] >= 2 * min(alike)


def _stage_costs(
    module: nn.Module,
    cut: _Cut,
    known: dict[tuple[str, ...], int],
    types: tuple[type, ...] = (),
    sizes: dict[str, int] | None = None,
) -> list[int]:
    """Per stage, about the bytes its backward holds on the sample: its input, what it saves, its output's
    gradient, and the input's gradient or the largest gradient inside (whichever is larger).

    One forward with grad of each stage's ops on a copy of its input as the trace found it (buffers and
    the RNG stream put back); a stage calling the same submodules as one measured before (`known`) is
    not run. `sizes`, when given, gets the output bytes of every call of a submodule of class `types`.
    """
    own = {_storage(t) for t in [*module.parameters(), *module.buffers()]}
    saved_buffers = {n: b.detach().clone() for n, b in module.named_buffers()}
    rng = [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    costs: list[int] = []
    hooks = _record_output_sizes(module, types, sizes) if sizes is not None else []
    try:
        with torch.random.fork_rng(devices=rng), torch.enable_grad():
            for k, called in enumerate(cut.called):
                key = tuple(called)
                if key and key in known:
                    costs.append(known[key])
                    continue
                value = map_aggregate(cut.stage_input(k), _fresh)
                _, cost = _backward_bytes(partial(cut.run_stage, module, k), value, own)
                costs.append(cost)
                if key:
                    known[key] = cost
    finally:
        for h in hooks:
            h.remove()
        _put_back_buffers(module, saved_buffers)
    return costs


def _fresh(t: Any) -> Any:
    """A tensor as a new leaf (requiring grad where it can), cut from what made it; anything else as is."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach().clone()
    return t.requires_grad_() if t.is_floating_point() else t


def _storage_bytes(tensors: list[torch.Tensor], skip: set[int | None]) -> tuple[int, set[int | None]]:
    """Bytes of the storages of `tensors` outside `skip`, each counted once, and those storages."""
    seen: dict[int | None, int] = {}
    for t in tensors:
        s = _storage(t)
        if s not in skip and s is not None:
            seen[s] = t.untyped_storage().nbytes()
    return sum(seen.values()), set(seen)


def _backward_bytes(stage: Callable[[Any], Any], value: Any, own: set[int | None]) -> tuple[Any, int]:
    """`stage` run on `value` with grad: its output, and about the bytes its backward holds (`_stage_costs`);
    `own`: the storages of the module's parameters and buffers, left out."""
    kept: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = stage(value)
    inputs, in_storages = _storage_bytes(_tensors(value), own)
    extra, _ = _storage_bytes(kept, own | in_storages)
    outputs, _ = _storage_bytes(_tensors(out), own | in_storages)
    inner = max((t.untyped_storage().nbytes() for t in kept if _storage(t) not in own), default=0)
    return out, inputs + extra + outputs + max(inputs, inner)  # the last: δ_k or an inner gradient


def _record_output_sizes(module: nn.Module, types: tuple[type, ...], sizes: dict[str, int]) -> list[RemovableHandle]:
    """Forward hooks writing into `sizes` the output bytes of each call of a submodule of class `types`."""

    def record(name: str) -> Callable[..., None]:
        def hook(_: nn.Module, __: Any, out: Any) -> None:
            sizes[name] = sum(t.untyped_storage().nbytes() for t in _tensors(out))

        return hook

    return [m.register_forward_hook(record(q)) for q, m in module.named_modules() if issubclass(type(m), types)]


def _put_back_buffers(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """The module's buffers (running statistics) set back to `saved`, in place."""
    with torch.no_grad():
        for n, b in module.named_buffers():
            if n in saved:
                b.copy_(saved[n])


@dataclass
class _Body:
    """The traced graph as `_cut` reads it: the ops in order and where each value is last used."""

    placeholders: list[fx.Node]  # the forward's arguments with a sample value
    dead: list[fx.Node]  # those without one: concrete arguments
    output: fx.Node
    ops: list[fx.Node]  # the ops with a sample value, in order; get_attr left out (read inside each stage)
    pos: dict[fx.Node, int]  # index in `ops`; -1 for placeholders
    last_use: dict[fx.Node, int]  # index in `ops` of the last op reading a value; len(ops) for the output

    @classmethod
    def of(cls, graph: fx.Graph, tracer: ShapeTracer) -> _Body:
        nodes = list(graph.nodes)
        placeholders = [n for n in nodes if n.op == "placeholder" and n in tracer.values]
        dead = [n for n in nodes if n.op == "placeholder" and n not in tracer.values]
        output = next(n for n in nodes if n.op == "output")
        ops = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr") and n in tracer.values]
        pos = {n: i for i, n in enumerate(ops)}
        for n in placeholders:
            pos[n] = -1
        last_use: dict[fx.Node, int] = {}
        for i, n in enumerate(ops):
            for a in n.all_input_nodes:
                last_use[a] = i
        for a in output.all_input_nodes:
            last_use[a] = len(ops)
        return cls(placeholders, dead, output, ops, pos, last_use)

    def live_after(self, i: int) -> list[fx.Node]:
        """The values a cut after op `i` carries: made by then, read later."""
        return [n for n in [*self.placeholders, *self.ops[: i + 1]] if self.last_use.get(n, -2) > i]


def _cut(
    root: nn.Module, graph: fx.Graph, tracer: ShapeTracer, max_carry: int, ends: AbstractSet[str] = frozenset()
) -> _Cut:
    """Cut after weighty ops where few tensors cross; also at the end of each block in `ends` (traced into)."""
    body = _Body.of(graph, tracer)
    blocked = _blocked_cuts(root, tracer, body)
    return _stages_between(tracer, body, _cut_points(tracer, body, blocked, max_carry, ends))


def _blocked_cuts(root: nn.Module, tracer: ShapeTracer, body: _Body) -> list[bool]:
    """Per op, whether a cut after it is forbidden: in-place writes forbid cuts between the written
    value's first alias and the write (NOTE: [in-place block start])."""
    blocked = [False] * len(body.ops)
    by_storage: dict[int, int] = {}
    for n in [*body.placeholders, *body.ops]:
        s = _storage(tracer.values.get(n))
        if s is not None and s not in by_storage:
            by_storage[s] = body.pos[n]
    for j, n in enumerate(body.ops):
        static = _writes_into(n, root, tracer.values)
        for target in {*tracer.writes.get(n, ()), *([static] if static is not None else [])}:
            if target.op == "get_attr":
                continue
            s = _storage(tracer.values.get(target))
            start = by_storage.get(s, body.pos.get(target, -1)) if s is not None else body.pos.get(target, -1)
            for c in range(max(start, 0), j):
                blocked[c] = True
            if start < 0:  # NOTE: [in-place block start]: the chain input has no producer to share a stage with
                raise DiscoveryError(
                    f"the forward writes in place into its input ({_describe(n, root)}): the first stage would "
                    "overwrite the chain input it is recomputed from; module-level discovery (discover='modules') runs "
                    "such a write before the chain, or make it out-of-place"
                )
    return blocked


def _cut_points(
    tracer: ShapeTracer, body: _Body, blocked: list[bool], max_carry: int, ends: AbstractSet[str]
) -> list[int]:
    """The ops a stage ends after: after weighty ops (or at a block's end), where at most `max_carry`
    tensors cross and no write forbids it."""
    cuts: list[int] = []
    weight = False
    for i, n in enumerate(body.ops[:-1]):
        weight = weight or _is_weighty(n)
        if not (weight or _ends_block(n, body.ops[i + 1], ends)) or blocked[i]:
            continue
        live = body.live_after(i)
        if sum(_is_data(tracer.values.get(v)) for v in live) > max_carry:
            continue
        cuts.append(i)
        weight = False
    if cuts and not any(_is_weighty(n) for n in body.ops[cuts[-1] + 1 :]):
        cuts.pop()  # a trailing stage without a submodule call or product joins the one before
    return cuts


@dataclass
class _StageSpec:
    """A stage as cut from the traced graph: its ops, the values crossing into it and out (None: the last)."""

    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node] | None


@dataclass
class _Cut:
    """The traced graph cut into stages, not yet built into modules: the floor split weighs several cuts
    (NOTE: [floor split]) and builds only the one it keeps."""

    body: _Body
    tracer: ShapeTracer
    specs: list[_StageSpec]
    names: list[str]
    crossing: list[str]  # per boundary: what crosses it
    called: list[list[str]]  # per stage, the submodules it calls
    guards: int
    floor_split: list[str] = field(default_factory=list)

    def chain(self, root: nn.Module) -> GraphChain:
        """The chain of `GraphModule`s on `root`, one per stage."""
        stages: list[nn.Module] = [
            _stage_module(root, s.nodes, s.inputs, s.outputs, self.body.output, self.body.dead, k)
            for k, s in enumerate(self.specs)
        ]
        chain = GraphChain(stages, self.names, self.crossing, self.guards, stage_modules=self.called)
        chain.floor_split = self.floor_split
        return chain

    def stage_input(self, k: int) -> Any:
        """Stage `k`'s input on the sample, as the stage before gives it (one value or a tuple)."""
        values = [self.tracer.values[n] for n in self.specs[k].inputs]
        return values[0] if len(values) == 1 else tuple(values)

    def run_stage(self, root: nn.Module, k: int, value: Any) -> Any:
        """Stage `k`'s ops run on `value`, as its `GraphModule` would run them (without building it)."""
        spec = self.specs[k]
        env: dict[fx.Node, Any] = dict(zip(spec.inputs, [value] if len(spec.inputs) == 1 else value, strict=True))

        def lookup(n: fx.Node) -> Any:
            if n not in env and n.op == "get_attr":
                env[n] = _fetch(root, str(n.target))
            return env[n]

        for n in spec.nodes:
            args, kwargs = map_arg((n.args, n.kwargs), lookup)
            env[n] = _run_node(root, n.op, n.target, args, kwargs)
        if spec.outputs is None:
            return map_arg(self.body.output.args[0], lookup)
        return lookup(spec.outputs[0]) if len(spec.outputs) == 1 else tuple(lookup(n) for n in spec.outputs)


def _fetch(root: nn.Module, target: str) -> Any:
    """The attribute `target` (a dotted path) of `root`: a parameter, buffer or constant a `get_attr` reads."""
    value: Any = root
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _stages_between(tracer: ShapeTracer, body: _Body, cuts: list[int]) -> _Cut:
    """The stages between the cuts, named by the submodules they call."""
    bounds = [-1, *cuts, len(body.ops) - 1]
    specs: list[_StageSpec] = []
    names: list[str] = []
    crossing: list[str] = []
    called: list[list[str]] = []
    for k in range(len(bounds) - 1):
        lo, hi = bounds[k] + 1, bounds[k + 1]
        inputs = body.placeholders if k == 0 else body.live_after(bounds[k])
        outputs = None if k == len(bounds) - 2 else body.live_after(hi)  # None: the last stage
        specs.append(_StageSpec(body.ops[lo : hi + 1], inputs, outputs))
        _check_crossing(specs[-1], body, k)
        mods = [str(n.target) for n in body.ops[lo : hi + 1] if n.op == "call_module"]
        names.append(_stage_name(mods, body.ops[lo : hi + 1], k))
        called.append(mods)
        if outputs is not None:
            crossing.append(
                f"after {names[-1]}: " + ", ".join(f"{v.name}{_shape_str(tracer.values.get(v))}" for v in outputs)
            )
    guards = sum(1 for n in body.ops if n.op == "call_function" and n.target in _GUARDS)
    return _Cut(body, tracer, specs, _unique(names), crossing, called, guards)


def _check_crossing(spec: _StageSpec, body: _Body, k: int) -> None:
    """Every value stage `k` reads is made in it, crosses into it or is a parameter or buffer (else the
    error `_stage_module` would raise building it)."""
    made = set(spec.inputs)
    for n in spec.nodes:
        for a in n.all_input_nodes:
            _check_reads(a, made, body, k)
        made.add(n)
    for a in body.output.all_input_nodes if spec.outputs is None else spec.outputs:
        _check_reads(a, made, body, k)


def _check_reads(n: fx.Node, made: set[fx.Node], body: _Body, k: int) -> None:
    if n in made or n.op == "get_attr":
        return
    if n in body.dead:
        raise DiscoveryError(f"stage {k} needs concrete argument {n.name}")
    raise DiscoveryError(f"stage {k} uses {n.name}, which does not cross into it (discovery bug)")


def _ends_block(node: fx.Node, after: fx.Node, ends: AbstractSet[str]) -> bool:
    """`node` is the last op of one of the blocks `ends` (a block boundary: a cut there splits no block)."""
    if not ends:
        return False
    inside = set(node.meta.get("nn_module_stack", {})) & ends
    return bool(inside - set(after.meta.get("nn_module_stack", {})))


def _shape_str(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)}"
    if isinstance(value, (tuple, list)) and _tensors(value):  # skips carried as a tuple: their shapes
        return f"=({len(value)}: " + ", ".join(_shape_str(v).lstrip("=") for v in value) + ")"
    return f"={value!r}"[:24]


def _stage_name(mods: list[str], nodes: list[fx.Node], k: int) -> str:
    if not mods:
        return nodes[0].name
    return mods[0] if len(mods) == 1 else f"{mods[0]}..{mods[-1]}"


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def _stage_module(
    root: nn.Module,
    nodes: list[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node] | None,
    output: fx.Node,
    dead: list[fx.Node],
    k: int,
) -> fx.GraphModule:
    """F_k as a GraphModule on the user's module: a_k (one value or a tuple) in, a_{k+1} out."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    a = g.placeholder("a")
    if len(inputs) == 1:
        env[inputs[0]] = a
    else:
        for i, n in enumerate(inputs):
            env[n] = g.call_function(operator.getitem, (a, i))

    def lookup(n: fx.Node) -> fx.Node:
        if n not in env:
            if n.op == "get_attr":
                env[n] = g.get_attr(str(n.target))
            elif n in dead:
                raise DiscoveryError(f"stage {k} needs concrete argument {n.name}")
            else:
                raise DiscoveryError(f"stage {k} uses {n.name}, which does not cross into it (discovery bug)")
        return env[n]

    for n in nodes:
        env[n] = g.node_copy(n, lookup)
    if outputs is None:
        g.output(map_arg(output.args[0], lookup))
    elif len(outputs) == 1:
        g.output(lookup(outputs[0]))
    else:
        g.output(tuple(lookup(n) for n in outputs))
    return fx.GraphModule(root, g, class_name=f"Stage{k}")
