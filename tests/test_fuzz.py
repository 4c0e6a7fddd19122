"""Fuzz the executor (issue 15): random DAG models x budgets from the smallest feasible to the plain peak.

Each generated model (tests/fuzz_models.py: a graph-discovered forward with skips carried
across stages, `torch.cat`, views, in-place ops, BatchNorm, dropout and several outputs; an
nn.Sequential; a ModuleList loop) is trained plainly and with rotor at every budget of
`FRACTIONS`, every plan executed: no crash, loss, gradients and buffers bitwise equal to
plain training, the measured peak within the budget. The cases run in a child process, so a
segfault fails this test (naming the model) instead of killing pytest. A bounded,
derandomized set of cases; `benchmarks/fuzz.py` is the long run.
"""

import pytest
from fuzz_models import FRACTIONS, Worker, specs
from hypothesis import HealthCheck, given, settings


@pytest.fixture(scope="module")
def worker():
    with Worker(timeout=120) as w:
        yield w


@settings(max_examples=60, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=specs(max_ops=14, max_blocks=4))
def test_random_models_train_like_plain_within_budget(worker, spec):
    outcome = worker.run(spec, FRACTIONS)
    lines = "\n".join(f"  {cls}: {line}" for cls, line in outcome.failures)
    assert not outcome.failures, f"{outcome.stages} stages, {outcome.plans} plans ran; reproduce with " \
                                 f"fuzz_models.check({spec!r}):\n{lines}"
