"""The memory-curve figure shows what was planned and what was measured, op by op."""

import torch
import torch.nn.functional as F
from torch import nn

from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning.callback import curve_figure
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
