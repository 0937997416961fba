// How a CUDA write-back rounds the parameter: the argument both launcher headers (lomo_cuda.h,
// adalomo_cuda.h) take, filled by binding.h. Plain C.
#pragma once

#include <stdint.h>

// To nearest even, or, when `stochastic` is non-zero (bf16 and fp16 parameters only),
// stochastically with the key of the host's seed parts (lomo::seed_lo_mixed, seed_hi_salted)
// and the per-step value at `seed_step` (one int64 read on the device; NULL: none), from each
// element's flat index (_rounding.random_bits16).
typedef struct {
  int stochastic;
  uint32_t seed_lo_mixed;
  uint32_t seed_hi_salted;
  const int64_t* seed_step;
} LomoRoundingArgs;
