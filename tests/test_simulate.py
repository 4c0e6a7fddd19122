"""Simulator: curve, peak and time on a hand-computed chain; invalid plans name the op and the reason."""

import pytest

from lightning_rotor.chain import Chain
from lightning_rotor.simulate import no_recompute_ops, no_recompute_peak, simulate


@pytest.fixture
def chain():
    # s = [10, 20, 5], sb = [30, 8]
    return Chain(
        input_size=10,
        out_size=[20, 5],
        saved_size=[30, 8],
        fwd_time=[1.0, 2.0],
        bwd_time=[3.0, 4.0],
        fwd_tmp=[3, 1],
        bwd_tmp=[4, 2],
        loss_tmp=6,
    )


def test_no_recompute_by_hand(chain):
    sim = simulate(chain, no_recompute_ops(2))
    # Fe0: 10+30 | Fe1: +8 | Loss: +δ_2 (5) | B1: +δ_1 20 - ā_2 8 - δ_2 5 | B0: +δ_0 10 - ā_1 30 - δ_1 20
    assert sim.curve == [40, 48, 53, 60, 20]
    # peaks during: Fe0 43, Fe1 49, Loss 48+5+6=59, B1 53+20+2=75, B0 60+10+4=74
    assert sim.peak == 75 == no_recompute_peak(chain)
    assert sim.time == 10.0


def test_recompute_plan_by_hand(chain):
    ops = [("Fc", 0), ("Fn", 1), ("Loss",), ("Fe", 0), ("Fe", 1), ("B", 1), ("B", 0)]
    sim = simulate(chain, ops)
    # Fc0 keeps a_0: 30 | Fn1 drops a_1: 15 | Loss drops plain a_2, adds δ_2: 15 | Fe0 45 | Fe1 53 | B1 60 | B0 20
    assert sim.curve == [30, 15, 15, 45, 53, 60, 20]
    assert sim.peak == 75
    assert sim.time == 13.0


def test_json_shaped_ops_accepted(chain):
    ops = [["Fe", 0], ["Fe", 1], ["Loss"], ["B", 1], ["B", 0]]
    assert simulate(chain, ops).peak == 75


@pytest.mark.parametrize(
    ("ops", "where", "why"),
    [
        ([("Fe", 0), ("B", 0)], "op 1 (B 0)", "backward before the loss"),
        ([("Fe", 0), ("Fe", 1), ("Loss",), ("B", 0)], "op 3 (B 0)", "expected B 1"),
        ([("Fe", 0), ("Fn", 1)], "op 1 (Fn 1)", "without graph"),
        ([("Fe", 1)], "op 0 (Fe 1)", "not held"),
        ([("Fe", 0), ("Fe", 5)], "op 1 (Fe 5)", "out of range"),
        ([("Fc", 0), ("Loss",)], "op 1 (Loss)", "chain output"),
        ([("Fe", 0), ("Fe", 1), ("Loss",), ("Loss",)], "op 3 (Loss)", "once"),
        ([("Fe", 0), ("Fe", 0)], "op 1 (Fe 0)", "already held with its graph"),
        ([("Fc", 0), ("Fc", 1), ("Loss",), ("B", 1)], "op 3 (B 1)", "with its graph"),
    ],
)
def test_invalid_plans_name_op_and_reason(chain, ops, where, why):
    with pytest.raises(ValueError, match="invalid plan") as err:
        simulate(chain, ops)
    assert where in str(err.value) and why in str(err.value)


def test_unfinished_plan_rejected(chain):
    with pytest.raises(ValueError, match="ends before B 0"):
        simulate(chain, [("Fe", 0), ("Fe", 1), ("Loss",), ("B", 1)])


@pytest.mark.parametrize("op", [("Jump", 1), ("Fe",), ("Loss", 2), ("Fe", "1"), 7])
def test_malformed_ops_rejected(chain, op):
    with pytest.raises(ValueError, match="op 0"):
        simulate(chain, [op])


def test_forward_without_grad_uses_its_own_transient(chain):
    lean = Chain.from_dict({**chain.to_dict(), "fwd_tmp_nograd": [50, 1]})
    ops = [("Fc", 0), ("Fn", 1), ("Loss",), ("Fe", 0), ("Fe", 1), ("B", 1), ("B", 0)]
    # Fc0 now peaks at 10 + 20 + 50 = 80; recording forwards keep fwd_tmp (Fe0: 15 + 30 + 3)
    assert simulate(lean, ops).peak == 80
    assert simulate(lean, no_recompute_ops(2)).peak == 75


def test_op_peaks_bound_each_op_and_reach_the_peak():
    from lightning_rotor.ops import no_recompute_ops

    chain = Chain(
        input_size=10,
        out_size=[20, 5],
        saved_size=[30, 8],
        fwd_time=[1.0, 1.0],
        bwd_time=[1.0, 1.0],
        fwd_tmp=[3, 1],
        bwd_tmp=[4, 2],
        loss_tmp=6,
    )
    sim = simulate(chain, no_recompute_ops(2))
    assert len(sim.op_peaks) == len(sim.curve) == 5
    assert max(sim.op_peaks) == sim.peak
    assert all(p >= c for p, c in zip(sim.op_peaks, sim.curve, strict=True))
    assert sim.op_peaks[0] == 10 + 30 + 3  # Fe 0: a_0, then ā_1 and its transient


def test_ops_are_one_type_from_json_to_plan():
    from lightning_rotor.ops import Op, OpKind, parse_ops

    ops = parse_ops([["Fc", 0], ["Fn", 1], ["Loss"], ["B", 1]])
    assert [op.label for op in ops] == ["Fc 0", "Fn 1", "Loss", "B 1"]
    assert ops[0] == ("Fc", 0) and ops[2] == ("Loss",) and ops[2].stage is None
    assert ops[1].kind is OpKind.FN and ops[1].kind.is_forward and not ops[3].kind.is_forward
    assert [op.to_json() for op in ops] == [["Fc", 0], ["Fn", 1], ["Loss"], ["B", 1]]
    with pytest.raises(ValueError, match="unknown op"):
        parse_ops([["Swap", 1]])
    with pytest.raises(ValueError, match="Loss takes no stage"):
        Op("Loss", 3)


def test_version_2_releases_free_outputs_and_charges_signed_transients(chain):
    # chain version 2: both outputs are free (their graphs keep neither), transients below δ_k, a loss below a_L
    tight = Chain(
        input_size=10,
        out_size=[20, 5],
        saved_size=[30, 8],
        fwd_time=[1.0, 2.0],
        bwd_time=[3.0, 4.0],
        fwd_tmp=[3, 1],
        bwd_tmp=[-10, -5],
        loss_tmp=-5,
        loss_tmp_kept=6,
        out_free=[20, 5],
    )
    sim = simulate(tight, no_recompute_ops(2))
    # Fe0 40 | Fe1 48 | Loss 48+5-5 during, lets a_2 go, adds δ_2: 48 | B1 48+20-5 = 63 during, then 48+20-3-5 = 60
    # | B0 lets a_1 go (20): 40, during 40+10-10, then 40+10-10-20 = 20
    assert sim.curve == [40, 48, 48, 60, 20]
    assert sim.op_peaks == [43, 49, 48, 63, 40]
    assert sim.peak == 63 < simulate(chain, no_recompute_ops(2)).peak == 75
    # a graph that keeps part of a_2 makes the loss charge loss_tmp_kept, and a_2 stays until B 1
    kept = Chain(**{**tight.__dict__, "out_free": [20, 0]})
    assert simulate(kept, no_recompute_ops(2)).op_peaks[2] == 48 + 5 + 6


def test_version_3_releases_a_stage_input_after_its_last_forward():
    """in_free[1] = 8 bytes of a_1 (kept by neither graph) go right after Fe 1, whether a_1 is plain or recorded."""
    base = dict(
        input_size=10,
        out_size=[20, 5],
        saved_size=[30, 8],
        fwd_time=[1.0, 2.0],
        bwd_time=[3.0, 4.0],
        fwd_tmp=[3, 1],
        bwd_tmp=[4, 2],
        loss_tmp=6,
        out_free=[12, 0],
    )
    before, after = Chain(**base), Chain(**base, in_free=[0, 8])

    # Recorded a_1 (ā_1 from Fe 0): Fe 1 peaks as before (49), then lets 8 go: 40. Loss 40+5+6 = 51, then 45.
    # B 1 45+20+2 = 67, then 45+20-8-5 = 52. B 0 lets go only the rest of ā_1's free part (12-8): 48,
    # peaks 48+10+4 = 62 as before, ends at 20.
    recorded = no_recompute_ops(2)
    sim = simulate(after, recorded)
    assert sim.curve == [40, 40, 45, 52, 20]
    assert sim.op_peaks == [43, 49, 51, 67, 62]
    old = simulate(before, recorded)
    assert old.curve == [40, 48, 53, 60, 20] and old.op_peaks == [43, 49, 59, 75, 62]

    # Plain a_1 (from Fc 0): Fe 1 peaks at 30+8+1 = 39, then lets 8 of the plain a_1 go: 30. Loss 41, then 35.
    # B 1 35+20+2 = 57, then 35+20-8-5 = 42, and drops the rest of the plain a_1 (20-8): 30.
    # Fe 0 (stage 0: a_0 is never let go) 63, then 60; B 0 lets go ā_1's free part (12): 48, peaks 62, ends at 20.
    plain = [("Fc", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fe", 0), ("B", 0)]
    sim = simulate(after, plain)
    assert sim.curve == [30, 30, 35, 30, 60, 20]
    assert sim.op_peaks == [33, 39, 41, 57, 63, 62]
    old = simulate(before, plain)
    assert old.curve == [30, 38, 43, 30, 60, 20] and old.op_peaks == [33, 39, 49, 65, 63, 62]


def test_version_3_last_forward_of_a_stage():
    from lightning_rotor.ops import last_forwards, parse_ops

    ops = parse_ops([("Fc", 0), ("Fc", 1), ("Fe", 2), ("Loss",), ("B", 2), ("Fe", 1), ("B", 1), ("Fe", 0), ("B", 0)])
    # Fe 2, the second forward of stage 1 and Fe 0 are last before their backwards; Fc 1 is not (stage 0 lets go
    # only the chain's own part of its input: in_free[0], a_F in the suffix of a frozen prefix)
    assert last_forwards(ops, 3) == {2, 5, 7}
    # a forward of stage k after its input was partly let go is refused (nothing of the kind is ever planned)
    chain = Chain(
        input_size=10,
        out_size=[20, 5],
        saved_size=[30, 8],
        fwd_time=[1.0, 2.0],
        bwd_time=[3.0, 4.0],
        fwd_tmp=[3, 1],
        bwd_tmp=[4, 2],
        loss_tmp=6,
        out_free=[12, 0],
        in_free=[0, 8],
    )
    late = [("Fe", 0), ("Fe", 1), ("Loss",), ("B", 1), ("Fc", 1)]
    with pytest.raises(ValueError, match=r"op 4 \(Fc 1\): a_1 was partly let go"):
        simulate(chain, late)


def test_annotate_gives_each_op_the_flags_both_interpreters_read():
    from lightning_rotor.ops import OpNote, annotate, parse_ops

    ops = parse_ops(
        [
            ("Fc", 0),
            ("Fc", 1),
            ("Fe", 2),
            ("OffloadSaved", 2),
            ("Loss",),
            ("PrefetchSaved", 2),
            ("B", 2),
            ("Fe", 1),
            ("B", 1),
            ("Fe", 0),
            ("B", 0),
        ]
    )
    notes = annotate(ops, 3, in_free=[0, 0, 4])
    assert [n.op for n in notes] == ops and all(isinstance(n, OpNote) for n in notes)
    assert [i for i, n in enumerate(notes) if n.last] == [2, 7, 9]  # last forwards before their B (`last_forwards`)
    assert [i for i, n in enumerate(notes) if n.pack] == [2]  # Fe 2: an OffloadSaved 2 moves what it saved
    assert [i for i, n in enumerate(notes) if n.moves] == [3]
    # Fc k ... Fe k right before B k, a_k kept whole between (in_free[k] = 0): early stop allowed, stages 0 and 1
    assert [i for i, n in enumerate(notes) if n.early] == [0, 1, 7, 9]
    assert not any(n.joins for n in notes)  # no B k right before B k-1
    assert [n.joins for n in annotate(no_recompute_ops(3), 3)] == [False] * 4 + [True, True, False]
    assert not any(n.early for n in annotate(ops, 3))  # without the chain's in_free: unknown, never early
    # an OffloadSaved after a forward other than Fe moves nothing (the executor refuses it, the simulator names why)
    odd = annotate(parse_ops([("Fc", 0), ("OffloadSaved", 0), ("Fe", 0), ("Loss",), ("B", 0)]), 1)
    assert [n.moves for n in odd] == [False] * 5 and not any(n.pack for n in odd)
