"""`RotorModelParallelStrategy` (Lightning's ModelParallelStrategy, FSDP2) over a real 2-process gloo group.

The LightningModule's `configure_model` shards as Lightning documents (each block, then the model) without
checkpointing; the strategy wrapped the model in a `Checkpointable` before. One spawn runs FSDP2 alone and
rotor on both ranks (each process is a Lightning rank launched externally, as torchrun would launch it):
3 AdamW steps saved as a distributed checkpoint, then resumed from it to 6. The local parameter shards must
be torch.equal after 3 steps and after the resumed run, and the ranks' plans the same. rotor's first fit logs
to TensorBoard (`RotorCallback` sampling every step): the event files are read back.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import socket
import tempfile
import warnings

import lightning.pytorch as pl
import pytest
import torch
import torch.multiprocessing as mp
from fitting import SaveAtEnd, quiet_trainer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor import own_checkpointing
from lightning_rotor.lightning import RotorCallback, RotorModelParallelStrategy
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.ops import is_no_recompute


class LM(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = gpt(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.0)

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        tokens, targets = batch
        return lm_loss(self.model(tokens), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _loader() -> DataLoader:
    data = torch.randint(32, (24, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=4)


def _fit(strategy, folder: str, steps: int, ckpt_path: str | None = None, logged: bool = False):
    """`steps` steps (3 make an epoch on each rank), from `ckpt_path` when given; saved to folder/NAME.ckpt.
    `logged`: with a TensorBoardLogger under folder/tb and a `RotorCallback` sampling every step; what the
    rank printed and wrote there, and the peak its callback measured, are kept (`_logged`)."""
    lm = LM()
    save = SaveAtEnd(f"{folder}/{type(strategy).__name__}.ckpt")
    rotor = RotorCallback(measure_every_n_steps=1)
    extra = dict(logger=TensorBoardLogger(folder, name="tb"), log_every_n_steps=1) if logged else {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = quiet_trainer(folder, strategy, devices=2, max_steps=steps, callbacks=[save, rotor], **extra)
        trainer.fit(lm, _loader(), ckpt_path=ckpt_path)
    seen = {"shards": [p.to_local().detach().clone() for p in lm.model.parameters()]}
    if hasattr(lm.model, "entries"):
        seen["ops"], seen["budget"] = list(lm.model.plan.ops), lm.model.plan.budget
    if logged:
        seen.update(_logged(folder), printed=printed.getvalue(), measured=rotor._measured_peak)
    torch.distributed.destroy_process_group()
    return seen


def _logged(folder: str) -> dict:
    """The TensorBoard event files under folder/tb (rank 0's logger writes them; another rank's none), read back."""
    files = glob.glob(f"{folder}/tb/**/events.out.tfevents.*", recursive=True)
    if not files:
        return {"event_files": 0}
    acc = EventAccumulator(os.path.dirname(files[0]), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    scalars = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    table = acc.Tensors("rotor/model/stages/text_summary")[0].tensor_proto.string_val[0].decode()
    return {"event_files": len(files), "scalars": scalars, "images": acc.Tags()["images"], "table": table}


class WrappedLM(LM):
    """The GPT with each block under torch's `checkpoint_wrapper` before `configure_model` shards it
    (torchtitan's recipe; the wrapper is the unit)."""

    def __init__(self):
        super().__init__()
        for k, block in enumerate(self.model.blocks):
            self.model.blocks[k] = checkpoint_wrapper(block)


def _fit_wrapped(strategy, folder: str) -> dict:
    """3 steps of `WrappedLM` under rotor: its shards, rotor's warnings, and the wrappers on after the fit."""
    lm = WrappedLM()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        quiet_trainer(folder, strategy, devices=2, max_steps=3).fit(lm, _loader())
    seen = {
        "shards": [p.to_local().detach().clone() for p in lm.model.parameters()],
        "warnings": [str(w.message) for w in said if str(w.message).startswith("rotor:")],
        "wrappers_on": len(own_checkpointing.flagged(lm.model)),
    }
    torch.distributed.destroy_process_group()
    return seen


def _worker(rank: int, ports: list[int], store: str) -> None:
    """FSDP2 alone and rotor: 3 steps saved (a distributed checkpoint), then resumed from it to 6 steps."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", WORLD_SIZE="2", NODE_RANK="0")
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank))  # launched externally: no launcher of Lightning's
    sizes = dict(data_parallel_size=2, tensor_parallel_size=1)
    seen = []
    with tempfile.TemporaryDirectory() as folder:
        for k, make in enumerate(
            (lambda: ModelParallelStrategy(**sizes), lambda: RotorModelParallelStrategy(0.5, **sizes))
        ):
            os.environ["MASTER_PORT"] = str(ports[2 * k])
            first = _fit(make(), folder, 3, logged=k == 1)
            os.environ["MASTER_PORT"] = str(ports[2 * k + 1])
            saved = f"{folder}/{type(make()).__name__}.ckpt"
            seen.append((first, _fit(make(), folder, 6, saved)))
        os.environ["MASTER_PORT"] = str(ports[4])
        seen.append(_fit_wrapped(RotorModelParallelStrategy(0.5, **sizes), folder))
    torch.save(seen, f"{store}.rank{rank}")


def _free_ports(count: int = 5) -> list[int]:
    """A port per fit: a process group's store does not meet the previous one's closing connections."""
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def ranks():
    """One spawn of two processes, four fits each: what each rank saw."""
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(_free_ports(), store), nprocs=2)
    return [torch.load(f"{store}.rank{rank}", weights_only=False) for rank in (0, 1)]


@pytest.mark.slow  # one spawn of two processes, four fits each
def test_rotor_model_parallel_strategy_is_bitwise_with_model_parallel_and_resumes_on_every_rank(ranks):
    for (plain, plain_resumed), (rotor, rotor_resumed), _ in ranks:
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(plain_resumed["shards"], rotor_resumed["shards"], strict=True))
        assert not is_no_recompute(rotor["ops"]) and rotor_resumed["ops"] == rotor["ops"]  # the plan restored
    assert ranks[0][1][0]["ops"] == ranks[1][1][0]["ops"]


def test_rotor_model_parallel_is_registered_by_name():
    assert "rotor_model_parallel" in StrategyRegistry
    assert StrategyRegistry["rotor_model_parallel"]["strategy"] is RotorModelParallelStrategy


ROTOR_SCALARS = ("budget_bytes", "predicted_peak_bytes", "measured_peak_bytes", "recomputed_stages", "step_seconds")


@pytest.mark.slow  # the same spawn as above (cached)
def test_summary_metrics_and_memory_curve_are_rank_zeros_under_model_parallel(ranks):
    """As under RotorStrategy/RotorDDPStrategy: the summary printed, the rotor scalars every step, the stage table
    and the memory curve, in TensorBoard event files read back; written by rank 0 alone, with rank 0's figures."""
    rank0, rank1 = (seen[1][0] for seen in ranks)
    assert rank1["event_files"] == 0 and "rotor plan" not in rank1["printed"]
    assert rank0["event_files"] == 1 and "rotor plan" in rank0["printed"] and "predicted peak" in rank0["printed"]
    scalars = rank0["scalars"]
    for tag in ROTOR_SCALARS:
        assert f"rotor/{tag}" in scalars, tag
    assert [step for step, _ in scalars["rotor/budget_bytes"]] == [0, 1, 2]  # every step
    assert scalars["rotor/budget_bytes"][-1][1] == rank0["budget"]
    measured = scalars["rotor/measured_peak_bytes"][-1][1]
    assert measured == rank0["measured"] and 0 < measured <= rank0["budget"]  # rank 0's own sample, per rank
    assert [step for step, _ in scalars["rotor/model/plan0/predicted_bytes"]] == list(range(len(rank0["ops"])))
    assert "rotor/model/plan0/measured_bytes" in scalars and "rotor/model/memory_curve" in rank0["images"]
    assert "| stage |" in rank0["table"]


@pytest.mark.slow  # the same spawn as above (cached)
def test_checkpoint_wrappers_are_turned_off_for_the_fit_and_on_again_at_its_end(ranks):
    """checkpoint_wrapper on the blocks before `configure_model` shards them: one warning on every rank, shards
    bitwise with ModelParallelStrategy without checkpointing, and the wrappers checkpoint again after the fit
    (the chains stay wrapped under FSDP2, but their own checkpointing is the user's again)."""
    for seen in ranks:
        (plain, _), _, wrapped = seen
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], wrapped["shards"], strict=True))
        (said,) = [w for w in wrapped["warnings"] if "had its own gradient checkpointing on" in w]
        assert "4 modules: model.blocks.0" in said or "4 modules: blocks.0" in said, said
        assert wrapped["wrappers_on"] == 4
