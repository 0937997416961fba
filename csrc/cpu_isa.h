// Which vector loops the CPU kernels run: chosen at run time from the CPU's features, so one
// build runs on any x86-64 and still uses AVX2 or AVX-512 where the CPU has them.
//
// Every level computes bit-identical results (the same rounded operations in the same order);
// only the speed differs. LOMO_KERNELS_CPU_ISA=<level> in the environment, read at the first
// call, picks a level below the best one (e.g. to compare them); the extensions' private
// `_set_cpu_isa` does the same at run time (tests).
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

// Several levels in one build need GCC's per-function target pragmas (GCC on x86); any other
// compiler builds the portable loops for its own baseline ISA only.
#if defined(__GNUC__) && !defined(__clang__) && (defined(__x86_64__) || defined(__i386__))
#define LOMO_CPU_MULTI_ISA 1
#else
#define LOMO_CPU_MULTI_ISA 0
#endif

namespace cpu_isa {

// Ordered: each level's CPU requirements include those of the levels below it.
enum Level : int {
  kBaseline = 0,    // portable loops, vectorised by the compiler for its baseline ISA
  kAvx2 = 1,        // AVX2 + F16C
  kAvx512 = 2,      // AVX-512 F/BW/DQ/VL
  kAvx512Bf16 = 3,  // and AVX512_BF16
  kLevelCount = 4,
};

constexpr const char* kNames[kLevelCount] = {"baseline", "avx2", "avx512", "avx512bf16"};
constexpr const char* kEnvVar = "LOMO_KERNELS_CPU_ISA";

inline const char* name(Level level) { return kNames[level]; }

// The best level this build can run on this CPU.
inline Level best() {
#if LOMO_CPU_MULTI_ISA
  // __builtin_cpu_supports also checks that the OS saves the vector registers.
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  if (avx512 && __builtin_cpu_supports("avx512bf16")) return kAvx512Bf16;
  if (avx512) return kAvx512;
  if (avx2) return kAvx2;
#endif
  return kBaseline;
}

// The level called `text`; a clear error for an unknown name or one above `best()`.
inline Level parse(const std::string& text, const char* source) {
  const Level top = best();
  for (int k = 0; k < kLevelCount; ++k) {
    if (text != kNames[k]) continue;
    TORCH_CHECK(k <= top, "lomo_kernels: ", source, " asks for the '", text,
                "' CPU loops, but this CPU (or build) supports at most '", name(top),
                "': pick that or a lower level");
    return static_cast<Level>(k);
  }
  TORCH_CHECK(false, "lomo_kernels: ", source, " = '", text,
              "' is not a CPU loop level; use one of baseline, avx2, avx512, avx512bf16");
  return kBaseline;
}

// -1 until the first call reads the environment.
inline std::atomic<int>& active_slot() {
  static std::atomic<int> slot{-1};
  return slot;
}

// The level the kernels run now: the environment's choice or the best, fixed at first use.
inline Level active() {
  int level = active_slot().load(std::memory_order_relaxed);
  if (level < 0) {
    const char* env = std::getenv(kEnvVar);
    level = (env != nullptr && *env != '\0') ? parse(env, kEnvVar) : best();
    active_slot().store(level, std::memory_order_relaxed);
  }
  return static_cast<Level>(level);
}

// Sets the level by name (checked as the environment's value is); returns the previous one.
inline std::string set(const std::string& text) {
  const Level level = parse(text, "_set_cpu_isa");
  const Level previous = active();
  active_slot().store(level, std::memory_order_relaxed);
  return name(previous);
}

// The levels this CPU and build can run, lowest first.
inline std::vector<std::string> supported() {
  std::vector<std::string> out;
  for (int k = 0; k <= best(); ++k) out.emplace_back(kNames[k]);
  return out;
}

// The private bindings every CPU extension exposes.
inline void def_bindings(py::module_& m) {
  m.def("_cpu_isa", [] { return std::string(name(active())); },
        "The CPU loop level the kernels run now");
  m.def("_cpu_isas", &supported, "The CPU loop levels this CPU and build can run");
  m.def("_set_cpu_isa", &set, "Runs the kernels with the given CPU loop level; returns the "
        "previous one", py::arg("level"));
}

}  // namespace cpu_isa
