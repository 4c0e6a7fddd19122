"""A profile's sizes are the model's and the sample's alone, whatever the process ran before.

NOTE: [cyclic garbage in profiles] (lightning_rotor/profile.py): a tensor kept by a reference cycle dies when
Python's collector runs, which depends on how many objects the process made before.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_rotor import Checkpointable
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.planner import min_feasible_budget

ROOT = Path(__file__).resolve().parents[1]


class Noted(nn.Module):
    """A block that keeps notes on its activation in objects referring to each other (a reference cycle)."""

    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        for _ in range(40):
            note = {"scaled": h * 2}
            note["note"] = note
        return torch.relu(h)


def sizes() -> tuple[dict, int]:
    """(the chain's size fields, its smallest feasible budget) of the noted model profiled on its first step."""
    torch.manual_seed(0)
    rotor = Checkpointable(nn.Sequential(*[Noted(64) for _ in range(4)]), mem_limit=10**9, repeats=1)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    rotor(x).square().mean().backward()
    fields = {k: v for k, v in rotor.chain.to_dict().items() if not k.endswith("_time")}
    return fields, min_feasible_budget(rotor.chain)


FRESH = "import json, torch; torch.set_num_threads(1); import test_profile_history as t; print(json.dumps(t.sizes()))"


def other_models(containers: int) -> None:
    """A GPT's training step through rotor, then `containers` objects made: what a process may run before."""
    torch.manual_seed(0)
    model = Checkpointable(gpt(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16), "60%", repeats=1)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    lm_loss(model(x), x).backward()
    made = [{} for _ in range(containers)]
    del made


@pytest.mark.slow  # a fresh process: about 10 s
def test_the_same_model_and_sample_profile_to_the_same_sizes_in_any_process():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-c", FRESH], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    fresh_fields, fresh_floor = json.loads(done.stdout)
    first = sizes()  # before the other models, in this process
    runs = [first]
    for containers in (200, 450, 650):
        other_models(containers)
        runs.append(sizes())
    for fields, floor in runs:
        assert fields == fresh_fields  # every size field
        assert floor == fresh_floor
