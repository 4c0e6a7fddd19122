"""`PlanCache`: one chain's profiles and plans, keyed by call signature.

A training call is planned once per *plan key*: the input's signature (pytree structure,
shapes, dtypes, devices, `requires_grad`, autocast state) and, when some stage parameters
are frozen, which ones. Each key holds an `Entry` (profile, plan within the chain's whole
budget, runner). A call made while other calls of its step are pending runs a plan of the
same chain at a smaller budget (lightning_rotor/calls.py); those are kept here too, per
(key, budget), with the figures the step planning reads.

`state_dict()` is plain data (lists, dicts, strings, numbers) so checkpoints load with
`weights_only=True`; stage fingerprints tell a saved plan of these very stages from one of
another model whose stage names happen to match. Each saved entry says whether its times were
derived (by FLOPs from another shape's, `times_derived`) rather than measured, so that after a
load such a shape is still checked against its training steps (lightning_rotor/shapes.py,
`ShapeTimes`); a state saved before the flag existed loads as timed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_rotor import pipeline
from lightning_rotor._torch_compat import tree_flatten
from lightning_rotor.calls import call_figures, step_budgets
from lightning_rotor.chain import Chain
from lightning_rotor.pipeline import Entry
from lightning_rotor.planner import Plan, min_feasible_budget
from lightning_rotor.profile import Profile
from lightning_rotor.stages import side_inputs

__all__ = ["PlanCache", "plan_key", "signature", "stage_fingerprints"]


def signature(value: Any, shapes: bool = True) -> str:
    """What makes a new profile necessary: shapes, dtypes, devices, grad flags, autocast (a string key).

    `shapes=False`: each tensor's rank instead of its shape, the key of a family of shapes.
    """
    flat, spec = tree_flatten(value)
    leaves = tuple(
        (tuple(t.shape) if shapes else t.dim(), t.dtype, str(t.device), t.requires_grad)
        if isinstance(t, torch.Tensor)
        else repr(t)
        for t in flat
    )
    autocast = tuple(
        (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in ("cpu", "cuda")
        if d == "cpu" or torch.cuda.is_available()
    )
    return repr((str(spec), leaves, autocast))


def plan_key(value: Any, trainable: Sequence[bool], shapes: bool = True, side: Sequence[str] = ()) -> str:
    """The input's signature, and which stage parameters are frozen when some are.

    Freezing or unfreezing parameters changes what the stages save and the frozen prefix
    (chain version 4), so a plan is made for each pattern: unfreezing layers mid-training
    profiles and plans again. With every parameter trainable the key is the signature alone.
    `trainable`: the stage parameters' `requires_grad`, in order. `side`: the names a module-level
    chain's stages record as side outputs (router logits), which their values then carry.
    """
    key = signature(value, shapes)
    if side:
        key = f"{key} side={','.join(side)}"
    if all(trainable):
        return key
    return f"{key} requires_grad={''.join('1' if f else '0' for f in trainable)}"


def stage_fingerprints(stages: Sequence[nn.Module]) -> list[str]:
    """A short digest per stage of its module types and parameter/buffer names, shapes and dtypes.

    Cheap (no forward); it tells a saved plan of this very chain from one of
    another model whose stage count or names happen to match.
    """
    prints = []
    for stage in stages:
        parts = [type(m).__qualname__ for m in stage.modules()]
        tensors = [*stage.named_parameters(), *stage.named_buffers()]
        parts += [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in tensors]
        prints.append(hashlib.sha1(repr(parts).encode()).hexdigest()[:16])
    return prints


class PlanCache:
    """Profiles and plans of one chain's stages, per plan key; per (key, budget) for calls after others."""

    def __init__(
        self, stages: Sequence[nn.Module], names: Sequence[str], slots: int | None = None, early_stop: bool = True
    ) -> None:
        self.stages = list(stages)
        self.sides = side_inputs(stages)  # tensors every stage reads besides its input (a `Stages`' only)
        # runners recompute with early stop where sound (`ops.early_pairs`, `execute.early_stage`)
        self.early_stop = early_stop
        self.names = list(names)
        self.slots = slots
        self.entries: dict[str, Entry] = {}  # per key: the plan for the chain's whole budget
        # keys whose times were derived, not measured (`add`, a load): the one record, which `ShapeTimes` reads
        self.times_derived: set[str] = set()
        self.input_uses: list[int] = []  # as measured last (`Profile.input_uses`), for entries planned on a bound
        self.forget_call_plans()

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, key: str) -> Entry:
        return self.entries[key]

    def add(self, key: str, entry: Entry) -> Entry:
        """`entry` for `key`; a profile with no timing rounds has its times derived (the profiler times every
        shape it times with one round at least)."""
        self.entries[key] = entry
        if entry.profile.repeats == 0:
            self.times_derived.add(key)
        else:
            self.times_derived.discard(key)
        return entry

    def forget(self, key: str) -> None:
        """`key`'s entry dropped (profiled again when next met); call `forget_call_plans` after."""
        self.entries.pop(key, None)
        self.times_derived.discard(key)

    def build(self, measured: Profile, chosen: Plan) -> Entry:
        """An entry of these stages running `chosen`; a profile that did not measure stage 0's input uses (a
        chain bounding a new shape's, `shapes.predicted_chain`) gets those measured last: the same stage 0."""
        if measured.input_uses:
            self.input_uses = list(measured.input_uses)
        uses = measured.input_uses or self.input_uses
        return Entry(
            measured,
            chosen,
            pipeline.runner(
                self.stages,
                measured.chain,
                chosen,
                self.names,
                early_stop=self.early_stop,
                sides=self.sides,
                input_uses=uses,
            ),
        )

    # -- the whole budget changed ----------------------------------------------------------------
    def replanned(self, budget: int | Callable[[str, Chain], int]) -> dict[str, Entry]:
        """Every key planned again for `budget` bytes, or `budget(key, chain)` bytes per key (profiles
        kept), not stored yet: raises `InfeasibleBudget` before anything changes when some chain cannot meet it."""
        nbytes = {key: budget(key, e.chain) if callable(budget) else budget for key, e in self.entries.items()}
        chosen = {key: pipeline.plan_chain(e.chain, nbytes[key], self.slots) for key, e in self.entries.items()}
        return {key: self.build(self.entries[key].profile, p) for key, p in chosen.items()}

    # -- calls after other calls of the step (lightning_rotor/calls.py) -----------------------------
    def forget_call_plans(self) -> None:
        """Plans of calls after others are made again (the budget or the profiles changed)."""
        self._plans: dict[tuple[str, int], Plan] = {}
        self._call_entries: dict[tuple[str, int], Entry] = {}
        self._held: dict[tuple[str, int], tuple[int, int]] = {}
        self._smallest: dict[str, int] = {}
        self.step_budgets: dict[tuple[tuple[str, ...], int | None], list[int] | None] = {}

    def smallest(self, key: str) -> int:
        """The smallest feasible budget of `key`'s chain (found once)."""
        if key not in self._smallest:
            self._smallest[key] = min_feasible_budget(self.entries[key].chain)
        return self._smallest[key]

    def smallest_of(self, keys: Sequence[str]) -> dict[str, int]:
        return {k: self.smallest(k) for k in keys}

    def plan_at(self, key: str, budget: int) -> Plan:
        primary = self.entries[key]
        if budget == primary.plan.budget:
            return primary.plan
        if (key, budget) not in self._plans:
            self._plans[(key, budget)] = pipeline.plan_chain(primary.chain, budget, self.slots)
        return self._plans[(key, budget)]

    def call_figures(self, key: str, budget: int) -> tuple[int, int]:
        """(bytes held while pending, peak of the backward part) of the plan for `key` at `budget` (once)."""
        if (key, budget) not in self._held:
            self._held[(key, budget)] = call_figures(self.entries[key].chain, self.plan_at(key, budget).ops)
        return self._held[(key, budget)]

    def figures(self, key: str, budget: int) -> tuple[int, int, float]:
        """(bytes held while pending, peak, seconds) of the plan for `key` at `budget` (planned if new)."""
        chosen = self.plan_at(key, budget)
        return self.call_figures(key, budget)[0], chosen.peak, chosen.time

    def entry_at(self, key: str, budget: int) -> Entry:
        """The entry of `key` that runs its plan at `budget` (the whole-budget one when that is it)."""
        if (key, budget) not in self._call_entries:
            self._call_entries[(key, budget)] = self.build(self.entries[key].profile, self.plan_at(key, budget))
        return self._call_entries[(key, budget)]

    def learned_budgets(self, structure: tuple[str, ...], budget: int | None, tried: list[int]) -> list[int] | None:
        """The budgets of a step of `structure`'s calls within `budget` (`calls.step_budgets`), once."""
        cache_key = (structure, budget)
        if cache_key not in self.step_budgets:
            if budget is None or any(sig not in self.entries for sig in structure):
                return None
            self.step_budgets[cache_key] = step_budgets(
                structure, budget, self.smallest_of(structure), self.figures, tried
            )
        return self.step_budgets[cache_key]

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Stage names, fingerprints and, per key, the chain and plan as plain data."""
        return {
            "stage_names": list(self.names),
            "fingerprints": stage_fingerprints(self.stages),
            "entries": [
                {
                    "signature": key,
                    "chain": e.chain.to_dict(),
                    "plan": e.plan.to_dict(),
                    "profile_seconds": e.profile.seconds,
                    "fwd_spread": e.profile.fwd_spread,
                    "bwd_spread": e.profile.bwd_spread,
                    "repeats": e.profile.repeats,
                    "round_seconds": e.profile.round_seconds,
                    "input_uses": e.profile.input_uses,
                    "threads": e.profile.threads,
                    "times_derived": key in self.times_derived,
                }
                for key, e in self.entries.items()
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Reuse saved profiles and plans: keys saved skip profiling.

        The saved stages must be these stages (same names, module types, parameter
        and buffer shapes and dtypes, see `stage_fingerprints`): a plan made for
        another model would break the budget. On any mismatch nothing is loaded and
        a one-line ValueError says why.
        """
        self._check_saved_stages(state)
        entries, derived = {}, set()
        for i, item in enumerate(state.get("entries", [])):
            chain = Chain.from_dict(item["chain"])
            if chain.length != len(self.stages) or list(chain.names) != self.names:
                raise ValueError(
                    f"saved plan is for a chain of {chain.length} stages {list(chain.names)[:4]}..., but this module "
                    f"has {len(self.stages)} stages {self.names[:4]}...; nothing loaded"
                )
            measured = Profile(
                chain,
                float(item.get("profile_seconds", 0.0)),
                list(item.get("fwd_spread", [])),
                list(item.get("bwd_spread", [])),
                repeats=int(item.get("repeats", 0)),
                round_seconds=[float(t) for t in item.get("round_seconds", [])],
                threads=int(item.get("threads", 0)),
                input_uses=[int(n) for n in item.get("input_uses", [])],
            )
            key = str(item["signature"])
            entries[key] = self.build(measured, Plan.from_dict(item["plan"]))
            if _times_derived(item, i):
                derived.add(key)
        self.entries.update(entries)
        self.times_derived = (self.times_derived - entries.keys()) | derived
        self.forget_call_plans()

    def _check_saved_stages(self, state: dict[str, Any]) -> None:
        names, prints = state.get("stage_names"), state.get("fingerprints")
        if names is None or prints is None:
            raise ValueError("saved plan state has no stage fingerprints (an older release made it); nothing loaded")
        if list(names) != self.names:
            raise ValueError(
                f"saved plan is for stages {list(names)[:4]}..., but this module has {self.names[:4]}...; "
                "nothing loaded"
            )
        ours = stage_fingerprints(self.stages)
        differ = [n for n, a, b in zip(self.names, prints, ours, strict=True) if a != b]
        if differ:
            raise ValueError(
                f"saved plan is for other stages: {', '.join(differ[:4])} differ in module types or "
                "parameter/buffer shapes or dtypes; nothing loaded"
            )


def _times_derived(item: dict[str, Any], i: int) -> bool:
    """A saved entry's `times_derived` flag: absent (a state saved before it existed) means timed."""
    flag = item.get("times_derived", False)
    if not isinstance(flag, bool):
        raise ValueError(
            f"saved plan state: entries[{i}].times_derived is {flag!r}, not true or false "
            f"(for input {item.get('signature')!r}); nothing loaded"
        )
    return flag
