// Dynamic program for optimal persistent checkpointing (see planner.hpp, docs/planner.md).
//
// Subproblem (s, t, given, m): the caller holds a_s and, when `given`, δ_t
// (otherwise t == L and the loss is pending); compute δ_s within m units.
// Its cost as a function of m is a table, contiguous over m, kept only on
// [m_min, m_full): below m_min nothing fits, and from m_full on the all-record
// schedule (Fe s … Fe t-1) fits, which is optimal (every stage forward once).
// Costs are exact integers held in doubles, so min-plus loops vectorize.
#include "planner.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace rotor {
namespace {

constexpr int kEndBlock = 8;
constexpr int64_t kBlock = 32;
constexpr int kWideRun = 12;  // the longest debt run (j - s) whose later stages move their parts too
constexpr double INF = std::numeric_limits<double>::infinity();

// Memory needs of the subproblems, in the chain's units. With offloading (docs/planner.md, "Debts") each
// subproblem has two: "input any" (given, pending) and "input plain" (pgiven, ppending: a_s held plain, so
// the split may offload it); without, the plain ones equal the others.
struct Needs {
    int L;
    std::vector<int64_t> given;    // [s * (L + 1) + t]: least m for (s, t, given)
    std::vector<int64_t> pending;  // [s]: least m for (s, L, loss pending)
    std::vector<int64_t> pgiven, ppending;  // the same, a_s held plain
    std::vector<int64_t> full_given, full_pending;  // m from which all-record fits

    int64_t g(int s, int t, bool plain = false) const { return (plain ? pgiven : given)[s * (L + 1) + t]; }
    int64_t p(int s, bool plain = false) const { return (plain ? ppending : pending)[s]; }
    int64_t sub(int s, int t, bool given_, bool plain = false) const { return given_ ? g(s, t, plain) : p(s, plain); }
    int64_t fg(int s, int t) const { return full_given[s * (L + 1) + t]; }
};

// What may move (chain version 6), for the memory needs: values (bandwidth > 0) and saved parts (offloadable).
struct Moves {
    bool values = false, saved = false;
};

// How stage s is recorded with option o: o = 0 is `Fe s` (the stage's columns, in_free[s] let go
// after it), o >= 1 is `Fs s:o` (chain version 5: the option's figures, nothing of a_s let go).
struct Record {
    int64_t saved, fwd_tmp, bwd_tmp, in_free, loss_tmp_graph;
};

inline Record record(const MemChain& c, int s, int o) {
    if (o == 0) return {c.saved[s], c.fwd_tmp[s], c.bwd_tmp[s], c.in_free[s], c.loss_tmp_graph};
    const StageOption& x = c.options[s][o - 1];
    return {x.saved, x.fwd_tmp, x.bwd_tmp, 0, x.loss_tmp_graph};
}

// Memory that recording s with option o itself needs inside (s, t): recording, and the backward. The
// recording peaks before in_free[s] bytes of a_s are let go; the loss and the backward come after that release.
int64_t fe_need(const MemChain& c, int s, int t, bool given, int o = 0) {
    const auto& size = c.size;
    const Record r = record(c, s, o);
    int64_t held = given ? size[t] : 0;
    // B s comes after the loss: with the loss pending in (s, t), the loss value is held by then
    int64_t need = std::max(held + r.saved + r.fwd_tmp,
                            r.saved + size[s + 1] + size[s] + r.bwd_tmp - r.in_free + (given ? 0 : c.loss_value));
    if (!given && s + 1 == c.length()) need = std::max(need, r.saved + size[s + 1] + r.loss_tmp_graph - r.in_free);
    return need;
}

// What recording s with option o takes from the memory of (s+1, t): its recorded output, less the part
// of a_s let go.
inline int64_t fe_shift(const MemChain& c, int s, int o = 0) {
    const Record r = record(c, s, o);
    return r.saved - r.in_free;
}

// Peak of the run Fc s, Fn s+1 … Fn j-1 reaching a_j, where the last step is j-1 -> j.
inline int64_t run_step(const MemChain& c, int s, int j) {
    return j == s + 1 ? c.size[s + 1] + c.fwd_tmp_nograd[s] : c.size[j - 1] + c.size[j] + c.fwd_tmp_nograd[j - 1];
}

// Held in (k, t)'s frame just before B k: its graph less in_free[k], δ_{k+1}, and the loss value after the loss.
inline int64_t before_b(const MemChain& c, int k, bool given) {
    return c.saved[k] - c.in_free[k] + c.size[k + 1] + (given ? 0 : c.loss_value);
}

// Peak of B k in (k, t)'s frame (fe_need's backward term).
inline int64_t b_peak(const MemChain& c, int k, bool given) { return before_b(c, k, given) + c.size[k] + c.bwd_tmp[k]; }

// Least m of (s, t) at which a split s -> s2 offloading a_s fits the prefetch and B s2 with a_s back on the device.
inline int64_t prefetch_need(const MemChain& c, int s2, bool given) {
    const int64_t held = before_b(c, s2, given);
    return c.size[s2] + std::max(held, held + c.size[s2] + c.bwd_tmp[s2]);
}

// What every debt run of (s, t) needs besides the rest: Fe s with its part, and B s.
inline int64_t run_head(const MemChain& c, int s, int t, bool given) {
    const int64_t held = given ? c.size[t] : 0;
    return std::max(held + c.saved[s] + c.fwd_tmp[s], b_peak(c, s, given));
}

// The state just before B s with stage s's part back (PrefetchSaved s there): the whole graph of s with the free part
// of a_{s+1} that B s lets go first, δ_{s+1}, the loss value; Fe s+1 has let go in_free[s+1] of a_{s+1} when s+1 < t
// and stage s+1 has no options. A part prefetched earlier is never charged this: it is held between B s+1 and B s,
// at no op's peak.
inline int64_t prefetch_at_b(const MemChain& c, int s, int t, bool given) {
    const int64_t gone = s + 1 < t && c.options_of(s + 1) == 0 ? c.in_free[s + 1] : 0;
    return before_b(c, s, given) - gone;
}

// Least m of (s, t) for stage s's part moved and back before B i for some i in s+1 … t-1: Fe s+1 … Fe i-1 recorded
// with the part still charged (a copy they do not hide, waited for before (i, t)), (i, t) without it but its last op,
// PrefetchSaved s, B i … B s+1 with it, B s (`head`); where stage i has options, Fe i inside the run too and (i+1, t)
// after the wait (the debt run j = i+1, d = i - s). The state just before B s is then held at no op's peak. `at`: the
// i of least need (0 when none).
int64_t part_back_early(const MemChain& c, const Needs& n, int s, int t, bool given, int64_t head, int& at) {
    const int64_t held = given ? c.size[t] : 0;
    int64_t least = std::numeric_limits<int64_t>::max(), base = fe_shift(c, s, 0), charged = head;
    at = 0;
    for (int i = s + 1; i < t; ++i) {
        if (i > s + 1) {  // stage i-1 recorded inside the run: Fe i-1 and B i-1 with the part
            const int k = i - 1;
            charged = std::max({charged, held + base + c.saved[k] + c.fwd_tmp[k], base + b_peak(c, k, given)});
            base += fe_shift(c, k, 0);
        }
        int64_t rest = base - c.offloadable[s] + n.sub(i, t, given);  // (i, t) any schedule, its last op B i
        if (c.options_of(i) != 0) {  // Fe i inside the run too, then (i+1, t) or the loss without the part
            const int64_t inside = base + fe_shift(c, i, 0) - c.offloadable[s];
            const int64_t after = i + 1 < t ? n.sub(i + 1, t, given) : given ? 0 : c.size[t] + c.loss_tmp_graph;
            rest = std::max(held + base + c.saved[i] + c.fwd_tmp[i], inside + after);
        }
        const int64_t x = std::max({charged, rest, base + std::max(before_b(c, i, given), b_peak(c, i, given))});
        if (x < least) {
            least = x;
            at = i;
        }
    }
    return least;
}

// `fastest[s]`: the option of least fwd + bwd cost (0 on ties): the all-record schedule records each stage
// so, and from m_full on it fits. Only the Solver reads m_full; min_budget passes no costs (all zeros).
// `moves`: what may move to host memory; the needs are then the least over the offloading choices too, a
// copy waited for where the memory needs it (docs/planner.md, "Debts"), so they do not depend on times.
Needs compute_needs(const MemChain& c, const std::vector<int>& fastest, Moves moves = {}) {
    const int L = c.length();
    const auto& size = c.size;
    Needs n;
    n.L = L;
    n.given.assign(static_cast<size_t>(L + 1) * (L + 1), 0);
    n.full_given.assign(n.given.size(), 0);
    n.pending.assign(L + 1, 0);
    n.full_pending.assign(L + 1, 0);
    n.pgiven = n.given;
    n.ppending = n.pending;
    auto need = [&](int s, int t, bool given, bool plain) {
        const int64_t held = given ? size[t] : 0, lshift = given ? 0 : c.loss_value;
        int64_t best = std::numeric_limits<int64_t>::max();
        for (int o = 0; o <= c.options_of(s); ++o) {  // the least need over ways to record s
            int64_t fe = fe_need(c, s, t, given, o);
            if (s + 1 < t) fe = std::max(fe, fe_shift(c, s, o) + n.sub(s + 1, t, given));
            best = std::min(best, fe);
        }
        const int64_t part = moves.saved ? c.offloadable[s] : 0;
        if (part > 0) {  // Fe s, OffloadSaved s, WaitSaved s, (s+1, t) without the part, PrefetchSaved s, B s
            const int64_t head = run_head(c, s, t, given);
            int64_t run = std::max(head, prefetch_at_b(c, s, t, given));
            if (s + 1 < t) run = std::max(run, fe_shift(c, s, 0) - part + n.sub(s + 1, t, given));
            if (!given && s + 1 == L) run = std::max(run, c.saved[s] + size[L] + c.loss_tmp_graph - c.in_free[s] - part);
            int at;
            best = std::min({best, run, part_back_early(c, n, s, t, given, head, at)});
        }
        int64_t run = 0;
        const int last = given ? t - 1 : t;
        for (int s2 = s + 1; s2 <= last; ++s2) {
            run = std::max(run, run_step(c, s, s2));
            const bool loss = !given && s2 == L;
            const int64_t right = loss ? 2 * size[L] + c.loss_tmp : size[s2] + n.sub(s2, t, given, true);
            const int64_t left = n.g(s, s2, plain) + lshift;  // the left part runs after the loss: its value is held
            best = std::min(best, std::max({held + run, right, left}));
            if (plain && moves.values && s > 0 && !loss && c.options_of(s2) == 0)  // a_s offloaded, waited for
                best = std::min(best, std::max({held + run, size[s2] - size[s] + n.sub(s2, t, given, true), left,
                                                prefetch_need(c, s2, given)}));
        }
        return best;
    };
    auto full = [&](int s, int t, bool given) {
        const int f = fastest[s];
        int64_t x = fe_need(c, s, t, given, f);
        if (s + 1 < t) x = std::max(x, fe_shift(c, s, f) + (given ? n.fg(s + 1, t) : n.full_pending[s + 1]));
        return x;
    };
    const bool two = moves.values;  // the plain needs differ only where a value may move
    for (int s = L - 1; s >= 0; --s) {
        for (int t = s + 1; t <= L; ++t) {
            const size_t at = static_cast<size_t>(s) * (L + 1) + t;
            n.given[at] = need(s, t, true, false);
            n.pgiven[at] = two && s > 0 ? need(s, t, true, true) : n.given[at];
            n.full_given[at] = full(s, t, true);
        }
        n.pending[s] = need(s, L, false, false);
        n.ppending[s] = two && s > 0 ? need(s, L, false, true) : n.pending[s];
        n.full_pending[s] = full(s, L, false);
    }
    return n;
}

// Cost over m of one subproblem: INF below lo, data[m - lo] on [lo, hi), `full_cost` from hi on.
struct Table {
    int64_t lo = 0, hi = 0;
    size_t offset = 0;
    double full_cost = 0;
};

class Solver {
   public:
    Solver(const MemChain& c, const std::vector<int64_t>& fwd_cost, const std::vector<int64_t>& bwd_cost, int64_t top,
           const std::vector<int64_t>& transfer_cost = {}, int count_bits = 0,
           const std::vector<int64_t>& saved_transfer_cost = {})
        : c_(c), L_(c.length()), top_(top), fastest_(fastest_options(c, fwd_cost, bwd_cost)),
          needs_(compute_needs(c, fastest_, Moves{!transfer_cost.empty(), !saved_transfer_cost.empty()})),
          offload_(!transfer_cost.empty()), count_bits_(count_bits),
          tc_(transfer_cost), bci_(bwd_cost), stc_(saved_transfer_cost), fci_(fwd_cost) {
        need_.assign(L_ + 1, 0);
        fc_.assign(fwd_cost.begin(), fwd_cost.end());
        bc_.assign(bwd_cost.begin(), bwd_cost.end());
        prefix_.assign(L_ + 1, 0);  // exact integer prefix sums of the fastest fwd + bwd of each stage
        fprefix_.assign(L_ + 1, 0);
        for (int k = 0; k < L_; ++k) {
            prefix_[k + 1] = prefix_[k] + step_cost(fwd_cost, bwd_cost, k, fastest_[k]);
            fprefix_[k + 1] = fprefix_[k] + fwd_cost[k];
        }
        given_.resize(static_cast<size_t>(L_ + 1) * (L_ + 1));
        pending_.resize(L_ + 1);
        if (offload_) {  // the "input plain" tables (offload choices allowed); for s = 0 the same as "any"
            pgiven_.resize(given_.size());
            ppending_.resize(L_ + 1);
        }
        size_t total = 0;
        auto layout = [&](Table& tab, int64_t lo, int64_t full, int s, int t) {
            tab.lo = lo;
            // a subproblem gets at most top_ + in_free[0]: Fe 0 may let go a part of the chain input (a_F)
            // that the caller's top_ had already been charged for (chain version 4)
            tab.hi = std::max(lo, std::min(full, top_ + c_.in_free[0] + 1));
            tab.offset = total;
            tab.full_cost = static_cast<double>(prefix_[t] - prefix_[s]);
            total += static_cast<size_t>(tab.hi - tab.lo);
        };
        // Each flavour starts at its own need: with offloading, below recompute-only's (docs/planner.md, "Debts").
        for_each_given([&](int s, int t) {
            layout(G(s, t), needs_.g(s, t), needs_.fg(s, t), s, t);
            if (offload_ && s > 0) layout(pgiven_[s * (L_ + 1) + t], needs_.g(s, t, true), needs_.fg(s, t), s, t);
        });
        for (int s = L_ - 1; s >= 0; --s) {
            layout(pending_[s], needs_.pending[s], needs_.full_pending[s], s, L_);
            if (offload_ && s > 0) layout(ppending_[s], needs_.p(s, true), needs_.full_pending[s], s, L_);
        }
        data_.assign(total, INF);
    }

    Solution run(int threads) {
        Solution out;
        if (top_ < needs_.pending[0]) return out;
        threads = std::max(1, std::min(threads, kEndBlock));
        if (threads == 1) {
            for_each_given([&](int s, int t) { fill(s, t, true, need_); });
        } else {
            fill_given_parallel(threads);
        }
        for (int s = L_ - 1; s >= 0; --s) fill(s, L_, false, need_);
        out.cost = value(pending_[0], top_);
        out.feasible = out.cost < INF;
        if (out.feasible) emit(0, L_, false, false, top_, out.ops);
        return out;
    }

   private:
    const MemChain& c_;
    int L_;
    int64_t top_;
    std::vector<int> fastest_;  // per stage, the option of least fwd + bwd cost (0 on ties)
    Needs needs_;
    bool offload_;                    // transfer costs given: a second table set, offload choices
    int count_bits_;                  // costs are ticks << count_bits | forward ops
    std::vector<int64_t> tc_, bci_;  // transfer costs of a_0 … a_L, backward costs (exact integers)
    std::vector<int64_t> stc_, fci_;  // transfer costs of the saved parts ([]: none), forward costs

    int64_t step_cost(const std::vector<int64_t>& fwd_cost, const std::vector<int64_t>& bwd_cost, int s, int o) const {
        return o == 0 ? fwd_cost[s] + bwd_cost[s] : c_.options[s][o - 1].fwd_cost + c_.options[s][o - 1].bwd_cost;
    }

    std::vector<int> fastest_options(const MemChain& c, const std::vector<int64_t>& fwd_cost,
                                     const std::vector<int64_t>& bwd_cost) const {
        std::vector<int> out(c.length(), 0);
        for (int s = 0; s < c.length(); ++s)
            for (int o = 1; o <= c.options_of(s); ++o)
                if (step_cost(fwd_cost, bwd_cost, s, o) < step_cost(fwd_cost, bwd_cost, s, out[s])) out[s] = o;
        return out;
    }

    double step(int s, int o) const {
        return o == 0 ? fc_[s] + bc_[s]
                      : static_cast<double>(c_.options[s][o - 1].fwd_cost + c_.options[s][o - 1].bwd_cost);
    }
    std::vector<double> fc_, bc_, data_;
    std::vector<int64_t> prefix_, fprefix_;
    std::vector<Table> given_, pending_, pgiven_, ppending_;  // "input any" (today's) and "input plain"
    std::vector<int64_t> need_;  // scratch of fill() on one thread (see fill)

    Table& G(int s, int t) { return given_[s * (L_ + 1) + t]; }

    // Visit every given subproblem after those it reads: (s2, t) for s2 > s and (s, s2) for s2 < t.
    // Ends t come in blocks, so the right parts (column t) and left parts (row s) a block reads
    // stay in cache; tables are laid out in this same order.
    template <class Visit>
    void for_each_given(Visit visit) {
        for (int t0 = 1; t0 <= L_; t0 += kEndBlock) {
            const int t1 = std::min(L_ + 1, t0 + kEndBlock);
            for (int s = t1 - 2; s >= 0; --s)
                for (int t = std::max(t0, s + 1); t < t1; ++t) visit(s, t);
        }
    }
    // `plain`: the caller holds a_s without graph, so the subproblem may offload it (s >= 1, offloading on).
    Table& T(int s, int t, bool given, bool plain = false) {
        if (plain && offload_ && s > 0) return given ? pgiven_[s * (L_ + 1) + t] : ppending_[s];
        return given ? G(s, t) : pending_[s];
    }

    // May a split s -> s2 offload a_s during its right part? Not into the loss split, and not when B s2's time
    // depends on an option. What the sweep Fn s+1 … Fn s2-1 does not hide of the copy, a `Wait s` pays.
    bool offloadable(int s, int t, bool given, int s2) const {
        return offload_ && s >= 1 && (given || s2 != L_) && s2 < t && c_.options_of(s2) == 0;
    }

    int64_t ticks(int64_t cost) const { return cost >> count_bits_; }

    // Forward ticks of stages a … b-1 (each rounded to nearest by discretize).
    int64_t forward_ticks(int a, int b) const {
        int64_t x = 0;
        for (int k = a; k < b; ++k) x += ticks(fci_[k]);
        return x;
    }

    // Whether a copy of `copy` (a cost) issued before the forwards a … b-1 surely ends by their end: its ticks
    // (rounded up) plus one per forward (rounded to nearest) at most theirs. Otherwise a wait follows them.
    bool done_after(int64_t copy, int a, int b) const { return ticks(copy) + (b - a) <= forward_ticks(a, b); }

    // The wait after the forwards a … b-1 for a copy issued before them (a cost).
    int64_t front_stall(int64_t copy, int a, int b) const {
        return std::max<int64_t>(0, ticks(copy) - forward_ticks(a, b)) << count_bits_;
    }

    int64_t prefetch_need(int s2, bool given) const { return rotor::prefetch_need(c_, s2, given); }

    // The stalls of offloading a_s over s -> s2: the wait before the right part, and the left part's first op
    // waiting for the prefetch, which overlaps B s2 only.
    double stall(int s, int s2) const {
        return static_cast<double>(front_stall(tc_[s], s + 1, s2) + std::max<int64_t>(0, tc_[s] - bci_[s2]));
    }

    // May recording s (Fe s) in (s, t) move its saved part to host memory while (s+1, t) runs? Only when
    // (s+1, t) is a real subproblem (its last op is B s+1), stage s+1 has no options (B s+1's time is known),
    // and the copy surely ends within the first op of (s+1, t), always a forward of stage s+1: its ticks
    // rounded up, plus one (the forward's ticks are rounded to nearest), at most that forward's ticks.
    bool saved_offloadable(int s, int t) const {
        if (stc_.empty() || c_.offloadable[s] <= 0 || s + 1 >= t || c_.options_of(s + 1) > 0) return false;
        return (stc_[s] >> count_bits_) + 1 <= (fci_[s + 1] >> count_bits_);
    }

    // Least m of (s, t) at which the saved-part variant fits beside what Fe s needs: the first op of (s+1, t)
    // runs with the saved part still on the device, its last op (B s+1) after it is back (and the prefetch
    // just before it); in between (s+1, t) has the part's memory too.
    int64_t saved_need(int s, int t, bool given) const {
        const int64_t lv = given ? 0 : c_.loss_value, held = given ? c_.size[t] : 0;
        const int64_t first = held + std::max(c_.saved[s + 1] + c_.fwd_tmp[s + 1],
                                              c_.size[s + 2] + c_.fwd_tmp_nograd[s + 1]);  // Fe or Fc s+1
        const int64_t before = c_.saved[s + 1] - c_.in_free[s + 1] + c_.size[s + 2] + lv;  // PrefetchSaved s
        const int64_t last = std::max(before, before + c_.size[s + 1] + c_.bwd_tmp[s + 1]);  // B s+1
        return std::max(fe_need(c_, s, t, given, 0), fe_shift(c_, s, 0) + std::max(first, last));
    }

    // A debt run of (s, t) (docs/planner.md, "Debts"): `Fe s, OffloadSaved s, Fe s+1, [OffloadSaved s+1], …, Fe j-1,
    // [WaitSaved e], (j, t), B j-1 … B s`: the parts of stages s … e move, queued on the channel in that order, and
    // `PrefetchSaved k` of each comes right before `B min(k + d, top)` (top: j when (j, t)'s last op is a plain B j,
    // else j-1). `need`: its least m but (j, t), read at m - shift; `cost`: its ops and stalls but (j, t).
    struct Run {
        int j, e, d;
        int64_t need, shift;
        double cost;
        bool wait;
    };

    int run_top(int t, int j) const { return j < t && c_.options_of(j) == 0 ? j : j - 1; }

    // Whether the forwards s+1 … j-1 surely hide stage s's copy and the backwards j-1 … s+1 hide its prefetch.
    bool run_hidden(int s, int j) const {
        int64_t hidden = 0;
        for (int k = s + 1; k < j; ++k) hidden += bci_[k];
        return done_after(stc_[s], s + 1, j) && hidden >= stc_[s];
    }

    // (need, nominal stall ticks, wait) of the forwards Fe s … Fe j-1 moving the parts s … e, queued on the channel.
    // `left[n]`: ticks until part s+n's copy surely ends (rounded up, each forward counted one tick short); `lag`: the
    // nominal ticks until the channel is free. A part leaves the device at the first forward starting after its end.
    void run_front(int s, int t, bool given, int j, int e, const std::vector<int64_t>& base, int64_t& need,
                   int64_t& lag, bool& wait) const {
        const int64_t held = given ? c_.size[t] : 0;
        need = run_head(c_, s, t, given);
        // a wide run is charged the state before B s whatever d (the floor models narrow runs only)
        if (e > s) need = std::max(need, prefetch_at_b(c_, s, t, given));
        std::vector<int64_t> left{ticks(stc_[s])};
        lag = ticks(stc_[s]);
        for (int k = s + 1; k < j; ++k) {
            int64_t gone = 0;
            for (size_t n = 0; n < left.size(); ++n)
                if (left[n] <= 0) gone += c_.offloadable[s + static_cast<int>(n)];
            need = std::max(need, held + base[k] - gone + c_.saved[k] + c_.fwd_tmp[k]);
            const int64_t f = ticks(fci_[k]);
            for (int64_t& x : left) x -= f - 1;
            lag = std::max<int64_t>(0, lag - f);
            if (k <= e) {
                left.push_back(std::max<int64_t>(0, left.back()) + ticks(stc_[k]));
                lag += ticks(stc_[k]);
            }
        }
        int64_t moved = 0;
        for (int k = s; k <= e; ++k) moved += c_.offloadable[k];
        if (j == t && !given) need = std::max(need, base[t] + c_.size[t] + c_.loss_tmp_graph - moved);
        wait = left.back() > 0;
    }

    // (need, nominal stall ticks) of the backwards B top … B s with the parts s … e prefetched before
    // B min(k + d, top): a part not yet issued is away; each B k (k <= e) waits for its part; the channel is free
    // at B top's start (the run's offloads were waited for, (j, t)'s prefetches consumed by then).
    void run_back(int s, int t, bool given, int j, int e, int d, int top, const std::vector<int64_t>& base,
                  int64_t& need, int64_t& stall) const {
        need = 0;
        stall = 0;
        int64_t now = 0, channel = 0;
        std::vector<int64_t> arrive(e - s + 1, -1);
        for (int i = top; i >= s; --i) {
            bool issued = false;
            for (int k = e; k >= s; --k) {
                if (std::min(k + d, top) != i) continue;
                channel = std::max(channel, now) + ticks(stc_[k]);
                arrive[k - s] = channel;
                issued = true;
            }
            int64_t away = 0;
            for (int k = s; k <= std::min(e, i - d - 1); ++k) away += c_.offloadable[k];
            if (i > s) {
                need = std::max(need, base[i] - away + b_peak(c_, i, given));
                if (issued) need = std::max(need, base[i] - away + before_b(c_, i, given));
            } else if (issued) {  // d = 0: stage s's part comes back just before B s
                need = std::max(need, prefetch_at_b(c_, s, t, given));
            }
            if (i < j && i <= e && arrive[i - s] >= 0) {
                stall += std::max<int64_t>(0, arrive[i - s] - now);
                now = std::max(now, arrive[i - s]);
            }
            now += ticks(bci_[i]);
        }
    }

    // The runs (j, e, d) of (s, t) for d ascending into `out`, less those an earlier one of the same (j, e) matches
    // or beats in both need and cost (they can never be the first of least cost).
    void runs_of(int s, int t, bool given, int j, int e, const std::vector<int64_t>& base,
                 std::vector<Run>& out) const {
        int64_t front, lag, back, stall;
        bool wait;
        run_front(s, t, given, j, e, base, front, lag, wait);
        const int top = run_top(t, j);
        int64_t moved = 0, ops = 0;
        for (int k = s; k <= e; ++k) moved += c_.offloadable[k];
        for (int k = s; k < j; ++k) ops += fci_[k] + bci_[k];
        const int64_t shift = j < t ? base[j] - moved : 0;
        const size_t first = out.size();
        for (int d = 0; d <= top - s; ++d) {
            run_back(s, t, given, j, e, d, top, base, back, stall);
            const int64_t need = std::max(front, back);
            const double cost = static_cast<double>(ops + ((lag + stall) << count_bits_));
            bool beaten = false;
            for (size_t n = first; n < out.size() && !beaten; ++n) beaten = out[n].need <= need && out[n].cost <= cost;
            if (!beaten) out.push_back({j, e, d, need, shift, cost, wait});
        }
    }

    // The runs of (s, t) in the reference planner's order (j ascending, then e, then d), into `out`; none when
    // stage s's part cannot move. Runs moving stage s's part only stop at the first j whose forwards and backwards
    // both hide its copy; wider ones (e > s) are at most kWideRun stages long.
    void runs(int s, int t, bool given, std::vector<Run>& out) const {
        out.clear();
        if (stc_.empty() || c_.offloadable[s] <= 0) return;
        std::vector<int64_t> base(t + 1, 0);  // (s, t)'s frame to (k, t)'s, the parts included
        base[s + 1] = fe_shift(c_, s, 0);
        for (int k = s + 1; k < t; ++k) base[k + 1] = base[k] + fe_shift(c_, k, 0);
        bool narrow = true;  // runs moving stage s's part only still go on
        for (int j = s + 1; j <= t; ++j) {
            const int last_e = j - s > kWideRun ? s : j - 1;
            if (!narrow && last_e == s) break;
            for (int e = narrow ? s : s + 1; e <= last_e; ++e) {
                if (c_.offloadable[e] <= 0) break;
                runs_of(s, t, given, j, e, base, out);
            }
            if (narrow && run_hidden(s, j)) narrow = false;
        }
    }

    // The stall of B s: the saved part's prefetch overlaps B s+1 only.
    double saved_stall(int s) const { return static_cast<double>(std::max<int64_t>(0, stc_[s] - bci_[s + 1])); }

    // The same fill as for_each_given, on `threads` threads, each table computed exactly as on one
    // thread (so the results are bit-identical). Inside a block of end points, thread k owns a
    // contiguous range of columns t and walks the rows s descending like the serial order. (s, t)
    // reads (s2, t) for s2 > s (same thread, done earlier), (s, s2) for s2 < t in this block (same
    // thread earlier, or a lower thread's columns on row s: wait for that thread to finish row s), and
    // tables of earlier blocks (thread 0 waits for every thread to finish the previous block; the
    // others wait on thread 0 transitively).
    void fill_given_parallel(int threads) {
        std::vector<std::atomic<int64_t>> done(threads);  // rows finished so far, over all blocks
        for (auto& d : done) d.store(0);
        // Spin briefly, then sleep: on a machine whose other cores are busy, a spinning waiter
        // would take CPU time from the thread it waits for. `sleepers` and `done` are both
        // sequentially consistent, so a publisher that sees no sleeper is seen by the sleeper's check.
        std::mutex mutex;
        std::condition_variable wake;
        std::atomic<int> sleepers{0};
        auto wait = [&](const std::atomic<int64_t>& a, int64_t at_least) {
            for (int spins = 0; spins < 2000; ++spins)
                if (a.load() >= at_least) return;
            sleepers.fetch_add(1);
            {
                std::unique_lock<std::mutex> lock(mutex);
                wake.wait(lock, [&] { return a.load() >= at_least; });
            }
            sleepers.fetch_sub(1);
        };
        auto publish = [&](std::atomic<int64_t>& a, int64_t value) {
            a.store(value);
            if (sleepers.load() > 0) {
                std::lock_guard<std::mutex> lock(mutex);
                wake.notify_all();
            }
        };
        auto work = [&](int k) {
            std::vector<int64_t> need(L_ + 1, 0);
            int64_t base = 0;  // rows of the blocks before this one
            for (int t0 = 1; t0 <= L_; t0 += kEndBlock) {
                const int t1 = std::min(L_ + 1, t0 + kEndBlock);
                const int width = t1 - t0;
                const int c0 = t0 + width * k / threads, c1 = t0 + width * (k + 1) / threads;
                if (k == 0) wait(done[threads - 1], base);
                int64_t row = base;
                for (int s = t1 - 2; s >= 0; --s, ++row) {
                    if (k > 0) wait(done[k - 1], row + 1);
                    for (int t = std::max(c0, s + 1); t < c1; ++t) fill(s, t, true, need);
                    publish(done[k], row + 1);
                }
                base = row;
            }
        };
        std::vector<std::thread> pool;
        for (int k = 1; k < threads; ++k) pool.emplace_back(work, k);
        work(0);
        for (auto& th : pool) th.join();
    }

    double value(const Table& tab, int64_t m) const {
        if (m < tab.lo) return INF;
        if (m >= tab.hi) return tab.full_cost;
        return data_[tab.offset + (m - tab.lo)];
    }

    double forward_cost(int s, int s2) const { return static_cast<double>(fprefix_[s2] - fprefix_[s]); }

    // out[m] = min(out[m], c + a(m - shift) + b(m)) for m in [from, to), b optional.
    // Callers guarantee m - shift >= a.lo and m >= b.lo on the range.
    void relax(const Table& dst, int64_t from, int64_t to, double c, const Table& a, int64_t shift,
               const Table* b, int64_t b_shift = 0) {
        double* out = data_.data() + dst.offset - dst.lo;
        const int64_t a_end = a.hi + shift, b_end = b ? b->hi + b_shift : std::numeric_limits<int64_t>::max();
        for (int64_t x = from; x < to;) {
            int64_t end = to;
            const bool in_a = x < a_end, in_b = b && x < b_end;
            if (in_a) end = std::min(end, a_end);
            if (in_b) end = std::min(end, b_end);
            double* o = out + x;
            const int64_t n = end - x;
            if (in_a && in_b) {
                const double* pa = data_.data() + a.offset + (x - shift - a.lo);
                const double* pb = data_.data() + b->offset + (x - b_shift - b->lo);
                for (int64_t i = 0; i < n; ++i) {
                    double v = c + pa[i] + pb[i];
                    o[i] = v < o[i] ? v : o[i];
                }
            } else if (in_a) {
                const double* pa = data_.data() + a.offset + (x - shift - a.lo);
                const double k = c + (b ? b->full_cost : 0.0);
                for (int64_t i = 0; i < n; ++i) {
                    double v = k + pa[i];
                    o[i] = v < o[i] ? v : o[i];
                }
            } else if (in_b) {
                const double* pb = data_.data() + b->offset + (x - b_shift - b->lo);
                const double k = c + a.full_cost;
                for (int64_t i = 0; i < n; ++i) {
                    double v = k + pb[i];
                    o[i] = v < o[i] ? v : o[i];
                }
            } else {
                const double v = c + a.full_cost + (b ? b->full_cost : 0.0);
                for (int64_t i = 0; i < n; ++i) o[i] = v < o[i] ? v : o[i];
            }
            x = end;
        }
    }

    // Both flavours of (s, t): they read the same subproblems, so they are filled at the same visit.
    void fill(int s, int t, bool given, std::vector<int64_t>& need_) {
        fill(s, t, given, false, need_);
        if (offload_ && s > 0) fill(s, t, given, true, need_);
    }

    // `need_` is this thread's scratch: per split s2, the memory its forward run needs.
    void fill(int s, int t, bool given, bool plain, std::vector<int64_t>& need_) {
        Table& tab = T(s, t, given, plain);
        if (tab.hi <= tab.lo) return;
        const int64_t lo = tab.lo, hi = tab.hi;
        // Fe s (o = 0) or Fs s:o: record stage s, solve (s+1, t), B s.
        for (int o = 0; o <= c_.options_of(s); ++o) {
            const double cost = step(s, o);
            const int64_t fe = std::max(lo, fe_need(c_, s, t, given, o));
            if (s + 1 == t) {
                double* out = data_.data() + tab.offset - lo;
                for (int64_t m = fe; m < hi; ++m) out[m] = std::min(out[m], cost);
            } else {
                // The shift is negative where Fe s lets go more of a_s than it records. Then m - shift can pass
                // top_, but only for m that no caller reaches: whoever holds a_s was charged at least in_free[s]
                // for it (size[s] plain, saved[s-1] or an option's saved recorded; check_chain), so a reached
                // (s, t, m) has m <= top_ - in_free[s]. For s = 0 the tables reach top_ + in_free[0] (layout).
                // The full_cost read beyond them is therefore never used.
                const Table& sub = T(s + 1, t, given);  // a_{s+1} recorded: "input any"
                const int64_t shift = fe_shift(c_, s, o);
                relax(tab, std::max(fe, sub.lo + shift), hi, cost, sub, shift, nullptr);
                if (o == 0 && saved_offloadable(s, t)) {
                    // Its saved part away meanwhile, (s+1, t) gets offloadable[s] more. As above, m - vshift
                    // passes top_ only for unreached m: a reached m is at most top_ - in_free[s], and
                    // offloadable[s] <= saved[s], so m - vshift <= top_.
                    const int64_t vshift = shift - c_.offloadable[s];
                    const int64_t from = std::max({lo, saved_need(s, t, given), sub.lo + vshift});
                    relax(tab, from, hi, cost + saved_stall(s), sub, vshift, nullptr);
                }
            }
        }
        // Debt runs: record s, its saved part moving while the forwards after it run (docs/planner.md, "Debts").
        static thread_local std::vector<Run> found;  // scratch: fill runs on several threads
        runs(s, t, given, found);
        for (const Run& r : found) {
            if (r.j == t) {
                double* out = data_.data() + tab.offset - lo;
                for (int64_t m = std::max(lo, r.need); m < hi; ++m) out[m] = std::min(out[m], r.cost);
                continue;
            }
            const Table& sub = T(r.j, t, given);  // a_j recorded: "input any"
            relax(tab, std::max({lo, r.need, sub.lo + r.shift}), hi, r.cost, sub, r.shift, nullptr);
        }
        // Checkpoint s -> s2: Fc s, Fn s+1 … Fn s2-1, then right (s2, t), then left (s, s2).
        const int64_t held = given ? c_.size[t] : 0;
        const int last = given ? t - 1 : t;
        int reach = s;  // splits whose forward run fits below hi
        for (int64_t run = 0; reach < last; ++reach) {
            run = std::max(run, run_step(c_, s, reach + 1));
            if (held + run >= hi) break;  // longer runs need at least as much
            need_[reach + 1] = held + run;
        }
        for (int s2 = s + 1; s2 <= reach; ++s2)
            if (!split(tab, s, t, given, plain, s2, need_)) break;
    }

    // Relax (s, t) with the split s -> s2 where it can win: m is walked in blocks, and a block is
    // skipped when the candidate at its top (its least value) cannot beat the best so far at its
    // bottom (the largest there). Returns false when no later split can win either.
    // Its right part has a_{s2} plain (the "input plain" table), its left part the flavour of (s, t).
    bool split(Table& tab, int s, int t, bool given, bool plain, int s2, const std::vector<int64_t>& need_) {
        const int64_t lo = tab.lo, hi = tab.hi;
        const double forward = forward_cost(s, s2);
        double* cur = data_.data() + tab.offset - lo;
        // Any schedule through s2 costs at least all-record plus this forward run; the best so far
        // is largest at lo, so if it is below that bound there, no split from here on can win.
        if (cur[lo] <= tab.full_cost + forward) return false;
        const Table& left = T(s, s2, true, plain);
        const bool loss = !given && s2 == L_;
        const Table& right = loss ? left : T(s2, t, given, true);
        const int64_t shift = loss ? 0 : c_.size[s2];
        const int64_t lshift = given ? 0 : c_.loss_value;  // the left part runs after the loss: its value is held
        int64_t from = std::max({lo, need_[s2], left.lo + lshift});
        from = std::max(from, loss ? 2 * c_.size[L_] + c_.loss_tmp : right.lo + shift);
        const double* lp = data_.data() + left.offset - left.lo - lshift;  // lp[m]: left part at m - lshift
        const double* rp = data_.data() + right.offset - right.lo - shift;  // rp[m]: right part at m - shift
        for (int64_t x = from; x < hi; x += kBlock) {
            const int64_t y = std::min(hi, x + kBlock);
            // The candidate only falls with m: its value at y - 1 is its least on the block.
            double least = forward + (y - 1 - lshift < left.hi ? lp[y - 1] : left.full_cost);
            if (!loss) least += y - 1 - shift < right.hi ? rp[y - 1] : right.full_cost;
            if (least >= cur[x]) continue;
            if (loss) {
                relax(tab, x, y, forward, left, lshift, nullptr);
            } else if (y - lshift <= left.hi && y - shift <= right.hi) {  // both parts stored on the block
                for (int64_t m = x; m < y; ++m) {
                    const double v = forward + rp[m] + lp[m];
                    cur[m] = v < cur[m] ? v : cur[m];
                }
            } else {
                relax(tab, x, y, forward, right, shift, &left, lshift);
            }
        }
        if (plain && offloadable(s, t, given, s2)) {
            // Offload a_s during the right part: it gets a_s's bytes; the prefetch and B s2 fit without them.
            // m - oshift can pass top_ (a_s larger than a_{s2}), but only for m that no caller reaches: a plain
            // (s, t) is reached with a_s charged to its caller, so m <= top_ - size[s] and m - oshift <= top_.
            const int64_t oshift = c_.size[s2] - c_.size[s];
            int64_t ofrom = std::max({lo, need_[s2], left.lo + lshift, right.lo + oshift});
            ofrom = std::max(ofrom, prefetch_need(s2, given));
            const double c = forward + stall(s, s2);
            for (int64_t x = ofrom; x < hi; x += kBlock) {  // blocks skipped as above
                const int64_t y = std::min(hi, x + kBlock);
                if (c + value(right, y - 1 - oshift) + value(left, y - 1 - lshift) >= cur[x]) continue;
                relax(tab, x, y, c, right, oshift, &left, lshift);
            }
        }
        return true;
    }

    // The ops of the first run of (s, t) reaching `target` at m, if one does (the reference's order).
    bool emit_run(int s, int t, bool given, int64_t m, double target, std::vector<Op>& ops) {
        std::vector<Run> found;
        runs(s, t, given, found);
        for (const Run& r : found) {
            if (m < r.need) continue;
            const double cand = r.cost + (r.j < t ? value(T(r.j, t, given), m - r.shift) : 0.0);
            if (cand != target) continue;
            const int top = run_top(t, r.j);
            auto prefetches = [&](int i) {
                for (int k = r.e; k >= s; --k)
                    if (std::min(k + r.d, top) == i) ops.push_back({OpKind::PrefetchSaved, k});
            };
            ops.push_back({OpKind::Fe, s});
            ops.push_back({OpKind::OffloadSaved, s});
            for (int k = s + 1; k < r.j; ++k) {
                ops.push_back({OpKind::Fe, k});
                if (k <= r.e) ops.push_back({OpKind::OffloadSaved, k});
            }
            if (r.wait) ops.push_back({OpKind::WaitSaved, r.e});
            if (r.j < t) {
                emit(r.j, t, given, false, m - r.shift, ops);
                if (top == r.j) {  // (j, t) ends with B j: the parts issued there come back just before it
                    ops.pop_back();
                    prefetches(r.j);
                    ops.push_back({OpKind::B, r.j});
                }
            } else if (!given) {
                ops.push_back({OpKind::Loss, -1});
            }
            for (int k = r.j - 1; k >= s; --k) {
                prefetches(k);
                ops.push_back({OpKind::B, k});
            }
            return true;
        }
        return false;
    }

    // Re-evaluate the choices at (s, t, m) and emit the ops of the first optimal one
    // (Fe first, then Fs s:1, s:2 …, then s2 ascending: the reference planner's order).
    // An offload follows the plain split of the same s2 (both planners' order).
    void emit(int s, int t, bool given, bool plain, int64_t m, std::vector<Op>& ops) {
        const double target = value(T(s, t, given, plain), m);
        for (int o = 0; o <= c_.options_of(s); ++o) {
            if (m >= fe_need(c_, s, t, given, o)) {
                double cand = step(s, o);
                if (s + 1 < t) cand += value(T(s + 1, t, given), m - fe_shift(c_, s, o));
                if (cand == target) {
                    ops.push_back(o == 0 ? Op{OpKind::Fe, s} : Op{OpKind::Fs, s, o});
                    if (s + 1 == t) {
                        if (!given) ops.push_back({OpKind::Loss, -1});
                    } else {
                        emit(s + 1, t, given, false, m - fe_shift(c_, s, o), ops);
                    }
                    ops.push_back({OpKind::B, s});
                    return;
                }
            }
            // The saved-part variant follows the plain record (both planners' order).
            if (o != 0 || !saved_offloadable(s, t) || m < saved_need(s, t, given)) continue;
            const int64_t inner = m - fe_shift(c_, s, 0) + c_.offloadable[s];
            if (step(s, 0) + saved_stall(s) + value(T(s + 1, t, given), inner) != target) continue;
            ops.push_back({OpKind::Fe, s});
            ops.push_back({OpKind::OffloadSaved, s});
            emit(s + 1, t, given, false, inner, ops);
            ops.pop_back();  // (s+1, t) ends with B s+1: the saved part comes back just before it
            ops.push_back({OpKind::PrefetchSaved, s});
            ops.push_back({OpKind::B, s + 1});
            ops.push_back({OpKind::B, s});
            return;
        }
        if (emit_run(s, t, given, m, target, ops)) return;
        const int64_t held = given ? c_.size[t] : 0;
        const int last = given ? t - 1 : t;
        int64_t run = 0;
        for (int s2 = s + 1; s2 <= last; ++s2) {
            run = std::max(run, run_step(c_, s, s2));
            if (held + run > m) break;
            const bool loss = !given && s2 == L_;
            double right;
            if (loss) {
                right = m >= 2 * c_.size[L_] + c_.loss_tmp ? 0.0 : INF;
            } else {
                right = value(T(s2, t, given, true), m - c_.size[s2]);
            }
            const int64_t lshift = given ? 0 : c_.loss_value;
            const double left = value(T(s, s2, true, plain), m - lshift);
            const double cand = forward_cost(s, s2) + right + left;
            if (cand == target) {
                ops.push_back({OpKind::Fc, s});
                for (int j = s + 1; j < s2; ++j) ops.push_back({OpKind::Fn, j});
                if (loss) {
                    ops.push_back({OpKind::Loss, -1});
                } else {
                    emit(s2, t, given, true, m - c_.size[s2], ops);
                }
                emit(s, s2, true, plain, m - lshift, ops);
                return;
            }
            if (!plain || !offloadable(s, t, given, s2) || m < prefetch_need(s2, given)) continue;
            const double ocand =
                forward_cost(s, s2) + stall(s, s2) + value(T(s2, t, given, true), m - c_.size[s2] + c_.size[s]) + left;
            if (ocand != target) continue;
            ops.push_back({OpKind::Fc, s});
            ops.push_back({OpKind::Offload, s});
            for (int j = s + 1; j < s2; ++j) ops.push_back({OpKind::Fn, j});
            if (!done_after(tc_[s], s + 1, s2)) ops.push_back({OpKind::Wait, s});
            emit(s2, t, given, true, m - c_.size[s2] + c_.size[s], ops);
            ops.pop_back();  // the right part ends with B s2: a_s comes back just before it
            ops.push_back({OpKind::Prefetch, s});
            ops.push_back({OpKind::B, s2});
            emit(s, s2, true, plain, m - lshift, ops);
            return;
        }
        throw std::logic_error("planner: no choice reproduces the table value at stage " + std::to_string(s));
    }
};

void emit_feasible(const MemChain& c, const Needs& n, Moves moves, int s, int t, bool given, bool plain, int64_t m,
                   std::vector<Op>& ops);

// Stage s recorded, its part moved and waited for at once (the shortest debt run), back before B s, else before B i
// (compute_needs' shapes, `part_back_early`); false when none fits in m.
bool emit_moved_part(const MemChain& c, const Needs& n, Moves moves, int s, int t, bool given, int64_t m,
                     std::vector<Op>& ops) {
    const int L = c.length();
    const int64_t part = c.offloadable[s], head = run_head(c, s, t, given);
    int64_t late = std::max(head, prefetch_at_b(c, s, t, given));
    if (s + 1 < t) late = std::max(late, fe_shift(c, s, 0) - part + n.sub(s + 1, t, given));
    if (!given && s + 1 == L) late = std::max(late, c.saved[s] + c.size[L] + c.loss_tmp_graph - c.in_free[s] - part);
    int at = 0;
    if (m < late && part_back_early(c, n, s, t, given, head, at) > m) return false;
    const bool early = m < late;
    const int i = early ? at : s + 1;  // the part comes back before B i
    const int j = early && c.options_of(i) != 0 ? i + 1 : i;  // the first stage after the wait
    int64_t base = fe_shift(c, s, 0);
    ops.insert(ops.end(), {{OpKind::Fe, s}, {OpKind::OffloadSaved, s}});
    for (int k = s + 1; k < j; ++k) {
        ops.push_back({OpKind::Fe, k});
        base += fe_shift(c, k, 0);
    }
    ops.push_back({OpKind::WaitSaved, s});
    if (j < t) {
        emit_feasible(c, n, moves, j, t, given, false, m - base + part, ops);
    } else if (!given) {
        ops.push_back({OpKind::Loss, -1});
    }
    if (j == i && early) {  // (i, t) ends with B i: the part comes back just before it
        ops.back() = {OpKind::PrefetchSaved, s};
        ops.push_back({OpKind::B, i});
    } else {
        ops.push_back({OpKind::PrefetchSaved, s});
        if (j > i) ops.push_back({OpKind::B, i});
    }
    for (int k = i - 1; k >= s; --k) ops.push_back({OpKind::B, k});
    return true;
}

// A schedule of (s, t) within m exact units, walking the needs' tables: record if the memory allows, then move
// stage s's saved part and wait for it, then the first split that fits (offloading a_s and waiting for it where
// only that fits). `moves` must be the needs' own; `plain`: the caller holds a_s plain.
void emit_feasible(const MemChain& c, const Needs& n, Moves moves, int s, int t, bool given, bool plain, int64_t m,
                   std::vector<Op>& ops) {
    const int L = c.length();
    for (int o = 0; o <= c.options_of(s); ++o) {  // record all first, then the options in order
        int64_t fe = fe_need(c, s, t, given, o);
        if (s + 1 < t) fe = std::max(fe, fe_shift(c, s, o) + n.sub(s + 1, t, given));
        if (m < fe) continue;
        ops.push_back(o == 0 ? Op{OpKind::Fe, s} : Op{OpKind::Fs, s, o});
        if (s + 1 == t) {
            if (!given) ops.push_back({OpKind::Loss, -1});
        } else {
            emit_feasible(c, n, moves, s + 1, t, given, false, m - fe_shift(c, s, o), ops);
        }
        ops.push_back({OpKind::B, s});
        return;
    }
    if (moves.saved && c.offloadable[s] > 0 && emit_moved_part(c, n, moves, s, t, given, m, ops)) return;
    const int64_t held = given ? c.size[t] : 0;
    const int last = given ? t - 1 : t;
    int64_t run = 0;
    for (int s2 = s + 1; s2 <= last; ++s2) {
        run = std::max(run, run_step(c, s, s2));
        const bool loss = !given && s2 == L;
        int64_t right = loss ? 2 * c.size[L] + c.loss_tmp : c.size[s2] + n.sub(s2, t, given, true);
        const int64_t lshift = given ? 0 : c.loss_value;
        const int64_t left = n.g(s, s2, plain) + lshift;
        const bool fits = std::max({held + run, right, left}) <= m;
        const bool moved = !fits && plain && moves.values && s > 0 && !loss && c.options_of(s2) == 0 &&
                           std::max({held + run, c.size[s2] - c.size[s] + n.sub(s2, t, given, true), left,
                                     prefetch_need(c, s2, given)}) <= m;
        if (!fits && !moved) continue;
        ops.push_back({OpKind::Fc, s});
        if (moved) ops.push_back({OpKind::Offload, s});
        for (int j = s + 1; j < s2; ++j) ops.push_back({OpKind::Fn, j});
        if (loss) {
            ops.push_back({OpKind::Loss, -1});
        } else if (moved) {
            ops.push_back({OpKind::Wait, s});
            emit_feasible(c, n, moves, s2, t, given, true, m - c.size[s2] + c.size[s], ops);
            ops.back() = {OpKind::Prefetch, s};  // (s2, t) ends with B s2: a_s comes back just before it
            ops.push_back({OpKind::B, s2});
        } else {
            emit_feasible(c, n, moves, s2, t, given, true, m - c.size[s2], ops);
        }
        emit_feasible(c, n, moves, s, s2, true, plain, m - lshift, ops);
        return;
    }
    throw std::logic_error("planner: no feasible choice at stage " + std::to_string(s));
}

void check_chain(const MemChain& c) {
    const size_t L = c.saved.size();
    if (L == 0 || c.size.size() != L + 1 || c.fwd_tmp.size() != L || c.fwd_tmp_nograd.size() != L ||
        c.bwd_tmp.size() != L || c.in_free.size() != L || (!c.offloadable.empty() && c.offloadable.size() != L))
        throw std::invalid_argument("planner: inconsistent chain lengths");
    for (size_t k = 0; k < c.offloadable.size(); ++k)
        if (c.offloadable[k] < 0 || c.offloadable[k] > c.saved[k])
            throw std::invalid_argument("planner: offloadable[" + std::to_string(k) + "] must be within 0..saved[" +
                                        std::to_string(k) + "]");
    // in_free[0]: the part of the chain input the chain owns (a_F after a frozen prefix), never the caller's
    if (c.in_free[0] < 0 || c.in_free[0] > c.size[0])
        throw std::invalid_argument("planner: in_free[0] must be within 0..size[0]");
    if (c.loss_value < 0) throw std::invalid_argument("planner: loss_value must be >= 0");
    for (size_t k = 1; k < L; ++k)
        if (c.in_free[k] < 0 || c.in_free[k] > std::min(c.size[k], c.saved[k - 1]))
            throw std::invalid_argument("planner: in_free[" + std::to_string(k) + "] must be within 0..min(size[" +
                                        std::to_string(k) + "], saved[" + std::to_string(k - 1) + "])");
    if (!c.options.empty() && c.options.size() != L)
        throw std::invalid_argument("planner: options must be empty or one list per stage");
    for (size_t k = 0; k < c.options.size(); ++k)
        for (const StageOption& o : c.options[k])
            if (o.saved < 0 || o.fwd_tmp < 0 || o.fwd_cost < 0 || o.bwd_cost < 0 ||
                (k + 1 < L && c.in_free[k + 1] > o.saved))
                throw std::invalid_argument("planner: an option of stage " + std::to_string(k) +
                                            " has a negative figure or saves less than in_free[" +
                                            std::to_string(k + 1) + "]");
}

// The chain with each saved part no larger than what stays charged for ā_{k+1} beyond the part of a_{k+1} that
// Fe k+1 lets go (in_free[k+1]): a part never holds a_{k+1}'s storage (docs/memory-model.md, "Chain version 6"),
// so a profiled chain always passes, and a reached subproblem then never has more memory than the budget.
MemChain movable(const MemChain& chain) {
    MemChain c = chain;
    for (size_t k = 0; k < c.offloadable.size(); ++k) {
        const int64_t freed = k + 1 < c.in_free.size() ? c.in_free[k + 1] : 0;
        c.offloadable[k] = std::max<int64_t>(0, std::min(c.offloadable[k], c.saved[k] - freed));
    }
    return c;
}

}  // namespace

int default_threads() {
    const unsigned hw = std::thread::hardware_concurrency();
    return hw >= 2 ? 2 : 1;
}

Solution solve(const MemChain& chain, const std::vector<int64_t>& fwd_cost, const std::vector<int64_t>& bwd_cost,
               int64_t slots, int threads, const std::vector<int64_t>& transfer_cost, int count_bits,
               const std::vector<int64_t>& saved_transfer_cost) {
    check_chain(chain);
    if (fwd_cost.size() != chain.saved.size() || bwd_cost.size() != chain.saved.size())
        throw std::invalid_argument("planner: cost lists must have one entry per stage");
    if (!transfer_cost.empty() && transfer_cost.size() != chain.size.size())
        throw std::invalid_argument("planner: transfer costs must be empty or one per value a_0 … a_L");
    if (count_bits < 0 || count_bits > 52) throw std::invalid_argument("planner: count_bits must be within 0..52");
    if (!saved_transfer_cost.empty() &&
        (transfer_cost.empty() || chain.offloadable.empty() || saved_transfer_cost.size() != chain.saved.size()))
        throw std::invalid_argument(
            "planner: saved transfer costs must be empty or one per stage, with transfer costs and offloadable");
    for (const auto* costs : {&transfer_cost, &saved_transfer_cost})
        for (int64_t x : *costs)
            if (x < 0 || (x & ((int64_t{1} << count_bits) - 1)) != 0)
                throw std::invalid_argument("planner: a transfer cost must be >= 0 and carry no forward-op count");
    const MemChain c = movable(chain);
    Solver solver(c, fwd_cost, bwd_cost, slots - c.size[0], transfer_cost, count_bits, saved_transfer_cost);
    if (threads <= 0) threads = default_threads();
    return solver.run(threads);
}

int64_t min_budget(const MemChain& chain, bool values) {
    check_chain(chain);
    const Moves moves{values, values && !chain.offloadable.empty()};
    const MemChain c = movable(chain);
    return c.size[0] + compute_needs(c, std::vector<int>(c.length(), 0), moves).pending[0];
}

Solution feasible_schedule(const MemChain& chain, int64_t budget, bool values) {
    check_chain(chain);
    Solution out;
    const Moves moves{values, values && !chain.offloadable.empty()};
    const MemChain c = movable(chain);
    Needs n = compute_needs(c, std::vector<int>(c.length(), 0), moves);
    const int64_t m = budget - c.size[0];
    if (m < n.pending[0]) return out;
    out.feasible = true;
    emit_feasible(c, n, moves, 0, c.length(), false, false, m, out.ops);
    return out;
}

}  // namespace rotor
