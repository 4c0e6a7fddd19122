"""rotor under FSDP2 (`fully_shard`), plain PyTorch, over a real 2-process gloo group (docs/sharded.md).

One spawn runs every case on both ranks (a spawn starts two interpreters) and writes what each rank saw;
the tests read it. Each model is trained 3 AdamW steps by FSDP2 alone and by rotor under FSDP2 (the
supported order: `Checkpointable` first, each block `fully_shard`ed, then the `Checkpointable` as the
root), on each rank's own batches: the local parameter shards must be torch.equal on every rank.
Collectives are counted over steps 2-3 (step 1 profiles); the step's peak is measured per rank by
tensor accounting of everything but the persistent model state (local shards, their gradients, the
optimizer's state, buffers): the budget's definition under FSDP2, less FSDP2's unsharded parameters,
which tensor accounting alone does not see (`test_measured_peak_counts_the_parameters_fsdp2_gathers`).
"""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from hf_models import TINY_DECODER, tiny_llama
from torch.distributed.fsdp import fully_shard

from lightning_rotor.bench.collectives import count_collectives as counting
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.models.gpt import gpt, lm_loss
from lightning_rotor.ops import is_no_recompute
from lightning_rotor.sharded import ShardedMemoryProbe

pytestmark = pytest.mark.slow  # one spawn of two processes for the whole file's cases

COUNTS = {"all_gather": 0, "reduce_scatter": 0}
BLOCK_CALLS = [0]  # forwards of the blocks a model counts (`_gpt_wrapped`), over steps 2-3
STEPS = 3


def count_collectives() -> None:
    """Count FSDP2's all-gathers and reduce-scatters in `COUNTS` (lightning_rotor/bench/collectives.py)."""
    counting(COUNTS)


def _gpt():
    torch.manual_seed(0)
    model = gpt(vocab_size=32, block_size=16, n_layer=4, n_head=2, n_embd=16, dropout=0.0)
    return model, list(model.blocks), 32


def _llama():
    model = tiny_llama()
    return model, list(model.model.layers), TINY_DECODER["vocab_size"]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0
    model = GPT2LMHeadModel(config)
    return model, list(model.transformer.h), 64


def _count_block_call(module, args) -> None:
    BLOCK_CALLS[0] += 1


def _gpt_wrapped():
    """The GPT with each block under torch's `checkpoint_wrapper` (torchtitan's recipe: before `fully_shard`, the
    wrapper the unit), each block's forwards counted: rotor must turn the wrappers off, not recompute on top."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model, blocks, vocab = _gpt()
    for k, block in enumerate(blocks):
        block.register_forward_pre_hook(_count_block_call)
        model.blocks[k] = checkpoint_wrapper(block)
    return model, list(model.blocks), vocab


def _llama_own():
    """The Llama with Hugging Face's own gradient checkpointing on."""
    model, blocks, vocab = _llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5: the method's name is deprecated, the flag is not
        model.gradient_checkpointing_enable()
    return model, blocks, vocab


class LoopLM(torch.nn.Module):
    """A model of the user's own: an embedding, a loop over a ModuleList of MLP blocks (each block under
    `torch.utils.checkpoint` in the forward when `own`), a head; "auto" discovery would trace it as a graph."""

    def __init__(self, own: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.own, self.embed, self.head = own, torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16)) for _ in range(4)
        )

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + (torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.own else block(x))
        return self.head(x)


def _loss(out, targets):
    logits = out if isinstance(out, torch.Tensor) else out.logits
    return lm_loss(logits, targets) if logits.dim() == 3 else F.cross_entropy(logits, targets)


def _persistent(root, opt) -> list[torch.Tensor]:
    """What the budget leaves out under FSDP2: local shards, their gradients, the optimizer's state, buffers."""
    params = list(root.parameters())
    kept = [p.to_local().detach() for p in params] + [p.grad.to_local() for p in params if p.grad is not None]
    kept += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return kept + list(root.buffers())


def _sharded(build, mem_limit):
    model, blocks, vocab = build()
    root = model if mem_limit is None else Checkpointable(model, mem_limit=mem_limit)
    for block in blocks:
        fully_shard(block)
    fully_shard(root)
    return root, vocab


def _steps(root, opt, vocab: int, rank: int, micro: int) -> int:
    """`STEPS` AdamW steps of `micro` micro-batches each; the largest peak measured over steps 2-3."""
    g = torch.Generator().manual_seed(100 + rank)
    peak = 0
    for step in range(STEPS):
        if step == 1:
            COUNTS.update(all_gather=0, reduce_scatter=0)
            BLOCK_CALLS[0] = 0
        for m in range(micro):
            root.set_requires_gradient_sync(m == micro - 1)
            data = torch.randint(vocab, (4, 17), generator=g)
            probe = ShardedMemoryProbe(root, _persistent(root, opt)) if step else None  # gathered units too
            with probe if probe is not None else torch.enable_grad():
                _loss(root(data[:, :-1]), data[:, 1:]).backward()
            peak = max(peak, probe.peak if probe is not None else 0)
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept: persistent state, left out of the measured peak
    return peak


def _train(build, mem_limit, rank, micro=1, plans=None):
    """3 AdamW steps of FSDP2 alone (`mem_limit` None) or rotor under FSDP2; `micro` micro-batches per step,
    the gradient sync off for all but the last (`set_requires_gradient_sync(False)`); `plans`: rotor's saved
    plans, loaded before the first step (no profiling)."""
    root, vocab = _sharded(build, mem_limit)
    if plans is not None:
        root.load_plan_state(plans)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        peak = _steps(root, opt, vocab, rank, micro)
    shards = [p.to_local().detach().clone() for p in root.parameters()]
    told = [str(w.message) for w in said if str(w.message).startswith("rotor:")]
    seen = {"shards": shards, "counts": dict(COUNTS), "peak": peak, "block_calls": BLOCK_CALLS[0], "warnings": told}
    if mem_limit is not None:
        seen.update(ops=list(root.plan.ops), budget=root.plan.budget, plan_peak=root.plan.peak)
    return seen


CASES = {  # name: (model, budget); each beside FSDP2 alone
    "gpt": (_gpt, 0.5),
    "gpt_no_recompute": (_gpt, 10**9),
    "llama": (_llama, 0.6),
    "gpt2": (_gpt2, 0.6),
}


def _plans_of_one_step(rank: int) -> dict:
    """The plans a rotor under FSDP2 made on its first step, as a checkpoint keeps them."""
    root, vocab = _sharded(_gpt, 0.5)
    data = torch.randint(vocab, (4, 17), generator=torch.Generator().manual_seed(100 + rank))
    _loss(root(data[:, :-1]), data[:, 1:]).backward()
    return root.plan_state()


def _wrong_orders() -> list[str]:
    """What each unsupported order raises: `fully_shard` before `Checkpointable`, and no FSDP root calling rotor."""
    seen = []
    model, blocks, _ = _gpt()
    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    try:
        Checkpointable(model, mem_limit=0.5)
        seen.append("no error")
    except ValueError as err:
        seen.append(str(err))
    model, blocks, _ = _gpt()
    rotor = Checkpointable(model, mem_limit=0.5)
    for block in blocks:
        fully_shard(block)  # no root: nothing unshards the embedding and the head
    try:
        lm_loss(rotor(torch.zeros(2, 8, dtype=torch.long)), torch.zeros(2, 8, dtype=torch.long)).backward()
        seen.append("no error")
    except ValueError as err:
        seen.append(str(err))
    return seen


def _refused_discoveries() -> list[str]:
    """What a forward calling torch.utils.checkpoint, graph discovery of sharded blocks, and a chain discovered
    inside one block (a residual around each block: the run found is the block's own layers) raise."""
    seen = []
    for own, discover in ((True, "auto"), (False, "graph"), (False, "auto")):
        model = LoopLM(own)
        rotor = Checkpointable(model, mem_limit=0.6, discover=discover)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(rotor)
        try:
            tokens = torch.zeros(2, 8, dtype=torch.long)
            lm_loss(rotor(tokens), tokens).backward()
            seen.append("no error")
        except NotImplementedError as err:
            seen.append(str(err))
    return seen


def _tensor_parallel() -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    model, blocks, _ = _gpt()
    mesh = init_device_mesh("cpu", (2,))
    parallelize_module(blocks[0].mlp, mesh, {"0": ColwiseParallel()})
    rotor = Checkpointable(model, mem_limit=0.5)
    try:
        lm_loss(rotor(torch.zeros(2, 8, dtype=torch.long)), torch.zeros(2, 8, dtype=torch.long)).backward()
    except NotImplementedError as err:
        return str(err)
    return "no error"


def _gathered_seen(rank: int) -> tuple[int, int, int]:
    """One step of FSDP2 alone after a first one, measured by tensor accounting alone and by
    `ShardedMemoryProbe` at once (nested), and a block's unsharded bytes."""
    root, vocab = _sharded(_gpt, None)
    opt = torch.optim.AdamW(root.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    peaks = []
    for _ in range(2):
        data = torch.randint(vocab, (4, 17), generator=g)
        kept = _persistent(root, opt)
        with MemoryProbe(kept) as blind, ShardedMemoryProbe(root, kept) as sharded:
            _loss(root(data[:, :-1]), data[:, 1:]).backward()
        peaks = [blind.peak, sharded.peak]
        opt.step()
        opt.zero_grad(set_to_none=False)
    unit = sum(p.numel() * p.element_size() for p in root.blocks[0].parameters())  # DTensors: the global sizes
    return peaks[0], peaks[1], unit


def _worker(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    count_collectives()
    seen: dict[str, object] = {}
    for name, (build, mem_limit) in CASES.items():
        seen[name] = (_train(build, None, rank), _train(build, mem_limit, rank))
    seen["accumulation"] = (_train(_gpt, None, rank, micro=2), _train(_gpt, 0.5, rank, micro=2))
    seen["restored"] = (seen["gpt"][0], _train(_gpt, 0.5, rank, plans=_plans_of_one_step(rank)))
    for name, build, plain in (("gpt_wrapped", _gpt_wrapped, "gpt"), ("llama_own", _llama_own, "llama")):
        seen[name] = (seen[plain][0], _train(build, CASES[plain][1], rank))  # beside FSDP2 alone, no checkpointing
    seen["wrong_orders"] = _wrong_orders()
    seen["gathered_seen"] = _gathered_seen(rank)
    seen["tensor_parallel"] = _tensor_parallel()
    seen["refused_discoveries"] = _refused_discoveries()
    dist.destroy_process_group()
    torch.save(seen, f"{store}.rank{rank}")


@pytest.fixture(scope="module")
def ranks():
    store = tempfile.mktemp()
    mp.spawn(_worker, args=(store,), nprocs=2)
    return [torch.load(f"{store}.rank{rank}", weights_only=False) for rank in (0, 1)]


TRAINED = [*CASES, "accumulation", "restored", "gpt_wrapped", "llama_own"]
# restored: plans loaded, rotor's hooks on the units all the same; gpt_wrapped, llama_own: the model's own
# checkpointing on (checkpoint_wrapper, Hugging Face's flag), beside FSDP2 alone without it


@pytest.mark.parametrize("case", TRAINED)
def test_rotor_under_fsdp2_is_bitwise_on_every_rank(ranks, case):
    for seen in ranks:
        plain, rotor = seen[case]
        assert len(plain["shards"]) == len(rotor["shards"])
        assert all(torch.equal(a, b) for a, b in zip(plain["shards"], rotor["shards"], strict=True))
        assert plain["counts"]["reduce_scatter"] == rotor["counts"]["reduce_scatter"]  # one per unit and step
    recomputes = not is_no_recompute(ranks[0][case][1]["ops"]) if case != "gpt_no_recompute" else True
    assert recomputes, f"{case}: the budget should make rotor recompute"


@pytest.mark.parametrize("case", TRAINED)
def test_one_plan_for_all_ranks(ranks, case):
    first, second = (seen[case][1] for seen in ranks)
    assert first["ops"] == second["ops"] and first["budget"] == second["budget"]


@pytest.mark.parametrize("case", TRAINED)
def test_measured_peak_per_rank_within_budget(ranks, case):
    for seen in ranks:
        rotor = seen[case][1]
        assert 0 < rotor["peak"] <= rotor["plan_peak"] <= rotor["budget"], (rotor["peak"], rotor["plan_peak"])


def test_measured_peak_counts_the_parameters_fsdp2_gathers(ranks):
    """FSDP2 resizes its unsharded parameters' storages in place (no op allocates them): tensor accounting alone
    missed them, so every measured peak under FSDP2 left out at least the running unit's parameters."""
    for seen in ranks:
        blind, sharded, unit = seen["gathered_seen"]
        assert sharded >= blind + unit, (blind, sharded, unit)


UNIT_STAGES = {
    "gpt": range(1, 5),
    "gpt_no_recompute": range(1, 5),
    "llama": range(4),
    "gpt2": range(4),
    "gpt_wrapped": range(1, 5),
    "llama_own": range(4),
}


def _block_forwards(ops, stages) -> int:
    return sum(1 for op in ops if op.kind.value in ("Fn", "Fc", "Fe") and op.stage in stages)


@pytest.mark.parametrize("case", UNIT_STAGES)
def test_no_more_all_gathers_than_charged(ranks, case):
    """At most one all-gather per forward of a unit's stage (each charged its all-gather time) and per backward,
    and the root's; no extra reduce-scatter."""
    for seen in ranks:
        plain, rotor = seen[case]
        forwards = _block_forwards(rotor["ops"], UNIT_STAGES[case])
        charged = 1 + forwards + len(UNIT_STAGES[case])
        assert rotor["counts"]["all_gather"] <= charged * (STEPS - 1), (rotor["counts"], charged)
        assert plain["counts"]["all_gather"] <= rotor["counts"]["all_gather"]


def test_no_recomputation_budget_is_plain_fsdp2(ranks):
    """At a budget above rotor's no-recomputation peak: nothing recomputed, FSDP2's own collectives and peak."""
    for seen in ranks:
        plain, rotor = seen["gpt_no_recompute"]
        assert is_no_recompute(rotor["ops"])
        assert rotor["counts"] == plain["counts"]
        # the same schedule; the peaks may differ by what Python's cycle collector frees when (seen: 1.9%)
        assert abs(rotor["peak"] - plain["peak"]) <= 0.05 * plain["peak"]


def test_wrong_order_is_refused_in_one_line_naming_the_supported_one(ranks):
    for seen in ranks:
        before, no_root = seen["wrong_orders"]
        assert before.startswith("Checkpointable got a fully_shard'ed FSDPSequential, the FSDP root"), before
        assert no_root.startswith("rotor ran outside its FSDP root's forward"), no_root
        for line in (before, no_root):
            assert "\n" not in line and "wrap the model in Checkpointable first" in line


def test_tensor_parallel_is_refused_in_one_line(ranks):
    for seen in ranks:
        assert seen["tensor_parallel"].startswith("rotor does not support tensor parallelism yet"), seen


@pytest.mark.parametrize("case", ["gpt_wrapped", "llama_own"])
def test_own_checkpointing_under_fsdp2_is_turned_off_with_one_warning(ranks, case):
    """checkpoint_wrapper before fully_shard (torchtitan's order), Hugging Face's `gradient_checkpointing_enable()`:
    turned off as on one device, one warning on every rank, each block run once per forward of rotor's plan (not
    recomputed by the wrapper on top); bitwise with FSDP2 alone (`test_rotor_under_fsdp2_is_bitwise_on_every_rank`)."""
    for seen in ranks:
        rotor = seen[case][1]
        (said,) = [w for w in rotor["warnings"] if "had its own gradient checkpointing on" in w]
        assert "rotor turned it off" in said, said
        if case == "gpt_wrapped":
            assert rotor["block_calls"] == _block_forwards(rotor["ops"], UNIT_STAGES[case]) * (STEPS - 1)


def test_what_fsdp2_cannot_run_is_refused_in_one_line(ranks):
    """torch.utils.checkpoint called in the forward (a CheckpointError in the first backward before) and graph
    discovery of fully_shard'ed blocks ("mixed torch.Tensor and DTensor" in the first forward before)."""
    for seen in ranks:
        calls, graph, inside = seen["refused_discoveries"]
        assert "is inside a fully_shard'ed unit" in inside and "fully_shard whole blocks" in inside, inside
        assert calls.startswith("LoopLM's forward calls torch.utils.checkpoint (") and "remove the call" in calls, calls
        assert graph.startswith("rotor under FSDP2 needs stages that call the fully_shard'ed blocks"), graph
        assert "discover='modules'" in graph and all("\n" not in line for line in (calls, graph, inside))
