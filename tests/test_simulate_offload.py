"""Simulator with offloading (chain version 6): the channel's timeline, memory freed when a copy ends, waits."""

import pytest

from lightning_rotor.chain import Chain
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
