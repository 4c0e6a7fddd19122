"""Encoder-decoder transformers under rotor: decoder blocks read the encoder output, a side input that requires
grad (docs/discovery.md, "Side inputs and several chains"). Parameters after a few steps are bitwise plain
training's (dropout on, same seeds) and the measured peak is within the budget, at the smallest feasible one."""

from __future__ import annotations

import contextlib
import copy

import lightning.pytorch as pl
import pytest
import torch
from fitting import quiet_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from training import check_measured_peak

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorStrategy
from lightning_rotor.lightning.state import rotor_modules
from lightning_rotor.planner import min_feasible_budget
from lightning_rotor.simulate import no_recompute_peak

torch.set_num_threads(1)


# -- the minimal pattern -----------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, memory=None):  # memory used twice: its gradient is a sum inside each block too
        return x + self.drop(torch.tanh(self.a(x) + self.b(memory) + self.b(2 * memory)))


class EncDec(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.enc = nn.Linear(16, 16)
        self.layers = nn.ModuleList(Block() for _ in range(layers))

    def forward(self, x, *args):
        mem = torch.relu(self.enc(x))
        for blk in self.layers:
            x = blk(x, memory=mem)
        return x


def square_mean(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def loss_of(model: nn.Module, batch: dict, loss_fn=None, region=contextlib.nullcontext) -> torch.Tensor:
    """The step's loss: `loss_fn` of the output, else the loss the model computes from `labels`, computed inside
    `region()` (autocast, as Lightning wraps the training step). The output is not kept into the backward (a step
    that keeps it holds it on top of the budget)."""
    with region():
        return loss_fn(model(**batch)) if loss_fn is not None else model(**batch).loss


def steps(model: nn.Module, batches: list[dict], loss_fn=None, region=contextlib.nullcontext) -> None:
    """SGD steps, each with its own seed (dropout draws the same in plain and rotor training)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, batch in enumerate(batches):
        opt.zero_grad()
        torch.manual_seed(100 + i)
        loss_of(model, batch, loss_fn, region).backward()
        opt.step()


def assert_same_parameters(plain: nn.Module, trained: nn.Module) -> None:
    for (n, a), (m, b) in zip(plain.named_parameters(), trained.named_parameters(), strict=True):
        assert n == m and torch.equal(a, b), n


def smallest(
    model: nn.Module, batch: dict, loss_fn=None, region=contextlib.nullcontext, **settings
) -> tuple[int, float]:
    """The smallest feasible budget of `model`'s chain on `batch`, and its ratio to the no-recompute peak."""
    probe = Checkpointable(copy.deepcopy(model), loss_fn=loss_fn, repeats=1, **settings)
    torch.manual_seed(0)
    loss_of(probe, batch, loss_fn, region)
    chain = probe.last_entry.chain
    least = min_feasible_budget(chain)
    return least, least / no_recompute_peak(chain)


def check_at_smallest(
    model: nn.Module, batches: list[dict], loss_fn=None, region=contextlib.nullcontext, **settings
) -> tuple[Checkpointable, float]:
    """Train `model` at its smallest budget and plain: same parameters; one more step measured within budget."""
    least, ratio = smallest(model, batches[0], loss_fn, region, **settings)
    plain = copy.deepcopy(model)
    rotor = Checkpointable(copy.deepcopy(model), mem_limit=least, loss_fn=loss_fn, repeats=1, **settings)
    steps(plain, batches, loss_fn, region)
    steps(rotor, batches, loss_fn, region)
    assert_same_parameters(plain, rotor.module)
    assert sum(r > 1 for r in rotor.last_entry.runs) > 0  # the budget really recomputes
    rotor.zero_grad()
    with rotor.measure_step() as measured:
        torch.manual_seed(7)
        loss_of(rotor, batches[0], loss_fn, region).backward()
    check_measured_peak(rotor, measured.peak)
    return rotor, ratio


def test_blocks_reading_an_encoder_output_train_bitwise_within_the_smallest_budget():
    torch.manual_seed(0)
    model = EncDec(6)
    batches = [{"x": torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(i))} for i in range(3)]
    rotor, ratio = check_at_smallest(model, batches, square_mean)
    assert rotor.stage_names == [f"layers.{i}" for i in range(6)]
    assert ratio < 0.5


def test_side_input_gradient_sums_in_plain_autograd_order():
    """The encoder's gradient, a sum over blocks and over two uses per block, is bitwise plain autograd's."""
    torch.manual_seed(0)
    model = EncDec(4)
    x = torch.randn(4, 8, 16)
    plain = copy.deepcopy(model)
    torch.manual_seed(1)
    square_mean(plain(x)).backward()
    least, _ = smallest(model, {"x": x}, square_mean)
    rotor = Checkpointable(copy.deepcopy(model), mem_limit=least, loss_fn=square_mean, repeats=1)
    torch.manual_seed(0)
    rotor(x)  # profiled and planned; the next call is the step compared
    rotor.zero_grad()
    torch.manual_seed(1)
    square_mean(rotor(x)).backward()
    assert torch.equal(plain.enc.weight.grad, rotor.module.enc.weight.grad)
    assert torch.equal(plain.enc.bias.grad, rotor.module.enc.bias.grad)


# -- Hugging Face encoder-decoders from tiny configs (nothing downloaded) ------------------------------------------
def bart(layers: int = 3) -> nn.Module:
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=64, d_model=16, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.1,
        use_cache=False,
    )  # fmt: skip
    return BartForConditionalGeneration(config).train()


def marian(layers: int = 3) -> nn.Module:
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=64, d_model=16, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=64, dropout=0.1,
        pad_token_id=0, decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    return MarianMTModel(config).train()


def t5(layers: int = 3) -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=layers, num_heads=2, dropout_rate=0.1,
        decoder_start_token_id=0, use_cache=False,
    )  # fmt: skip
    return T5ForConditionalGeneration(config).train()


def whisper(layers: int = 3) -> nn.Module:
    """A Whisper-style speech encoder-decoder: convolutions over mel features, then encoder and decoder layers."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=64, d_model=16, encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=8, max_source_positions=16,
        max_target_positions=32, dropout=0.1, pad_token_id=0, decoder_start_token_id=1, bos_token_id=1,
        eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None, use_cache=False,
    )  # fmt: skip
    return WhisperForConditionalGeneration(config).train()


def seq2seq_batches(n: int = 2, source: int = 16, target: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, 64, (2, source), generator=g) for _ in range(n)]
    return [{"input_ids": x, "labels": torch.randint(3, 64, (2, target), generator=g)} for x in ids]


def speech_batches(n: int = 2, frames: int = 32, target: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(2, 8, frames, generator=g) for _ in range(n)]
    return [{"input_features": f, "labels": torch.randint(3, 64, (2, target), generator=g)} for f in feats]


@pytest.mark.parametrize(
    "make, batches, run",
    [
        (bart, seq2seq_batches, "model.decoder.layers.{}"),
        (marian, seq2seq_batches, "model.decoder.layers.{}"),
        (t5, seq2seq_batches, "decoder.block.{}"),
        (whisper, speech_batches, "model.decoder.layers.{}"),
    ],
    ids=["bart", "marian", "t5", "whisper"],
)
def test_hugging_face_encoder_decoder_trains_bitwise_within_the_smallest_budget(make, batches, run):
    """`Checkpointable(model)`: the decoder's blocks are the chain (T5's from the second: the first computes the
    position biases), the encoder runs as written and is charged with the chain's input."""
    pytest.importorskip("transformers")
    rotor, ratio = check_at_smallest(make(), batches())
    first = 1 if make is t5 else 0
    assert rotor.stage_names == [run.format(i) for i in range(first, 3)]
    assert ratio < 1


def test_t5_block_runs_are_found_past_the_first_block():
    """T5's blocks return (hidden, position bias, cross-attention bias); the first computes the biases, the others
    pass them on: the runs are blocks 1..n-1 of the encoder and of the decoder, the biases side inputs."""
    pytest.importorskip("transformers")
    from lightning_rotor.discovery.modules import find_runs

    model = t5(4)
    batch = seq2seq_batches(1)[0]
    runs = find_runs(model, (), batch)
    assert [r.names for r in runs[:2]] == [
        [f"decoder.block.{i}" for i in (1, 2, 3)],
        [f"encoder.block.{i}" for i in (1, 2, 3)],
    ]


# -- two chains in one step: the encoder's blocks, then the decoder's -----------------------------------------------
def whole_step_peak(model: nn.Module, batch: dict) -> int:
    from lightning_rotor.memory import MemoryProbe

    model.zero_grad()
    with MemoryProbe(model) as probe:
        torch.manual_seed(7)
        loss_of(model, batch).backward()
    return probe.peak


def smallest_total(model: nn.Module, batch: dict, include: list[str] | None) -> int:
    """The smallest budget the encoder and decoder chains of `model` share (`InfeasibleTotal` names it)."""
    from lightning_rotor.lightning.wrap import wrap
    from lightning_rotor.shared_budget import InfeasibleTotal

    trial = copy.deepcopy(model)
    wrap(trial, 1, include=include, discover="auto")
    with pytest.raises(InfeasibleTotal) as refused:
        loss_of(trial, batch).backward()
    return refused.value.min_feasible


@pytest.mark.parametrize(
    "make, batches",
    [(bart, seq2seq_batches), (marian, seq2seq_batches), (whisper, speech_batches)],
    ids=["bart", "marian", "whisper"],
)
def test_encoder_and_decoder_chains_share_one_budget_bitwise(make, batches):
    """Both block runs are chains under one budget, both recompute at the smallest total, training is bitwise plain
    training's, and the whole step (the LM head and loss the model computes around the chains included) stays within
    the total (docs/discovery.md, "Side inputs and several chains")."""
    pytest.importorskip("transformers")
    from lightning_rotor.lightning.wrap import wrap

    model, batches = make(), batches(3)
    include = ["model.encoder", "model.decoder"]
    total = smallest_total(model, batches[0], include)
    plain, rotor = copy.deepcopy(model), copy.deepcopy(model)
    wrapped, _ = wrap(rotor, total, include=include, discover="auto")
    steps(plain, batches)
    steps(rotor, batches)
    assert_same_parameters(plain, rotor)
    chains = {w.name: w.rotor for w in wrapped}
    assert chains["model.encoder"].stage_names == [f"layers.{i}" for i in range(3)]
    assert chains["model.decoder"].stage_names == [f"layers.{i}" for i in range(3)]
    assert all(sum(r > 1 for r in c.last_entry.runs) > 0 for c in chains.values())  # both recompute
    assert whole_step_peak(rotor, batches[0]) <= total  # a planned step (the first one profiled)
    assert total < 0.75 * whole_step_peak(plain, batches[0])


class Seq2Seq(pl.LightningModule):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.chains: dict[str, Checkpointable] = {}

    def training_step(self, batch, batch_idx):
        self.chains = self.chains or rotor_modules(self)  # the strategy puts the modules back after fit
        input_ids, labels = batch
        torch.manual_seed(100 + batch_idx)
        return self.model(input_ids=input_ids, labels=labels).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def seq2seq_loader() -> DataLoader:
    batches = seq2seq_batches(3)
    ids = torch.cat([b["input_ids"] for b in batches])
    labels = torch.cat([b["labels"] for b in batches])
    return DataLoader(TensorDataset(ids, labels), batch_size=2)


class StepPeaks(pl.Callback):
    """The measured activation peak of every training step but the first (which profiles), forward to backward."""

    def __init__(self):
        self.peaks: list[int] = []
        self.probe = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        from lightning_rotor.memory import MemoryProbe

        self.probe = MemoryProbe(pl_module).__enter__() if batch_idx > 0 else None

    def on_after_backward(self, trainer, pl_module):
        if self.probe is not None:
            self.probe.__exit__(None, None, None)
            self.peaks.append(self.probe.peak)


@pytest.mark.slow  # two Trainer fits per model and budget, about 3 s each
@pytest.mark.parametrize(
    "make, budget, include",
    [
        (bart, "smallest", ["*encoder", "*decoder"]),  # the model's encoder and decoder, wherever they stand
        (bart, "50%", ["*encoder", "*decoder"]),
        (t5, "smallest", ["*encoder", "*decoder"]),
        (t5, "80%", ["*encoder", "*decoder"]),  # T5 needs over half its peaks
        (bart, "smallest", None),  # found without include: the model's get_encoder() and get_decoder()
    ],
    ids=["bart-smallest", "bart-50%", "t5-smallest", "t5-80%", "bart-default"],
)
def test_encoder_decoder_trains_in_a_trainer_bitwise_within_the_budget(make, budget, include, tmp_path):
    """Through a real Trainer with `RotorStrategy` wrapping the encoder and the decoder (one budget), as plain, each
    planned step's measured peak (the LM head and loss around the chains included) within the total."""
    pytest.importorskip("transformers")
    model = make()
    total = smallest_total(model, seq2seq_batches(1)[0], include) if budget == "smallest" else budget
    runs, peaks = {}, StepPeaks()
    for name, strategy in (("plain", "auto"), ("rotor", RotorStrategy(total, include=include))):
        task = Seq2Seq(copy.deepcopy(model))
        callbacks = [peaks] if name == "rotor" else []
        quiet_trainer(tmp_path / name, strategy, callbacks=callbacks).fit(task, seq2seq_loader())
        runs[name] = task
    assert_same_parameters(runs["plain"].model, runs["rotor"].model)
    chains = runs["rotor"].chains
    assert len(chains) == 2 and all(len(c.stage_names) >= 2 for c in chains.values())
    assert [name.rsplit(".", 1)[-1] for name in chains] == ["encoder", "decoder"]
    assert all(sum(r > 1 for r in c.last_entry.runs) > 0 for c in chains.values())  # both recompute
    limit = next(iter(chains.values())).shared.total_bytes()
    assert budget != "smallest" or limit == total
    assert len(peaks.peaks) == 2 and max(peaks.peaks) <= limit, (peaks.peaks, limit)


class TwoSided(nn.Module):
    """Blocks reading two side inputs positionally (an encoder output and a conditioning vector, as a U-Net's
    time embedding), under autocast: each recomputation re-enters the autocast state of its first run."""

    def __init__(self, layers: int = 4):
        super().__init__()
        self.enc, self.cond = nn.Linear(16, 16), nn.Linear(16, 16)
        self.layers = nn.ModuleList(SidedBlock() for _ in range(layers))

    def forward(self, x, c):
        mem, emb = torch.relu(self.enc(x)), self.cond(c)
        for blk in self.layers:
            x = blk(x, mem, emb)
        return x


class SidedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, memory, emb):
        return x + self.drop(torch.tanh(self.a(x + emb[:, None]) * self.b(memory)))


def test_positional_side_inputs_under_autocast_train_bitwise_within_the_smallest_budget():
    torch.manual_seed(0)
    model = TwoSided(6)
    g = torch.Generator().manual_seed(0)
    batches = [{"x": torch.randn(4, 8, 16, generator=g), "c": torch.randn(4, 16, generator=g)} for _ in range(3)]

    def loss_fn(out):
        return out.float().square().mean()

    def bf16():  # one autocast region per step's forward and loss, as Lightning's bf16-mixed precision
        return torch.autocast("cpu", dtype=torch.bfloat16)

    rotor, ratio = check_at_smallest(model, batches, loss_fn, bf16, discover="modules")  # graph would trace it
    assert rotor.stage_names == [f"layers.{i}" for i in range(6)]
    assert ratio < 0.6


class TwoStacks(nn.Module):
    """Two chains and a head around them, in one forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        self.b = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        self.head = nn.Linear(16, 256)

    def forward(self, x):
        return self.head(self.b(self.a(x)))


def test_code_around_several_chains_is_charged_when_a_holder_runs_them_else_told():
    """Called through the model, its head (and the loss stand-in) is measured and charged beside the chains; chains
    called one by one by the step itself cannot be measured around, and one warning says so."""
    from lightning_rotor.lightning.wrap import wrap
    from lightning_rotor.shared_budget import OUTSIDE

    x = torch.randn(8, 16)
    model = TwoStacks()
    wrapped, _ = wrap(model, None, include=["a", "b"])
    model(x).pow(2).mean().backward()
    budget = wrapped[0].rotor.shared
    assert budget.needs[OUTSIDE][0] >= 2 * 8 * 256 * 4  # the logits and their gradient, at least
    assert not budget.hooks
    apart = TwoStacks()
    wrapped, _ = wrap(apart, None, include=["a", "b"])
    with pytest.warns(UserWarning, match="charged to no chain"):
        apart.head(apart.b(apart.a(x))).pow(2).mean().backward()
    assert OUTSIDE not in wrapped[0].rotor.shared.needs and not wrapped[0].rotor.shared.hooks


@pytest.mark.slow  # two Trainer fits, about 4 s
def test_t5_own_checkpointing_in_a_trainer_one_warning_naming_each_stack(tmp_path):
    """The strategy's default wrapping of T5 after `gradient_checkpointing_enable()`: two chains (encoder, decoder),
    one warning for the model naming both stacks, training as plain, the user's flags back after the fit."""
    pytest.importorskip("transformers")
    model = t5()
    plain = Seq2Seq(copy.deepcopy(model))
    quiet_trainer(tmp_path / "plain").fit(plain, seq2seq_loader())
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rotor = Seq2Seq(model)
    with pytest.warns(UserWarning) as record:
        quiet_trainer(tmp_path / "rotor", RotorStrategy("80%")).fit(rotor, seq2seq_loader())
    own = [str(w.message) for w in record if "own gradient checkpointing on" in str(w.message)]
    assert len(own) == 1 and own[0].startswith("rotor: T5ForConditionalGeneration had its own"), own
    assert "model.encoder: 7 modules" in own[0] and "model.decoder: 10 modules" in own[0], own
    assert "its share" in own[0] and "mem_limit=" not in own[0], own  # a share of the budget, not a mem_limit
    assert len(rotor.chains) == 2
    assert_same_parameters(plain.model, rotor.model)
    assert rotor.model.encoder.gradient_checkpointing and rotor.model.decoder.gradient_checkpointing
