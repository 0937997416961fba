// The element types and rounding mode of a kernel, chosen at run time: calls a generic
// function once with the lomo::Fp32 / Fp16 / Bf16 tags of dtype codes (lomo::DtypeCode) and
// with the write-back's rounding as a compile-time constant. Host code with no torch headers:
// the CUDA launchers (lomo_cuda.cu, adalomo_cuda.cu) and the torch bindings (binding.h) share it.
#pragma once

#include <type_traits>

#include "lomo_math.h"

namespace lomo {

// f(Fp32{}), f(Fp16{}) or f(Bf16{}) for `code`; false, with f not called, for any other code.
template <class F>
bool dispatch_dtype(int code, F&& f) {
  switch (code) {
    case kFloat32:
      f(Fp32{});
      return true;
    case kFloat16:
      f(Fp16{});
      return true;
    case kBFloat16:
      f(Bf16{});
      return true;
    default:
      return false;
  }
}

// f(param tag, grad tag); false when either code is unknown (the parameter's is tried first).
template <class F>
bool dispatch_param_grad(int param_code, int grad_code, F&& f) {
  bool known = false;
  dispatch_dtype(param_code, [&](auto p_tag) {
    known = dispatch_dtype(grad_code, [&](auto g_tag) { f(p_tag, g_tag); });
  });
  return known;
}

// f(std::true_type{}) or f(std::false_type{}) for `flag`: a run-time flag as a compile-time one.
template <class F>
void dispatch_bool(bool flag, F&& f) {
  if (flag) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// What a pass that stores values measures of them: nothing; whether any stored value times
// inv_scale is inf/nan (found_inf alone: an accumulation's micro-batches before the measuring
// one); or that flag and their sum of squares (sumsq).
enum class Measure { kNothing, kFlag, kSquares };

// f(std::integral_constant<Measure, m>{}): the run-time choice as a compile-time one.
template <class F>
void dispatch_measure(Measure m, F&& f) {
  switch (m) {
    case Measure::kNothing:
      f(std::integral_constant<Measure, Measure::kNothing>{});
      return;
    case Measure::kFlag:
      f(std::integral_constant<Measure, Measure::kFlag>{});
      return;
    case Measure::kSquares:
      f(std::integral_constant<Measure, Measure::kSquares>{});
      return;
  }
}

// f(std::true_type{}) when a write-back to P rounds stochastically (asked for, and P is bf16 or
// fp16: fp32 stores the result exactly), else f(std::false_type{}); the stochastic code is
// instantiated only for the types that take it.
template <class P, class F>
void dispatch_rounding(bool stochastic, F&& f) {
  if constexpr (P::kRoundsStochastically) {
    if (stochastic) {
      f(std::true_type{});
      return;
    }
  }
  f(std::false_type{});
}

// dispatch_param_grad of a write-back: f(param tag, grad tag, its rounding as dispatch_rounding
// gives it).
template <class F>
bool dispatch_write_back(int param_code, int grad_code, bool stochastic, F&& f) {
  return dispatch_param_grad(param_code, grad_code, [&](auto p_tag, auto g_tag) {
    dispatch_rounding<decltype(p_tag)>(stochastic,
                                       [&](auto rounding) { f(p_tag, g_tag, rounding); });
  });
}

}  // namespace lomo
