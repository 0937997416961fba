// Torch binding of the CUDA launchers in lomo_cuda.cu (built only with a CUDA-enabled torch).
// Same Python-visible signatures as the CPU extension (lomo_cpu.cpp).
#include <torch/extension.h>

// c10's stream header rather than ATen/cuda/CUDAContext.h: no cuBLAS/cuSPARSE headers needed.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <optional>

#include "lomo_math.h"

extern "C" int lomo_cuda_sgd_update(void* param, int param_dtype, const void* grad,
                                    int grad_dtype, int64_t numel, const float* lr,
                                    const float* inv_scale, float clip_value,
                                    const float* clip_coef, float weight_decay,
                                    const float* skip_if, float* found_inf,
                                    int stochastic_rounding, uint32_t seed_lo_mixed,
                                    uint32_t seed_hi_salted, const int64_t* seed_step,
                                    cudaStream_t stream);

extern "C" int lomo_cuda_grad_sumsq(const void* grad, int grad_dtype, int64_t numel,
                                    const float* inv_scale, float* sumsq, float* found_inf,
                                    cudaStream_t stream);

namespace {

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return lomo::kFloat32;
    case at::kHalf:
      return lomo::kFloat16;
    case at::kBFloat16:
      return lomo::kBFloat16;
    default:
      TORCH_CHECK(false, "lomo_kernels: unsupported dtype ", t.scalar_type());
  }
}

void check_scalar(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device() == like.device(),
              "lomo_kernels: ", name, " must be a 1-element fp32 tensor on ", like.device());
}

const float* scalar_ptr(const std::optional<at::Tensor>& t, const at::Tensor& like,
                        const char* name) {
  if (!t.has_value()) return nullptr;
  check_scalar(*t, like, name);
  return t->const_data_ptr<float>();
}

float* mutable_scalar_ptr(const std::optional<at::Tensor>& t, const at::Tensor& like,
                          const char* name) {
  if (!t.has_value()) return nullptr;
  check_scalar(*t, like, name);
  return t->data_ptr<float>();
}

// The rounding seed's per-step value stays on the device: the kernel reads it.
const int64_t* seed_step_ptr(const std::optional<at::Tensor>& t, const at::Tensor& like) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kLong && t->numel() == 1 && t->device() == like.device(),
              "lomo_kernels: seed_step must be a 1-element int64 tensor on ", like.device());
  return t->const_data_ptr<int64_t>();
}

// Raw-pointer writes bypass autograd's in-place tracking (see lomo_cpu.cpp).
void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
}

void sgd_update_(at::Tensor param, const at::Tensor& grad, const at::Tensor& lr,
                 const std::optional<at::Tensor>& inv_scale, std::optional<double> clip_value,
                 const std::optional<at::Tensor>& clip_coef, double weight_decay,
                 const std::optional<at::Tensor>& found_inf,
                 const std::optional<at::Tensor>& skip_if, bool stochastic_rounding,
                 int64_t seed_lo_mixed, int64_t seed_hi_salted,
                 const std::optional<at::Tensor>& seed_step) {
  TORCH_CHECK(param.is_cuda() && grad.device() == param.device(),
              "lomo_kernels: param and grad must be on the same CUDA device");
  TORCH_CHECK(param.is_contiguous() && grad.is_contiguous() && param.numel() == grad.numel(),
              "lomo_kernels: param and grad must be contiguous with the same numel");
  check_scalar(lr, param, "lr");
  const c10::cuda::CUDAGuard guard(param.device());

  // Every block reads skip_if while any block may set found_inf: when they share storage a
  // late block could see an early block's write and skip half the tensor. Snapshot it.
  std::optional<at::Tensor> skip = skip_if;
  if (skip.has_value() && found_inf.has_value() && skip->is_alias_of(*found_inf)) {
    skip = skip->clone();
  }

  const int rc = lomo_cuda_sgd_update(
      param.data_ptr(), dtype_code(param), grad.const_data_ptr(), dtype_code(grad),
      param.numel(), lr.const_data_ptr<float>(), scalar_ptr(inv_scale, param, "inv_scale"),
      clip_value.has_value() ? static_cast<float>(*clip_value)
                             : std::numeric_limits<float>::infinity(),
      scalar_ptr(clip_coef, param, "clip_coef"), static_cast<float>(weight_decay),
      scalar_ptr(skip, param, "skip_if"), mutable_scalar_ptr(found_inf, param, "found_inf"),
      stochastic_rounding ? 1 : 0, static_cast<uint32_t>(seed_lo_mixed),
      static_cast<uint32_t>(seed_hi_salted), seed_step_ptr(seed_step, param),
      c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  bump_version(param);
  if (found_inf.has_value()) bump_version(*found_inf);
}

void grad_sumsq_(const at::Tensor& grad, const std::optional<at::Tensor>& inv_scale,
                 at::Tensor sumsq, const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(grad.is_cuda() && grad.is_contiguous(),
              "lomo_kernels: grad must be a contiguous CUDA tensor");
  check_scalar(sumsq, grad, "sumsq");
  const c10::cuda::CUDAGuard guard(grad.device());
  const int rc = lomo_cuda_grad_sumsq(
      grad.const_data_ptr(), dtype_code(grad), grad.numel(),
      scalar_ptr(inv_scale, grad, "inv_scale"), sumsq.data_ptr<float>(),
      mutable_scalar_ptr(found_inf, grad, "found_inf"),
      c10::cuda::getCurrentCUDAStream().stream());
  C10_CUDA_CHECK(static_cast<cudaError_t>(rc));
  bump_version(sumsq);
  if (found_inf.has_value()) bump_version(*found_inf);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lomo_kernels CUDA kernels";
  m.def("sgd_update_", &sgd_update_, "Fused LOMO SGD update of one parameter, in place",
        py::arg("param"), py::arg("grad"), py::arg("lr"), py::arg("inv_scale"),
        py::arg("clip_value"), py::arg("clip_coef"), py::arg("weight_decay"),
        py::arg("found_inf"), py::arg("skip_if"), py::arg("stochastic_rounding"),
        py::arg("seed_lo_mixed"), py::arg("seed_hi_salted"), py::arg("seed_step"));
  m.def("grad_sumsq_", &grad_sumsq_, "sumsq += sum((grad * inv_scale)^2), in place",
        py::arg("grad"), py::arg("inv_scale"), py::arg("sumsq"), py::arg("found_inf"));
}
