# Types of the C++ extension `lightning_rotor._planner` (cpp/bindings.cpp), for the type checker.
# Ops come back as ("Fe", 2) / ("Fs", 2, 1) / ("Loss",) tuples; lightning_rotor.ops.parse_ops turns them into Ops.

def solve(
    size: list[int],
    saved: list[int],
    fwd_tmp: list[int],
    fwd_tmp_nograd: list[int],
    bwd_tmp: list[int],
    loss_tmp: int,
    fwd_cost: list[int],
    bwd_cost: list[int],
    slots: int,
    threads: int = 0,
    loss_tmp_graph: int | None = None,
    in_free: list[int] | None = None,
    loss_value: int = 0,
    options: list[list[list[int]]] | None = None,
    transfer_cost: list[int] | None = None,
    count_bits: int = 0,
    offloadable: list[int] | None = None,
    saved_transfer_cost: list[int] | None = None,
) -> tuple[int, list[tuple[str, int] | tuple[str, int, int] | tuple[str]]] | None: ...
def default_threads() -> int: ...
def min_budget(
    size: list[int],
    saved: list[int],
    fwd_tmp: list[int],
    fwd_tmp_nograd: list[int],
    bwd_tmp: list[int],
    loss_tmp: int,
    loss_tmp_graph: int | None = None,
    in_free: list[int] | None = None,
    loss_value: int = 0,
    options: list[list[list[int]]] | None = None,
    offload: bool = False,
    offloadable: list[int] | None = None,
) -> int: ...
def feasible_schedule(
    size: list[int],
    saved: list[int],
    fwd_tmp: list[int],
    fwd_tmp_nograd: list[int],
    bwd_tmp: list[int],
    loss_tmp: int,
    budget: int,
    loss_tmp_graph: int | None = None,
    in_free: list[int] | None = None,
    loss_value: int = 0,
    options: list[list[list[int]]] | None = None,
    offload: bool = False,
    offloadable: list[int] | None = None,
) -> list[tuple[str, int] | tuple[str, int, int] | tuple[str]] | None: ...
