"""FSDP2 (`fully_shard`) is refused in one line, in either order, over a real 2-process gloo group.

rotor does not compose with FSDP2 yet (docs/sharded.md); without the refusal a sharded
GPT fails with torch's "mixed torch.Tensor and DTensor" or with a ChainDiverged naming
no FSDP at all.
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import fully_shard

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.fabric import RotorFabricStrategy
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.models.gpt import gpt, lm_loss


def _loop_gpt():
    from lightning_rotor.bench.any_models import GPT

    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    return model, model.transformer.h


def _seq_gpt():
    torch.manual_seed(0)
    model = gpt(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    return model, model.blocks


def _shard(model, blocks) -> None:
    for block in blocks:
        fully_shard(block)
    fully_shard(model)


def _first_step_error(build, rotor_first: bool) -> str:
    model, blocks = build()
    if rotor_first:
        rotor = Checkpointable(model, mem_limit=0.5)
        _shard(model, blocks)
    else:
        _shard(model, blocks)
        rotor = Checkpointable(model, mem_limit=0.5)
    data = torch.randint(32, (2, 9), generator=torch.Generator().manual_seed(0))
    try:
        lm_loss(rotor(data[:, :-1]), data[:, 1:]).backward()
    except Exception as err:  # what each process saw, checked by the test
        return f"{type(err).__name__}: {err}"
    return "no error"


def _worker(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    seen = [_first_step_error(build, first) for build in (_seq_gpt, _loop_gpt) for first in (True, False)]
    dist.destroy_process_group()
    with open(f"{store}.rank{rank}", "w") as f:
        f.write("\n".join(seen))


@pytest.mark.slow  # two spawned processes
def test_fully_sharded_model_is_refused_in_one_line_in_either_order():
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(store,), nprocs=2)
    for rank in (0, 1):
        with open(f"{store}.rank{rank}") as f:
            seen = f.read().split("\n")
        assert len(seen) == 4
        for line in seen:
            assert line.startswith("NotImplementedError: rotor does not support FSDP2 yet"), line
            assert "without rotor" in line and "DDP" in line, line


@pytest.mark.parametrize("strategy", [RotorStrategy, RotorFabricStrategy])
def test_several_devices_name_fsdp2_as_not_supported_yet(strategy):
    with pytest.raises(ValueError, match="FSDP2 is not supported yet"):
        strategy().parallel_devices = [torch.device("cpu"), torch.device("cpu")]
