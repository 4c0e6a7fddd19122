// Python binding `lightning_rotor._planner`: plain lists in, plain tuples out.
// lightning_rotor/planner.py is the public API; this module has no torch types.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <stdexcept>

#include "planner.hpp"

namespace py = pybind11;
using rotor::MemChain;
using rotor::Op;
using rotor::OpKind;
using Sizes = std::vector<int64_t>;

namespace {

using Opt = std::optional<int64_t>;
using OptSizes = std::optional<Sizes>;
// chain version 5: per stage, its options 1, 2, … as (saved, fwd_tmp, bwd_tmp, loss_tmp_graph[, fwd_cost, bwd_cost])
using OptOptions = std::optional<std::vector<std::vector<Sizes>>>;

std::vector<std::vector<rotor::StageOption>> make_options(OptOptions options, size_t length) {
    std::vector<std::vector<rotor::StageOption>> out;
    if (!options) return out;
    if (options->size() != length) throw std::invalid_argument("planner: options must have one list per stage");
    bool any = false;
    out.resize(length);
    for (size_t k = 0; k < length; ++k) {
        for (const Sizes& f : (*options)[k]) {
            if (f.size() != 4 && f.size() != 6)
                throw std::invalid_argument(
                    "planner: an option is (saved, fwd_tmp, bwd_tmp, loss_tmp_graph[, fwd_cost, bwd_cost])");
            out[k].push_back({f[0], f[1], f[2], f[3], f.size() == 6 ? f[4] : 0, f.size() == 6 ? f[5] : 0});
            any = true;
        }
    }
    if (!any) out.clear();  // no options anywhere: exactly the chain without them
    return out;
}

// loss_tmp_graph defaults to loss_tmp (chain version 1: the loss charges the same either way);
// in_free to zeros (chain version 2: nothing of a stage input is let go before its backward);
// loss_value to 0 (before chain version 3 the loss value was counted with a_0).
MemChain make_chain(Sizes size, Sizes saved, Sizes fwd_tmp, Sizes fwd_tmp_nograd, Sizes bwd_tmp, int64_t loss_tmp,
                    Opt loss_tmp_graph, OptSizes in_free, int64_t loss_value = 0, OptOptions options = std::nullopt) {
    MemChain c;
    c.options = make_options(std::move(options), saved.size());
    c.loss_value = loss_value;
    c.in_free = in_free ? std::move(*in_free) : Sizes(saved.size(), 0);
    c.size = std::move(size);
    c.saved = std::move(saved);
    c.fwd_tmp = std::move(fwd_tmp);
    c.fwd_tmp_nograd = std::move(fwd_tmp_nograd);
    c.bwd_tmp = std::move(bwd_tmp);
    c.loss_tmp = loss_tmp;
    c.loss_tmp_graph = loss_tmp_graph.value_or(loss_tmp);
    return c;
}

py::list to_python(const std::vector<Op>& ops) {
    static const char* names[] = {"Fn",      "Fc",       "Fe",           "Loss",          "B",    "Fs",
                                  "Offload", "Prefetch", "OffloadSaved", "PrefetchSaved", "Wait", "WaitSaved"};
    py::list out;
    for (const Op& op : ops) {
        if (op.kind == OpKind::Loss) {
            out.append(py::make_tuple("Loss"));
        } else if (op.kind == OpKind::Fs) {
            out.append(py::make_tuple("Fs", op.stage, op.option));
        } else {
            out.append(py::make_tuple(names[static_cast<int>(op.kind)], op.stage));
        }
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
    m.doc() = "C++ core of lightning_rotor's planner (use lightning_rotor.planner).";

    m.def(
        "solve",
        [](Sizes size, Sizes saved, Sizes fwd_tmp, Sizes fwd_tmp_nograd, Sizes bwd_tmp, int64_t loss_tmp, Sizes fwd_cost, Sizes bwd_cost,
           int64_t slots, int threads, Opt loss_tmp_graph, OptSizes in_free, int64_t loss_value,
           OptOptions options, OptSizes transfer_cost, int count_bits, OptSizes offloadable,
           OptSizes saved_transfer_cost) -> py::object {
            MemChain c = make_chain(std::move(size), std::move(saved), std::move(fwd_tmp), std::move(fwd_tmp_nograd),
                                    std::move(bwd_tmp), loss_tmp, loss_tmp_graph, std::move(in_free), loss_value,
                                    std::move(options));
            if (offloadable) c.offloadable = std::move(*offloadable);
            rotor::Solution sol;
            {
                py::gil_scoped_release release;
                sol = rotor::solve(c, fwd_cost, bwd_cost, slots, threads, transfer_cost ? *transfer_cost : Sizes{},
                                   count_bits, saved_transfer_cost ? *saved_transfer_cost : Sizes{});
            }
            if (!sol.feasible) return py::none();
            return py::make_tuple(static_cast<int64_t>(sol.cost), to_python(sol.ops));
        },
        py::arg("size"), py::arg("saved"), py::arg("fwd_tmp"), py::arg("fwd_tmp_nograd"), py::arg("bwd_tmp"), py::arg("loss_tmp"),
        py::arg("fwd_cost"), py::arg("bwd_cost"), py::arg("slots"), py::arg("threads") = 0,
        py::arg("loss_tmp_graph") = py::none(), py::arg("in_free") = py::none(), py::arg("loss_value") = 0,
        py::arg("options") = py::none(), py::arg("transfer_cost") = py::none(), py::arg("count_bits") = 0,
        py::arg("offloadable") = py::none(), py::arg("saved_transfer_cost") = py::none(),
        "(cost, ops) of the least-cost schedule within `slots` units (a_0 included), or None.\n"
        "`threads` <= 0: default_threads(); the result does not depend on it.\n"
        "`transfer_cost`: None, or per value a_0 … a_L its copy time (ticks << count_bits): splits may then\n"
        "offload their kept input (Offload/Prefetch ops).\n"
        "`offloadable`, `saved_transfer_cost`: None, or per stage the units of its saved part that can move\n"
        "to host memory and their copy time: a record may then offload it (OffloadSaved/PrefetchSaved ops).");

    m.def("default_threads", &rotor::default_threads, "Threads solve() uses by default: min(2, hardware threads).");

    m.def(
        "min_budget",
        [](Sizes size, Sizes saved, Sizes fwd_tmp, Sizes fwd_tmp_nograd, Sizes bwd_tmp, int64_t loss_tmp, Opt loss_tmp_graph,
           OptSizes in_free, int64_t loss_value, OptOptions options, bool offload, OptSizes offloadable) {
            MemChain c = make_chain(size, saved, fwd_tmp, fwd_tmp_nograd, bwd_tmp, loss_tmp, loss_tmp_graph,
                                    std::move(in_free), loss_value, std::move(options));
            if (offloadable) c.offloadable = std::move(*offloadable);
            return rotor::min_budget(c, offload);
        },
        py::arg("size"), py::arg("saved"), py::arg("fwd_tmp"), py::arg("fwd_tmp_nograd"), py::arg("bwd_tmp"), py::arg("loss_tmp"),
        py::arg("loss_tmp_graph") = py::none(), py::arg("in_free") = py::none(), py::arg("loss_value") = 0,
        py::arg("options") = py::none(), py::arg("offload") = false, py::arg("offloadable") = py::none(),
        "Smallest budget (a_0 included) for which a persistent schedule exists; `offload`: a channel exists,\n"
        "so kept inputs (and the `offloadable` bytes of saved parts) may move to host memory.");

    m.def(
        "feasible_schedule",
        [](Sizes size, Sizes saved, Sizes fwd_tmp, Sizes fwd_tmp_nograd, Sizes bwd_tmp, int64_t loss_tmp, int64_t budget,
           Opt loss_tmp_graph, OptSizes in_free, int64_t loss_value, OptOptions options, bool offload,
           OptSizes offloadable) -> py::object {
            MemChain c = make_chain(size, saved, fwd_tmp, fwd_tmp_nograd, bwd_tmp, loss_tmp, loss_tmp_graph,
                                    std::move(in_free), loss_value, std::move(options));
            if (offloadable) c.offloadable = std::move(*offloadable);
            rotor::Solution sol = rotor::feasible_schedule(c, budget, offload);
            if (!sol.feasible) return py::none();
            return to_python(sol.ops);
        },
        py::arg("size"), py::arg("saved"), py::arg("fwd_tmp"), py::arg("fwd_tmp_nograd"), py::arg("bwd_tmp"), py::arg("loss_tmp"),
        py::arg("budget"), py::arg("loss_tmp_graph") = py::none(), py::arg("in_free") = py::none(),
        py::arg("loss_value") = 0, py::arg("options") = py::none(), py::arg("offload") = false,
        py::arg("offloadable") = py::none(),
        "Ops of a schedule within `budget` exact units, or None below the minimum (`offload` as min_budget's).");
}
