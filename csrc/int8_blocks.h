// The 8-bit blockwise buffer's layout and scale rule (lomo_kernels/core/int8_blocks.py), for
// the C++ kernels: int8 codes, one power-of-two fp32 scale per kBlock elements of the
// parameter's flat index; a buffer of `numel` elements starts at flat `offset` >= 0, so its
// first and last blocks may be partial. No torch headers here.
#pragma once

#include <stdint.h>

#include "lomo_math.h"

namespace int8_blocks {

constexpr int64_t kBlock = 256;
// The mantissa field of the largest m (in [1, 2)) with m * 64 <= 127.
constexpr uint32_t kMantissaLimit = 0x7E0000u;
// The smallest scale exponent (fp32's smallest normal power of two).
constexpr int32_t kMinExponent = -126;
constexpr float kMaxCode = 127.0f;
constexpr uint32_t kMagnitudeMask = 0x7FFFFFFFu;
// Magnitude bits from here up are inf or nan.
constexpr uint32_t kNonFiniteBits = 0x7F800000u;
// A block holding an inf or nan stores this scale (Python's float("nan")) and codes 0.
constexpr uint32_t kNanScaleBits = 0x7FC00000u;

// The scales of `numel` elements from flat `offset`: the blocks they touch (0 when empty).
LOMO_HD LOMO_INLINE int64_t blocks_of(int64_t offset, int64_t numel) {
  return numel <= 0 ? 0 : (offset % kBlock + numel + kBlock - 1) / kBlock;
}

// A block's scale and its inverse, both powers of two (0 and 0 for an all-zero block).
struct Scale {
  float scale;
  float inverse;
};

// The scale of a block whose largest magnitude has the bits `absmax_bits` (finite, sign
// clear): 2^e for the smallest e >= kMinExponent with absmax <= 127 * 2^e, from the bits
// alone. absmax = m * 2^E: e = E - 6 when m <= 127 / 64, else E - 5.
LOMO_HD LOMO_INLINE Scale power_of_two(uint32_t absmax_bits) {
  if (absmax_bits == 0) return {0.0f, 0.0f};
  const int32_t big = (absmax_bits & 0x7FFFFFu) > kMantissaLimit ? 1 : 0;
  int32_t e = static_cast<int32_t>(absmax_bits >> 23) - 127 - 6 + big;
  e = e < kMinExponent ? kMinExponent : e;
  return {lomo::float_of(static_cast<uint32_t>(e + 127) << 23),
          lomo::float_of(static_cast<uint32_t>(127 - e) << 23)};
}

// Where block `b` of a buffer (counted from its first, partial block) lies.
struct BlockSpan {
  int64_t begin;  // the buffer's index of its first element in this block
  int64_t head;   // that element's position in the block (non-zero in the first block only)
  int64_t count;  // the buffer's elements in the block
  uint64_t flat;  // the flat index of the block's position 0 (a multiple of kBlock)
  LOMO_HD LOMO_INLINE bool whole() const { return count == kBlock; }
};

LOMO_HD LOMO_INLINE BlockSpan block_span(int64_t offset, int64_t numel, int64_t b) {
  const int64_t lead = offset % kBlock;
  const int64_t start = b * kBlock - lead;  // the buffer's index of position 0 (< 0 at first)
  const int64_t begin = start < 0 ? 0 : start;
  const int64_t end = start + kBlock < numel ? start + kBlock : numel;
  return {begin, begin - start, end - begin, static_cast<uint64_t>(offset - lead + b * kBlock)};
}

}  // namespace int8_blocks
