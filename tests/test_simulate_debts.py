"""Transfers that span several operations, and `Wait`: compute idles for a copy when memory needs it to end."""

import pytest
from test_simulate_offload import PLAN, SAVED_PLAN, four, saving

from lightning_rotor.ops import Op, OpKind, parse_ops
from lightning_rotor.simulate import simulate


def test_an_offload_spans_several_ops_and_frees_at_the_first_op_after_it():
    # 20 bytes at 5 B/s from t = 2: the copy ends at t = 6, inside B 3 (t 4..6 starts at 4), so a_1 is held
    # through Fn 2, Fe 3, the loss and B 3; the prefetch queues behind it (t 6..10) and Fe 1 waits 4 s
    sim = simulate(four(bandwidth=5.0), PLAN)
    assert sim.curve[2:6] == [35, 35, 43, 48]  # Offload, Fn 2, Fe 3, Loss: a_1 still on the device
    assert sim.wait == pytest.approx(4.0)
    assert sim.time == pytest.approx(15.0 + 4.0)


def test_wait_idles_until_the_offload_ends_then_its_bytes_are_free():
    plan = [*PLAN[:3], ("Wait", 1), *PLAN[3:]]  # at t = 2, the copy ends at t = 4: 2 s idle
    sim = simulate(four(), plan)
    assert sim.wait == pytest.approx(2.0)
    assert sim.time == pytest.approx(15.0 + 2.0)
    assert sim.op_peaks[3] == 35 and sim.curve[3] == 15  # a_1's 20 bytes held while idle, gone after
    assert sim.curve[4] == 15 and sim.op_peaks[4] == 20  # Fn 2: a_3 made, a_2 dropped
    assert sim.op_peaks[5] == 15 + 8 and simulate(four(), PLAN).op_peaks[4] == 43  # Fe 3 without a_1 beside it


def test_wait_for_a_copy_already_ended_costs_nothing():
    plan = [*PLAN[:6], ("Wait", 1), *PLAN[6:]]  # after the loss (t = 4): the copy ended at t = 4
    sim, base = simulate(four(), plan), simulate(four(), PLAN)
    assert sim.wait == 0.0 and sim.time == base.time and sim.peak == base.peak


def test_wait_saved_idles_for_the_saved_part():
    plan = [*SAVED_PLAN[:3], ("WaitSaved", 1), *SAVED_PLAN[3:]]  # 12 bytes at 12 B/s from t = 2: 1 s idle
    sim = simulate(saving(), plan)
    assert sim.wait == pytest.approx(1.0)
    assert sim.curve[3] == 56 - 12  # the saved part left when the copy ended, before Fe 2 runs


def test_wait_needs_a_copy_issued_before():
    with pytest.raises(ValueError, match=r"op 2 \(Wait 1\): no copy of a_1 was issued"):
        simulate(four(), [*PLAN[:2], ("Wait", 1), *PLAN[2:]])
    with pytest.raises(ValueError, match=r"\(WaitSaved 2\): no copy of the saved part of stage 2"):
        simulate(saving(), [*SAVED_PLAN[:3], ("WaitSaved", 2), *SAVED_PLAN[3:]])


def test_wait_ops_parse_and_name_themselves():
    ops = parse_ops([["Wait", 3], ["WaitSaved", 2]])
    assert ops == [Op(OpKind.WAIT, 3), Op(OpKind.WAIT_SAVED, 2)]
    assert [op.label for op in ops] == ["Wait 3", "WaitSaved 2"]
    assert not any(op.kind.is_transfer or op.kind.is_forward for op in ops)
