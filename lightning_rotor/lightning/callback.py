"""`RotorCallback`: what rotor decided and what it cost, in the Trainer's loggers.

Every step (through `LightningModule.log`, so `log_every_n_steps` and every logger
apply; rank zero only):

- `rotor/budget_bytes` (the chains' budgets: each covers every call of its chain in a
  step), `rotor/predicted_peak_bytes` (the step's, all calls together),
  `rotor/recomputed_stages` (of the latest call), summed over the wrapped chains;
- `rotor/measured_peak_bytes`: the activation peak of a sampled step (see below);
- `rotor/no_recompute_seconds` (Σ forward + backward of the chains as profiled),
  `rotor/predicted_seconds` (the plans' time), `rotor/predicted_overhead`
  (`predicted / no_recompute - 1`), `rotor/step_seconds` (wall time of a whole
  training batch: data, loss and optimizer included) and `rotor/step_overhead`
  (`step_seconds / no_recompute_seconds - 1`);
- with offloading (`offload=`): `rotor/host_peak_bytes`, the host memory the plans' offloaded
  values take at most (the simulator's, summed over the chains).

Measuring memory costs time (tensor accounting sees every op), so it is a
sample: the first step that runs each new schedule (the plan's ops; shapes that
share a schedule share the sample, so changing input shapes do not each cost a
measured step), then each schedule again once it has run `measure_every_n_steps` steps
since its sample. Which plans a step runs is told by its batch (`StepSampler`): a last
partial batch's plan is sampled too. A sampled step that met a
new shape is no clean sample (it profiled); the next try waits for a step of known
shapes, so that dynamic padding does not run profile after profile under the probe.
The value logged is the latest sample; steps that were measured do not update `rotor/step_seconds`. With one
chain, each step neither profiled nor measured also checks the times of a shape derived by FLOPs against the
step's wall time (`ChainState.step_timed`, lightning_rotor/shapes.py `ShapeTimes`). A sample above the
budget is warned about (rank zero, one line per plan). On CPU the sample is
exact tensor accounting of the whole training step up to the end of the
backward (docs/memory-model.md, section 5): the chain input, every activation,
graph, gradient and transient, the loss and whatever else `training_step`
allocates; not parameters or their gradients, nor DDP's gradient buckets, nor
the rest of the batch (the targets: data the loader made before the step), nor
Lightning's copies of the loss and of logged values (`LIGHTNING_BOOKKEEPING`).
On CUDA it is the caching allocator's peak.

Once per plan: the stage table (`rotor/<chain>/stages`, TensorBoard text) and
the memory curve of one step, bytes alive after each op, predicted by the
simulator and measured (`rotor/<chain>/memory_curve` as a figure, and the
scalar series `rotor/<chain>/plan<i>/predicted_bytes` / `measured_bytes`
indexed by op; a plan that offloads adds its host bytes after each op to the figure and as
`rotor/<chain>/plan<i>/predicted_host_bytes`). At the first plan a summary table is printed through the
progress bar (rich when installed).

Checkpoints carry the chains and plans under `checkpoint["rotor"]`
(`lightning_rotor.lightning.state`).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_rotor.budget import format_bytes
from lightning_rotor.checkpointable import Checkpointable
from lightning_rotor.lightning.sampling import Measured, StepSampler, batch_key
from lightning_rotor.lightning.sampling import schedule_key as schedule_key  # where tests and scripts took it
from lightning_rotor.lightning.state import STATE_KEY, export_state, import_state, rotor_modules
from lightning_rotor.loss_watch import settle_watches
from lightning_rotor.measure import StepMeasurement
from lightning_rotor.memory import MemoryProbe
from lightning_rotor.pipeline import Entry
from lightning_rotor.shared_budget import OUTSIDE
from lightning_rotor.simulate import no_recompute_peak, simulate
from lightning_rotor.tables import stage_markdown

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _lightning_bookkeeping() -> tuple[Callable, ...]:
    """Lightning's own copies in a training step: of logged values (`self.log`), of the loss for the progress bar."""
    try:
        from lightning.pytorch.loops.optimization.automatic import ClosureResult
    except ImportError:  # a Lightning that moved it: that copy counts (a few bytes too many, never too few)
        return (pl.LightningModule.log,)
    return pl.LightningModule.log, ClosureResult._clone_loss


LIGHTNING_BOOKKEEPING = _lightning_bookkeeping()


def checked_measure_every(n: Any) -> int:
    """`measure_every_n_steps` (the callback's, the Fabric strategy's), or one clear error."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"measure_every_n_steps must be an integer >= 0, got {n!r}")
    return n


def summary_text(chains: dict[str, Checkpointable]) -> str:
    """The start-of-training table: one row per chain (rich when installed, plain otherwise)."""
    header = (
        "chain",
        "stages",
        "budget",
        "predicted peak",
        "no-recompute peak",
        "recomputed",
        "predicted step",
        "profiling",
    )
    rows = []
    for name, rotor in chains.items():
        if rotor.last_entry is None:
            continue
        entry = rotor.entry  # the whole-budget plan (a first step runs each call at its smallest budget)
        no_recompute = no_recompute_peak(entry.chain)
        base = entry.chain.no_recompute_time()
        rows.append(
            (
                name,
                str(entry.chain.length),
                format_bytes(entry.plan.budget),
                format_bytes(entry.plan.peak),
                format_bytes(no_recompute),
                str(entry.plan.recomputed_stages),
                f"{entry.plan.time * 1e3:.1f} ms ({entry.plan.time / base:.2f}x)" if base > 0 else "-",
                f"{entry.profile.seconds:.2f} s",
            )
        )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        lines = ["rotor plan"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in (header, *rows)]
        return "\n".join([*lines, *budget_lines(chains), *discovery_lines(chains)])
    table = Table(title="rotor plan")
    for column in header:
        table.add_column(column)
    for row in rows:
        table.add_row(*row)
    buffer = io.StringIO()
    Console(file=buffer, width=160, force_terminal=False).print(table)
    return "\n".join([buffer.getvalue().rstrip(), *budget_lines(chains), *discovery_lines(chains)])


def budget_lines(chains: dict[str, Checkpointable]) -> list[str]:
    """Per chain under an automatic budget: the bytes it became and why (`Checkpointable.automatic_budget_note`)."""
    notes = {name: rotor.automatic_budget_note() for name, rotor in chains.items()}
    return [f"{name}: {note}" for name, note in notes.items() if note is not None]


def discovery_lines(chains: dict[str, Checkpointable]) -> list[str]:
    """How each chain was found: its stages and, for discovered chains, the cut points and guards."""
    lines = []
    for name, rotor in chains.items():
        if rotor.stages is None:
            continue
        stages = rotor.stages
        shown = ", ".join(stages.names[:12]) + (f", … ({len(stages)} in all)" if len(stages) > 12 else "")
        lines.append(f"{name}: {stages.kind} chain of {len(stages)} stages: {shown}")
        notes = list(rotor.discovery.notes) if rotor.discovery is not None else list(stages.notes)
        lines += [f"  {note}" for note in notes[:16]]
        if len(notes) > 16:
            lines.append(f"  … {len(notes) - 16} more cut points")
    return lines


def last_entries(chains: dict[str, Checkpointable]) -> list[Entry]:
    """Each chain's latest plan, in order; every chain given has run (callers pass the planned ones)."""
    entries = []
    for rotor in chains.values():
        entry = rotor.last_entry
        assert entry is not None, "a chain that has not run has no plan to report"
        entries.append(entry)
    return entries


def step_budget(chains: dict[str, Checkpointable]) -> int:
    """The bytes a step of `chains` may hold: per chain its budget for all its calls in the step
    (`Checkpointable.step_limit`), else its last plan's, and what the model's code around the chains
    was charged (`Budget.charge_outside`); what `rotor/budget_bytes` logs."""
    total = 0
    budgets = {id(r.shared): r.shared for r in chains.values() if r.shared is not None}
    for rotor, entry in zip(chains.values(), last_entries(chains), strict=True):
        total += rotor.step_limit or entry.plan.budget
    return total + sum(b.needs.get(OUTSIDE, (0, 0))[0] for b in budgets.values())


def warn_if_over_budget(chains: dict[str, Checkpointable], peak: int, warned: set[tuple[int, ...]], hint: str) -> None:
    """One rank-zero line, once per set of plans (`warned` remembers them), when a measured peak is
    above the step's budget; `hint` says where to look (the Trainer's curves, Fabric's loop)."""
    budget = step_budget(chains)
    plans = tuple(id(rotor.last_entry) for rotor in chains.values())
    if peak > budget and plans not in warned:
        warned.add(plans)
        rank_zero_warn(
            f"rotor: the measured activation peak {format_bytes(peak)} ({peak} bytes) is above the "
            f"budget {format_bytes(budget)} ({budget} bytes) of {', '.join(chains)}: the step holds "
            f"more than the plan predicts ({hint})"
        )


def step_metrics(
    chains: dict[str, Checkpointable], step_seconds: float | None = None, measured_peak: int | None = None
) -> dict[str, float]:
    """The `rotor/...` scalars of a step, summed over `chains` (the Trainer's callback and Fabric log the same)."""
    entries = last_entries(chains)
    no_recompute = sum(e.chain.no_recompute_time() for e in entries)
    predicted = sum(e.plan.time for e in entries)
    # per chain: its budget, which covers all its calls in a step, and the step's predicted peak
    # (the largest of each call's plan peak above what the step's earlier calls still held)
    metrics = {
        "rotor/budget_bytes": float(step_budget(chains)),
        "rotor/predicted_peak_bytes": float(
            sum(rotor.calls.step_peak or e.plan.peak for rotor, e in zip(chains.values(), entries, strict=True))
        ),
        "rotor/recomputed_stages": float(sum(e.plan.recomputed_stages for e in entries)),
        "rotor/no_recompute_seconds": no_recompute,
        "rotor/predicted_seconds": predicted,
    }
    if no_recompute > 0:
        metrics["rotor/predicted_overhead"] = predicted / no_recompute - 1
    if any(e.chain.offloads for e in entries):  # offloading was on: 0 is news too (the plans keep all on device)
        metrics["rotor/host_peak_bytes"] = float(sum(e.plan.host_peak for e in entries))
    if measured_peak is not None:
        metrics["rotor/measured_peak_bytes"] = float(measured_peak)
    if step_seconds is not None:
        metrics["rotor/step_seconds"] = step_seconds
        if no_recompute > 0:
            metrics["rotor/step_overhead"] = step_seconds / no_recompute - 1
    return metrics


def probe_kind(rotor: Checkpointable) -> Callable[..., MemoryProbe]:
    """Tensor accounting for a CPU step; under FSDP2 it also counts the parameters FSDP2 gathers, which it
    resizes in place where tensor accounting alone never sees them (`sharded.ShardedMemoryProbe`)."""
    if rotor.sharded:
        from lightning_rotor.sharded import ShardedMemoryProbe

        return partial(ShardedMemoryProbe, rotor)
    return MemoryProbe


class RotorCallback(Callback):
    """Logs rotor's budgets, peaks, times and plans; carries chains in checkpoints.

    `measure_every_n_steps`: how often the activation peak is sampled (0: only the
    first step of each plan). `log_curves`: log the memory-curve figure and
    per-op scalars once per plan. `print_summary`: print the plan table at start.
    """

    def __init__(self, measure_every_n_steps: int = 50, log_curves: bool = True, print_summary: bool = True):
        self.measure_every_n_steps = checked_measure_every(measure_every_n_steps)
        self.log_curves = log_curves
        self.print_summary = print_summary
        self._pending: dict[str, Any] | None = None
        self._plans: dict[int, int] = {}  # id(entry) -> plan index, per chain order
        self._curves_done: set[int] = set()
        self.sampler = StepSampler(self.measure_every_n_steps)  # which steps run under the probe
        self._batch_key: tuple[Any, ...] = ()
        self._measurements: list[Measured] = []
        self._t0 = 0.0
        self._step_seconds: float | None = None
        self._measured_peak: int | None = None
        self._printed = False
        self._warned_unused = False
        self._warned_over: set[tuple[int, ...]] = set()
        self._batches = 0

    # -- checkpoints ------------------------------------------------------------------------------------
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        if rotor_modules(pl_module):
            checkpoint[STATE_KEY] = export_state(pl_module)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._pending = checkpoint.get(STATE_KEY)
        if self._pending is not None and rotor_modules(pl_module):
            self._restore(pl_module)

    def _restore(self, pl_module: pl.LightningModule) -> None:
        restored, problems = import_state(pl_module, self._pending)
        self._pending = None
        if restored:
            rank_zero_info(
                f"rotor: chains and plans of {', '.join(restored)} restored from the checkpoint; "
                "no profiling for the same input shapes"
            )
        for problem in problems:
            rank_zero_warn(f"rotor: checkpoint state not restored for {problem}")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is not None and rotor_modules(pl_module):
            self._restore(pl_module)

    # -- measuring a step -------------------------------------------------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        chains = rotor_modules(pl_module)
        self._measurements = []
        self._batch_key = batch_key(batch)
        if self.sampler.wants(chains, self._batch_key):
            for name, rotor in chains.items():
                # on CPU count the whole step, excluding every parameter of the LightningModule and what the
                # strategy's wrapper (DDP) keeps; the chain input is tracked by the chain, the rest of the batch
                # is data, not activations
                excluded = [m for m in (pl_module, trainer.strategy.model) if m is not None]
                wide = (
                    probe_kind(rotor)(excluded, record_curve=True, bookkeeping=LIGHTNING_BOOKKEEPING)
                    if pl_module.device.type != "cuda"
                    else None
                )
                m = rotor.measure_step(probe=wide)
                m.__enter__()
                self._measurements.append((name, rotor, m, len(rotor.entries)))
        self._entries_before = {name: len(rotor.entries) for name, rotor in chains.items()}
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        self._t0 = time.perf_counter()

    def _close_measurements(self) -> None:
        for _, _, m, _ in reversed(self._measurements):
            if m.is_open:
                m.__exit__(None, None, None)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        settle_watches()  # loss windows off the dispatch-mode stack before the optimizer step
        self._close_measurements()
        shared = {id(r.shared): r.shared for r in rotor_modules(pl_module).values() if r.shared is not None}
        for budget in shared.values():  # a total too small for the chains that ran: before any optimizer step
            budget.check()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._close_measurements()
        self._measurements = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
        seconds = time.perf_counter() - self._t0
        self._close_measurements()
        chains = rotor_modules(pl_module)
        self._batches += 1
        if not chains:
            return
        planned = {name: rotor for name, rotor in chains.items() if rotor.last_entry is not None}
        if not planned:
            if not self._warned_unused:
                self._warned_unused = True
                rank_zero_warn(
                    f"rotor: the wrapped chain(s) {', '.join(chains)} did not run in the training "
                    "forward of the first batch, so nothing was profiled or planned"
                )
            return
        profiled = any(len(rotor.entries) != self._entries_before.get(name, 0) for name, rotor in chains.items())
        measured = self._measurements
        self._measurements = []
        if not measured and not profiled:
            self._step_seconds = seconds
            if len(chains) == 1:  # a shape whose times were derived, checked against its steps' (ShapeTimes)
                next(iter(chains.values())).step_timed(seconds)
        # a step that profiled a new signature under the probe gives no clean sample
        clean = self.sampler.ran(self._batch_key, planned, self._entries_before, measured)
        for name, _, m, entry in clean:
            self._measured_peak = m.peak
            if trainer.is_global_zero and self.log_curves and id(entry) not in self._curves_done:
                self._curves_done.add(id(entry))
                self._log_plan(trainer, name, entry, m)
        peak = max((m.peak for _, _, m, _ in clean), default=0)
        warn_if_over_budget(planned, peak, self._warned_over, "see rotor/<chain>/memory_curve")
        if trainer.is_global_zero:
            for (name, rotor), entry in zip(planned.items(), last_entries(planned), strict=True):
                if id(entry) not in self._plans:
                    self._plans[id(entry)] = sum(1 for _ in rotor.entries) - 1
                    self._log_stage_table(trainer, name, entry)
            if self.print_summary and not self._printed:
                self._printed = True
                text = summary_text(planned)
                bar = trainer.progress_bar_callback
                (bar.print if bar is not None else print)(text)
        self._log_metrics(pl_module, planned)

    # -- logging ----------------------------------------------------------------------------------------
    def _log_metrics(self, pl_module: pl.LightningModule, chains: dict[str, Checkpointable]) -> None:
        metrics = step_metrics(chains, self._step_seconds, self._measured_peak)
        for key, value in metrics.items():
            pl_module.log(key, value, on_step=True, on_epoch=False, rank_zero_only=True, batch_size=1)

    def _experiments(self, trainer: pl.Trainer) -> list[Any]:
        """The loggers' backends that take scalars (TensorBoard's SummaryWriter and the like): duck-typed."""
        # the base Logger declares no `experiment`; every logger Lightning ships has one
        found = [getattr(logger, "experiment", None) for logger in trainer.loggers]
        return [experiment for experiment in found if hasattr(experiment, "add_scalar")]

    def _log_stage_table(self, trainer: pl.Trainer, name: str, entry: Entry) -> None:
        text = stage_markdown(name, entry)
        for experiment in self._experiments(trainer):
            if hasattr(experiment, "add_text"):
                experiment.add_text(f"rotor/{name}/stages", text, trainer.global_step)

    def _log_plan(self, trainer: pl.Trainer, name: str, entry: Entry, m: StepMeasurement) -> None:
        """The memory curve of one step: predicted bytes after and during each op, and measured where marked."""
        ops = [op.label for op in entry.plan.ops]
        sim = simulate(entry.chain, entry.plan.ops)
        measured: list[tuple[int, int, int]] = []  # (op index, bytes after, peak during)
        j = 0
        for i, label in enumerate(ops):
            if j < len(m.curve) and m.curve[j][0] == label:
                during = m.op_peaks[j] if j < len(m.op_peaks) else m.curve[j][1]
                measured.append((i, m.curve[j][1], during))
                j += 1
        index = self._plans.get(id(entry), len(self._curves_done) - 1)
        tag = f"rotor/{name}/plan{max(index, 0)}"
        host = list(sim.host_curve) if any(sim.host_curve) else []  # only a plan that offloads has host bytes
        for experiment in self._experiments(trainer):
            for i, nbytes in enumerate(sim.curve):
                experiment.add_scalar(f"{tag}/predicted_bytes", nbytes, i)
            for i, nbytes in enumerate(host):
                experiment.add_scalar(f"{tag}/predicted_host_bytes", nbytes, i)
            for i, nbytes in enumerate(sim.op_peaks):
                experiment.add_scalar(f"{tag}/predicted_op_peak_bytes", nbytes, i)
            for i, after, during in measured:
                experiment.add_scalar(f"{tag}/measured_bytes", after, i)
                experiment.add_scalar(f"{tag}/measured_op_peak_bytes", during, i)
            if hasattr(experiment, "add_figure"):
                figure = curve_figure(
                    name, ops, sim.curve, sim.op_peaks, measured, entry.plan.budget, m.chain_peak, host=host
                )
                experiment.add_figure(f"rotor/{name}/memory_curve", figure, trainer.global_step)


def curve_figure(
    name: str,
    ops: list[str],
    predicted: list[int],
    predicted_peaks: list[int],
    measured: list[tuple[int, int, int]],
    mem_limit: int,
    measured_peak: int,
    host: Sequence[int] = (),
) -> Figure:
    """Bytes alive after each op and the peak during it (MiB), predicted and measured, against the budget.

    `measured` holds (op index, bytes after, peak during); `measured_peak` is this chain's measured peak.
    `host`: host bytes held by offloaded values after each op (the simulator's `host_curve`), drawn beside
    the device bytes so that what offloading moved out of the budget shows where it went; empty: none.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    mib = 2.0**20
    x = range(len(ops))
    fig, ax = plt.subplots(figsize=(max(6, len(ops) * 0.18), 3.8))
    ax.step(x, [b / mib for b in predicted], where="mid", label="predicted after op")
    ax.plot(x, [b / mib for b in predicted_peaks], "_", markersize=8, color="tab:blue", label="predicted op peak")
    predicted_peak = max(predicted_peaks, default=0)
    ax.axhline(
        predicted_peak / mib, color="tab:blue", linestyle=":", label=f"predicted peak {format_bytes(predicted_peak)}"
    )
    if measured:
        _draw_measured(ax, measured, mib)
    if any(host):
        ax.step(
            x,
            [b / mib for b in host],
            where="mid",
            color="tab:green",
            linestyle="--",
            label=f"host bytes after op (offloaded; peak {format_bytes(max(host))})",
        )
    ax.axhline(mem_limit / mib, color="red", linestyle="--", label=f"budget {format_bytes(mem_limit)}")
    if measured_peak:
        ax.axhline(
            measured_peak / mib, color="gray", linestyle="-.", label=f"measured peak {format_bytes(measured_peak)}"
        )
    ax.set_xticks(list(x))
    ax.set_xticklabels(ops, rotation=90, fontsize=6)
    top = max(mem_limit, measured_peak, predicted_peak, *predicted, *(b for _, _, b in measured), *host)
    ax.set_ylim(0, top * 1.45 / mib)  # room for the legend above the curve
    ax.set_ylabel("activation MiB (device; host where offloaded)" if any(host) else "activation MiB")
    ax.set_title(f"rotor memory curve: {name}")
    ax.legend(fontsize=6, loc="upper center", ncol=3)
    fig.tight_layout()
    return fig


def _draw_measured(ax: Axes, measured: list[tuple[int, int, int]], mib: float) -> None:
    """The measured points of `curve_figure`: bytes after each marked op, and the peak during it."""
    ops = [i for i, _, _ in measured]
    ax.plot(ops, [b / mib for _, b, _ in measured], "o", markersize=3, color="tab:orange", label="measured after op")
    ax.plot(ops, [b / mib for _, _, b in measured], "^", markersize=3, color="tab:orange", label="measured op peak")
