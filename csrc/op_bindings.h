// The Python-visible arguments of every fused op's binding, written once for the CPU and the
// CUDA extension of each family: the names and order of the ops' specs
// (lomo_kernels/ops/lomo.py, adalomo.py), which tests/test_op_specs.py compares with these.
// pybind11 checks at compile time that each function takes as many arguments as declared.
#pragma once

#include <torch/extension.h>

namespace op_bindings {

template <class Update, class Sumsq>
void def_lomo_ops(py::module_& m, Update update, Sumsq sumsq) {
  m.def("lomo_update_", update, "Fused LOMO update of one parameter, in place",
        py::arg("param"), py::arg("grad"), py::arg("lr"), py::arg("inv_scale"),
        py::arg("clip_value"), py::arg("clip_coef"), py::arg("weight_decay"),
        py::arg("found_inf"), py::arg("skip_if"), py::arg("stochastic_rounding"),
        py::arg("seed"), py::arg("seed_step"));
  m.def("grad_sumsq_", sumsq, "sumsq += sum((grad * inv_scale)^2), in place",
        py::arg("grad"), py::arg("inv_scale"), py::arg("sumsq"), py::arg("found_inf"));
}

template <class Stats, class Moments, class Norm, class Apply, class VStats, class VApply>
void def_adalomo_ops(py::module_& m, Stats stats, Moments moments, Norm norm, Apply apply,
                     VStats vector_stats, VApply vector_apply) {
  m.def("factored_stats_", stats, "AdaLomo pass A (>= 2-D)", py::arg("grad"),
        py::arg("param"), py::arg("workspace"), py::arg("found_inf"), py::arg("skip_if"),
        py::arg("cols"), py::arg("inv_scale"), py::arg("clip_value"));
  m.def("factored_moments_", moments, "AdaLomo row/column moments",
        py::arg("exp_avg_sq_row"), py::arg("exp_avg_sq_col"), py::arg("workspace"),
        py::arg("beta2"), py::arg("clip_coef"), py::arg("eps0"));
  m.def("factored_norm_", norm, "AdaLomo pass B (>= 2-D)", py::arg("grad"),
        py::arg("exp_avg_sq_row"), py::arg("exp_avg_sq_col"), py::arg("workspace"),
        py::arg("inv_scale"), py::arg("clip_value"), py::arg("clip_coef"));
  m.def("factored_apply_", apply, "AdaLomo pass C (>= 2-D)", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg_sq_row"), py::arg("exp_avg_sq_col"),
        py::arg("workspace"), py::arg("lr"), py::arg("eps1"), py::arg("clip_threshold"),
        py::arg("weight_decay"), py::arg("inv_scale"), py::arg("clip_value"),
        py::arg("clip_coef"), py::arg("stochastic_rounding"), py::arg("seed"),
        py::arg("seed_step"));
  m.def("vector_stats_", vector_stats, "AdaLomo pass A1 (1-D)", py::arg("grad"),
        py::arg("param"), py::arg("exp_avg_sq"), py::arg("workspace"), py::arg("found_inf"),
        py::arg("skip_if"), py::arg("beta2"), py::arg("eps0"), py::arg("inv_scale"),
        py::arg("clip_value"), py::arg("clip_coef"));
  m.def("vector_apply_", vector_apply, "AdaLomo pass C1 (1-D)", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg_sq"), py::arg("workspace"), py::arg("beta2"),
        py::arg("eps0"), py::arg("lr"), py::arg("eps1"), py::arg("clip_threshold"),
        py::arg("weight_decay"), py::arg("inv_scale"), py::arg("clip_value"),
        py::arg("clip_coef"), py::arg("stochastic_rounding"), py::arg("seed"),
        py::arg("seed_step"));
}

}  // namespace op_bindings
