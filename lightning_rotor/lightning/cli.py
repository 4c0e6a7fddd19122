"""`lightning-rotor fit|validate|test|predict`: LightningCLI with rotor registered.

`main(argv)` takes the subcommand first (`["fit", "--config", "configs/quickstart.yaml"]`),
so `--trainer.strategy=rotor` and `--print_config` work as in any LightningCLI.
"""

from __future__ import annotations

import sys
import warnings

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI

import lightning_rotor.lightning  # noqa: F401  registers the "rotor*" strategy names
from lightning_rotor.budget import BudgetError
from lightning_rotor.chain import ChainError
from lightning_rotor.checkpointable import InfeasibleBudget


def main(argv: list[str] | None = None) -> int:
    """Run LightningCLI on `argv`; return the exit code (argparse exits become codes).

    Budget mistakes (unparsable, infeasible) end with one line on stderr, not a traceback.
    """
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
            )
    except (BudgetError, InfeasibleBudget, ChainError) as err:
        print(f"lightning-rotor: error: {err}", file=sys.stderr)
        return 1
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0
