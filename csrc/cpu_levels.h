// The CPU loops of one extension built once per vector level of cpu_isa.h, each copy in its
// own namespace (loops_baseline, loops_avx2, loops_avx512, loops_avx512bf16) and, above the
// baseline, under a GCC target pragma; LOMO_AT_LEVEL picks a function of the copy a call runs.
//
// Define LOMO_CPU_LOOPS as the loops header's name, then include this file once, at file
// scope, after everything the loops header needs (torch, lomo_math.h, ...). Each copy also
// gets copy_level(), its own level, which `loops_level()` reads back. The loops header
// sees LOMO_LOOPS_AVX2, LOMO_LOOPS_AVX512 and LOMO_LOOPS_AVX512_BF16 (0 or 1) for its
// hand-written vector loops; portable loops in it are vectorised by the compiler per level.
#pragma once

#include "cpu_isa.h"

#if LOMO_CPU_MULTI_ISA
#include <immintrin.h>
#endif

// Internal linkage for every copy: nothing exported, no calls through the PLT.
namespace {

// The baseline level is the build's own target.
namespace loops_baseline {
#define LOMO_LOOPS_AVX2 0
#define LOMO_LOOPS_AVX512 0
#define LOMO_LOOPS_AVX512_BF16 0
#include LOMO_CPU_LOOPS
inline cpu_isa::Level copy_level() { return cpu_isa::kBaseline; }
}  // namespace loops_baseline

#if LOMO_CPU_MULTI_ISA
#undef LOMO_LOOPS_AVX2
#define LOMO_LOOPS_AVX2 1
#pragma GCC push_options
#pragma GCC target("avx2,f16c,prfchw")
namespace loops_avx2 {
#include LOMO_CPU_LOOPS
inline cpu_isa::Level copy_level() { return cpu_isa::kAvx2; }
}  // namespace loops_avx2
#pragma GCC pop_options

#undef LOMO_LOOPS_AVX512
#define LOMO_LOOPS_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx2,f16c,prfchw,avx512f,avx512bw,avx512dq,avx512vl")
namespace loops_avx512 {
#include LOMO_CPU_LOOPS
inline cpu_isa::Level copy_level() { return cpu_isa::kAvx512; }
}  // namespace loops_avx512
#pragma GCC pop_options

#undef LOMO_LOOPS_AVX512_BF16
#define LOMO_LOOPS_AVX512_BF16 1
#pragma GCC push_options
#pragma GCC target("avx2,f16c,prfchw,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")
namespace loops_avx512bf16 {
#include LOMO_CPU_LOOPS
inline cpu_isa::Level copy_level() { return cpu_isa::kAvx512Bf16; }
}  // namespace loops_avx512bf16
#pragma GCC pop_options

#endif

}  // namespace

#if LOMO_CPU_MULTI_ISA
// &loops_<level>::__VA_ARGS__: a function of the loops at `level` (a cpu_isa::Level).
#define LOMO_AT_LEVEL(level, ...)                                  \
  ((level) == cpu_isa::kAvx512Bf16 ? &loops_avx512bf16::__VA_ARGS__ \
   : (level) == cpu_isa::kAvx512   ? &loops_avx512::__VA_ARGS__     \
   : (level) == cpu_isa::kAvx2     ? &loops_avx2::__VA_ARGS__       \
                                   : &loops_baseline::__VA_ARGS__)
#else
#define LOMO_AT_LEVEL(level, ...) (&loops_baseline::__VA_ARGS__)
#endif

// The level of the copy LOMO_AT_LEVEL picks for the active level, as the copy itself says
// (each copy's copy_level): a forced level must run its own loops, not only be named.
inline std::string loops_level() {
  return cpu_isa::name(LOMO_AT_LEVEL(cpu_isa::active(), copy_level)());
}
