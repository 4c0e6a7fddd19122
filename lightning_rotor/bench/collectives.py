"""Counting FSDP2's collectives, for the sharded benchmarks and tests: what a step all-gathers and reduce-scatters."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

COLLECTIVES = (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter"))


def count_collectives(counts: dict[str, int]) -> None:
    """From now on in this process, add each all-gather and reduce-scatter to `counts` ("all_gather",
    "reduce_scatter"). FSDP2 (torch 2.13) calls them through torch.distributed's module attributes."""
    for name, key in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args: Any, _original: Any = original, _key: str = key, **kwargs: Any) -> Any:
            counts[_key] = counts.get(_key, 0) + 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
