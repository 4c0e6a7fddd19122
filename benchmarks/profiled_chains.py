"""Every figure a first profile and a measured shape give, times left out: to compare two checkouts' profiles.

    PYTHONPATH=. python benchmarks/profiled_chains.py --out /tmp/a.json
    cd /path/to/other/checkout && PYTHONPATH=. python /this/checkout/benchmarks/profiled_chains.py --out /tmp/b.json
    cmp /tmp/a.json /tmp/b.json

The models of `benchmarks/profile_cost.py` (small GPT, Hugging Face GPT-2 and Llama, ConvNeXt-Atto, litgpt), each a
fresh `Checkpointable` (default settings, `"50%"`) taking its first step on shape A (discovery, a timed and traced
profile), then on shape B (a measured shape, or one derived from A's trace). Written per model and shape: every
field of the chain planned on except the measured times (`fwd_time`, `bwd_time`, an option's), the FLOP counts
taken, in order (by a profile's walk, `Profile.flops`, or by `shapes.stage_flops`: a checkout that counts by the
other gives the same file where both count the same), and each traced profile's storages and guards
(`size_trace.SizeTrace`, as `symbolic_sizes.ShapeLaws.add` gets it). A change that must leave every figure as it
was gives a byte-identical file; times are measured, so they are compared by `benchmarks/profile_cost.py`, not here.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profile_cost import CASES, add_test_models, plain_steps, timed_step  # noqa: E402

import lightning_rotor.chain_state as chain_state  # noqa: E402
import lightning_rotor.pipeline as pipeline  # noqa: E402
from lightning_rotor import Checkpointable  # noqa: E402
from lightning_rotor.size_trace import SizeTrace  # noqa: E402
from lightning_rotor.symbolic_sizes import ShapeLaws  # noqa: E402

TIMES = ("fwd_time", "bwd_time")


def _untimed(chain: dict[str, Any]) -> dict[str, Any]:
    """A chain's fields without its measured times (an option's too)."""
    out = {k: v for k, v in chain.items() if k not in TIMES}
    if "options" in out:
        out["options"] = [[{k: v for k, v in o.items() if k not in TIMES} for o in opts] for opts in out["options"]]
    return out


class Recorder:
    """What the profiles of one step counted: FLOPs per profile that counted them in its walk and per call of
    `stage_flops`, and each trace `ShapeLaws.add` got."""

    def __init__(self) -> None:
        self.flops: list[Any] = []
        self.traces: list[Any] = []
        counted, add, profiled = chain_state.stage_flops, ShapeLaws.add, pipeline.profile_chain

        def stage_flops(*args: Any) -> Any:
            found = counted(*args)
            self.flops.append(found)
            return found

        def profile_chain(*args: Any, **kwargs: Any) -> Any:
            found = profiled(*args, **kwargs)
            if getattr(found, "flops", None) is not None:  # counted in the walk (a checkout that does)
                self.flops.append(found.flops)
            return found

        def law_add(laws: ShapeLaws, family: str, dims: Any, trace: Any, chain: Any, flops: Any) -> Any:
            if trace is not None:
                storages = [[s.itemsize, list(s.factors)] for s in trace.storages]
                if isinstance(trace, SizeTrace):
                    guards = [[list(t.items()), c, op, r] for t, c, op, r in trace.guards]  # in order
                    entry = {"storages": storages, "guards": guards, "abandoned": trace.abandoned}
                    if hasattr(trace, "peaks"):  # its peak variables (a checkout that has them)
                        entry["peaks"] = [
                            [list(top.items()), [list(r.items()) for r in rises]] for top, rises in trace.peaks
                        ]
                    self.traces.append(entry)
                else:  # a numbered shape (`StorageNumbers`): its storages only
                    self.traces.append({"storages": storages})
            return add(laws, family, dims, trace, chain, flops)

        chain_state.stage_flops = stage_flops  # type: ignore[assignment]
        pipeline.profile_chain = profile_chain  # type: ignore[assignment]
        ShapeLaws.add = law_add  # type: ignore[method-assign]

    def take(self) -> dict[str, Any]:
        taken = {"flops": self.flops, "traces": self.traces}
        self.flops, self.traces = [], []
        return taken


def model_chains(name: str, budget: str, recorder: Recorder) -> dict[str, Any]:
    plain, loss, a, b = CASES[name]()
    plain_steps(plain, loss, a, 1)
    rotor = Checkpointable(copy.deepcopy(plain), budget)
    opt = torch.optim.SGD(rotor.parameters(), lr=0.0)
    found: dict[str, Any] = {}
    for label, x in (("A", a), ("B", b)):
        recorder.take()
        timed_step(rotor, loss, x, opt)
        entry = rotor.chain_state.last_entry
        assert entry is not None
        found[label] = {"chain": _untimed(entry.chain.to_dict()), **recorder.take()}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--budget", default="50%")
    args = parser.parse_args()
    torch.set_num_threads(1)
    add_test_models()
    warnings.filterwarnings("ignore")
    recorder = Recorder()
    out = {name: model_chains(name, args.budget, recorder) for name in args.models}
    Path(args.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
