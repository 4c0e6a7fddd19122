"""`lightning-rotor bench`: rotor against the checkpointing a user would pick instead.

On one model, one input and one seed, every method runs the same training step
(forward, loss, backward) and is measured the same way:

- `none`: plain autograd, nothing recomputed;
- `rotor`: `Checkpointable` at each budget (predicted and measured peak, the
  plan's predicted time, profiling time);
- `checkpoint_sequential`: torch's uniform segments, every count from 2 to the
  number of stages, non-reentrant, on the same flattened stages rotor sees;
- `recompute_all`: every stage checkpointed;
- `compile`: `torch.compile` with `torch._functorch.config.activation_memory_budget`
  at the same fractions, where it runs (a failure is recorded in its row; opt-in with
  `--compile` for hf:/timm: models).

Models by name from transformers and timm (`hf:gpt2`, `timm:convnext_atto`, built from
configs, `peers`) are compared with their own checkpointing instead: `own` (the library's),
`sac` (torch's selective checkpointing per block), and `rotor` / `rotor+options` planned for
each one's measured peak.

Memory: exact tensor accounting (`MemoryProbe`) on CPU, the allocator's peak on
CUDA. Compiled code allocates outside the dispatcher, where tensor accounting
cannot see, so on CPU compiled rows use the CPU allocator events of
`torch.profiler` instead; their note says so, with the eager baseline measured
that way for comparison.

Timing: the eager methods' timed steps are interleaved (one step of each method
per round), so machine noise hits all alike; medians and the spread
((max - min) / median) are reported. Compiled methods are timed in their own
block, because dynamo's cache is global.

The package runs one way: `workload` builds the model and batch, `methods` turns
them into the configurations to compare (a `Row` each), `measure` fills the rows
(peaks, interleaved timing, torch.compile), `report` prints and plots them, and
`cli` is the command. A new model is a `ModelSpec` in `lightning_rotor.models`
(or any `pkg.module:factory`); a new method is one `Method` in `methods.eager_methods`.
"""

from lightning_rotor.bench.cli import build_parser, main, run
from lightning_rotor.bench.methods import Method, Row
from lightning_rotor.bench.workload import BenchError, Workload, load_workload

__all__ = ["BenchError", "Method", "Row", "Workload", "build_parser", "load_workload", "main", "run"]
