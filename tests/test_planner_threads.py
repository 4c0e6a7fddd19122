"""The C++ tables filled on several threads give exactly the single-threaded plan (cost and ops)."""

import random

import pytest

from lightning_rotor import _planner
from lightning_rotor.chain import Chain
from lightning_rotor.planner import min_feasible_budget, plan, solve_discretized
from lightning_rotor.simulate import no_recompute_peak


def random_chain(rng: random.Random, length: int, release: bool = False) -> Chain:
    out = [rng.choice([0, 1, 3, 8, 20, 55]) for _ in range(length)]
    released = {}
    if release:  # chain version 3: outputs their graphs do not keep, stage inputs neither graph keeps
        out_free = [rng.choice([0, o // 2, o]) for o in out]
        released = dict(out_free=out_free, in_free=[0] + [rng.randint(0, f) for f in out_free[:-1]])
    return Chain(
        input_size=rng.randint(0, 40),
        out_size=out,
        saved_size=[o + rng.choice([0, 0, 5, 17, 40]) for o in out],
        fwd_time=[rng.choice([0.0, 0.25, 1.0, 1.5, 3.0, 0.1]) for _ in range(length)],
        bwd_time=[rng.choice([0.0, 0.5, 1.0, 2.0, 7.0]) for _ in range(length)],
        fwd_tmp=[rng.choice([0, 0, 3, 20]) for _ in range(length)],
        fwd_tmp_nograd=[rng.choice([0, 2, 9, 30]) for _ in range(length)],
        bwd_tmp=[rng.choice([0, 0, 4, 25]) for _ in range(length)],
        loss_tmp=rng.choice([0, 6, 30]),
        **released,
    )


def solve(chain, budget, slots, threads):
    return solve_discretized(chain, budget, slots, threads)


@pytest.mark.parametrize("seed", range(40))
def test_threads_give_identical_plans(seed):
    rng = random.Random(seed)
    chain = random_chain(rng, rng.choice([1, 2, 7, 8, 9, 17, 33, 60]), release=seed % 2 == 1)
    low, high = min_feasible_budget(chain), no_recompute_peak(chain)
    for _ in range(3):
        budget = max(1, int(low + rng.uniform(-0.05, 1.1) * (high - low)))
        slots = rng.choice([40, 200, 500])
        single = solve(chain, budget, slots, threads=1)
        for threads in (2, 3, 8):  # more threads than cores too: other interleavings
            assert solve(chain, budget, slots, threads=threads) == single


def test_default_threads_and_plan_argument():
    assert 1 <= _planner.default_threads() <= 2
    chain = random_chain(random.Random(7), 30)
    one, two = plan(chain, 0.4, threads=1), plan(chain, 0.4, threads=2)
    assert one.ops == two.ops and one.time == two.time and one.peak == two.peak
    assert plan(chain, 0.4).ops == one.ops
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            plan(chain, 0.4, threads=bad)
