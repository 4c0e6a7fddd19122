"""The chains graph discovery finds, logged and compared: a change that must keep every chain can be checked on main.

Log every `trace_chain` result of a test run (stage names, what crosses each cut, guards, the blocks kept whole or
traced into, each stage's generated code), one JSON line per discovery, then compare two logs:

    export LIGHTNING_ROTOR_TEST_MODELS=/work/main/.models
    CHAINS_LOG=/tmp/a.jsonl PYTHONPATH=.:benchmarks python -m pytest -q -p discovered_chains tests/test_discovery*.py
    (the same in another checkout, CHAINS_LOG=/tmp/b.jsonl)
    python benchmarks/discovered_chains.py /tmp/a.jsonl /tmp/b.jsonl

Discoveries are matched by test id and order within the test; the checkouts' paths (in guards' file:line) are
left out of the comparison.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import defaultdict
from typing import Any


def _log_chains(path: str) -> None:
    """Wrap `trace_chain` as "auto" and "graph" discovery call it, appending each chain to `path`."""
    import lightning_rotor.discovery as discovery

    original = discovery.trace_chain

    def logged(module: Any, bound: Any, **options: Any) -> Any:
        chain = original(module, bound, **options)
        record = {
            "test": os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0],
            "model": type(module).__name__,
            "names": chain.names,
            "cuts": chain.cuts,
            "guards": chain.guards,
            "leaves": chain.leaves,
            "floor_split": chain.floor_split,
            "stage_modules": chain.stage_modules,
            "code": [str(getattr(stage, "code", "")) for stage in chain.stages],
        }
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return chain

    discovery.trace_chain = logged


if os.environ.get("CHAINS_LOG") and __name__ != "__main__":  # loaded as a pytest plugin
    _log_chains(os.environ["CHAINS_LOG"])


def _load(path: str) -> dict[str, list[dict[str, Any]]]:
    by_test: dict[str, list[dict[str, Any]]] = defaultdict(list)
    with open(path) as f:
        for line in f:
            line = re.sub(r"/[^'\" ]*?/(lightning_rotor|tests|benchmarks)/", r"<checkout>/\1/", line)
            record = json.loads(line)
            by_test[record["test"]].append(record)
    return by_test


def main() -> None:
    a, b = _load(sys.argv[1]), _load(sys.argv[2])
    common = [t for t in a if t in b]
    differ = [t for t in common if a[t] != b[t]]
    stages = sum(len(r["names"]) for t in common for r in a[t])
    split = sum(1 for t in common for r in a[t] if r["floor_split"])
    print(
        f"{sum(len(a[t]) for t in common)} discoveries in {len(common)} tests compared ({stages} stages, {split} "
        f"floor splits); in one log only: {sorted(set(a) ^ set(b))}; differing: {len(differ)}"
    )
    for t in differ:
        print("  differs:", t)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
