// Optimal persistent checkpointing schedules for a chain (docs/planner.md).
//
// Solves exactly the integer problem of lightning_rotor/discretize.py, with the
// recursion of tests/reference_planner.py (the executable specification, the tests' oracle).
// No Python or torch types here: bindings.cpp wraps these for Python.
#pragma once

#include <cstdint>
#include <vector>

namespace rotor {

enum class OpKind : int {
    Fn = 0,
    Fc = 1,
    Fe = 2,
    Loss = 3,
    B = 4,
    Fs = 5,
    Offload = 6,
    Prefetch = 7,
    OffloadSaved = 8,
    PrefetchSaved = 9,
    Wait = 10,      // compute idles until the copy of a_k ends (docs/memory-model.md, "Debts")
    WaitSaved = 11  // the same for stage k's saved part
};

struct Op {
    OpKind kind;
    int stage;       // -1 for Loss
    int option = 0;  // Fs: the stage option recorded (>= 1); 0 for every other op
};

// Option o >= 1 of a stage (chain version 5, `Fs k:o`): record a selection, recompute the rest in
// the backward. Figures as the stage's own: saved is sb^o_{k+1}, bwd_tmp the signed net figure
// (StageOption.bwd_net), loss_tmp_graph the loss on an a_L it recorded; no part of a_k is let go
// after it (its backward recomputes from a_k). Costs are unused by min_budget and feasible_schedule.
struct StageOption {
    int64_t saved = 0, fwd_tmp = 0, bwd_tmp = 0, loss_tmp_graph = 0;
    int64_t fwd_cost = 0, bwd_cost = 0;
};

// A chain in integer memory units (slots or bytes) with integer costs.
// size has L+1 entries (s_0 .. s_L); the per-stage vectors have L entries,
// saved[k] being sb_{k+1}. fwd_tmp is the transient of a recording forward (Fe),
// fwd_tmp_nograd that of a forward without grad (Fn, Fc).
// bwd_tmp is signed (chain version 2): B k peaks at cur + size[k] + bwd_tmp[k], where the
// release of the part of a_{k+1} its graph does not keep is folded into bwd_tmp (Chain.bwd_net).
// loss_tmp is the loss on a plain a_L, loss_tmp_graph on a_L held with its graph.
// in_free (chain version 3, L entries): bytes of a_k that neither the graph of F_{k-1} nor that of F_k
// keeps, let go right after Fe k, the last forward of stage k before B k (in_free[0]: only a part of the
// chain input the chain owns, a_F after a frozen prefix (chain version 4); the caller's a_0 never goes; a release:
// discretize.py rounds it down). The same amount whether a_k is held plain or recorded, so one table
// per subproblem serves both: after Fe s the subproblem (s+1, t) gets m - saved[s] + in_free[s].
// loss_value (chain version 3): bytes the loss holds from the end of Loss to the end of the step
// (its value and the gradient backward seeds it with); every op after Loss needs them on top.
// options (chain version 5): empty, or per stage its options 1, 2, … (option 0 is the columns above).
// offloadable (chain version 6): empty, or per stage the part of saved[k] that OffloadSaved k moves to host
// memory (a release while it is away: discretize.py rounds it down), 0 <= offloadable[k] <= saved[k].
struct MemChain {
    std::vector<int64_t> size, saved, fwd_tmp, fwd_tmp_nograd, bwd_tmp, in_free, offloadable;
    int64_t loss_tmp = 0;
    int64_t loss_tmp_graph = 0;
    int64_t loss_value = 0;
    std::vector<std::vector<StageOption>> options;
    int length() const { return static_cast<int>(saved.size()); }
    int options_of(int s) const { return options.empty() ? 0 : static_cast<int>(options[s].size()); }
};

struct Solution {
    bool feasible = false;
    double cost = 0;  // exact integer held in a double (< 2**53)
    std::vector<Op> ops;
};

// Least-cost schedule within `slots` (a_0 included). fwd_cost/bwd_cost are the
// integer costs of discretize.py (all sums < 2**53). The tables are filled on
// `threads` threads (<= 0: default_threads()); the result does not depend on it.
// transfer_cost (chain version 6): empty, or per value a_0 … a_L its copy time between device
// and host (ticks << count_bits, rounded up); then a split may offload its kept input during its
// right part (docs/planner.md, "Offloading"). Empty: exactly the tables and plans without it.
// saved_transfer_cost: empty, or per stage the copy time of chain.offloadable[k] (as transfer_cost; needs
// transfer_cost and chain.offloadable): then recording s may move its saved part to host memory while
// (s+1, t) runs (`Fe s, OffloadSaved s, …, PrefetchSaved s, B s+1, B s`), or over a debt run (`Fe s,
// OffloadSaved s, Fe s+1 … Fe j-1, [WaitSaved s], (j, t), B j-1 … B s`, PrefetchSaved s before one of those
// backwards; docs/planner.md, "Debts"). A split's offloaded input is waited for (`Wait s`) where its sweep
// does not hide the copy. Each part is clamped to saved[k] - in_free[k+1] (what stays charged for ā_{k+1}).
Solution solve(const MemChain& chain, const std::vector<int64_t>& fwd_cost,
               const std::vector<int64_t>& bwd_cost, int64_t slots, int threads = 0,
               const std::vector<int64_t>& transfer_cost = {}, int count_bits = 0,
               const std::vector<int64_t>& saved_transfer_cost = {});

// min(2, std::thread::hardware_concurrency()), at least 1.
int default_threads();

// Smallest budget (a_0 included) for which some persistent schedule exists. `values`: a channel exists
// (bandwidth > 0), so kept inputs and the chain's offloadable saved parts may move to host memory, each
// copy waited for where the memory needs it (docs/planner.md, "Debts"): the floor may then be lower.
int64_t min_budget(const MemChain& chain, bool values = false);

// A schedule that fits in `budget` (exact units), or infeasible when budget < min_budget(chain, values).
// Prefers recording (Fe) and short forward runs wherever memory allows, then moving what may move. It
// walks min_budget's tables, so it shares the DP's memory rules; plans are scored by
// lightning_rotor/simulate.py alone.
Solution feasible_schedule(const MemChain& chain, int64_t budget, bool values = false);

}  // namespace rotor
