"""Acceptance models for discovery, written as users write them (no nn.Sequential chain).

The ResNet, the nanoGPT-style GPT and the transformers GPT-2 live in
`lightning_rotor.models.as_written` (the bench trains them too); the U-Net and the
branching models are here.
"""

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor.models.as_written import GPT, MLP, BasicBlock, Block, CausalSelfAttention, ResNet, gpt2

__all__ = [
    "GPT",
    "MLP",
    "BasicBlock",
    "Block",
    "CausalSelfAttention",
    "Clamp",
    "DoubleConv",
    "Gated",
    "ResNet",
    "UNet",
    "Up",
    "WithInnerBranch",
    "gpt2",
]


# -- U-Net with long skips ---------------------------------------------------------------------------
class DoubleConv(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(cin, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
            nn.Conv2d(cout, cout, 3, padding=1),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )

    def forward(self, x):
        return self.conv(x)


class Up(nn.Module):
    def __init__(self, cin, cout):
        super().__init__()
        self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
        self.conv = DoubleConv(cin, cout)

    def forward(self, x1, x2):
        x1 = self.up(x1)
        diff_y = x2.size()[2] - x1.size()[2]
        diff_x = x2.size()[3] - x1.size()[3]
        if diff_y or diff_x:
            x1 = F.pad(x1, [diff_x // 2, diff_x - diff_x // 2, diff_y // 2, diff_y - diff_y // 2])
        return self.conv(torch.cat([x2, x1], dim=1))


class UNet(nn.Module):
    def __init__(self, in_channels=3, n_classes=2, width=4):
        super().__init__()
        w = width
        self.inc = DoubleConv(in_channels, w)
        self.down1 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(w, 2 * w))
        self.down2 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(2 * w, 4 * w))
        self.down3 = nn.Sequential(nn.MaxPool2d(2), DoubleConv(4 * w, 8 * w))
        self.up1 = Up(8 * w, 4 * w)
        self.up2 = Up(4 * w, 2 * w)
        self.up3 = Up(2 * w, w)
        self.outc = nn.Conv2d(w, n_classes, 1)

    def forward(self, x):
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x = self.up1(x4, x3)
        x = self.up2(x, x2)
        x = self.up3(x, x1)
        return self.outc(x)


class ReluUNet(nn.Module):
    """issue 15's U-Net: conv-BN-ReLU blocks, so each skip is a ReLU output that the ReLU saves itself."""

    def __init__(self, c=8):
        super().__init__()

        def conv(a, b):
            return nn.Sequential(nn.Conv2d(a, b, 3, padding=1), nn.BatchNorm2d(b), nn.ReLU())

        self.d1, self.d2, self.d3 = conv(3, c), conv(c, 2 * c), conv(2 * c, 4 * c)
        self.mid = conv(4 * c, 4 * c)
        self.u3, self.u2, self.u1 = conv(8 * c, 2 * c), conv(4 * c, c), conv(2 * c, c)
        self.out = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        s1 = self.d1(x)
        s2 = self.d2(F.max_pool2d(s1, 2))
        s3 = self.d3(F.max_pool2d(s2, 2))
        h = self.u3(torch.cat([self.mid(s3), s3], 1))
        h = self.u2(torch.cat([F.interpolate(h, scale_factor=2.0), s2], 1))
        h = self.u1(torch.cat([F.interpolate(h, scale_factor=2.0), s1], 1))
        return self.out(h)


# -- a value-dependent branch in the top-level forward --------------------------------------------
class Gated(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(3)])

    def forward(self, x):
        x = self.a(x)
        if x.mean() > 0:  # value-dependent
            x = self.b(x)
        for block in self.blocks:
            x = block(x)
        return self.c(x)


# -- a value-dependent branch inside a submodule ------------------------------------------------------
class Clamp(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        y = self.lin(x)
        if y.abs().max() > 1:
            y = y / y.abs().max()
        return y


class WithInnerBranch(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.clamp = Clamp(width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        return self.out(torch.relu(self.clamp(self.inp(x))))
