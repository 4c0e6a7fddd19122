"""On CUDA the profiler can run warm-up rounds before its timing rounds (`CUDA_WARMUP_ROUNDS`, 0 by default: NOTE:
[warm timing rounds on CUDA]); elsewhere none, so that CPU figures stay as they were. Counted by the forward calls
of the first stage: a timing round runs it twice (its `Fe`, then the forward without grad that makes the next
stage's input), the memory runs as often with and without timing rounds (`timed=False` runs none)."""

import pytest
import torch
from torch import nn

from lightning_rotor import profile
from lightning_rotor.profile import profile_chain

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


def first_stage_calls(stages: list[nn.Module], x: torch.Tensor, timed: bool) -> tuple[int, int]:
    """(forward calls of stage 0 while profiling, timing rounds run)."""
    calls = []
    handle = stages[0].register_forward_hook(lambda *_: calls.append(1))
    try:
        measured = profile_chain(stages, x, timed=timed)
    finally:
        handle.remove()
    return len(calls), measured.repeats if timed else 0


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_rounds_run_on_cuda_only(device, monkeypatch):
    """The same timed profile with 0 and 1 warm-up round: on CUDA one round more of stage 0's two forwards, on CPU
    the same calls (the walk's first timing sample stands there; on CUDA the rounds take every sample). One round,
    since warm-up rounds stop as timing rounds do, once two are settled (asked for 3, an H200 ran 2)."""
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()).to(device) for _ in range(3)]
    x = torch.randn(4, 16, device=device)
    counts = []
    for warm in (0, 1):
        monkeypatch.setattr(profile, "CUDA_WARMUP_ROUNDS", warm)
        calls, rounds = first_stage_calls(stages, x, timed=True)
        assert rounds >= profile.MIN_ROUNDS
        counts.append(calls - 2 * rounds)  # what is not a timing round: the walk, the warm-up
    assert counts[1] - counts[0] == (2 if device == "cuda" else 0)
