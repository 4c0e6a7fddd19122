"""RecordRandom / ReplayRandom: a replay draws its first run's numbers and never moves the default generator."""

import copy
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.rng import GeneratorWatch, RecordRandom, ReplayFrom, ReplayRandom, Rewind

X = torch.randn(4, 8)
USER = torch.Generator()

RANDOM_CALLS = {
    "dropout": lambda: F.dropout(X, 0.2, True),
    "alpha_dropout": lambda: F.alpha_dropout(X, 0.2, True),
    "native_dropout (no generator overload)": lambda: torch.native_dropout(X, 0.3, True)[0],
    "rrelu": lambda: F.rrelu(X, training=True),
    "rand_like": lambda: torch.rand_like(X),
    "randn_like": lambda: torch.randn_like(X),
    "randint_like": lambda: torch.randint_like(X, 10),
    "rand": lambda: torch.rand(3),
    "randn float64": lambda: torch.randn(3, dtype=torch.float64),
    "randperm": lambda: torch.randperm(5),
    "randint": lambda: torch.randint(0, 9, (4,)),
    "multinomial": lambda: torch.multinomial(torch.ones(5), 2),
    "bernoulli": lambda: torch.bernoulli(torch.full((3,), 0.5)),
    "poisson": lambda: torch.poisson(torch.ones(3)),
    "normal": lambda: torch.normal(torch.zeros(3), 1.0),
    "sdpa with dropout": lambda: F.scaled_dot_product_attention(
        X[None, None], X[None, None], X[None, None], dropout_p=0.3
    ),
    "a user's generator": lambda: torch.rand(3, generator=USER),
    "two draws": lambda: torch.rand(2) + F.dropout(torch.ones(2), 0.5, True),
}


@pytest.mark.parametrize("name", list(RANDOM_CALLS))
def test_replay_draws_the_first_runs_numbers_and_leaves_the_generators_alone(name):
    call = RANDOM_CALLS[name]
    torch.manual_seed(0)
    USER.manual_seed(1)
    record = RecordRandom()
    with record:
        first = call()
    assert record.states
    after_first = torch.get_rng_state(), USER.get_state()
    plain = call()  # what the next draw would be without a replay in between
    torch.set_rng_state(after_first[0])
    USER.set_state(after_first[1])
    for _ in range(2):
        with ReplayRandom(record.states, "0"):
            assert torch.equal(call(), first)
        assert torch.equal(torch.get_rng_state(), after_first[0]) and torch.equal(USER.get_state(), after_first[1])
    assert torch.equal(call(), plain)


def test_recording_does_not_change_what_is_drawn():
    torch.manual_seed(0)
    plain = F.dropout(torch.ones(64), 0.5, True)
    torch.manual_seed(0)
    with RecordRandom():
        recorded = F.dropout(torch.ones(64), 0.5, True)
    assert torch.equal(plain, recorded)


def test_a_replay_drawing_more_than_the_first_run_is_one_clear_error():
    record = RecordRandom()
    with record:
        torch.rand(2)
    with pytest.raises(RuntimeError, match="stage 3 draws different random numbers when recomputed"):
        with ReplayRandom(record.states, "3"):
            torch.rand(2)
            torch.rand(2)


def test_replay_from_a_watch_draws_the_same_sequence_and_leaves_the_generator_alone():
    torch.manual_seed(0)
    watch = GeneratorWatch([torch.device("cpu")])
    assert not watch.moved()
    first = [F.dropout(torch.ones(16), 0.5, True), torch.rand(3), torch.native_dropout(X, 0.3, True)[0]]
    assert watch.moved()
    after = torch.get_rng_state()
    with ReplayFrom(watch):
        again = [F.dropout(torch.ones(16), 0.5, True), torch.rand(3), torch.native_dropout(X, 0.3, True)[0]]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert torch.equal(torch.get_rng_state(), after)


def test_rewind_draws_the_watched_sequence_and_puts_the_generator_back():
    torch.manual_seed(0)
    watch = GeneratorWatch([torch.device("cpu")])
    first = [F.dropout(torch.ones(16), 0.5, True), torch.native_dropout(X, 0.3, True)[0]]
    after = torch.get_rng_state()
    with Rewind(watch):
        again = [F.dropout(torch.ones(16), 0.5, True), torch.native_dropout(X, 0.3, True)[0]]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert torch.equal(torch.get_rng_state(), after)


class DropBlock(nn.Module):
    """A stage with dropout that notes the dispatch mode each of its forwards runs under."""

    modes: list = []

    def __init__(self):
        super().__init__()
        self.lin, self.drop = nn.Linear(32, 32), nn.Dropout(0.3)

    def forward(self, x):
        DropBlock.modes.append(_get_current_dispatch_mode())
        return torch.tanh(self.drop(self.lin(x)))


# Run in a fresh interpreter: threads that other tests leave behind (or that are still ending) must not
# decide which path is taken. One interpreter runs the three cases in turn, each thread joined before the next
# case starts, one line each: "<case> <alone()> <modes seen>".
_ALONE = """
import sys, threading
sys.path.insert(0, {tests!r})
from test_rng import _train_and_note_modes
from lightning_rotor.rng import alone
for other in {cases!r}:
    stop = threading.Event()
    thread = None
    if other is not None:
        thread = threading.Thread(target=stop.wait, daemon=other == "daemon")
        thread.start()
    try:
        print(other, alone(), sorted(m.__name__ if m else "none" for m in _train_and_note_modes()))
    finally:
        stop.set()
        if thread is not None:
            thread.join()
"""
OTHERS = [None, "daemon", "thread"]


@pytest.fixture(scope="module")
def alone_runs():
    """Each case's line of `_ALONE`, run once for the three tests below."""
    code = _ALONE.format(tests=os.path.dirname(os.path.abspath(__file__)), cases=OTHERS)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()[-len(OTHERS) :]
    return {
        other: line.split(" ", 1)[1] for other, line in zip(OTHERS, lines, strict=True) if line.startswith(str(other))
    }


@pytest.mark.slow
@pytest.mark.parametrize("other", OTHERS)
def test_alone_recomputed_dropout_stages_run_with_no_mode_and_train_like_plain(other, alone_runs):
    """No other thread that may draw (none, or only a daemon service thread): the first run only notes the
    generator and the replay rewinds it (no per-op dispatch). An ordinary thread selects the exact modes."""
    expected = "True ['none']" if other != "thread" else "False ['RecordRandom', 'ReplayRandom', 'none']"
    assert alone_runs[other] == expected


def _train_and_note_modes():
    torch.manual_seed(0)
    plain = nn.Sequential(*[DropBlock() for _ in range(6)], nn.Linear(32, 4))
    rotor = Checkpointable(copy.deepcopy(plain), 0.6, repeats=1, warmup=0)
    x, y = torch.randn(64, 32), torch.randint(4, (64,))

    def step(model):
        torch.manual_seed(5)
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        return torch.get_rng_state()

    step(rotor)  # profiles and plans
    assert rotor.plan.recomputed_stages > 0
    seen = set()
    for _ in range(2):
        DropBlock.modes.clear()
        after_rotor = step(rotor)
        assert len(DropBlock.modes) > 6  # some stages ran twice: recomputed
        seen |= {m if m is None else type(m) for m in DropBlock.modes}
        after_plain = step(plain)
        assert torch.equal(after_rotor, after_plain)  # the generator ends where plain training leaves it
        for a, b in zip(plain.parameters(), rotor.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
    return seen


class Interfere(TorchDispatchMode):
    """Another draw from the default generator just before every random op: a thread drawing in the window."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and (kwargs or {}).get("generator") is None:
            torch.empty(4).uniform_()
        return func(*args, **(kwargs or {}))


@pytest.fixture
def another_thread():
    """A second Python thread alive (idle): the refill of tensor-filling ops is done only then."""
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    yield
    stop.set()
    thread.join()


def test_an_op_filling_a_tensor_is_exact_even_when_another_draw_lands_before_it(another_thread):
    torch.manual_seed(0)
    plain = F.dropout(torch.ones(64), 0.5, True)  # bernoulli_ on a new mask
    torch.manual_seed(0)
    record = RecordRandom()
    with Interfere(), record:
        first = F.dropout(torch.ones(64), 0.5, True)
    assert torch.equal(first, plain)  # the numbers of the state before the interfering draw
    with ReplayRandom(record.states, "0"):
        assert torch.equal(F.dropout(torch.ones(64), 0.5, True), first)
