"""`lightning-rotor`: one console script, several jobs.

`plan` and `bench` are plain argparse commands; `fit`, `validate`, `test` and
`predict` are LightningCLI. Each job's code lives in its own module and is
imported only when asked for, so `plan` starts fast.
"""

from __future__ import annotations

import sys

USAGE = """usage: lightning-rotor {plan,bench,fit,validate,test,predict} ...

  plan      plan a saved chain for a budget (lightning-rotor plan CHAIN.json --mem-limit 6GiB)
  bench     compare rotor with other checkpointing on a model (lightning-rotor bench --model resnet18)
  fit, validate, test, predict
            LightningCLI with rotor registered (lightning-rotor fit --config configs/quickstart.yaml)
"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from lightning_rotor.plan_cli import main as run
    elif command == "bench":
        from lightning_rotor.bench import main as run
    elif command in ("fit", "validate", "test", "predict"):
        from lightning_rotor.lightning.cli import main as run

        rest = argv
    else:
        print(
            f"lightning-rotor: unknown command {command!r}; commands: plan, bench, fit, validate, test, predict",
            file=sys.stderr,
        )
        return 2
    return run(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
