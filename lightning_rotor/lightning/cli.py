"""`lightning-rotor fit|validate|test|predict`: LightningCLI with rotor registered.

`main(argv)` takes the subcommand first (`["fit", "--config", "configs/quickstart.yaml"]`),
so `--trainer.strategy=rotor` and `--print_config` work as in any LightningCLI.

The strategy names work wherever a strategy is written: `strategy: rotor`,
`strategy: {class_path: rotor, init_args: {mem_limit: 50%}}`, `--trainer.strategy=rotor`
followed by `--trainer.strategy.mem_limit=50%`. jsonargparse knows classes, not
Lightning's strategy names, so a name of ours is turned into its class path as
configs and arguments are read. A rotor setting the strategy refuses (a budget, an `offload=` rate, a
`discover=` method, ...: `RotorConfig`'s checks) is reported in one line.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, NoReturn

import lightning.pytorch as pl
from jsonargparse import get_loader, set_loader
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_rotor.lightning  # noqa: F401  registers the "rotor*" strategy names
from lightning_rotor.budget import ACCEPTED, BANDWIDTH_ACCEPTED, BudgetError
from lightning_rotor.chain import ChainError
from lightning_rotor.planner import InfeasibleBudget

SUBCOMMANDS = ("fit", "validate", "test", "predict")
LOADER = "rotor_yaml"
STRATEGY_NAMES: dict[str, tuple[str, dict[str, Any]]] = {
    "rotor": ("lightning_rotor.lightning.RotorStrategy", {}),
    "rotor_ddp": ("lightning_rotor.lightning.RotorDDPStrategy", {}),
    "rotor_ddp_spawn": ("lightning_rotor.lightning.RotorDDPStrategy", {"start_method": "spawn"}),
}


def expand_strategy(value: Any) -> Any:
    """`rotor` or `{class_path: rotor, ...}` as `{class_path: lightning_rotor..., init_args: ...}`; others as given."""
    if isinstance(value, str) and value in STRATEGY_NAMES:
        path, init_args = STRATEGY_NAMES[value]
        return {"class_path": path, "init_args": dict(init_args)}
    if isinstance(value, dict) and value.get("class_path") in STRATEGY_NAMES:
        path, init_args = STRATEGY_NAMES[value["class_path"]]
        return {**value, "class_path": path, "init_args": {**init_args, **(value.get("init_args") or {})}}
    return value


def _load_config(stream: str) -> Any:
    data = get_loader("yaml")(stream)
    trainer = data.get("trainer") if isinstance(data, dict) else None
    if isinstance(trainer, dict) and "strategy" in trainer:
        trainer["strategy"] = expand_strategy(trainer["strategy"])
    return data


def expand_argv(argv: list[str]) -> list[str]:
    """`--trainer.strategy=rotor` (or `--trainer.strategy rotor`) as the class path when nested options follow.

    Alone, the name stays a name (Lightning resolves it); jsonargparse would keep a bare class path as a string.
    """
    if not any(arg.startswith("--trainer.strategy.") for arg in argv):
        return list(argv)
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key == "--trainer.strategy" and not eq:
            value = next(it, "")
        if key == "--trainer.strategy" and value in STRATEGY_NAMES:
            path, init_args = STRATEGY_NAMES[value]
            out.append(f"--trainer.strategy={path}")
            out += [f"--trainer.strategy.{k}={v}" for k, v in init_args.items()]
        elif key == "--trainer.strategy" and not eq:
            out += [arg, value] if value else [arg]
        else:
            out.append(arg)
    return out


def budget_line(message: str) -> str | None:
    """Rotor's one-line message inside jsonargparse's report, if that is what it reports: a setting the strategy
    refused (a line of the report's "Errors:" list other than a type mismatch), or a budget, bandwidth or host
    limit it could not parse."""
    lines = [line.strip(" -") for line in message.splitlines()]
    if "class_path='lightning_rotor." in message:  # our strategy, instantiated: its own error is listed
        listed = [line.strip(" -") for line in message.splitlines() if line.startswith("  - ")]
        refused = [line for line in listed if not line.startswith("Expected a")]
        if refused:
            return refused[0]
    return next(
        (
            line
            for line in lines
            if not line.startswith("Given value")  # jsonargparse's dump of every argument
            and (ACCEPTED in line or BANDWIDTH_ACCEPTED in line or "host_limit=" in line or "host limit" in line)
        ),
        None,
    )


class RotorArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, but a budget it cannot parse ends in our one-line message."""

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        ours = budget_line(message)
        if ours is not None:
            print(f"lightning-rotor: error: {ours}", file=sys.stderr)
            sys.exit(2)
        super().error(message, ex)


def main(argv: list[str] | None = None) -> int:
    """Run LightningCLI on `argv`; return the exit code (argparse exits become codes).

    Budget mistakes (unparsable, infeasible) end with one line on stderr, not a traceback.
    """
    set_loader(LOADER, _load_config)
    argv = expand_argv(list(sys.argv[1:] if argv is None else argv))
    try:
        with warnings.catch_warnings():
            # argv is the command line here, even when called from Python with sys.argv set
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
            LightningCLI(
                pl.LightningModule,
                pl.LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=argv,
                save_config_kwargs={"overwrite": True},
                auto_configure_optimizers=False,
                parser_class=RotorArgumentParser,
                parser_kwargs={"parser_mode": LOADER, **{c: {"parser_mode": LOADER} for c in SUBCOMMANDS}},
            )
    except (BudgetError, InfeasibleBudget, ChainError) as err:
        print(f"lightning-rotor: error: {err}", file=sys.stderr)
        return 1
    except ValueError as err:  # jsonargparse instantiating the strategy wraps our BudgetError in its report
        ours = budget_line(str(err))
        if ours is None:
            raise
        print(f"lightning-rotor: error: {ours}", file=sys.stderr)
        return 1
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
