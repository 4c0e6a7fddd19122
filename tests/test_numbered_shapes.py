"""A later shape measured with its storages numbered only (lightning_rotor/size_trace.py `StorageNumbers`), not
traced: its chain is the one a traced profile measures there, to the byte, and its trace (`numbered_shape`: a traced
shape's guards, peaks and rows with its own storages) is the one a traced profile there records, array for array; a
family's first shape is numbered and takes its next shape's trace; one numbered where no trace holds (other ops)
keeps its measured chain, untraced, and its family is traced from then on (lightning_rotor/symbolic_sizes.py
`ShapeLaws`)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from fitting import KeepRotorModules, fit_both
from test_shapes import LM, batch, small_gpt
from test_symbolic_sizes import (
    LengthBatches,
    StepPeaks,
    convnext_stages,
    gpt_stages,
    image,
    sizes,
    tiny_gpt2,
    tokens,
)
from torch.utils.data import DataLoader

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning import RotorCallback, RotorStrategy
from lightning_rotor.models.gpt import lm_loss
from lightning_rotor.profile import profile_chain
from lightning_rotor.size_trace import SizeTrace, StorageNumbers, traced
from lightning_rotor.symbolic_sizes import ShapeLaws, TracedShape, chain_sizes, numbered_shape, traced_shape


def traced_at(stages, x, names=None):
    with traced() as trace:
        chain = profile_chain(stages, x, names=names, repeats=1, timed=False).chain
        shape = traced_shape(0, trace, chain, None)  # inside: a peak's guards are recorded as its terms are read
    return shape, trace


def numbered_at(stages, x):
    with traced(StorageNumbers()) as numbers:
        chain = profile_chain(stages, x, repeats=1, timed=False).chain
    return chain, numbers


def storage_sizes(shape: TracedShape) -> np.ndarray:
    return shape.itemsizes * np.prod(shape.dims, axis=1)


def assert_derives_right(got: TracedShape, want: TracedShape, others: list[TracedShape]) -> None:
    """`got` (a numbered shape's trace) has `want`'s (a traced profile's there) storages and chain, and at every
    other traced shape where its guards hold, its rows give that shape's measured chain to the byte (held at one at
    least). Its guards need not be `want`'s: where two levels of a peak are equal here, a trace taken here keeps the
    first as the peak, the traced shape it came from the other, the same bytes here."""
    assert np.array_equal(got.dims, want.dims) and np.array_equal(got.itemsizes, want.itemsizes)
    assert got.ranks == want.ranks and sizes(got.chain) == sizes(want.chain)
    assert got.guards_hold(storage_sizes(want))
    assert got.held_sizes(storage_sizes(want)) == chain_sizes(want.chain)
    held = 0
    for other in others:
        at = storage_sizes(other)
        if got.ranks == other.ranks and got.guards_hold(at):
            assert got.held_sizes(at) == chain_sizes(other.chain)
            held += 1
    assert held >= 1


@pytest.mark.parametrize(
    "make, shapes",
    [
        (gpt_stages, [tokens(2, n) for n in (24, 28, 20, 26, 32)]),
        (convnext_stages, [image(2, n) for n in (64, 72, 56, 80)]),
        (convnext_stages, [image(n, 64) for n in (4, 3, 2, 5)]),  # a partial last batch
    ],
    ids=["gpt-length", "convnext-side", "convnext-batch"],
)
def test_a_numbered_shape_has_the_chain_a_traced_profile_measures_and_a_trace_that_derives_right(make, shapes):
    stages = make()
    base, _ = traced_at(stages, shapes[0])
    chain, numbers = numbered_at(stages, shapes[1])
    want, trace = traced_at(stages, shapes[1])
    assert chain.to_dict() == want.chain.to_dict()  # every field: a numbered profile is an untraced one
    assert numbers.storages == trace.storages and not isinstance(numbers, SizeTrace)
    got = numbered_shape(numbers, chain, None, [base])
    assert got is not None
    assert_derives_right(got, want, [traced_at(stages, x)[0] for x in shapes[2:]])


def test_a_numbered_shape_no_trace_holds_at_has_none_and_its_family_is_traced_from_then_on():
    """A ConvNeXt at side 72 first (numbered only, a family's first shape), 64 traced (72 takes its trace), then 48:
    its last stage is 1x1 there and runs other ops, so no trace holds; numbered anyway, it keeps its measured chain,
    untraced, and the next shape is traced."""
    stages, laws = convnext_stages(), ShapeLaws()
    for n, kind in ((72, StorageNumbers), (64, SizeTrace)):
        key = ("family", ((2, 3, n, n),))
        with laws.tracing(True, key=key) as trace:
            assert type(trace) is kind  # the first shape numbered only, the next traced
            laws.add(*key, trace, profile_chain(stages, image(2, n), repeats=1, timed=False).chain, None)
    assert laws.numbered == [("family", ((2, 3, 72, 72),))] and laws.measured[0][2] is not None
    chain, numbers = numbered_at(stages, image(2, 48))
    assert laws.add("family", ((2, 3, 48, 48),), numbers, chain, None).to_dict() == chain.to_dict()
    assert laws.missed == [("family", ((2, 3, 48, 48),))] and laws.measured[-1][2] is None
    with laws.tracing(True, key=("family", ((2, 3, 80, 80),))) as trace:
        assert isinstance(trace, SizeTrace)  # near 72, but its family missed once: traced


def test_a_family_s_first_shape_is_numbered_and_takes_the_trace_of_its_next_shape():
    """NOTE: [the first shape numbered] The small GPT at 20, then 32: 20 takes 32's trace, which holds there though
    another op is the largest of some stages at 32 (a peak is a variable: NOTE: [peak variables]), with its own
    storages' dimensions. Its chain is the one a traced profile measures there, and the trace derives the chains
    of other traced shapes to the byte."""
    stages, laws = list(small_gpt()), ShapeLaws()
    for n in (20, 32):
        key = ("family", ((2, n),))
        with laws.tracing(True, key=key) as trace:
            laws.add(*key, trace, profile_chain(stages, tokens(2, n), repeats=1, timed=False).chain, None)
    (_, _, got, chain, _), (_, _, second, _, _) = laws.measured
    want, _ = traced_at(stages, tokens(2, 20))
    assert got is not None and second is not None and sizes(chain) == sizes(want.chain)
    assert laws.numbered == [("family", ((2, 20),))]
    assert_derives_right(got, want, [traced_at(stages, tokens(2, n))[0] for n in (8, 28, 30, 32)])


def test_a_first_shape_no_trace_holds_at_borrows_one_that_ran_the_same_ops():
    """`numbered_shape(..., borrow=True)`, as a family's first shape takes its next shape's trace: where the
    trace's guards do not hold at the numbered shape, it is borrowed all the same (a trace is exact wherever its
    guards hold, whichever shape it was taken at), with the numbered storages' dimensions; without `borrow`, None."""
    stages = gpt_stages()
    base, _ = traced_at(stages, tokens(2, 24))
    failing = dataclasses.replace(base, allowed=np.zeros_like(base.allowed))  # no guard's outcome holds anywhere
    chain, numbers = numbered_at(stages, tokens(2, 20))
    assert numbered_shape(numbers, chain, None, [failing]) is None
    got = numbered_shape(numbers, chain, None, [failing], borrow=True)
    want, _ = traced_at(stages, tokens(2, 20))
    assert got is not None and got.guards is failing.guards and not got.guards_hold(storage_sizes(want))
    assert np.array_equal(got.dims, want.dims) and sizes(got.chain) == sizes(want.chain)


def steps(rotor, lengths):
    for step, n in enumerate(lengths):
        x, y = batch(n)
        rotor.zero_grad()
        torch.manual_seed(step)
        lm_loss(rotor(x), y).backward()


def test_a_later_shape_is_numbered_where_its_regime_is_a_traced_one_s_and_traced_where_not():
    """The small GPT: 18 first (numbered only), 20 traced; 24 is in 20's regime (numbered); 8 is not (traced: at the
    sizes its storages likely have, another op is some stage's largest, and its trace's tops serve the shapes
    beyond the measured sizes, NOTE: [peak variables]); every measured shape's chain and trace are those of the
    small GPT traced at that length."""
    rotor = Checkpointable(small_gpt(), "60%", repeats=1)
    steps(rotor, (18, 20, 24, 8))
    laws = rotor.chain_state._laws
    assert [d for _, d in laws.numbered] == [((2, 18),), ((2, 24),)] and not laws.missed
    for _, dims, shape, chain, _ in laws.measured:
        want, _ = traced_at(list(rotor.stages), tokens(2, dims[0][1]), rotor.stage_names)
        assert shape is not None and sizes(chain) == sizes(want.chain)
        assert_derives_right(shape, want, [m[2] for m in laws.measured if m[2] is not None])


def test_hugging_face_gpt2_numbers_a_later_length_with_the_code_around_its_run_and_keeps_its_sizes():
    """GPT-2 from its config, a module-level chain (the code around the run measured in the numbering its profile
    goes on with): a later length is numbered, and its chain (the code around the run charged to it) and its trace
    are those of GPT-2 traced at that length first."""
    pytest.importorskip("transformers")

    def measured(lengths):
        rotor = Checkpointable(tiny_gpt2(), "70%", repeats=1)
        for step, n in enumerate(lengths):
            x = tokens(2, n)
            rotor.zero_grad()
            torch.manual_seed(step)
            rotor(input_ids=x, labels=x).loss.backward()
        return rotor.chain_state._laws

    numbered, traced = measured((36, 32)), measured((32, 36))  # a family's first shape is numbered only
    assert [d for _, d in numbered.numbered] == [((2, 36), (2, 36))]
    assert [d for _, d in traced.numbered] == [((2, 32), (2, 32))]
    got, want = numbered.measured[0], traced.measured[-1]
    assert got[:2] == want[:2] and sizes(got[3]) == sizes(want[3])
    assert got[2] is not None and want[2] is not None
    assert_derives_right(got[2], want[2], [m[2] for m in numbered.measured if m[2] is not None])


# dynamic padding's lengths: 20 numbered (the first), 22 traced; 18 (beyond the two) and 21 (odd: off the even
# sizes measured) numbered; 8 and 30 traced (beyond the measured sizes, where another op is a stage's largest); 12
# and 26 derived
NEAR = (20, 22, 18, 21, 8, 30, 12, 26)


def test_the_trainer_numbers_near_lengths_and_trains_bitwise_within_budget(tmp_path):
    """A real Trainer and `RotorStrategy` (the defaults): the later lengths near the first's regime are measured
    numbered; every step bitwise equal to plain training's and measured within its budget, at most its plan's
    predicted peak."""
    keep, loader, peaks = KeepRotorModules(), DataLoader(LengthBatches(NEAR), batch_size=None), StepPeaks()
    measure = RotorCallback(measure_every_n_steps=1, log_curves=False, print_summary=False)
    runs = fit_both(tmp_path, LM, loader, len(NEAR), RotorStrategy(mem_limit="60%"), [keep, measure, peaks])
    rotor = keep.modules["net"]
    laws = rotor.chain_state._laws
    assert peaks.checked == len(NEAR) - 1 and len(rotor.entries) == len(NEAR)
    assert [d[0][1] for _, d in laws.numbered] == [20, 18, 21] and not laws.missed
    assert [d[0][1] for _, d, shape, _, _ in laws.measured if shape is not None] == [20, 22, 18, 21, 8, 30]
    assert sorted(rotor.chain_state._shapes[k] for k in rotor.fitted) == ["(2, 12)", "(2, 26)"]
    for a_step, b_step in zip(runs["rotor"].grads, runs["plain"].grads, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(a_step, b_step, strict=True))


def test_a_partial_batch_of_a_small_batch_is_numbered_and_keeps_its_sizes():
    """Batch 2, then a last batch of 3: a guess that scaled every even dimension by 3/2 (a width of 32 is a multiple
    of a batch of 2) took the shape for another regime and traced it; the batch scales only what it multiplies."""
    rotor = Checkpointable(small_gpt(), "60%", repeats=1)
    for step, rows in enumerate((6, 2, 3)):  # 6 numbered (the first), 2 traced, 3 guessed from 2's trace
        x = torch.randint(0, 64, (rows, 24), generator=torch.Generator().manual_seed(rows))
        rotor.zero_grad()
        torch.manual_seed(step)
        lm_loss(rotor(x), x).backward()
    laws = rotor.chain_state._laws
    assert [d for _, d in laws.numbered] == [((6, 24),), ((3, 24),)] and not laws.missed
    want, _ = traced_at(list(rotor.stages), x, rotor.stage_names)
    assert sizes(laws.measured[-1][3]) == sizes(want.chain)


def test_two_traced_lengths_record_the_same_guards_and_peaks_constants_too():
    """The small GPT traced at lengths 24 and 28 records the same guards and peak variables, their constants too.
    The bound on a chain's total bytes (a sum with `abs` of signed sizes, which leaves the sums: a constant that
    moves with the shape) was a guard before, the one guard whose constant differed between the two."""
    stages = gpt_stages()
    _, a = traced_at(stages, tokens(2, 24))
    _, b = traced_at(stages, tokens(2, 28))
    assert len(a.guards) > 50 and len(a.peaks) > 10
    assert [(g[0], g[1], g[2], g[3]) for g in a.guards] == [(g[0], g[1], g[2], g[3]) for g in b.guards]
    assert a.peaks == b.peaks
