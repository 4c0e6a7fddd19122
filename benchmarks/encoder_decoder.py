"""Encoder-decoders under rotor: the smallest feasible budget over plain training's measured peak, with the decoder's
blocks as the chain (`Checkpointable(model)`) and with the encoder's and the decoder's as two chains under one budget
(`wrap(model, budget, include=["*encoder", "*decoder"])`), each checked bitwise and measured on a whole step.

    python benchmarks/encoder_decoder.py --layers 6 --d-model 64 --seq 64 --batch 4

Models from tiny configs (nothing downloaded): BART, Marian, T5, Whisper (16 mel bins, 2 x seq frames). Memory only
(MemoryProbe counts storages, deterministic): one run suffices. Docs: docs/discovery.md, "Side inputs and several
chains".
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from torch import nn

from lightning_rotor import Checkpointable, MemoryProbe
from lightning_rotor.lightning.wrap import wrap
from lightning_rotor.planner import InfeasibleBudget

VOCAB = 256


def model_of(family: str, layers: int, width: int, seq: int) -> nn.Module:
    import transformers as t

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, d_model=width, dropout=0.1, use_cache=False)
    sizes = dict(
        encoder_layers=layers, decoder_layers=layers, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=4 * width, decoder_ffn_dim=4 * width,
    )  # fmt: skip
    if family == "bart":
        return t.BartForConditionalGeneration(t.BartConfig(**common, **sizes, max_position_embeddings=256))
    if family == "marian":
        config = t.MarianConfig(
            **common, **sizes, max_position_embeddings=256, pad_token_id=0, decoder_start_token_id=0
        )
        return t.MarianMTModel(config)
    if family == "t5":
        config = t.T5Config(
            vocab_size=VOCAB, d_model=width, d_kv=width // 4, d_ff=4 * width, num_layers=layers, num_heads=4,
            dropout_rate=0.1, decoder_start_token_id=0, use_cache=False,
        )  # fmt: skip
        return t.T5ForConditionalGeneration(config)
    config = t.WhisperConfig(
        **common, **sizes, num_mel_bins=16, max_source_positions=seq, max_target_positions=256, pad_token_id=0,
        decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None,
    )  # fmt: skip
    return t.WhisperForConditionalGeneration(config)


def batch_of(family: str, batch: int, seq: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(3, VOCAB, (batch, seq), generator=g)
    if family == "whisper":
        return {"input_features": torch.randn(batch, 16, 2 * seq, generator=g), "labels": labels}
    return {"input_ids": torch.randint(3, VOCAB, (batch, seq), generator=g), "labels": labels}


def step_peak(model: nn.Module, batch: dict) -> int:
    """One step (fixed seed: dropout alike) under `MemoryProbe`: the whole step's activation peak."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    with MemoryProbe(model) as probe:
        model(**batch).loss.backward()
    return probe.peak


def smallest(prepare: Callable[[nn.Module, int], nn.Module], model: nn.Module, batch: dict) -> int:
    trial = prepare(copy.deepcopy(model), 1)
    try:
        trial(**batch).loss.backward()
    except InfeasibleBudget as refused:
        return refused.min_feasible
    raise RuntimeError("a budget of 1 byte was feasible")


def one_chain(model: nn.Module, budget: int) -> nn.Module:
    return Checkpointable(model, mem_limit=budget, repeats=1)


def two_chains(model: nn.Module, budget: int) -> nn.Module:
    wrap(model, budget, include=["*encoder", "*decoder"], discover="auto")
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="bart,marian,t5,whisper")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | chains | smallest budget / plain peak | measured / budget | bitwise |")
    print("|---|---|---|---|---|")
    for family in args.families.split(","):
        model = model_of(family, args.layers, args.d_model, args.seq).train()
        batch = batch_of(family, args.batch, args.seq)
        plain = copy.deepcopy(model)
        plain_peak = step_peak(plain, batch)
        grads = [p.grad for p in plain.parameters()]
        for label, prepare in (("decoder", one_chain), ("encoder + decoder", two_chains)):
            least = smallest(prepare, model, batch)
            rotor = prepare(copy.deepcopy(model), least)
            torch.manual_seed(5)
            rotor(**batch).loss.backward()  # profiled and planned
            peak = step_peak(rotor, batch)
            same = all(
                (a is None and b.grad is None) or torch.equal(a, b.grad)
                for a, b in zip(grads, rotor.parameters(), strict=True)
            )
            print(f"| {family} | {label} | {least / plain_peak:.3f} | {peak / least:.3f} | {same} |")


if __name__ == "__main__":
    main()
