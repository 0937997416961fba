// The Python-visible arguments of every fused op's binding, written once for the CPU and the
// CUDA extension of each family: the names and order of the ops' specs (the packages
// lomo_kernels/ops/lomo and adalomo), which tests/ops/test_op_specs.py compares with these.
// An op's arguments reach each extension's implementation as one struct named after the op
// (references to the call's arguments), the groups several ops share as nested structs.
// pybind11 checks at compile time that each function takes as many arguments as declared.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>

namespace op_bindings {

using OptTensor = std::optional<at::Tensor>;

// How a stored gradient becomes the g of the math: grad * inv_scale, clamped to +-clip_value,
// times clip_coef (an absent factor is 1, an absent clip_value no clamp).
struct GradArgs {
  const OptTensor& inv_scale;
  std::optional<double> clip_value;
  const OptTensor& clip_coef;
};

// How a write-back rounds the parameter (bf16 and fp16 stochastically when asked).
struct RoundingArgs {
  bool stochastic_rounding;
  uint64_t seed;
  const OptTensor& seed_step;
};

// ----------------------------------------------------------------------------- LOMO

// offset (LomoUpdate, GradAccumulate): the flat index of the dense tensor's element 0 in the
// parameter it is a slice of; the rounding draws the bits of index offset + j.
struct LomoUpdate {
  const at::Tensor& param;
  const at::Tensor& grad;
  const at::Tensor& lr;
  GradArgs grad_args;
  double weight_decay;
  const OptTensor& found_inf;
  const OptTensor& skip_if;
  RoundingArgs rounding;
  int64_t offset;
};

struct GradSumsq {
  const at::Tensor& grad;
  const OptTensor& inv_scale;
  const at::Tensor& sumsq;
  const OptTensor& found_inf;
};

struct GradAccumulate {
  const at::Tensor& buffer;
  const at::Tensor& grad;
  bool first;
  const OptTensor& inv_scale;
  const OptTensor& sumsq;
  const OptTensor& found_inf;
  RoundingArgs rounding;
  int64_t offset;
};

// The 8-bit blockwise buffer (lomo_kernels/core/int8_blocks.py): int8 codes, one fp32
// power-of-two scale per 256-element block of the parameter's flat index; offset is the flat
// offset of codes[0] in its parameter (the block edges and the rounding bits follow it).
struct Int8Buffer {
  const at::Tensor& codes;
  const at::Tensor& scales;
  int64_t offset;
};

struct GradAccumulateInt8 {
  Int8Buffer buffer;
  const at::Tensor& grad;
  bool first;
  const OptTensor& inv_scale;
  const OptTensor& sumsq;
  const OptTensor& found_inf;
  RoundingArgs rounding;
};

struct LomoUpdateInt8 {
  const at::Tensor& param;
  Int8Buffer buffer;
  const at::Tensor& lr;
  GradArgs grad_args;
  double weight_decay;
  const OptTensor& found_inf;
  const OptTensor& skip_if;
  RoundingArgs rounding;
};

struct Int8Dequantize {
  const at::Tensor& out;
  Int8Buffer buffer;
};

// The implementations of the LOMO family's ops in one extension, in the specs' order.
struct LomoOps {
  void (*update)(const LomoUpdate&);
  void (*sumsq)(const GradSumsq&);
  void (*accumulate)(const GradAccumulate&);
  void (*accumulate_int8)(const GradAccumulateInt8&);
  void (*update_int8)(const LomoUpdateInt8&);
  void (*dequantize_int8)(const Int8Dequantize&);
};

inline void def_int8_ops(py::module_& m, const LomoOps& ops);

inline void def_lomo_ops(py::module_& m, const LomoOps& ops) {
  const auto update = ops.update;
  const auto sumsq = ops.sumsq;
  const auto accumulate = ops.accumulate;
  const auto lomo_update = [update](const at::Tensor& param, const at::Tensor& grad,
                                    const at::Tensor& lr, const OptTensor& inv_scale,
                                    std::optional<double> clip_value, const OptTensor& clip_coef,
                                    double weight_decay, const OptTensor& found_inf,
                                    const OptTensor& skip_if, bool stochastic_rounding,
                                    uint64_t seed, const OptTensor& seed_step, int64_t offset) {
    update({param, grad, lr, {inv_scale, clip_value, clip_coef}, weight_decay, found_inf,
            skip_if, {stochastic_rounding, seed, seed_step}, offset});
  };
  const auto grad_sumsq = [sumsq](const at::Tensor& grad, const OptTensor& inv_scale,
                                  const at::Tensor& sumsq_out, const OptTensor& found_inf) {
    sumsq({grad, inv_scale, sumsq_out, found_inf});
  };
  const auto grad_accumulate = [accumulate](const at::Tensor& buffer, const at::Tensor& grad,
                                            bool first, const OptTensor& inv_scale,
                                            const OptTensor& sumsq_out, const OptTensor& found_inf,
                                            bool stochastic_rounding, uint64_t seed,
                                            const OptTensor& seed_step, int64_t offset) {
    accumulate({buffer, grad, first, inv_scale, sumsq_out, found_inf,
                {stochastic_rounding, seed, seed_step}, offset});
  };
  m.def("lomo_update_", lomo_update, "Fused LOMO update of one parameter, in place",
        py::arg("param"), py::arg("grad"), py::arg("lr"), py::arg("inv_scale"),
        py::arg("clip_value"), py::arg("clip_coef"), py::arg("weight_decay"),
        py::arg("found_inf"), py::arg("skip_if"), py::arg("stochastic_rounding"),
        py::arg("seed"), py::arg("seed_step"), py::arg("offset"));
  m.def("grad_sumsq_", grad_sumsq, "sumsq += sum((grad * inv_scale)^2), in place",
        py::arg("grad"), py::arg("inv_scale"), py::arg("sumsq"), py::arg("found_inf"));
  m.def("grad_accumulate_", grad_accumulate,
        "buffer = round(buffer + grad) (first: round(grad)), the stored values' scaled sum of "
        "squares and inf/nan flag, in place",
        py::arg("buffer"), py::arg("grad"), py::arg("first"), py::arg("inv_scale"),
        py::arg("sumsq"), py::arg("found_inf"), py::arg("stochastic_rounding"),
        py::arg("seed"), py::arg("seed_step"), py::arg("offset"));
  def_int8_ops(m, ops);
}

inline void def_int8_ops(py::module_& m, const LomoOps& ops) {
  const auto accumulate_int8 = ops.accumulate_int8;
  const auto update_int8 = ops.update_int8;
  const auto dequantize_int8 = ops.dequantize_int8;
  const auto grad_accumulate_int8 =
      [accumulate_int8](const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& grad,
                        int64_t offset, bool first, const OptTensor& inv_scale,
                        const OptTensor& sumsq_out, const OptTensor& found_inf,
                        bool stochastic_rounding, uint64_t seed, const OptTensor& seed_step) {
        accumulate_int8({{codes, scales, offset}, grad, first, inv_scale, sumsq_out, found_inf,
                         {stochastic_rounding, seed, seed_step}});
      };
  const auto lomo_update_int8 =
      [update_int8](const at::Tensor& param, const at::Tensor& codes, const at::Tensor& scales,
                    int64_t offset, const at::Tensor& lr, const OptTensor& inv_scale,
                    std::optional<double> clip_value, const OptTensor& clip_coef,
                    double weight_decay, const OptTensor& found_inf, const OptTensor& skip_if,
                    bool stochastic_rounding, uint64_t seed, const OptTensor& seed_step) {
        update_int8({param, {codes, scales, offset}, lr, {inv_scale, clip_value, clip_coef},
                     weight_decay, found_inf, skip_if, {stochastic_rounding, seed, seed_step}});
      };
  const auto int8_dequantize = [dequantize_int8](const at::Tensor& out, const at::Tensor& codes,
                                                 const at::Tensor& scales, int64_t offset) {
    dequantize_int8({out, {codes, scales, offset}});
  };
  m.def("grad_accumulate_int8_", grad_accumulate_int8,
        "codes, scales = the 8-bit blockwise buffer of (codes * scales + grad) (first: of grad), "
        "the stored values' scaled sum of squares and inf/nan flag, in place",
        py::arg("codes"), py::arg("scales"), py::arg("grad"), py::arg("offset"), py::arg("first"),
        py::arg("inv_scale"), py::arg("sumsq"), py::arg("found_inf"),
        py::arg("stochastic_rounding"), py::arg("seed"), py::arg("seed_step"));
  m.def("lomo_update_int8_", lomo_update_int8,
        "Fused LOMO update of one parameter (or slice) from an 8-bit blockwise buffer, in place",
        py::arg("param"), py::arg("codes"), py::arg("scales"), py::arg("offset"), py::arg("lr"),
        py::arg("inv_scale"), py::arg("clip_value"), py::arg("clip_coef"),
        py::arg("weight_decay"), py::arg("found_inf"), py::arg("skip_if"),
        py::arg("stochastic_rounding"), py::arg("seed"), py::arg("seed_step"));
  m.def("int8_dequantize_", int8_dequantize, "out = codes * scales, in place", py::arg("out"),
        py::arg("codes"), py::arg("scales"), py::arg("offset"));
}

// ----------------------------------------------------------------------------- AdaLomo

// The hyper-parameters of a write-back pass (C, C1).
struct StepArgs {
  const at::Tensor& lr;
  double eps1;
  double clip_threshold;
  double weight_decay;
};

// Pass A applies no clip coefficient (the moments pass does): its grad_args.clip_coef is
// absent. grad and param hold the flat elements [offset, offset + numel) of a [rows, cols]
// matrix, its rows those the workspace holds sums of (the whole matrix at offset 0).
struct FactoredStats {
  const at::Tensor& grad;
  const at::Tensor& param;
  const at::Tensor& workspace;
  const OptTensor& found_inf;
  const OptTensor& skip_if;
  int64_t cols;
  GradArgs grad_args;
  int64_t offset;
};

struct FactoredMoments {
  const at::Tensor& exp_avg_sq_row;
  const at::Tensor& exp_avg_sq_col;
  const at::Tensor& workspace;
  const at::Tensor& beta2;
  const OptTensor& clip_coef;
  double eps0;
};

// Passes B and C: grad (and param) hold the flat elements [offset, offset + numel) of the
// moments' [rows, cols] matrix (the whole of it at offset 0).
struct FactoredNorm {
  const at::Tensor& grad;
  const at::Tensor& exp_avg_sq_row;
  const at::Tensor& exp_avg_sq_col;
  const at::Tensor& workspace;
  GradArgs grad_args;
  int64_t offset;
};

struct FactoredApply {
  const at::Tensor& param;
  const at::Tensor& grad;
  const at::Tensor& exp_avg_sq_row;
  const at::Tensor& exp_avg_sq_col;
  const at::Tensor& workspace;
  StepArgs step;
  GradArgs grad_args;
  RoundingArgs rounding;
  int64_t offset;
};

struct VectorStats {
  const at::Tensor& grad;
  const at::Tensor& param;
  const at::Tensor& exp_avg_sq;
  const at::Tensor& workspace;
  const OptTensor& found_inf;
  const OptTensor& skip_if;
  const at::Tensor& beta2;
  double eps0;
  GradArgs grad_args;
};

struct VectorApply {
  const at::Tensor& param;
  const at::Tensor& grad;
  const at::Tensor& exp_avg_sq;
  const at::Tensor& workspace;
  const at::Tensor& beta2;
  double eps0;
  StepArgs step;
  GradArgs grad_args;
  RoundingArgs rounding;
  // param, grad and v hold elements [offset, offset + numel) of a vector of full_numel.
  int64_t offset;
  int64_t full_numel;
};

// One extension's implementation of every AdaLomo pass.
struct AdalomoOps {
  void (*factored_stats)(const FactoredStats&);
  void (*factored_moments)(const FactoredMoments&);
  void (*factored_norm)(const FactoredNorm&);
  void (*factored_apply)(const FactoredApply&);
  void (*vector_stats)(const VectorStats&);
  void (*vector_apply)(const VectorApply&);
};

inline void def_adalomo_ops(py::module_& m, const AdalomoOps& ops) {
  static const OptTensor kAbsent;
  const auto stats = [ops](const at::Tensor& grad, const at::Tensor& param,
                           const at::Tensor& workspace, const OptTensor& found_inf,
                           const OptTensor& skip_if, int64_t cols, const OptTensor& inv_scale,
                           std::optional<double> clip_value, int64_t offset) {
    ops.factored_stats({grad, param, workspace, found_inf, skip_if, cols,
                        {inv_scale, clip_value, kAbsent}, offset});
  };
  const auto moments = [ops](const at::Tensor& exp_avg_sq_row, const at::Tensor& exp_avg_sq_col,
                             const at::Tensor& workspace, const at::Tensor& beta2,
                             const OptTensor& clip_coef, double eps0) {
    ops.factored_moments({exp_avg_sq_row, exp_avg_sq_col, workspace, beta2, clip_coef, eps0});
  };
  const auto norm = [ops](const at::Tensor& grad, const at::Tensor& exp_avg_sq_row,
                          const at::Tensor& exp_avg_sq_col, const at::Tensor& workspace,
                          const OptTensor& inv_scale, std::optional<double> clip_value,
                          const OptTensor& clip_coef, int64_t offset) {
    ops.factored_norm({grad, exp_avg_sq_row, exp_avg_sq_col, workspace,
                       {inv_scale, clip_value, clip_coef}, offset});
  };
  const auto apply = [ops](const at::Tensor& param, const at::Tensor& grad,
                           const at::Tensor& exp_avg_sq_row, const at::Tensor& exp_avg_sq_col,
                           const at::Tensor& workspace, const at::Tensor& lr, double eps1,
                           double clip_threshold, double weight_decay,
                           const OptTensor& inv_scale, std::optional<double> clip_value,
                           const OptTensor& clip_coef, bool stochastic_rounding, uint64_t seed,
                           const OptTensor& seed_step, int64_t offset) {
    ops.factored_apply({param, grad, exp_avg_sq_row, exp_avg_sq_col, workspace,
                        {lr, eps1, clip_threshold, weight_decay},
                        {inv_scale, clip_value, clip_coef},
                        {stochastic_rounding, seed, seed_step}, offset});
  };
  const auto vector_stats = [ops](const at::Tensor& grad, const at::Tensor& param,
                                  const at::Tensor& exp_avg_sq, const at::Tensor& workspace,
                                  const OptTensor& found_inf, const OptTensor& skip_if,
                                  const at::Tensor& beta2, double eps0,
                                  const OptTensor& inv_scale, std::optional<double> clip_value,
                                  const OptTensor& clip_coef) {
    ops.vector_stats({grad, param, exp_avg_sq, workspace, found_inf, skip_if, beta2, eps0,
                      {inv_scale, clip_value, clip_coef}});
  };
  const auto vector_apply = [ops](const at::Tensor& param, const at::Tensor& grad,
                                  const at::Tensor& exp_avg_sq, const at::Tensor& workspace,
                                  const at::Tensor& beta2, double eps0, const at::Tensor& lr,
                                  double eps1, double clip_threshold, double weight_decay,
                                  const OptTensor& inv_scale, std::optional<double> clip_value,
                                  const OptTensor& clip_coef, bool stochastic_rounding,
                                  uint64_t seed, const OptTensor& seed_step, int64_t offset,
                                  int64_t full_numel) {
    ops.vector_apply({param, grad, exp_avg_sq, workspace, beta2, eps0,
                      {lr, eps1, clip_threshold, weight_decay},
                      {inv_scale, clip_value, clip_coef},
                      {stochastic_rounding, seed, seed_step}, offset, full_numel});
  };
  m.def("factored_stats_", stats, "AdaLomo pass A (>= 2-D)", py::arg("grad"),
        py::arg("param"), py::arg("workspace"), py::arg("found_inf"), py::arg("skip_if"),
        py::arg("cols"), py::arg("inv_scale"), py::arg("clip_value"), py::arg("offset"));
  m.def("factored_moments_", moments, "AdaLomo row/column moments",
        py::arg("exp_avg_sq_row"), py::arg("exp_avg_sq_col"), py::arg("workspace"),
        py::arg("beta2"), py::arg("clip_coef"), py::arg("eps0"));
  m.def("factored_norm_", norm, "AdaLomo pass B (>= 2-D)", py::arg("grad"),
        py::arg("exp_avg_sq_row"), py::arg("exp_avg_sq_col"), py::arg("workspace"),
        py::arg("inv_scale"), py::arg("clip_value"), py::arg("clip_coef"), py::arg("offset"));
  m.def("factored_apply_", apply, "AdaLomo pass C (>= 2-D)", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg_sq_row"), py::arg("exp_avg_sq_col"),
        py::arg("workspace"), py::arg("lr"), py::arg("eps1"), py::arg("clip_threshold"),
        py::arg("weight_decay"), py::arg("inv_scale"), py::arg("clip_value"),
        py::arg("clip_coef"), py::arg("stochastic_rounding"), py::arg("seed"),
        py::arg("seed_step"), py::arg("offset"));
  m.def("vector_stats_", vector_stats, "AdaLomo pass A1 (1-D)", py::arg("grad"),
        py::arg("param"), py::arg("exp_avg_sq"), py::arg("workspace"), py::arg("found_inf"),
        py::arg("skip_if"), py::arg("beta2"), py::arg("eps0"), py::arg("inv_scale"),
        py::arg("clip_value"), py::arg("clip_coef"));
  m.def("vector_apply_", vector_apply, "AdaLomo pass C1 (1-D)", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg_sq"), py::arg("workspace"), py::arg("beta2"),
        py::arg("eps0"), py::arg("lr"), py::arg("eps1"), py::arg("clip_threshold"),
        py::arg("weight_decay"), py::arg("inv_scale"), py::arg("clip_value"),
        py::arg("clip_coef"), py::arg("stochastic_rounding"), py::arg("seed"),
        py::arg("seed_step"), py::arg("offset"), py::arg("full_numel"));
}

}  // namespace op_bindings
