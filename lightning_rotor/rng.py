"""Replaying a recomputed stage's random numbers without rewinding the process-wide generator.

A recomputed stage must draw the same random numbers (dropout masks) as its first run, or its
gradients are wrong. How, with other threads drawing meanwhile: NOTE: [never rewind a shared
generator], [one lock, and refilling in place], [quiet stages]; the usual single training thread
pays for none of it: NOTE: [alone].
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from lightning_rotor._torch_compat import TorchDispatchMode, op_arguments, tree_leaves

__all__ = ["RNG_LOCK", "GeneratorWatch", "RecordRandom", "ReplayFrom", "ReplayRandom", "Rewind", "alone"]

# NOTE: [never rewind a shared generator]
# A recomputed stage must draw the same random numbers (dropout masks) as its
# first run, or its gradients are wrong. Rewinding the default generator for the
# replay (`torch.random.fork_rng` + `set_rng_state`) would do that in one thread,
# but the default generator is shared by every thread of the process: another
# thread drawing meanwhile would get repeated numbers, and its draws would shift
# the replayed ones.
#
# So the default generator is never rewound. Instead, during the first run of a
# stage that the plan recomputes, `RecordRandom` notes, immediately before each
# op that draws random numbers (aten ops tagged `nondeterministic_seeded`:
# `bernoulli_` under dropout, `normal_`, `rand`, `randperm`, fused attention with
# dropout, ...), the state of the generator that op draws from. On a replay,
# `ReplayRandom` hands each such op a private `torch.Generator` set to that
# state: the op's own `generator` argument, or the same op's overload that takes
# one (`rand.default` -> `rand.generator`).
#
# NOTE: [one lock, and refilling in place]
# One lock, `RNG_LOCK`, is held from each snapshot to the end of its op, so
# rotor threads' recorded ops cannot draw between the two. Ops that fill an
# existing tensor (`bernoulli_`, which is dropout on CPU, `uniform_`, `normal_`,
# ...) are made exact whatever other threads do: the op first draws from the
# default generator (which so moves on exactly as without rotor), then fills
# the tensor again from the snapshot with a private generator. That second fill
# costs one more random op, so it is done only while other Python threads are
# alive (not `alone()`, below: a process with no other thread that may draw has
# nobody to draw in between). What remains:
#
# - an op that makes a new tensor (`rand`, `randn`, `bernoulli(p)`,
#   `multinomial`, `rrelu`'s noise, ...) draws from the default generator
#   itself: a draw from the same generator by any thread that is not inside a
#   recorded op (a thread outside rotor, or a stage the plan does not recompute)
#   landing between the snapshot and the op shifts the op's numbers, and its
#   replay is then not exact. The window is one GIL hand-over wide, so a thread
#   drawing continuously does hit it; the generator still never repeats a
#   number to anyone;
# - ops that draw but take no generator in any overload (`native_dropout`, the
#   fused CUDA attention kernels, cuDNN RNNs: CUDA only; on CPU dropout is
#   `bernoulli_`) have the same window on their first run, and are replayed by
#   setting the default generator of their device to the snapshot and restoring
#   its state right after, under the lock: a thread outside rotor drawing on that
#   device in that window sees repeated numbers;
# - profiling (the first training forward of each new input signature,
#   `profile.profile_chain`) still forks the RNG around its runs, so a thread
#   drawing during profiling may see numbers again afterwards.
#
# NOTE: [quiet stages]
# Only stages that the plan recomputes run under these modes (one Python
# dispatch per op of their forward runs); other stages run as they are. A
# recomputed stage whose recorded first run drew nothing is *quiet*: later steps
# run it with no mode at all, only comparing the default generators' states
# before and after its first run (`GeneratorWatch`). Should they have moved (the
# stage drew after all, or another thread drew meanwhile), that step replays the
# stage from one private generator per device set to the states before its first
# run (`ReplayFrom`: exact unless another thread drew meanwhile), and the next
# step records it again.
#
# NOTE: [alone]
# A process whose only thread that may draw is the training thread (`alone()`: every
# other Python thread is a daemon, as tqdm's monitor and TensorBoard's writer are; the
# usual training loop) pays for none of this: a recomputed stage's first run only notes the generators' states
# (`GeneratorWatch`), and its replay rewinds the default generators to them and
# puts them back afterwards (`Rewind`), with no dispatch mode, as
# torch.utils.checkpoint does. Should another thread appear between the two, the
# replay takes `ReplayFrom` instead, which is exact since nobody could draw during
# the first run.

RNG_LOCK = threading.RLock()

_SEEDED = torch.Tag.nondeterministic_seeded
_WITH_GENERATOR: dict[Any, Any] = {}  # op -> the overload taking `generator` (itself, a sibling, or None)


def _takes_generator(op: Any) -> bool:
    return any(a.name == "generator" for a in op_arguments(op))


def _with_generator(op: Any) -> Any:
    """`op` if it takes a generator, else its overload with the same arguments plus one, else None."""
    if op in _WITH_GENERATOR:
        return _WITH_GENERATOR[op]
    found = None
    if _takes_generator(op):
        found = op
    else:
        names = [a.name for a in op_arguments(op)]
        packet = op.overloadpacket
        for name in packet.overloads():
            other = getattr(packet, name)
            if _takes_generator(other) and [a.name for a in op_arguments(other) if a.name != "generator"] == names:
                found = other
                break
    _WITH_GENERATOR[op] = found
    return found


def _overwrites_first(op: Any, args: Any, kwargs: dict) -> bool:
    """Whether `op` writes its random numbers into its first argument, which no other argument shares."""
    first = op_arguments(op)[0]
    if first.alias_info is None or not first.alias_info.is_write or not args:
        return False
    target = args[0]
    if not isinstance(target, torch.Tensor):
        return False
    ptr = target.untyped_storage().data_ptr()
    others = [t for t in tree_leaves((args[1:], kwargs)) if isinstance(t, torch.Tensor)]
    return all(t.untyped_storage().data_ptr() != ptr for t in others)


def _device(args: Any, kwargs: dict) -> torch.device:
    for t in tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor):
            return t.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.device("cpu")


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise RuntimeError(
        f"rotor replays random numbers on CPU and CUDA only, and a recomputed stage draws some on {device}; "
        "use a budget at which nothing is recomputed, or run the stage without randomness"
    )


def _source(kwargs: dict, device: torch.device) -> torch.Generator:
    """The generator the op draws from: its own argument, or its device's default generator."""
    generator = kwargs.get("generator")
    return generator if generator is not None else _default_generator(device)


class RecordRandom(TorchDispatchMode):
    """First run of a recomputed stage: remember the generator state each random op draws from.

    See NOTE: [never rewind a shared generator] and NOTE: [one lock, and refilling in place].
    """

    def __init__(self) -> None:
        super().__init__()
        self.states: list[tuple[torch.device, torch.Tensor]] = []
        self.private: dict[torch.device, torch.Generator] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        device = _device(args, kwargs)
        source = _source(kwargs, device)
        overwrite = (
            not alone()  # alone, nothing can draw between the snapshot and the op
            and _with_generator(func) is func
            and _overwrites_first(func, args, kwargs)
        )
        with RNG_LOCK:
            state = source.get_state()
            self.states.append((device, state))
            if not overwrite:
                return func(*args, **kwargs)
            # The op fills an existing tensor (bernoulli_ under dropout, uniform_, normal_, ...): let it draw
            # from `source` (which moves on exactly as without rotor), then fill the tensor again from `state`
            # with a private generator. Its numbers are then those of `state` even if another thread drew
            # from `source` in between, and a replay from `state` is exact.
            func(*args, **kwargs)
            private = self.private.get(device)
            if private is None:
                private = self.private[device] = torch.Generator(device=device)
            private.set_state(state)
            return func(*args, **{**kwargs, "generator": private})


class ReplayRandom(TorchDispatchMode):
    """A recomputation: each random op draws from a private generator set to its first run's state."""

    def __init__(self, states: list[tuple[torch.device, torch.Tensor]], stage: str):
        super().__init__()
        self.states = iter(states)
        self.stage = stage
        self.private: dict[torch.device, torch.Generator] = {}

    def _next_state(self, device: torch.device) -> torch.Tensor:
        recorded = next(self.states, None)
        if recorded is None or recorded[0] != device:
            raise RuntimeError(
                f"stage {self.stage} draws different random numbers when recomputed than in its first run "
                "(its random ops depend on something other than its input); it cannot be recomputed exactly"
            )
        return recorded[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _SEEDED not in func.tags:
            return func(*args, **kwargs)
        device = _device(args, kwargs)
        state = self._next_state(device)
        op = _with_generator(func)
        if op is not None:
            private = self.private.get(device)
            if private is None:
                private = self.private[device] = torch.Generator(device=device)
            private.set_state(state)
            return op(*args, **{**kwargs, "generator": private})
        source = _source(kwargs, device)
        with RNG_LOCK:  # no generator argument anywhere: set the source, then put it back as it was
            now = source.get_state()
            source.set_state(state)
            try:
                return func(*args, **kwargs)
            finally:
                source.set_state(now)


class GeneratorWatch:
    """The default generators' states of some devices, to tell whether anything drew from them since.

    See NOTE: [quiet stages].
    """

    def __init__(self, devices: list[torch.device]):
        self.states = [(d, _default_generator(d).get_state()) for d in devices]

    def moved(self) -> bool:
        return any(not torch.equal(_default_generator(d).get_state(), state) for d, state in self.states)


def alone() -> bool:
    """Whether no other thread may draw while a generator is rewound: every other Python thread is a daemon.

    Daemon threads are a process's services (tqdm's monitor, TensorBoard's event writer, a
    DataLoader's pin-memory thread) and draw no random numbers; a thread that trains or
    samples is an ordinary thread, and its presence selects the exact per-op modes.
    """
    current = threading.current_thread()
    return all(t is current or t.daemon for t in threading.enumerate())


class Rewind:
    """A recomputation while `alone()` (NOTE: [alone]): no mode, the default generators rewound and put back.

    Rewinding is what torch.utils.checkpoint does; alone, it is exact and disturbs no one (the
    generators end where they were), and the stage runs with no Python dispatch per op.
    """

    def __init__(self, watch: GeneratorWatch):
        self.watch = watch
        self.now: list[tuple[torch.device, torch.Tensor]] = []

    def __enter__(self) -> Rewind:
        RNG_LOCK.acquire()
        self.now = [(d, _default_generator(d).get_state()) for d, _ in self.watch.states]
        for device, state in self.watch.states:
            _default_generator(device).set_state(state)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            for device, state in self.now:
                _default_generator(device).set_state(state)
        finally:
            RNG_LOCK.release()


class ReplayFrom(TorchDispatchMode):
    """A recomputation drawing, in order, from private generators set to the states a `GeneratorWatch` saw."""

    def __init__(self, watch: GeneratorWatch):
        super().__init__()
        self.private: dict[torch.device, torch.Generator] = {}
        for device, state in watch.states:
            self.private[device] = torch.Generator(device=device)
            self.private[device].set_state(state)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _SEEDED not in func.tags or kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        device = _device(args, kwargs)
        private = self.private.get(device)
        if private is None:
            private = self.private[device] = torch.Generator(device=device)
            private.set_state(_default_generator(device).get_state())
        op = _with_generator(func)
        if op is not None:
            return op(*args, **{**kwargs, "generator": private})
        source = _default_generator(device)
        with RNG_LOCK:
            now = source.get_state()
            source.set_state(private.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                private.set_state(source.get_state())
                source.set_state(now)
