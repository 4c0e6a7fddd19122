"""Is a monomial law from two measured shapes safe? Per model, every size in a range is profiled once (traced);
then for every pair of them as the only measured shapes, every other size of the range is derived by the monomial
law (`symbolic_sizes.monomial_law`) with no run and compared, every size field, with its own profile: right,
wrong (a silent wrong result) or refused (measured): as the default derives (at multiples of the gcd of the
sizes the law holds at; from two sizes, between them only), without the span rule, without either. Then for
sampled triples as the only measured sizes: the monomial law as the default, the affine law (`shape_law`) with
the gcd rule (as the default asks it, where the monomial law is refused) and without it (as before).
Each cell: laws found / sets tried: right / **wrong** / refused, over the sizes each set did not measure.

    PYTHONPATH=. python benchmarks/shapes_monomial.py

Models (stages given, CPU, 1 thread): the small GPT of tests/test_symbolic_sizes.py over lengths; a sequence
padded to a multiple of 8; one with a class token (`L + 1`); two unpadded 3x3 convolutions, the second of
stride 2 (`(H - 4) // 2`), over sides; a small ConvNeXt (stride-4 stem, three stride-2 downsamplings) over sides.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor.models.convnext import ConvNeXt
from lightning_rotor.models.gpt import gpt
from lightning_rotor.profile import profile_chain
from lightning_rotor.size_trace import traced
from lightning_rotor.symbolic_sizes import MonomialLaw, TracedShape, monomial_law, shape_law, traced_shape

TIMES = ("fwd_time", "bwd_time")
TRIPLES = 120  # sampled per model


class PadToEight(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(x, (0, 0, 0, -x.shape[1] % 8)) * 2


class ClassToken(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.token.expand(x.shape[0], 1, 8), x], dim=1)


def models() -> dict[str, tuple[list[nn.Module], Callable[[int], torch.Tensor], list[int], dict[str, Any]]]:
    torch.manual_seed(0)
    small_gpt = list(gpt(vocab_size=64, block_size=128, n_layer=2, n_head=2, n_embd=32, dropout=0.0))
    convnext = ConvNeXt(depths=(1, 1, 1, 1), dims=(8, 16, 32, 64), num_classes=10)
    g = torch.Generator().manual_seed(0)
    return {
        "gpt (length)": (small_gpt, lambda n: torch.randint(0, 64, (2, n), generator=g), list(range(4, 41, 2)), {}),
        "pad to 8 (length)": (
            [nn.Linear(8, 8), PadToEight(), nn.Linear(8, 8)],
            lambda n: torch.randn(2, n, 8, generator=g),
            list(range(4, 41)),
            {},
        ),
        "class token (length)": (
            [nn.Linear(8, 8), ClassToken(), nn.Linear(8, 8)],
            lambda n: torch.randn(2, n, 8, generator=g),
            list(range(4, 41, 2)),
            {},
        ),
        "unpadded convs (side)": (
            [nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2), nn.ReLU()],
            lambda n: torch.randn(2, 3, n, n, generator=g),
            list(range(8, 41)),
            {},
        ),
        "convnext (side)": (
            [convnext.stem, *convnext.stages],
            lambda n: torch.randn(2, 3, n, n, generator=g),
            list(range(32, 225, 8)),
            {"loss_tmp": 0},
        ),
    }


def sizes(chain: Any) -> dict[str, Any]:
    return {k: v for k, v in chain.to_dict().items() if k not in TIMES}


def verdicts(law: Any, measured: dict[int, tuple[TracedShape, dict[str, Any]]], skip: set[int]) -> list[str]:
    """Per size not in `skip`: "right", "wrong" or "refused", of `law.chain` at it against its profile."""
    out = []
    for n, (_, chain) in measured.items():
        if n in skip:
            continue
        if isinstance(law, MonomialLaw):
            found = law.chain((n,))
        else:  # the affine law: at multiples of its divisor only, as `ShapeLaws` asks it (1 before)
            found = law.chain(n) if n % law.divisor == 0 else None
        found = found if isinstance(found, tuple) else "refused"
        out.append("refused" if isinstance(found, str) else "right" if sizes(found[1]) == chain else "wrong")
    return out


def tally(laws: list[tuple[Any, set[int]]], measured: dict[int, tuple[TracedShape, dict[str, Any]]]) -> str:
    """`with a law / tried: right / wrong / refused` over every size each law was not measured at."""
    counts = dict.fromkeys(("right", "wrong", "refused"), 0)
    found = [(law, skip) for law, skip in laws if not isinstance(law, str)]
    for law, skip in found:
        for v in verdicts(law, measured, skip):
            counts[v] += 1
    return f"{len(found)}/{len(laws)}: {counts['right']} / **{counts['wrong']}** / {counts['refused']}"


def main() -> None:
    torch.set_num_threads(1)
    rng = random.Random(0)
    print(
        "| model | sizes | 2 measured: monomial (the default) | same, no span rule | same, no rules | 3 measured: "
        "monomial (the default) | 3 measured: affine | same, no gcd rule (before) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, (stages, make, sizes_, options) in models().items():
        measured = {}
        for n in sizes_:
            x = make(n)
            with traced() as trace:
                chain = profile_chain(stages, x, repeats=1, timed=False, **options).chain
            again = profile_chain(stages, x, repeats=1, timed=False, **options).chain
            measured[n] = (traced_shape(n, trace, chain, None), sizes(again))
        pairs = list(itertools.combinations(sizes_, 2))
        two = [(monomial_law([(a,), (b,)], [measured[a][0], measured[b][0]]), {a, b}) for a, b in pairs]
        bare = [
            (dataclasses.replace(law, divisors={}, spans={}), skip) for law, skip in two if not isinstance(law, str)
        ]
        gcd_only = [(dataclasses.replace(law, spans={}), skip) for law, skip in two if not isinstance(law, str)]
        triples = rng.sample(list(itertools.combinations(sizes_, 3)), min(TRIPLES, len(sizes_) ** 3))
        three = [(monomial_law([(n,) for n in t], [measured[n][0] for n in t]), set(t)) for t in triples]
        affine = [(shape_law([dataclasses.replace(measured[n][0], size=n) for n in t]), set(t)) for t in triples]
        before = [(dataclasses.replace(law, divisor=1), skip) for law, skip in affine if not isinstance(law, str)]
        print(
            f"| {name} | {sizes_[0]}..{sizes_[-1]} ({len(sizes_)}) | {tally(two, measured)} | "
            f"{tally(gcd_only, measured)} | {tally(bare, measured)} | {tally(three, measured)} | "
            f"{tally(affine, measured)} | {tally(before, measured)} |"
        )


if __name__ == "__main__":
    main()
