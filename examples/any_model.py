"""A model as users write it (a GPT whose forward loops over a ModuleList), trained with rotor.

    python examples/any_model.py            # CPU, a few seconds
    python examples/any_model.py --layers 2 --width 16 --seq 8 --batch-size 4 --steps 2   # a smoke run

No nn.Sequential anywhere: `RotorStrategy` wraps `self.model`, discovers its chain on the
first batch (torch.fx, cut between blocks), and trains it within half of the activation
memory plain training needs, with the same losses and gradients.
"""

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_rotor import RotorStrategy, format_bytes


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, dropout=dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.size(1)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self,
        vocab: int = 256,
        block_size: int = 64,
        layers: int = 6,
        width: int = 64,
        heads: int = 4,
        dropout: float = 0.1,
    ):
        super().__init__()
        self.block_size = block_size
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(width, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.size()
        assert t <= self.block_size, f"sequence of {t} tokens, block size is {self.block_size}"
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class LanguageModel(pl.LightningModule):
    def __init__(self, **sizes: int):
        super().__init__()
        self.model = GPT(**sizes)

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self.model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mem-limit", default="50%", help="bytes, '64MiB', or a fraction of the no-recompute peak")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    text = torch.randint(256, (4 * args.batch_size, args.seq + 1))
    data = DataLoader(TensorDataset(text[:, :-1], text[:, 1:]), batch_size=args.batch_size)
    trainer = pl.Trainer(
        strategy=RotorStrategy(mem_limit=args.mem_limit),
        accelerator="cpu",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LanguageModel(layers=args.layers, width=args.width, block_size=args.seq), data)
    metrics = trainer.callback_metrics
    print(
        f"trained {trainer.global_step} steps, loss {float(metrics['loss']):.3f}; "
        f"budget {format_bytes(int(metrics['rotor/budget_bytes']))}, "
        f"{int(metrics['rotor/recomputed_stages'])} stages recomputed"
    )


if __name__ == "__main__":
    main()
