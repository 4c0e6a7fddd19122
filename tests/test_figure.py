"""The memory-curve figure shows what was planned and what was measured, op by op."""

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor.chain import Chain
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning.callback import curve_figure
from lightning_rotor.ops import Op
from lightning_rotor.simulate import simulate

MIB = 2.0**20


def test_figure_draws_op_peaks_predicted_peak_budget_and_the_chains_measured_peak():
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(64, 64), nn.Tanh())], nn.Linear(64, 10))
    ckpt = Checkpointable(model, "60%")
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    ckpt.prepare_for(x)
    with ckpt.measure_step() as m:
        F.cross_entropy(ckpt(x), y).backward()
    plan = ckpt.last_entry.plan  # the plan the measured step ran (a first step runs at the smallest budget)
    sim = simulate(ckpt.chain, plan.ops)
    labels = [op.label for op in plan.ops]
    measured = [
        (labels.index(label, i if i < len(labels) else 0), after, during)
        for i, ((label, after), during) in enumerate(zip(m.curve, m.op_peaks, strict=True))
    ]
    fig = curve_figure("model", labels, sim.curve, sim.op_peaks, measured, plan.budget, m.chain_peak)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    op_peaks = lines["predicted op peak"].get_ydata()
    assert list(op_peaks) == [b / MIB for b in sim.op_peaks]
    assert max(op_peaks) > max(lines["predicted after op"].get_ydata())  # peaks during ops exceed what stays
    predicted_line = next(line for label, line in lines.items() if label.startswith("predicted peak"))
    assert predicted_line.get_ydata()[0] == plan.peak / MIB
    budget_line = next(line for label, line in lines.items() if label.startswith("budget"))
    assert budget_line.get_ydata()[0] == plan.budget / MIB
    measured_line = next(line for label, line in lines.items() if label.startswith("measured peak"))
    assert measured_line.get_ydata()[0] == m.chain_peak / MIB <= plan.budget / MIB
    assert list(lines["measured op peak"].get_ydata()) == [b / MIB for b in m.op_peaks]
    assert max(m.op_peaks) <= plan.peak  # measured never above the prediction


def test_figure_draws_host_bytes_beside_device_bytes_when_the_plan_offloads():
    # tests/test_simulate_offload.py's plan: a_1 (20 bytes) goes to the host during stages 2 and 3
    chain = Chain(
        input_size=10,
        out_size=[20, 5, 5, 5],
        saved_size=[30, 8, 8, 8],
        fwd_time=[1.0] * 4,
        bwd_time=[2.0] * 4,
        fwd_tmp=[0] * 4,
        bwd_tmp=[0] * 4,
        bandwidth=10.0,
    )
    ops = [("Fc", 0), ("Fc", 1), ("Offload", 1), ("Fn", 2), ("Fe", 3), ("Loss",), ("Prefetch", 1), ("B", 3)]
    ops += [("Fe", 1), ("Fe", 2), ("B", 2), ("B", 1), ("Fe", 0), ("B", 0)]
    sim = simulate(chain, ops)
    labels = [Op(*op).label for op in ops]
    fig = curve_figure("model", labels, sim.curve, sim.op_peaks, [], 64, 0, host=sim.host_curve)
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    host = next(line for label, line in lines.items() if label.startswith("host bytes after op"))
    assert list(host.get_ydata()) == [b / MIB for b in sim.host_curve] and max(sim.host_curve) == 20
    assert "peak 20 B" in host.get_label()
    assert list(lines["predicted after op"].get_ydata()) == [b / MIB for b in sim.curve]
    plain = curve_figure("model", labels, sim.curve, sim.op_peaks, [], 64, 0)
    assert not any(line.get_label().startswith("host") for line in plain.axes[0].get_lines())
