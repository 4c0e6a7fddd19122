"""One config: every rotor setting is declared once (`RotorConfig`), accepted by every entry point (Checkpointable,
wrap(), the Trainer strategies, the Fabric strategy), as keyword arguments or as `config=`, and arrives in the
Checkpointables they build."""

from __future__ import annotations

import dataclasses
import inspect
import os

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from fitting import classes_loader, quiet_trainer
from lightning.fabric import Fabric
from lightning.fabric.strategies import SingleDeviceStrategy as FabricSingleDevice
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy
from torch import nn

from lightning_rotor import Checkpointable, RotorConfig
from lightning_rotor.config import DEFAULTS, FIELDS
from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorDDPStrategy, RotorModelParallelStrategy, RotorStrategy
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.lightning.wrap import wrap
from lightning_rotor.shared_budget import Budget


class Block(nn.Module):
    def __init__(self, out: int = 12):
        super().__init__()
        self.linear = nn.Linear(12, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def chain(out: int = 12) -> nn.Sequential:
    return nn.Sequential(Block(), Block(), Block(), Block(out))


class Task(pl.LightningModule):
    """Two chains, `a` and `b`, four blocks each."""

    def __init__(self):
        super().__init__()
        self.a, self.b = chain(), chain(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


# Every field: a value other than its default, the group of settings it is given in (some exclude each other),
# and what the Checkpointable(s) built from it show. `chains` are the wrapped chains by name.
def _host_limit(chains: dict[str, Checkpointable]) -> bool:
    return all(r.host_limit == 2**20 // len(chains) for r in chains.values())


WALK = {
    "mem_limit": ("a", "37%", lambda r, chains: r.mem_limit == "37%"),
    "include": ("a", ["a"], lambda r, chains: list(chains) == ["a"]),
    "exclude": ("b", ["b"], lambda r, chains: list(chains) == ["a"]),
    "discover": ("a", "graph", lambda r, chains: r.discover == "graph"),
    "checkpoint_modules": ("a", ["Block"], lambda r, chains: r.checkpoint_modules == (Block,)),
    "slots": ("a", 7, lambda r, chains: r.slots == 7),
    "loss_fn": ("a", loss, lambda r, chains: r.loss_fn is loss),
    "loss_tmp": ("b", 64, lambda r, chains: r.loss_tmp == 64),
    "repeats": ("a", 2, lambda r, chains: r.repeats == 2),
    "warmup": ("a", 1, lambda r, chains: r.warmup == 1),
    "fallback_plain": ("a", False, lambda r, chains: r.fallback_plain is False),
    "compile": ("a", {"backend": "eager"}, lambda r, chains: r.compiler is not None),
    "derive_shapes": ("a", False, lambda r, chains: r.derive_shapes is False),
    "predict_shapes": ("a", True, lambda r, chains: r.predict_shapes is True),
    "fit_shapes": ("a", True, lambda r, chains: r.fit_shapes is True),
    "shape_buckets": ("a", {1: [8]}, lambda r, chains: r.shape_buckets == {1: (8,)}),
    "options": ("a", True, lambda r, chains: r.options is True),
    "offload": ("a", "12GB/s", lambda r, chains: r.offload == "12GB/s" and r.bandwidth == 12e9),
    "host_limit": ("b", "1MiB", lambda r, chains: _host_limit(chains)),
    "early_stop": ("a", True, lambda r, chains: r.early_stop is True),
}
GROUPS = {group: {name: value for name, (g, value, _) in WALK.items() if g == group} for group in ("a", "b")}
GROUPS["b"].update(include=["a", "b"], offload=True)  # Fabric wraps the set-up module whole without include=


def test_the_walk_covers_every_setting():
    assert sorted(WALK) == sorted(FIELDS)


def _checkpointable(arguments: dict) -> dict[str, Checkpointable]:
    return {"": Checkpointable(chain(), **arguments)}


def _wrap(settings: dict) -> dict[str, Checkpointable]:
    task = Task()
    return {w.name: w.rotor for w in wrap(task, **settings)[0]}


class Keep(pl.Callback):
    def on_fit_start(self, trainer, pl_module):
        self.chains = rotor_modules(pl_module)


def _trainer(strategy: pl.strategies.Strategy, tmp_path) -> dict[str, Checkpointable]:
    """The chains a fit of no step wraps (one process: DDP's group and environment are put back as they were)."""
    keep, environ, grouped = Keep(), dict(os.environ), dist.is_initialized()
    try:
        quiet_trainer(tmp_path, strategy, max_steps=0, callbacks=[keep]).fit(Task(), classes_loader())
    finally:
        if dist.is_initialized() and not grouped:
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)
    return keep.chains


def _fabric(strategy: RotorFabricStrategy) -> dict[str, Checkpointable]:
    Fabric(strategy=strategy, accelerator="cpu", devices=1).setup_module(Task())
    return strategy.chains


def _for_checkpointable(settings: dict) -> dict:
    """A Checkpointable wraps the module it is given (no include / exclude) and takes block classes, not names."""
    kept = {k: v for k, v in settings.items() if k not in ("include", "exclude")}
    if "checkpoint_modules" in kept:
        kept["checkpoint_modules"] = [Block]
    return kept


ENTRIES = {
    "Checkpointable": lambda settings, tmp: _checkpointable(settings),
    "wrap": lambda settings, tmp: _wrap(settings),
    "RotorStrategy": lambda settings, tmp: _trainer(RotorStrategy(**settings), tmp),
    "RotorDDPStrategy": lambda settings, tmp: _trainer(RotorDDPStrategy(**settings), tmp),
    "RotorFabricStrategy": lambda settings, tmp: _fabric(RotorFabricStrategy(**settings)),
}


@pytest.mark.parametrize("form", ["keywords", "config"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_every_setting_reaches_the_checkpointables_of_every_entry(entry, form, tmp_path):
    """Each setting given to each entry point, as a keyword argument or in `config=`, is what the Checkpointable(s)
    it builds hold; wrap() builds each complete: under a Trainer strategy the budget is shared, under DDP
    `distributed` is set, before any training call."""
    for group, settings in GROUPS.items():
        given = _for_checkpointable(settings) if entry == "Checkpointable" else settings
        arguments = {"config": RotorConfig(**given)} if form == "config" else given
        chains = ENTRIES[entry](arguments, tmp_path / group)
        assert chains, f"{entry} wrapped nothing with {settings}"
        for name, (g, _, arrived) in WALK.items():
            if g != group or (entry == "Checkpointable" and name in ("include", "exclude")):
                continue
            assert all(arrived(r, chains) for r in chains.values()), f"{name} did not reach {entry}'s chains"
        assert all(r.distributed == (entry == "RotorDDPStrategy") for r in chains.values())
        if entry != "Checkpointable":
            assert all(isinstance(r.shared, Budget) and r.shared_name == n for n, r in chains.items())


def _rotor_parameters(cls: type, *own: type | str) -> dict[str, inspect.Parameter]:
    """`cls.__init__`'s parameters less `self`, `config=`, `**kwargs` and those of the classes or names in `own`."""
    others = {"self", "config", "kwargs"}
    for item in own:
        others |= set(inspect.signature(item.__init__).parameters) if isinstance(item, type) else {item}
    return {n: p for n, p in inspect.signature(cls.__init__).parameters.items() if n not in others}


@pytest.mark.parametrize(
    ("cls", "own", "leaves_out"),
    [
        (RotorStrategy, (SingleDeviceStrategy,), ()),
        (RotorDDPStrategy, (DDPStrategy,), ()),
        (RotorModelParallelStrategy, (ModelParallelStrategy,), ()),
        (RotorFabricStrategy, (FabricSingleDevice, "measure_every_n_steps", "print_summary"), ()),
        (Checkpointable, ("module", "stages", "shared", "shared_name", "distributed"), ("include", "exclude")),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_signatures_list_exactly_the_config_fields_with_its_defaults(cls, own, leaves_out):
    """The keyword arguments an entry point declares beside its own are RotorConfig's fields, with RotorConfig's
    defaults, so they cannot drift (`RotorDDPStrategy` lacked `shape_buckets` and `predict_shapes`)."""
    parameters = _rotor_parameters(cls, *own)
    assert sorted(parameters) == sorted(set(FIELDS) - set(leaves_out))
    assert {n: p.default for n, p in parameters.items()} == {n: DEFAULTS[n] for n in parameters}
    assert "config" in inspect.signature(cls.__init__).parameters


def test_config_is_frozen_checked_and_normalised_once():
    config = RotorConfig(mem_limit="50%", include=["a"], shape_buckets={1: [64, 32]}, checkpoint_modules=["Block"])
    assert config.include == ("a",) and config.shape_buckets == {1: (32, 64)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mem_limit = 0.3  # type: ignore[misc]
    assert config.replace(options=True).options is True and config.options is False
    with pytest.raises(ValueError, match="shape_buckets takes"):
        config.replace(shape_buckets=[32])  # a copy is checked again
    for bad, message in [
        (dict(warmup=-1), "warmup must be an integer >= 0, got -1"),
        (dict(include="body"), "include must be a list of submodule names"),  # not read letter by letter
        (dict(exclude="body"), "exclude must be a list of submodule names"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message) as err:
            RotorConfig(**bad)
        assert "\n" not in str(err.value)


def test_config_and_keywords_at_once_are_refused_in_one_line():
    config = RotorConfig(mem_limit="50%")
    for make in (
        lambda: RotorStrategy(config=config, options=True),
        lambda: RotorFabricStrategy(config=config, options=True),
        lambda: Checkpointable(chain(), config=config, options=True),
        lambda: wrap(Task(), config=config, options=True),
    ):
        with pytest.raises(ValueError, match="not both: options given beside config=") as err:
            make()
        assert "\n" not in str(err.value)
    assert RotorStrategy(config=config, options=False).config is config  # a default beside config= is no conflict
    with pytest.raises(TypeError, match="unknown setting"):
        wrap(Task(), budget="50%")


def test_a_checkpointable_refuses_what_only_wrap_uses():
    with pytest.raises(ValueError, match="include= and exclude= choose the submodules wrap"):
        Checkpointable(chain(), config=RotorConfig(include=["0"]))
    with pytest.raises(ValueError, match="shared_name='x' is none of the shared budget's chains"):
        Checkpointable(chain(), shared=Budget("50%", ["a"]), shared_name="x")


def test_strategies_read_their_settings_as_attributes():
    strategy = RotorDDPStrategy(mem_limit="50%", predict_shapes=True)
    assert strategy.mem_limit == "50%" and strategy.predict_shapes is True and strategy.config.predict_shapes
    with pytest.raises(AttributeError):
        strategy.no_such_setting  # noqa: B018
