"""Simulator with offloading (chain version 6): the channel's timeline, memory freed when a copy ends, waits."""

import pytest

from lightning_rotor.chain import Chain, StageOption
from lightning_rotor.simulate import simulate


def four(bandwidth: float = 10.0, host_limit: int | None = None) -> Chain:
    # s = [10, 20, 5, 5, 5]; every forward 1 s, every backward 2 s
    return Chain(
        input_size=10,
        out_size=[20, 5, 5, 5],
        saved_size=[30, 8, 8, 8],
        fwd_time=[1.0] * 4,
        bwd_time=[2.0] * 4,
        fwd_tmp=[0] * 4,
        bwd_tmp=[0] * 4,
        bandwidth=bandwidth,
        host_limit=host_limit,
    )


# keep a_1 as a checkpoint, offload it while stages 2 and 3 run, prefetch it back during B 3
PLAN = [
    ("Fc", 0),  # t 0..1: a_1 (20) made: 30
    ("Fc", 1),  # t 1..2: a_2 (5) made, a_1 kept: 35
    ("Offload", 1),  # t = 2: 20 bytes at 10 B/s, the copy ends at t = 4
    ("Fn", 2),  # t 2..3
    ("Fe", 3),  # t 3..4: a_1 still held
    ("Loss",),  # t = 4: a_1's device copy is gone
    ("Prefetch", 1),  # t = 4: on the device again from now, arriving at t = 6
    ("B", 3),  # t 4..6
    ("Fe", 1),  # needs a_1, there since t = 6: no wait
    ("Fe", 2),
    ("B", 2),
    ("B", 1),
    ("Fe", 0),
    ("B", 0),
]


def test_offload_frees_device_memory_when_the_copy_ends():
    sim = simulate(four(), PLAN)
    assert sim.curve[:5] == [30, 35, 35, 35, 43]
    assert sim.curve[5] == 43 - 20 + 5  # the loss: a_1's copy has ended, δ_4 held
    assert sim.op_peaks[5] == 23 + 5 + 0  # the loss's own peak is charged without a_1
    assert sim.curve[6] == sim.curve[5] + 20  # the prefetched copy counts from the prefetch on
    assert sim.host_curve[:8] == [0, 0, 20, 20, 20, 20, 20, 20]
    assert sim.host_peak == 20 and sim.host_curve[-1] == 0
    assert sim.wait == 0.0
    assert sim.time == 4 * 1.0 + 3 * 1.0 + 4 * 2.0  # forwards, recomputed forwards, backwards: no wait
    assert sim.peak == simulate(four(), PLAN).peak  # deterministic


def test_a_slow_channel_makes_compute_wait():
    sim = simulate(four(bandwidth=4.0), PLAN)
    # the offload runs t 2..7; the prefetch queues behind it, t 7..12; Fe 1 is ready at t 6: waits 6 s
    assert sim.wait == pytest.approx(6.0)
    assert sim.time == pytest.approx(15.0 + 6.0)
    assert sim.curve[6] == 43 + 5 + 20  # the device copy was still held when the prefetch began: both count


def test_offload_errors_name_the_op():
    with pytest.raises(ValueError, match=r"op 2 \(Offload 1\).*no transfer bandwidth"):
        simulate(four(bandwidth=0.0), PLAN)
    with pytest.raises(ValueError, match=r"Offload 0.*a_0 is the caller's"):
        simulate(four(), [("Offload", 0), *PLAN])
    with pytest.raises(ValueError, match=r"op 7 \(Fe 1\): needs a_1, which is not held \(offloaded: Prefetch 1"):
        simulate(four(), [op for op in PLAN if op != ("Prefetch", 1)])
    with pytest.raises(ValueError, match=r"Prefetch 1.*not on the host"):
        simulate(four(), [op for op in PLAN if op != ("Offload", 1)])
    with pytest.raises(ValueError, match=r"op 9 \(Offload 2\).*a_2 is held with its graph"):
        simulate(four(), [*PLAN[:9], ("Offload", 2), *PLAN[9:]])
    with pytest.raises(ValueError, match="host memory 20 bytes exceeds the chain's host_limit 10"):
        simulate(four(host_limit=10), PLAN)
    with pytest.raises(ValueError, match="a_2 is offloaded and never prefetched"):
        # a_2 held twice, plain (Fc 1) and with its graph (Fe 1): the plain copy goes and never comes back
        simulate(
            four(),
            [("Fc", 0), ("Fc", 1), ("Fe", 1), ("Offload", 2), ("Fe", 2), ("Fe", 3), ("Loss",)]
            + [("B", 3), ("B", 2), ("B", 1), ("Fe", 0), ("B", 0)],
        )


def test_without_transfers_nothing_changes():
    ops = [("Fe", 0), ("Fe", 1), ("Fe", 2), ("Fe", 3), ("Loss",), ("B", 3), ("B", 2), ("B", 1), ("B", 0)]
    assert simulate(four(), ops)[:4] == simulate(four(bandwidth=0.0), ops)[:4]
    assert simulate(four(), ops).host_peak == 0


def test_saved_part_ops_parse_and_name_themselves():
    from lightning_rotor.ops import Op, OpKind, parse_ops

    ops = parse_ops([["OffloadSaved", 3], ["PrefetchSaved", 3], ("Offload", 1)])
    assert [op.kind for op in ops] == [OpKind.OFFLOAD_SAVED, OpKind.PREFETCH_SAVED, OpKind.OFFLOAD]
    assert [op.label for op in ops] == ["OffloadSaved 3", "PrefetchSaved 3", "Offload 1"]
    assert all(op.kind.is_transfer and not op.kind.is_forward for op in ops)
    assert ops[0].to_json() == ["OffloadSaved", 3] and ops[0] == Op("OffloadSaved", 3)
    assert not OpKind.B.is_transfer and not OpKind.FE.is_transfer
    with pytest.raises(ValueError, match="OffloadSaved needs one integer stage index"):
        parse_ops([["OffloadSaved"]])
    with pytest.raises(ValueError, match="PrefetchSaved takes no option"):
        Op("PrefetchSaved", 2, 1)


def saving(bandwidth: float = 12.0, host_limit: int | None = None) -> Chain:
    # s = [10, 20, 5, 5, 5]; stage 1 saves 16 bytes, 12 of them offloadable; forwards 1 s, backwards 2 s
    return Chain(
        input_size=10,
        out_size=[20, 5, 5, 5],
        saved_size=[30, 16, 8, 8],
        fwd_time=[1.0] * 4,
        bwd_time=[2.0] * 4,
        fwd_tmp=[0] * 4,
        bwd_tmp=[0] * 4,
        bandwidth=bandwidth,
        host_limit=host_limit,
        offloadable=[0, 12, 0, 0],
    )


# record stage 1, move its saved part out while stages 2 and 3 run, back during B 2 (the planner's shape)
SAVED_PLAN = [
    ("Fe", 0),  # t 0..1: 10 + 30 = 40
    ("Fe", 1),  # t 1..2: + 16 = 56
    ("OffloadSaved", 1),  # t = 2: 12 bytes at 12 B/s, the copy ends at t = 3
    ("Fe", 2),  # t 2..3: + 8 = 64, the saved part still there
    ("Fe", 3),  # t 3..4: starts at the copy's end: 64 - 12 + 8 = 60
    ("Loss",),  # t = 4: + δ_4 = 65
    ("B", 3),  # t 4..6: peak 70, then 65 + 5 - 8 - 5 = 57
    ("PrefetchSaved", 1),  # t = 6: + 12 = 69, arriving at t = 7
    ("B", 2),  # t 6..8: peak 74, then 69 + 5 - 8 - 5 = 61
    ("B", 1),  # t = 8: the copy ended at 7, no wait; peak 81, then 61 + 20 - 16 - 5 = 60
    ("B", 0),  # peak 70, then 60 + 10 - 30 - 20 = 20
]


def test_saved_part_leaves_while_the_next_stage_runs_and_comes_back_during_b_next():
    sim = simulate(saving(), SAVED_PLAN)
    assert sim.curve == [40, 56, 56, 64, 60, 65, 57, 69, 61, 60, 20]
    assert sim.op_peaks == [40, 56, 56, 64, 60, 65, 70, 69, 74, 81, 70]
    assert sim.host_curve == [0, 0, 12, 12, 12, 12, 12, 12, 12, 0, 0]  # the host copy goes when the prefetch ends
    assert sim.host_peak == 12 and sim.peak == 81
    assert sim.wait == 0.0 and sim.time == 4 * 1.0 + 4 * 2.0
    # without the transfers, the same schedule holds the saved part throughout: Fe 3 at 72, not 60
    plain = simulate(saving(), [op for op in SAVED_PLAN if not op[0].endswith("Saved")])
    assert plain.op_peaks[3] == 72 and plain.time == sim.time


def test_a_slow_saved_copy_makes_b_wait():
    sim = simulate(saving(bandwidth=4.0), SAVED_PLAN)
    # the offload runs t 2..5: the device bytes stay through Fe 3, the loss and B 3 (t 4), leave at the prefetch (t 6)
    assert sim.curve[4] == 72 and sim.curve[5] == 77 and sim.op_peaks[6] == 82
    assert sim.curve[7] == 69 - 12 + 12  # left at the prefetch's start, back at once
    # the prefetch runs t 6..9; B 2 ends at 8; B 1 waits 1 s
    assert sim.wait == 1.0 and sim.time == 12.0 + 1.0
    assert sim.host_curve == [0, 0, 12, 12, 12, 12, 12, 12, 12, 12, 0]  # B 1 starts at 8, before the copy's end
    # one channel: a value's offload ahead of the saved part's delays it (a_1, 20 B at 4 B/s: t 2..7)
    queued = [("Fc", 0), ("Fe", 1), ("Offload", 1), ("OffloadSaved", 1), *SAVED_PLAN[3:8], ("Prefetch", 1)]
    queued += SAVED_PLAN[8:10] + [("Fe", 0), ("B", 0)]
    sim = simulate(saving(bandwidth=4.0), queued)
    # saved part t 7..10, its prefetch t 10..13, a_1's t 13..18: B 1 (t 8) waits for a_1 until 18
    assert sim.wait == 10.0 and sim.host_peak == 32


def test_saved_part_errors_name_the_op():
    with pytest.raises(ValueError, match=r"op 2 \(OffloadSaved 1\).*no transfer bandwidth"):
        simulate(saving(bandwidth=0.0), SAVED_PLAN)
    with pytest.raises(ValueError, match=r"op 6 \(PrefetchSaved 1\).*no transfer bandwidth"):
        simulate(saving(bandwidth=0.0), [op for op in SAVED_PLAN if op != ("OffloadSaved", 1)])
    with pytest.raises(ValueError, match=r"op 1 \(OffloadSaved 1\): needs a_2 recorded by Fe 1"):
        simulate(saving(), [("Fc", 0), ("OffloadSaved", 1), *SAVED_PLAN[1:]])
    with pytest.raises(ValueError, match=r"op 2 \(OffloadSaved 0\): stage 0 has nothing offloadable"):
        simulate(saving(), [*SAVED_PLAN[:2], ("OffloadSaved", 0), *SAVED_PLAN[2:]])
    with pytest.raises(ValueError, match=r"op 3 \(OffloadSaved 1\).*already on the host"):
        simulate(saving(), [*SAVED_PLAN[:3], ("OffloadSaved", 1), *SAVED_PLAN[3:]])
    with pytest.raises(ValueError, match=r"op 8 \(OffloadSaved 1\).*still being prefetched"):
        simulate(saving(), [*SAVED_PLAN[:8], ("OffloadSaved", 1), *SAVED_PLAN[8:]])
    with pytest.raises(ValueError, match=r"op 6 \(PrefetchSaved 1\).*not on the host \(no OffloadSaved 1 before\)"):
        simulate(saving(), [op for op in SAVED_PLAN if op != ("OffloadSaved", 1)][:6] + SAVED_PLAN[7:])
    with pytest.raises(ValueError, match=r"op 8 \(B 1\): the saved part of stage 1 is on the host \(PrefetchSaved 1"):
        simulate(saving(), [op for op in SAVED_PLAN if op != ("PrefetchSaved", 1)])
    with pytest.raises(ValueError, match=r"op 2 \(OffloadSaved 1\).*host memory 12 bytes exceeds .*host_limit 11"):
        simulate(saving(host_limit=11), SAVED_PLAN)
    with pytest.raises(ValueError, match="the saved part of stage 1 is offloaded and never prefetched"):
        simulate(saving(), [*SAVED_PLAN[:7], *SAVED_PLAN[8:9]])
    fs = saving()
    fs.options[1] = [StageOption(saved_size=8, fwd_time=1.0, bwd_time=3.0, fwd_tmp=0, bwd_tmp=0)]
    with pytest.raises(ValueError, match=r"op 2 \(OffloadSaved 1\): a_2 was recorded by Fs 1:1; only Fe 1's"):
        simulate(fs, [("Fe", 0), ("Fs", 1, 1), *SAVED_PLAN[2:]])
