// kiln CUDA runtime header.
//
// codegen::cuda `include_str!`s this file and prepends it to every generated kernel, so it
// must compile with NVRTC alone: no host headers (<cstdint>, <cmath>, <cfloat>, ...). The
// only includes are <cuda_fp16.h> and <cuda_bf16.h>, which NVRTC finds through
// `-I <site-packages>/nvidia/cu13/include` (the nvidia-cuda-runtime wheel). Compile with
// `--std=c++17 -default-device` (python/kiln/runtime/nvrtc.py does).
//
// Contents (all in namespace kiln unless noted):
//   integer typedefs (global scope)  int8_t .. uint64_t, guarded by KILN_NO_INT_TYPEDEFS
//   ceilDiv, numeric<T>::lowest/highest (infinities for floating types)
//   checkedIndex                       a gathered index kept inside its table
//   to_float, from_float<T>            half / bf16 <-> float
//   math: abs neg exp log sqrt rsqrt reciprocal sin cos tanh sigmoid relu pow maximum
//         minimum add sub mul div eq ne lt le gt ge where   (float, double, __half,
//         __nv_bfloat16; half/bf16 computed in float; integer overloads where they make sense)
//   rounding, predicates, integer and logical ops: floor ceil round trunc frac sign
//         signbit isnan isinf isfinite isposinf isneginf truediv fmod remainder bitwise_*
//         logical_* gcd (the element-wise ops of rust/src/ir/op_table.rs that are not a
//         CUDA math-library call; codegen calls those, erf and the like, directly)
//   iotaValue, philox, randomFloat, randomDouble, uniformBelow   iota and counter-based random numbers
//   cast<To>(From)                     every pair of {bool, int, int64_t, __half,
//                                      __nv_bfloat16, float, double}
//   Array<T, N>, loadVec, storeVec     vectorized global/shared accesses
//   loadVecStreaming, loadVecEvictLast loadVec with L1 / L2 cache hints (read-only inputs)
//   loadVolatile, storeVolatile        bitwise volatile accesses for any T of 1/2/4/8 bytes
//   Sum, Prod, Max, Min                reduction functors (with identity<T>())
//   LseAcc, LogSumExp(Floored), LsePair, lseAddBlock(Raised)   log-sum-exp accumulation
//   blockX/Y/Z (KILN_BLOCK_SHAPE), tidX/Y/Z                the block's extents, fixed or not
//   threadIndex/threadCount/blockIndex/blockCount<X,Y,Z>   linearisation helpers
//   warpReduce, warpAllReduce, blockReduce, blockAllReduce(2)  block reductions
//   gridReduce, gridReduceSerial                           grid reductions (semaphores)
//   cpAsyncElem, cpAsyncBytes, cpAsyncCommit, cpAsyncWait   asynchronous copies (cp.async), sm_80+
//   mbarrierInit/Inval/Arrive/Wait, bulkLoad               mbarriers and bulk (TMA) copies, sm_90+
//   tmemAlloc/Relinquish/Dealloc/Address, TmemTensor        Tensor memory (tcgen05), sm_100a
//   clusterAllReduce, clusterSync/Arrive/Wait/Settle,       cluster reductions (distributed Shared memory), sm_90+
//   loadFromClusterBlock
//
// Conventions shared by the reductions:
//   * Linearisation is always x fastest, then y, then z, restricted to the chosen dims.
//     A thread's "reduced index" is its linear index over the reduced thread dims, its
//     "segment" the linear index over the other thread dims (likewise for blocks).
//   * Every thread of the block must call a block/grid reduction (they contain
//     __syncthreads); the call must be block-uniform. Predicated-off threads pass `init`.
//   * `smem` must hold blockDim.x*blockDim.y*blockDim.z elements of T (dynamic shared
//     memory is fine). The functions end with a barrier, so `smem` can be reused right away.

#ifndef KILN_RUNTIME_CUH
#define KILN_RUNTIME_CUH

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// ---------------------------------------------------------------------------------------
// Integer typedefs. NVRTC has no <cstdint>; these match the LP64 sizes. Define
// KILN_NO_INT_TYPEDEFS if the including source already provides them.
#ifndef KILN_NO_INT_TYPEDEFS
#ifndef KILN_INT_TYPEDEFS_DEFINED
#define KILN_INT_TYPEDEFS_DEFINED
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long long int int64_t;
typedef unsigned long long int uint64_t;
#endif
#endif

#define KILN_DEVICE __device__ __forceinline__

namespace kiln {

// ---------------------------------------------------------------------------------------
// Basic helpers

template <typename T>
KILN_DEVICE constexpr T ceilDiv(T a, T b) {
  return (a + b - 1) / b;
}
KILN_DEVICE constexpr int64_t ceilDiv(int64_t a, int b) { return (a + b - 1) / b; }
KILN_DEVICE constexpr int64_t ceilDiv(int a, int64_t b) { return (a + b - 1) / b; }

// An index_select value outside [0, n) selects entry 0 instead of reading outside the
// table: bad data never becomes a wild address. The first such value is recorded in the
// kernel's error word `err` (host memory the device writes; the host reports it as an
// error later): [site + 1, element of the index tensor, value, n]. The value is checked
// as read (64-bit), before a 32-bit kernel narrows it.
template <typename I, typename N, typename E>
KILN_DEVICE I checkedIndex(I v, N n, int64_t* err, int site, E element) {
  if (v >= 0 && v < (I)n) {
    return v;
  }
  unsigned long long* flag = reinterpret_cast<unsigned long long*>(err);
  if (atomicCAS(flag, 0ull, (unsigned long long)(site + 1)) == 0ull) {
    err[1] = (int64_t)element;
    err[2] = (int64_t)v;
    err[3] = (int64_t)n;
    __threadfence_system();
  }
  return (I)0;
}

template <typename T>
struct numeric;
template <>
struct numeric<bool> {
  static KILN_DEVICE bool lowest() { return false; }
  static KILN_DEVICE bool highest() { return true; }
};
template <>
struct numeric<int> {
  static KILN_DEVICE int lowest() { return -2147483647 - 1; }
  static KILN_DEVICE int highest() { return 2147483647; }
};
template <>
struct numeric<int64_t> {
  static KILN_DEVICE int64_t lowest() { return -9223372036854775807LL - 1; }
  static KILN_DEVICE int64_t highest() { return 9223372036854775807LL; }
};
template <>
struct numeric<float> {
  static KILN_DEVICE float lowest() { return __int_as_float(0xff800000); }   // -inf
  static KILN_DEVICE float highest() { return __int_as_float(0x7f800000); }  // +inf
};
template <>
struct numeric<double> {
  static KILN_DEVICE double lowest() { return __longlong_as_double(0xfff0000000000000ULL); }
  static KILN_DEVICE double highest() { return __longlong_as_double(0x7ff0000000000000ULL); }
};
template <>
struct numeric<__half> {
  static KILN_DEVICE __half lowest() { return __ushort_as_half((unsigned short)0xfc00U); }
  static KILN_DEVICE __half highest() { return __ushort_as_half((unsigned short)0x7c00U); }
};
template <>
struct numeric<__nv_bfloat16> {
  static KILN_DEVICE __nv_bfloat16 lowest() { return __ushort_as_bfloat16((unsigned short)0xff80U); }
  static KILN_DEVICE __nv_bfloat16 highest() { return __ushort_as_bfloat16((unsigned short)0x7f80U); }
};

// Bit-level copy between same-sized trivially-copyable types.
template <typename To, typename From>
KILN_DEVICE To bitCast(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "kiln::bitCast needs equal sizes");
  To r;
  memcpy(&r, &x, sizeof(To));
  return r;
}

// ---------------------------------------------------------------------------------------
// half / bf16 <-> float

KILN_DEVICE float to_float(float x) { return x; }
KILN_DEVICE float to_float(__half x) { return __half2float(x); }
KILN_DEVICE float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
KILN_DEVICE T from_float(float x) {
  return static_cast<T>(x);
}
template <>
KILN_DEVICE __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
KILN_DEVICE __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ---------------------------------------------------------------------------------------
// Math. float and double call the CUDA math library directly; __half and __nv_bfloat16
// convert to float, compute, and round back (round-to-nearest-even).

// float
KILN_DEVICE float abs(float a) { return fabsf(a); }
KILN_DEVICE float neg(float a) { return -a; }
KILN_DEVICE float exp(float a) { return expf(a); }
KILN_DEVICE float log(float a) { return logf(a); }
KILN_DEVICE float sqrt(float a) { return sqrtf(a); }
KILN_DEVICE float rsqrt(float a) { return rsqrtf(a); }
KILN_DEVICE float reciprocal(float a) { return 1.0f / a; }
KILN_DEVICE float sin(float a) { return sinf(a); }
KILN_DEVICE float cos(float a) { return cosf(a); }
KILN_DEVICE float tanh(float a) { return tanhf(a); }
// sigmoid's reciprocal is one MUFU.RCP (rcp.approx.ftz.f32), within 1 ulp: the divisor is
// in [1, inf], so no IEEE slow path is needed, and a result below 2^-126 (divisor past
// 2^126) flushes to 0, which is sigmoid's value there too. __fdividef would add a
// rescaling step for such divisors (measured: bf16 sigmoid chain 69.9 -> 67.6 us).
KILN_DEVICE float rcpApprox(float a) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return r;
}
KILN_DEVICE float sigmoid(float a) { return rcpApprox(1.0f + expf(-a)); }
// Float values that end as half/bfloat16 values (analysis::narrow): the approximations'
// error (exp: 2 + 1.173|a| ulp; division: 2 ulp) is below 1/32 of that rounding.
KILN_DEVICE float expNarrow(float a) { return __expf(a); }
KILN_DEVICE float sigmoidNarrow(float a) { return rcpApprox(1.0f + __expf(-a)); }
// div.full: full-range (no __fdividef cut-off for divisors past 2^126), no IEEE slow path.
KILN_DEVICE float divNarrow(float a, float b) {
  float r;
  asm("div.full.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
KILN_DEVICE float relu(float a) { return a <= 0.0f ? 0.0f : a; }  // NaN stays NaN
KILN_DEVICE float pow(float a, float b) { return powf(a, b); }

// double
KILN_DEVICE double abs(double a) { return fabs(a); }
KILN_DEVICE double neg(double a) { return -a; }
KILN_DEVICE double exp(double a) { return ::exp(a); }
KILN_DEVICE double log(double a) { return ::log(a); }
KILN_DEVICE double sqrt(double a) { return ::sqrt(a); }
KILN_DEVICE double rsqrt(double a) { return ::rsqrt(a); }
KILN_DEVICE double reciprocal(double a) { return 1.0 / a; }
KILN_DEVICE double sin(double a) { return ::sin(a); }
KILN_DEVICE double cos(double a) { return ::cos(a); }
KILN_DEVICE double tanh(double a) { return ::tanh(a); }
KILN_DEVICE double sigmoid(double a) { return 1.0 / (1.0 + ::exp(-a)); }
KILN_DEVICE double relu(double a) { return a <= 0.0 ? 0.0 : a; }
KILN_DEVICE double pow(double a, double b) { return ::pow(a, b); }

// integers (abs/neg wrap like torch for the minimum value)
KILN_DEVICE int abs(int a) { return a < 0 ? -a : a; }
KILN_DEVICE int64_t abs(int64_t a) { return a < 0 ? -a : a; }
KILN_DEVICE int neg(int a) { return -a; }
KILN_DEVICE int64_t neg(int64_t a) { return -a; }
KILN_DEVICE int relu(int a) { return a < 0 ? 0 : a; }
KILN_DEVICE int64_t relu(int64_t a) { return a < 0 ? 0 : a; }
// Integer power by squaring; negative exponents follow torch: 1 for base 1, +-1 for base
// -1, 0 otherwise.
template <typename I>
KILN_DEVICE I ipow(I a, I b) {
  if (b < 0) {
    if (a == 1) return 1;
    if (a == -1) return (b & 1) ? -1 : 1;
    return 0;
  }
  I r = 1;
  while (b) {
    if (b & 1) r *= a;
    b >>= 1;
    a *= a;
  }
  return r;
}
KILN_DEVICE int pow(int a, int b) { return ipow<int>(a, b); }
KILN_DEVICE int64_t pow(int64_t a, int64_t b) { return ipow<int64_t>(a, b); }

// half / bf16 through float
#define KILN_UNARY_VIA_FLOAT(NAME)                                                      \
  KILN_DEVICE __half NAME(__half a) { return __float2half_rn(NAME(__half2float(a))); } \
  KILN_DEVICE __nv_bfloat16 NAME(__nv_bfloat16 a) {                                    \
    return __float2bfloat16_rn(NAME(__bfloat162float(a)));                             \
  }
KILN_UNARY_VIA_FLOAT(exp)
KILN_UNARY_VIA_FLOAT(log)
KILN_UNARY_VIA_FLOAT(sqrt)
KILN_UNARY_VIA_FLOAT(rsqrt)
KILN_UNARY_VIA_FLOAT(reciprocal)
KILN_UNARY_VIA_FLOAT(sin)
KILN_UNARY_VIA_FLOAT(cos)
KILN_UNARY_VIA_FLOAT(tanh)
KILN_UNARY_VIA_FLOAT(sigmoid)
#undef KILN_UNARY_VIA_FLOAT
// Sign-bit operations are exact on the bits (no rounding, NaN payload kept).
KILN_DEVICE __half abs(__half a) {
  return __ushort_as_half((unsigned short)(__half_as_ushort(a) & 0x7fffU));
}
KILN_DEVICE __nv_bfloat16 abs(__nv_bfloat16 a) {
  return __ushort_as_bfloat16((unsigned short)(__bfloat16_as_ushort(a) & 0x7fffU));
}
KILN_DEVICE __half neg(__half a) {
  return __ushort_as_half((unsigned short)(__half_as_ushort(a) ^ 0x8000U));
}
KILN_DEVICE __nv_bfloat16 neg(__nv_bfloat16 a) {
  return __ushort_as_bfloat16((unsigned short)(__bfloat16_as_ushort(a) ^ 0x8000U));
}
KILN_DEVICE __half relu(__half a) { return __half2float(a) <= 0.0f ? __ushort_as_half(0) : a; }
KILN_DEVICE __nv_bfloat16 relu(__nv_bfloat16 a) {
  return __bfloat162float(a) <= 0.0f ? __ushort_as_bfloat16(0) : a;
}

// Binary arithmetic: generic for float/double/integers, via float for half/bf16.
template <typename T>
KILN_DEVICE T add(T a, T b) {
  return a + b;
}
template <typename T>
KILN_DEVICE T sub(T a, T b) {
  return a - b;
}
template <typename T>
KILN_DEVICE T mul(T a, T b) {
  return a * b;
}
template <typename T>
KILN_DEVICE T div(T a, T b) {
  return a / b;
}
#define KILN_BINARY_VIA_FLOAT(NAME, EXPR)                                              \
  template <>                                                                          \
  KILN_DEVICE __half NAME<__half>(__half a_, __half b_) {                              \
    const float a = __half2float(a_), b = __half2float(b_);                            \
    return __float2half_rn(EXPR);                                                      \
  }                                                                                    \
  template <>                                                                          \
  KILN_DEVICE __nv_bfloat16 NAME<__nv_bfloat16>(__nv_bfloat16 a_, __nv_bfloat16 b_) {  \
    const float a = __bfloat162float(a_), b = __bfloat162float(b_);                    \
    return __float2bfloat16_rn(EXPR);                                                  \
  }
KILN_BINARY_VIA_FLOAT(add, a + b)
KILN_BINARY_VIA_FLOAT(sub, a - b)
KILN_BINARY_VIA_FLOAT(mul, a * b)
KILN_BINARY_VIA_FLOAT(div, a / b)
#undef KILN_BINARY_VIA_FLOAT
KILN_DEVICE __half pow(__half a, __half b) {
  return __float2half_rn(powf(__half2float(a), __half2float(b)));
}
KILN_DEVICE __nv_bfloat16 pow(__nv_bfloat16 a, __nv_bfloat16 b) {
  return __float2bfloat16_rn(powf(__bfloat162float(a), __bfloat162float(b)));
}

// maximum / minimum propagate NaN like torch.maximum / torch.minimum.
KILN_DEVICE bool isnan_(float a) { return a != a; }
KILN_DEVICE bool isnan_(double a) { return a != a; }
template <typename T>
KILN_DEVICE T maximum(T a, T b) {  // integers and bool
  return a > b ? a : b;
}
template <typename T>
KILN_DEVICE T minimum(T a, T b) {
  return a < b ? a : b;
}
// sm_80 and later have NaN-propagating min/max in one instruction (a NaN operand gives
// the canonical NaN); the select chain costs four, a tenth of a half softmax's work.
template <>
KILN_DEVICE float maximum<float>(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return isnan_(a) ? a : (isnan_(b) ? b : (a > b ? a : b));
#endif
}
template <>
KILN_DEVICE float minimum<float>(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return isnan_(a) ? a : (isnan_(b) ? b : (a < b ? a : b));
#endif
}
template <>
KILN_DEVICE double maximum<double>(double a, double b) {
  return isnan_(a) ? a : (isnan_(b) ? b : (a > b ? a : b));
}
template <>
KILN_DEVICE double minimum<double>(double a, double b) {
  return isnan_(a) ? a : (isnan_(b) ? b : (a < b ? a : b));
}
template <>
KILN_DEVICE __half maximum<__half>(__half a, __half b) {
  const float x = __half2float(a), y = __half2float(b);
  return isnan_(x) ? a : (isnan_(y) ? b : (x > y ? a : b));
}
template <>
KILN_DEVICE __half minimum<__half>(__half a, __half b) {
  const float x = __half2float(a), y = __half2float(b);
  return isnan_(x) ? a : (isnan_(y) ? b : (x < y ? a : b));
}
template <>
KILN_DEVICE __nv_bfloat16 maximum<__nv_bfloat16>(__nv_bfloat16 a, __nv_bfloat16 b) {
  const float x = __bfloat162float(a), y = __bfloat162float(b);
  return isnan_(x) ? a : (isnan_(y) ? b : (x > y ? a : b));
}
template <>
KILN_DEVICE __nv_bfloat16 minimum<__nv_bfloat16>(__nv_bfloat16 a, __nv_bfloat16 b) {
  const float x = __bfloat162float(a), y = __bfloat162float(b);
  return isnan_(x) ? a : (isnan_(y) ? b : (x < y ? a : b));
}

// Rounding and sign: integers and bool are unchanged by rounding; half and bfloat16
// compute in float (codegen converts), so only float and double have real overloads.
template <typename T>
KILN_DEVICE T floor(T a) {
  return a;
}
template <typename T>
KILN_DEVICE T ceil(T a) {
  return a;
}
template <typename T>
KILN_DEVICE T round(T a) {
  return a;
}
template <typename T>
KILN_DEVICE T trunc(T a) {
  return a;
}
KILN_DEVICE float floor(float a) { return floorf(a); }
KILN_DEVICE double floor(double a) { return ::floor(a); }
KILN_DEVICE float ceil(float a) { return ceilf(a); }
KILN_DEVICE double ceil(double a) { return ::ceil(a); }
KILN_DEVICE float round(float a) { return rintf(a); }  // halves to even, as torch.round
KILN_DEVICE double round(double a) { return ::rint(a); }
KILN_DEVICE float trunc(float a) { return truncf(a); }
KILN_DEVICE double trunc(double a) { return ::trunc(a); }
KILN_DEVICE float frac(float a) { return a - truncf(a); }
KILN_DEVICE double frac(double a) { return a - ::trunc(a); }
// sign: -1, 0 or 1; 0 for NaN and for either zero (torch.sign).
template <typename T>
KILN_DEVICE T sign(T a) {
  return (T)((T(0) < a) - (a < T(0)));
}
KILN_DEVICE bool sign(bool a) { return a; }

// Predicates (the result is bool; integers are finite and never NaN).
template <typename T>
KILN_DEVICE bool signbit(T a) {
  return a < T(0);
}
KILN_DEVICE bool signbit(bool) { return false; }
KILN_DEVICE bool signbit(float a) { return ::signbit(a); }
KILN_DEVICE bool signbit(double a) { return ::signbit(a); }
template <typename T>
KILN_DEVICE bool isnan(T) {
  return false;
}
KILN_DEVICE bool isnan(float a) { return ::isnan(a); }
KILN_DEVICE bool isnan(double a) { return ::isnan(a); }
template <typename T>
KILN_DEVICE bool isinf(T) {
  return false;
}
KILN_DEVICE bool isinf(float a) { return ::isinf(a); }
KILN_DEVICE bool isinf(double a) { return ::isinf(a); }
template <typename T>
KILN_DEVICE bool isfinite(T) {
  return true;
}
KILN_DEVICE bool isfinite(float a) { return ::isfinite(a); }
KILN_DEVICE bool isfinite(double a) { return ::isfinite(a); }
template <typename T>
KILN_DEVICE bool isposinf(T a) {
  return isinf(a) && a > T(0);
}
template <typename T>
KILN_DEVICE bool isneginf(T a) {
  return isinf(a) && a < T(0);
}
// One compare each (NaN compares false): the online log-sum-exp's floor tests every element.
KILN_DEVICE bool isposinf(float a) { return a == __int_as_float(0x7f800000); }
KILN_DEVICE bool isposinf(double a) { return a == __longlong_as_double(0x7ff0000000000000ULL); }
KILN_DEVICE bool isneginf(float a) { return a == __int_as_float(0xff800000); }
KILN_DEVICE bool isneginf(double a) { return a == __longlong_as_double(0xfff0000000000000ULL); }

// Division and remainders. Integer division truncates (C, nvFuser's div); an integer
// divisor of 0 gives 0 and the minimum divided by -1 wraps, so no input is undefined.
#define KILN_INT_DIVISION(I, U)                                                         \
  template <>                                                                          \
  KILN_DEVICE I div<I>(I a, I b) {                                                     \
    return b == 0 ? I(0) : (b == -1 ? (I)((U)0 - (U)a) : a / b);                       \
  }                                                                                    \
  KILN_DEVICE I fmod(I a, I b) { return (b == 0 || b == -1) ? I(0) : a % b; }          \
  KILN_DEVICE I remainder(I a, I b) {                                                  \
    const I m = fmod(a, b);                                                            \
    return (m != 0 && ((b < 0) != (m < 0))) ? (I)((U)m + (U)b) : m;                    \
  }                                                                                    \
  KILN_DEVICE I bitwise_left_shift(I a, I b) {                                         \
    return (b < 0 || b >= (I)(8 * sizeof(I))) ? I(0) : (I)((U)a << b);                 \
  }                                                                                    \
  KILN_DEVICE I bitwise_right_shift(I a, I b) {                                        \
    return a >> ((b < 0 || b >= (I)(8 * sizeof(I))) ? (I)(8 * sizeof(I) - 1) : b);     \
  }                                                                                    \
  KILN_DEVICE I gcd(I a, I b) {                                                        \
    U x = a < 0 ? (U)0 - (U)a : (U)a, y = b < 0 ? (U)0 - (U)b : (U)b;                  \
    while (y != 0) {                                                                   \
      const U t = x % y;                                                               \
      x = y;                                                                           \
      y = t;                                                                           \
    }                                                                                  \
    return (I)x;                                                                       \
  }
KILN_INT_DIVISION(int, unsigned int)
KILN_INT_DIVISION(int64_t, uint64_t)
#undef KILN_INT_DIVISION
KILN_DEVICE float truediv(float a, float b) { return a / b; }
KILN_DEVICE double truediv(double a, double b) { return a / b; }
KILN_DEVICE float fmod(float a, float b) { return fmodf(a, b); }
KILN_DEVICE double fmod(double a, double b) { return ::fmod(a, b); }
// Python's %: the remainder takes the divisor's sign (torch.remainder).
template <typename F>
KILN_DEVICE F remainderFloat(F a, F b) {
  const F m = fmod(a, b);
  return (m != F(0) && ((b < F(0)) != (m < F(0)))) ? m + b : m;
}
KILN_DEVICE float remainder(float a, float b) { return remainderFloat(a, b); }
KILN_DEVICE double remainder(double a, double b) { return remainderFloat(a, b); }

// Bitwise ops (integers and bool) and logic (on bool: codegen converts operands to truth).
template <typename T>
KILN_DEVICE T bitwise_and(T a, T b) {
  return a & b;
}
template <typename T>
KILN_DEVICE T bitwise_or(T a, T b) {
  return a | b;
}
template <typename T>
KILN_DEVICE T bitwise_xor(T a, T b) {
  return a ^ b;
}
template <typename T>
KILN_DEVICE T bitwise_not(T a) {
  return ~a;
}
KILN_DEVICE bool bitwise_not(bool a) { return !a; }
KILN_DEVICE bool logical_not(bool a) { return !a; }
KILN_DEVICE bool logical_and(bool a, bool b) { return a && b; }
KILN_DEVICE bool logical_or(bool a, bool b) { return a || b; }
KILN_DEVICE bool logical_xor(bool a, bool b) { return a != b; }

// iota: start + i * step, fused (one rounding) for floats as the interpreter computes it.
template <typename T>
KILN_DEVICE T iotaValue(T start, T step, int64_t i) {
  return (T)(start + (T)i * step);
}
template <>
KILN_DEVICE float iotaValue<float>(float start, float step, int64_t i) {
  return fmaf((float)i, step, start);
}
template <>
KILN_DEVICE double iotaValue<double>(double start, double step, int64_t i) {
  return ::fma((double)i, step, start);
}

// Random numbers (rust/src/ir/random.rs is the reference): the element at row-major
// position i is drawn from Philox 4x32-10 with counter (i, offset) and key seed.
struct PhiloxBlock {
  uint32_t x, y, z, w;
};
KILN_DEVICE PhiloxBlock philox(uint64_t seed, uint64_t offset, uint64_t index) {
  uint32_t c0 = (uint32_t)index, c1 = (uint32_t)(index >> 32), c2 = (uint32_t)offset,
           c3 = (uint32_t)(offset >> 32);
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return PhiloxBlock{c0, c1, c2, c3};
}
// dist: 0 uniform in [a, b), 1 normal with mean a and standard deviation b.
KILN_DEVICE float randomFloat(int dist, int64_t seed, int64_t offset, int64_t index, float a, float b) {
  const PhiloxBlock r = philox((uint64_t)seed, (uint64_t)offset, (uint64_t)index);
  const float scale = 1.0f / 16777216.0f;
  if (dist == 0) return fmaf((float)(r.x >> 8) * scale, b - a, a);
  const float u1 = (float)((r.x >> 8) + 1) * scale, u2 = (float)(r.y >> 8) * scale;
  const float z = sqrtf(-2.0f * logf(u1)) * cosf(6.28318530717958647692f * u2);
  return fmaf(z, b, a);
}
KILN_DEVICE double randomDouble(int dist, int64_t seed, int64_t offset, int64_t index, double a, double b) {
  const PhiloxBlock r = philox((uint64_t)seed, (uint64_t)offset, (uint64_t)index);
  const double scale = 1.0 / 9007199254740992.0;
  const uint64_t b0 = ((uint64_t)r.x << 21) | (r.y >> 11), b1 = ((uint64_t)r.z << 21) | (r.w >> 11);
  if (dist == 0) return ::fma((double)b0 * scale, b - a, a);
  const double u1 = (double)(b0 + 1) * scale, u2 = (double)b1 * scale;
  const double z = ::sqrt(-2.0 * ::log(u1)) * ::cos(6.28318530717958647692 * u2);
  return ::fma(z, b, a);
}

// Comparisons (half/bf16 compared in float) and select.
KILN_DEVICE float cmpValue(__half a) { return __half2float(a); }
KILN_DEVICE float cmpValue(__nv_bfloat16 a) { return __bfloat162float(a); }
template <typename T>
KILN_DEVICE T cmpValue(T a) {
  return a;
}
template <typename T>
KILN_DEVICE bool eq(T a, T b) {
  return cmpValue(a) == cmpValue(b);
}
template <typename T>
KILN_DEVICE bool ne(T a, T b) {
  return cmpValue(a) != cmpValue(b);
}
template <typename T>
KILN_DEVICE bool lt(T a, T b) {
  return cmpValue(a) < cmpValue(b);
}
template <typename T>
KILN_DEVICE bool le(T a, T b) {
  return cmpValue(a) <= cmpValue(b);
}
template <typename T>
KILN_DEVICE bool gt(T a, T b) {
  return cmpValue(a) > cmpValue(b);
}
template <typename T>
KILN_DEVICE bool ge(T a, T b) {
  return cmpValue(a) >= cmpValue(b);
}
template <typename T>
KILN_DEVICE T where(bool c, T a, T b) {
  return c ? a : b;
}

// ---------------------------------------------------------------------------------------
// cast<To>(From). Covers every pair of {bool, int, int64_t, __half, __nv_bfloat16, float,
// double}. Float -> bool is `x != 0` (NaN -> true, like torch); float -> int truncates
// (CUDA's cvt.rzi saturates out-of-range values and maps NaN to 0).

namespace detail {
template <typename To, typename From>
struct Cast {
  static KILN_DEVICE To apply(From x) { return static_cast<To>(x); }
};
template <typename From>
struct Cast<bool, From> {
  static KILN_DEVICE bool apply(From x) { return x != From(0); }
};
template <>
struct Cast<bool, bool> {
  static KILN_DEVICE bool apply(bool x) { return x; }
};
// -> half
template <typename From>
struct Cast<__half, From> {
  static KILN_DEVICE __half apply(From x) { return __float2half_rn(static_cast<float>(x)); }
};
template <>
struct Cast<__half, double> {
  static KILN_DEVICE __half apply(double x) { return __double2half(x); }
};
template <>
struct Cast<__half, int> {
  static KILN_DEVICE __half apply(int x) { return __int2half_rn(x); }
};
template <>
struct Cast<__half, int64_t> {
  static KILN_DEVICE __half apply(int64_t x) { return __ll2half_rn(x); }
};
template <>
struct Cast<__half, bool> {
  static KILN_DEVICE __half apply(bool x) { return __ushort_as_half(x ? (unsigned short)0x3c00U : (unsigned short)0U); }
};
// -> bf16
template <typename From>
struct Cast<__nv_bfloat16, From> {
  static KILN_DEVICE __nv_bfloat16 apply(From x) { return __float2bfloat16_rn(static_cast<float>(x)); }
};
template <>
struct Cast<__nv_bfloat16, double> {
  static KILN_DEVICE __nv_bfloat16 apply(double x) { return __double2bfloat16(x); }
};
template <>
struct Cast<__nv_bfloat16, int> {
  static KILN_DEVICE __nv_bfloat16 apply(int x) { return __int2bfloat16_rn(x); }
};
template <>
struct Cast<__nv_bfloat16, int64_t> {
  static KILN_DEVICE __nv_bfloat16 apply(int64_t x) { return __ll2bfloat16_rn(x); }
};
template <>
struct Cast<__nv_bfloat16, bool> {
  static KILN_DEVICE __nv_bfloat16 apply(bool x) {
    return __ushort_as_bfloat16(x ? (unsigned short)0x3f80U : (unsigned short)0U);
  }
};
// half -> *
template <typename To>
struct Cast<To, __half> {
  static KILN_DEVICE To apply(__half x) { return Cast<To, float>::apply(__half2float(x)); }
};
template <>
struct Cast<bool, __half> {
  static KILN_DEVICE bool apply(__half x) { return (__half_as_ushort(x) & 0x7fffU) != 0; }
};
// bf16 -> *
template <typename To>
struct Cast<To, __nv_bfloat16> {
  static KILN_DEVICE To apply(__nv_bfloat16 x) { return Cast<To, float>::apply(__bfloat162float(x)); }
};
template <>
struct Cast<bool, __nv_bfloat16> {
  static KILN_DEVICE bool apply(__nv_bfloat16 x) { return (__bfloat16_as_ushort(x) & 0x7fffU) != 0; }
};
// half <-> bf16 (both partial specialisations match: spell them out)
template <>
struct Cast<__half, __half> {
  static KILN_DEVICE __half apply(__half x) { return x; }
};
template <>
struct Cast<__nv_bfloat16, __nv_bfloat16> {
  static KILN_DEVICE __nv_bfloat16 apply(__nv_bfloat16 x) { return x; }
};
template <>
struct Cast<__half, __nv_bfloat16> {
  static KILN_DEVICE __half apply(__nv_bfloat16 x) { return __float2half_rn(__bfloat162float(x)); }
};
template <>
struct Cast<__nv_bfloat16, __half> {
  static KILN_DEVICE __nv_bfloat16 apply(__half x) { return __float2bfloat16_rn(__half2float(x)); }
};
}  // namespace detail

template <typename To, typename From>
KILN_DEVICE To cast(From x) {
  return detail::Cast<To, From>::apply(x);
}

// A uniform draw in the output type T, kept below b (rounding to T can reach b): such a
// draw becomes the largest T below b. `prevValue` steps one value of T towards -inf.
KILN_DEVICE float prevValue(float x) { return nextafterf(x, __int_as_float(0xff800000)); }
KILN_DEVICE double prevValue(double x) { return ::nextafter(x, __longlong_as_double((long long)0xfff0000000000000ULL)); }
KILN_DEVICE unsigned short prevBits16(unsigned short b) {
  return (b & 0x7fffU) == 0 ? (unsigned short)0x8001U : ((b & 0x8000U) ? (unsigned short)(b + 1) : (unsigned short)(b - 1));
}
KILN_DEVICE __half prevValue(__half x) { return __ushort_as_half(prevBits16(__half_as_ushort(x))); }
KILN_DEVICE __nv_bfloat16 prevValue(__nv_bfloat16 x) {
  return __ushort_as_bfloat16(prevBits16(__bfloat16_as_ushort(x)));
}
template <typename T, typename C>
KILN_DEVICE T uniformBelow(C v, C a, C b) {
  T r = cast<T>(v);
  if (!(a < b) || static_cast<C>(cast<C>(r)) < b) return r;
  T c = cast<T>(b);
  if (cast<C>(c) >= b) c = prevValue(c);
  return c;
}

// ---------------------------------------------------------------------------------------
// Vectorized access. Array<T, N> is aligned to the largest power of two dividing
// sizeof(T)*N, capped at 16 bytes (so Array<float, 4> is 16-byte aligned, Array<float, 3>
// 4-byte aligned). loadVec/storeVec move the whole array with one 1/2/4/8/16-byte access
// (several 16-byte ones when sizeof(T)*N is a multiple of 16 larger than 16); the pointer
// must be aligned to that width — the scheduler's Vectorize guarantees it.

namespace detail {
constexpr int vecAlign(int bytes) {
  return (bytes % 16 == 0) ? 16 : (bytes % 8 == 0) ? 8 : (bytes % 4 == 0) ? 4 : (bytes % 2 == 0) ? 2 : 1;
}
}  // namespace detail

template <typename T, int N>
struct alignas(detail::vecAlign(sizeof(T) * N)) Array {
  T v[N];
  KILN_DEVICE T& operator[](int i) { return v[i]; }
  KILN_DEVICE const T& operator[](int i) const { return v[i]; }
  KILN_DEVICE void set(T x) {
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = x;
  }
};

template <typename T, int N>
KILN_DEVICE void loadVec(Array<T, N>& dst, const T* src) {
  constexpr int BYTES = sizeof(T) * N;
  static_assert(BYTES == 1 || BYTES == 2 || BYTES == 4 || BYTES == 8 || BYTES % 16 == 0,
                "kiln::loadVec: sizeof(T)*N must be 1, 2, 4, 8 or a multiple of 16 bytes");
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      reinterpret_cast<uint4*>(&dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else if constexpr (BYTES == 8) {
    *reinterpret_cast<uint2*>(&dst) = *reinterpret_cast<const uint2*>(src);
  } else if constexpr (BYTES == 4) {
    *reinterpret_cast<unsigned int*>(&dst) = *reinterpret_cast<const unsigned int*>(src);
  } else if constexpr (BYTES == 2) {
    *reinterpret_cast<unsigned short*>(&dst) = *reinterpret_cast<const unsigned short*>(src);
  } else {
    *reinterpret_cast<unsigned char*>(&dst) = *reinterpret_cast<const unsigned char*>(src);
  }
}

// loadVec with cache hints, for Global reads of a read-only input (same contract as loadVec;
// the source must not change during the kernel):
//   loadVecStreaming           `set_streaming_load`: skip L1 allocation, so data that nothing
//                              reads again leaves L1 to what is reused.
//   loadVecEvictLast           `set_evict_last`: the lines stay in L2 ahead of normal data.
//                              On the H200 this keeps the written output from lingering in L2
//                              behind the input (a 16384x4096 fp32 layernorm: 129.4 -> 124.9
//                              us). The lines stay after the kernel too, until newer
//                              evict_last lines replace them or cuCtxResetPersistingL2Cache.
//   loadVecStreamingEvictLast  both.
namespace detail {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
// An L2 cache policy giving every line it is used on the evict_last priority.
KILN_DEVICE unsigned long long evictLastPolicy() {
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
#endif

template <bool NO_L1, bool L2_LAST>
KILN_DEVICE void load16Hinted(uint4& d, const uint4* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (L2_LAST) {
    const unsigned long long policy = evictLastPolicy();
    if constexpr (NO_L1) {
      asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
          : "l"(p), "l"(policy));
    } else {
      asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
          : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
          : "l"(p), "l"(policy));
    }
    return;
  }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if constexpr (NO_L1) {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
        : "l"(p));
    return;
  }
#endif
  d = *p;
}

template <bool NO_L1, bool L2_LAST>
KILN_DEVICE void load8Hinted(uint2& d, const uint2* p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (L2_LAST) {
    const unsigned long long policy = evictLastPolicy();
    if constexpr (NO_L1) {
      asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
          : "=r"(d.x), "=r"(d.y)
          : "l"(p), "l"(policy));
    } else {
      asm("ld.global.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;" : "=r"(d.x), "=r"(d.y) : "l"(p), "l"(policy));
    }
    return;
  }
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  if constexpr (NO_L1) {
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(d.x), "=r"(d.y) : "l"(p));
    return;
  }
#endif
  d = *p;
}

// 16- and 8-byte-multiple vectors take the hinted loads; narrower ones load plainly.
template <bool NO_L1, bool L2_LAST, typename T, int N>
KILN_DEVICE void loadVecHinted(Array<T, N>& dst, const T* src) {
  constexpr int BYTES = sizeof(T) * N;
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      load16Hinted<NO_L1, L2_LAST>(reinterpret_cast<uint4*>(&dst)[i], reinterpret_cast<const uint4*>(src) + i);
    }
  } else if constexpr (BYTES == 8) {
    load8Hinted<NO_L1, L2_LAST>(*reinterpret_cast<uint2*>(&dst), reinterpret_cast<const uint2*>(src));
  } else {
    loadVec<T, N>(dst, src);
  }
}
}  // namespace detail

template <typename T, int N>
KILN_DEVICE void loadVecStreaming(Array<T, N>& dst, const T* src) {
  detail::loadVecHinted<true, false, T, N>(dst, src);
}

template <typename T, int N>
KILN_DEVICE void loadVecEvictLast(Array<T, N>& dst, const T* src) {
  detail::loadVecHinted<false, true, T, N>(dst, src);
}

template <typename T, int N>
KILN_DEVICE void loadVecStreamingEvictLast(Array<T, N>& dst, const T* src) {
  detail::loadVecHinted<true, true, T, N>(dst, src);
}

template <typename T, int N>
KILN_DEVICE void storeVec(T* dst, const Array<T, N>& src) {
  constexpr int BYTES = sizeof(T) * N;
  static_assert(BYTES == 1 || BYTES == 2 || BYTES == 4 || BYTES == 8 || BYTES % 16 == 0,
                "kiln::storeVec: sizeof(T)*N must be 1, 2, 4, 8 or a multiple of 16 bytes");
  if constexpr (BYTES % 16 == 0) {
#pragma unroll
    for (int i = 0; i < BYTES / 16; ++i) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(&src)[i];
    }
  } else if constexpr (BYTES == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(&src);
  } else if constexpr (BYTES == 4) {
    *reinterpret_cast<unsigned int*>(dst) = *reinterpret_cast<const unsigned int*>(&src);
  } else if constexpr (BYTES == 2) {
    *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(&src);
  } else {
    *reinterpret_cast<unsigned char*>(dst) = *reinterpret_cast<const unsigned char*>(&src);
  }
}

// ---------------------------------------------------------------------------------------
// Volatile accesses by bits, so types without volatile copy operations (__half, bf16)
// work. Used on grid-reduction work buffers.

template <typename T>
KILN_DEVICE T loadVolatile(const volatile T* p) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                "kiln::loadVolatile: T must be 1, 2, 4 or 8 bytes");
  if constexpr (sizeof(T) == 8) {
    const unsigned long long u = *reinterpret_cast<const volatile unsigned long long*>(p);
    return bitCast<T>(u);
  } else if constexpr (sizeof(T) == 4) {
    const unsigned int u = *reinterpret_cast<const volatile unsigned int*>(p);
    return bitCast<T>(u);
  } else if constexpr (sizeof(T) == 2) {
    const unsigned short u = *reinterpret_cast<const volatile unsigned short*>(p);
    return bitCast<T>(u);
  } else {
    const unsigned char u = *reinterpret_cast<const volatile unsigned char*>(p);
    return bitCast<T>(u);
  }
}

template <typename T>
KILN_DEVICE void storeVolatile(volatile T* p, T x) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                "kiln::storeVolatile: T must be 1, 2, 4 or 8 bytes");
  if constexpr (sizeof(T) == 8) {
    *reinterpret_cast<volatile unsigned long long*>(p) = bitCast<unsigned long long>(x);
  } else if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<volatile unsigned int*>(p) = bitCast<unsigned int>(x);
  } else if constexpr (sizeof(T) == 2) {
    *reinterpret_cast<volatile unsigned short*>(p) = bitCast<unsigned short>(x);
  } else {
    *reinterpret_cast<volatile unsigned char*>(p) = bitCast<unsigned char>(x);
  }
}

// ---------------------------------------------------------------------------------------
// Reduction functors. op(a, b) must be associative and commutative; Max/Min propagate NaN.

struct Sum {
  template <typename T>
  KILN_DEVICE T operator()(T a, T b) const {
    return add(a, b);
  }
  template <typename T>
  static KILN_DEVICE T identity() {
    return cast<T>(0);
  }
};
struct Prod {
  template <typename T>
  KILN_DEVICE T operator()(T a, T b) const {
    return mul(a, b);
  }
  template <typename T>
  static KILN_DEVICE T identity() {
    return cast<T>(1);
  }
};
struct Max {
  template <typename T>
  KILN_DEVICE T operator()(T a, T b) const {
    return maximum(a, b);
  }
  template <typename T>
  static KILN_DEVICE T identity() {
    return numeric<T>::lowest();
  }
};
struct Min {
  template <typename T>
  KILN_DEVICE T operator()(T a, T b) const {
    return minimum(a, b);
  }
  template <typename T>
  static KILN_DEVICE T identity() {
    return numeric<T>::highest();
  }
};

// log(sum(exp(x))) in one pass (float and double). A thread accumulates a running maximum
// m and the sum s of exp(x - m), rescaling s when m grows, so each element costs one exp,
// exp(-|x - m|), and no branch (a branch per element kept the loads of an unrolled row
// apart). m starts at the most negative finite value: -inf elements and the first finite
// one need no special case. A NaN element makes m NaN (max.NaN), and NaN sticks; +inf makes
// m +inf, which the finish returns. Threads then merge their partial results as
// log-sum-exp values (LogSumExp on T).
//
// Float terms use ex2.approx of d * log2(e), d = -|x - m| <= 0: at most 2 + |d|/2 ulp per
// term (ex2.approx's 2 ulp, and the rounding of the product scaled by |d|). Weighted by the
// terms' share of the sum, that is below (2 + (1 + ln n)/2) ulp of the sum of n terms,
// under the float summation's own error; the exact exp costs about ten instructions an
// element more, as much as the rest of a cross-entropy row's math.
template <typename T>
struct LseAcc {
  T m, s;
};
template <typename T>
KILN_DEVICE T lseFloor();
template <>
KILN_DEVICE float lseFloor<float>() {
  return __int_as_float(0xff7fffff);  // -FLT_MAX
}
template <>
KILN_DEVICE double lseFloor<double>() {
  return __longlong_as_double(0xffefffffffffffffULL);  // -DBL_MAX
}
KILN_DEVICE float lseExp(float d) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d * 1.4426950408889634f));
  return r;
}
KILN_DEVICE double lseExp(double d) { return exp(d); }
template <typename T>
KILN_DEVICE LseAcc<T> lseEmpty() {
  return LseAcc<T>{lseFloor<T>(), T(0)};
}
// The log-sum-exp of an accumulator: +-inf where the maximum is (an infinite input, or no
// finite one: m at its floor with s = 0 gives -inf), NaN once a NaN was seen.
// R: the result type, T or wider. A double result of a float row keeps log(s) next to a
// maximum of any size (a row masked to -1e9 has lse = -1e9 + log(n), which float rounds
// to -1e9): exp(x - lse) then still sums to one.
template <typename R, typename T>
KILN_DEVICE R lseFinish(LseAcc<T> a) {
  return a.m == numeric<T>::highest() ? R(a.m) : R(a.m) + log(R(a.s));
}
// A float row finished in double: log(s) as e * log(2) + log(mantissa), exact to float's
// precision of a value below 1 (1e-7 absolute at any s) without a double log per thread.
// s = 0 (no finite element) gives log(0) = -inf, and a NaN s NaN, as above.
template <>
KILN_DEVICE double lseFinish<double, float>(LseAcc<float> a) {
  if (a.m == numeric<float>::highest()) return double(a.m);
  int e;
  const float mantissa = frexpf(a.s, &e);
  return double(a.m) + (double(e) * 0.6931471805599453 + double(logf(mantissa)));
}
// Merges the double log-sum-exps of float rows (finished above): the larger plus
// log(1 + exp(lo - hi)), a correction in [0, log 2] that float computes to 1e-7 absolute.
// The double keeps log(n) beside a maximum of any size; a double exp and log per merge cost
// as much as a thread's share of a 32000-column row, and a row merges 5 to 13 times.
struct LogSumExpOfFloats {
  KILN_DEVICE double operator()(double a, double b) const {
    const double hi = maximum(a, b), lo = minimum(a, b);
    if (hi == numeric<double>::highest() || hi == numeric<double>::lowest()) return hi;
    return hi + double(log1pf(expf(float(lo - hi))));  // NaN stays NaN
  }
  static KILN_DEVICE double identity() {
    return numeric<double>::lowest();
  }
};
// Merges two accumulators of float rows: the larger maximum keeps its sum, the other's is
// scaled by exp(-|difference|), one accurate exp (1 ulp) per merge. Threads merge their
// (maximum, sum) pairs in 8-byte shuffles and finish once (lseFinish<double>), where merging
// finished log-sum-exps paid a log and an exp per merge. An empty side (m at its floor, s =
// 0) adds nothing; +inf keeps m = +inf, which the finish returns; NaN sticks (max.NaN).
struct LsePair {
  template <typename T>
  KILN_DEVICE LseAcc<T> operator()(LseAcc<T> a, LseAcc<T> b) const {
    const T d = a.m - b.m;
    const T e = exp(-abs(d));
    LseAcc<T> r;
    r.s = d > T(0) ? a.s + b.s * e : b.s + a.s * e;
    r.m = maximum(a.m, b.m);
    return r;
  }
};
struct LogSumExp {
  // Merge two log-sum-exp values.
  template <typename T>
  KILN_DEVICE T operator()(T a, T b) const {
    const T hi = maximum(a, b), lo = minimum(a, b);
    if (hi == numeric<T>::highest() || hi == numeric<T>::lowest()) return hi;
    return hi + log(T(1) + exp(lo - hi));
  }
  // Add one element to an accumulator.
  template <typename T>
  KILN_DEVICE LseAcc<T> operator()(LseAcc<T> a, T x) const {
    // exp(-|x - m|) from one difference: its sign picks the branch for free.
    const T d = x - a.m;
    const bool up = d > T(0);
    const T e = lseExp(-abs(d));  // NaN with a NaN, or with m = x = +inf
    a.s = up ? a.s * e + T(1) : a.s + e;
    a.m = maximum(a.m, x);
    return a;
  }
  template <typename T>
  static KILN_DEVICE T identity() {
    return numeric<T>::lowest();
  }
};

// The elements of a floored log-sum-exp: raised to -2^32 unless -inf or NaN
// (ReductionOp::LogSumExpFloored, LSE_FLOOR in the IR).
template <typename T>
KILN_DEVICE T lseRaise(T x) {
  return isneginf(x) ? x : maximum(x, T(-4294967296.0));
}
// A log-sum-exp of raised elements. Its partial results are at or above the floor (or -inf,
// or NaN) already, so raising the operands of a merge leaves them as they are.
struct LogSumExpFloored {
  template <typename T>
  KILN_DEVICE T operator()(T a, T b) const {
    return LogSumExp()(lseRaise(a), lseRaise(b));
  }
  template <typename T>
  KILN_DEVICE LseAcc<T> operator()(LseAcc<T> a, T x) const {
    return LogSumExp()(a, lseRaise(x));
  }
  template <typename T>
  static KILN_DEVICE T identity() {
    return numeric<T>::lowest();
  }
};

// Adds N elements to an accumulator at once: the maximum of them and the running one first,
// then each element's exp(x - m) and one rescale of the old sum, where adding them one by
// one rescales per element. Same values as one by one (each term exp(x - m) <= 1 of the
// final maximum, ex2.approx as lseExp): -inf elements add 0, a NaN makes m and s NaN, and
// +inf makes m +inf, which the finish returns.
template <int N, typename T>
KILN_DEVICE LseAcc<T> lseAddBlock(LseAcc<T> a, const T (&v)[N]) {
  T m = a.m;
#pragma unroll
  for (int i = 0; i < N; ++i) m = maximum(m, v[i]);
  T s = a.s * lseExp(a.m - m);
#pragma unroll
  for (int i = 0; i < N; ++i) s += lseExp(v[i] - m);
  return LseAcc<T>{m, s};
}

// lseAddBlock of raised elements (LogSumExpFloored). With the maximum at least 2048 above the
// floor, a raised element's term exp(-2^32 - m) is zero in float, and in double less than an
// ulp of the sum (at least 1, from the maximum's own term), as its raw term is; so the
// elements are raised only when the maximum is nearer (or NaN), not one by one. (2048, not
// less: float's spacing at 2^32 is 512, and -2^32 + 128 would round back to the floor.)
template <int N, typename T>
KILN_DEVICE LseAcc<T> lseAddBlockRaised(LseAcc<T> a, const T (&v)[N]) {
  T m = a.m;
#pragma unroll
  for (int i = 0; i < N; ++i) m = maximum(m, v[i]);
  if (!(m >= T(-4294967296.0 + 2048.0))) {
    T r[N];
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = lseRaise(v[i]);
    return lseAddBlock(a, r);
  }
  return lseAddBlock(a, v);
}

// ---------------------------------------------------------------------------------------
// Index helpers. X/Y/Z select the dims; linearisation is x fastest.

// The block's extents. Declared here and defined by the source after this header with
// KILN_BLOCK_SHAPE(x, y, z): a generated kernel whose block is fixed when it is generated
// passes constants, so every block reduction folds its shape and its path at compile time
// (less code to run and to compile); otherwise blockDim.x, blockDim.y, blockDim.z.
KILN_DEVICE unsigned blockX();
KILN_DEVICE unsigned blockY();
KILN_DEVICE unsigned blockZ();
// threadIdx in a dim, 0 where the block's extent there is 1 (known at compile time with a
// fixed block). This and every other function that reads blockX/Y/Z is a template, so a
// source that never calls them need not define the extents.
template <int = 0>
KILN_DEVICE unsigned tidX() { return blockX() == 1u ? 0u : threadIdx.x; }
template <int = 0>
KILN_DEVICE unsigned tidY() { return blockY() == 1u ? 0u : threadIdx.y; }
template <int = 0>
KILN_DEVICE unsigned tidZ() { return blockZ() == 1u ? 0u : threadIdx.z; }

template <bool X, bool Y, bool Z>
KILN_DEVICE unsigned threadCount() {
  return (X ? blockX() : 1u) * (Y ? blockY() : 1u) * (Z ? blockZ() : 1u);
}
template <bool X, bool Y, bool Z>
KILN_DEVICE unsigned threadIndex() {
  unsigned idx = 0, stride = 1;
  if (X) {
    idx += tidX();
    stride *= blockX();
  }
  if (Y) {
    idx += tidY() * stride;
    stride *= blockY();
  }
  if (Z) idx += tidZ() * stride;
  return idx;
}
template <bool X, bool Y, bool Z>
KILN_DEVICE int64_t blockCount() {
  return (X ? (int64_t)gridDim.x : 1LL) * (Y ? (int64_t)gridDim.y : 1LL) * (Z ? (int64_t)gridDim.z : 1LL);
}
template <bool X, bool Y, bool Z>
KILN_DEVICE int64_t blockIndex() {
  int64_t idx = 0, stride = 1;
  if (X) {
    idx += blockIdx.x;
    stride *= gridDim.x;
  }
  if (Y) {
    idx += (int64_t)blockIdx.y * stride;
    stride *= gridDim.y;
  }
  if (Z) idx += (int64_t)blockIdx.z * stride;
  return idx;
}
template <int = 0>
KILN_DEVICE bool isFirstThread() { return tidX() == 0 && tidY() == 0 && tidZ() == 0; }

// ---------------------------------------------------------------------------------------
// Warp shuffles for any T of at most 8 bytes.

template <typename T>
KILN_DEVICE T shflDown(T v, unsigned offset, int width = 32, unsigned lanes = 0xffffffffu) {
  static_assert(sizeof(T) <= 8, "kiln::shflDown: T must be at most 8 bytes");
  if constexpr (sizeof(T) == 8) {
    unsigned long long u = bitCast<unsigned long long>(v);
    u = __shfl_down_sync(lanes, u, offset, width);
    return bitCast<T>(u);
  } else if constexpr (sizeof(T) == 4) {
    unsigned int u = bitCast<unsigned int>(v);
    u = __shfl_down_sync(lanes, u, offset, width);
    return bitCast<T>(u);
  } else {
    unsigned int u = 0;
    memcpy(&u, &v, sizeof(T));
    u = __shfl_down_sync(lanes, u, offset, width);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
  }
}

template <typename T>
KILN_DEVICE T shflXor(T v, unsigned mask) {
  static_assert(sizeof(T) <= 8, "kiln::shflXor: T must be at most 8 bytes");
  if constexpr (sizeof(T) == 8) {
    unsigned long long u = bitCast<unsigned long long>(v);
    u = __shfl_xor_sync(0xffffffffu, u, mask);
    return bitCast<T>(u);
  } else if constexpr (sizeof(T) == 4) {
    unsigned int u = bitCast<unsigned int>(v);
    u = __shfl_xor_sync(0xffffffffu, u, mask);
    return bitCast<T>(u);
  } else {
    unsigned int u = 0;
    memcpy(&u, &v, sizeof(T));
    u = __shfl_xor_sync(0xffffffffu, u, mask);
    T r;
    memcpy(&r, &u, sizeof(T));
    return r;
  }
}

// Reduce over the whole warp with the result in every lane (butterfly). All 32 lanes
// must call it.
template <typename T, typename Op>
KILN_DEVICE T warpAllReduce(T val, Op op) {
  for (unsigned mask = 16; mask > 0; mask /= 2) {
    val = op(val, shflXor(val, mask));
  }
  return val;
}

// Reduce over aligned groups of WIDTH lanes (WIDTH a power of two <= 32); the result is
// valid in the first lane of each group. All 32 lanes of the warp must call it.
template <typename T, typename Op>
KILN_DEVICE T warpReduce(T val, Op op, int width = 32) {
  for (int offset = width / 2; offset > 0; offset /= 2) {
    val = op(val, shflDown(val, offset, width));
  }
  return val;
}

// Reduce over lanes [0, lanes) of the warp (1 <= lanes <= 32; `lane` is this thread's);
// the result is valid in lane 0. Only those lanes call it: the last, partial warp of a
// block whose size is not a multiple of 32.
template <typename T, typename Op>
KILN_DEVICE T warpReduceLanes(T val, Op op, unsigned lanes, unsigned lane) {
  if (lanes == 32) return warpReduce(val, op);
  const unsigned mask = (1u << lanes) - 1u;
  for (unsigned offset = 16; offset > 0; offset /= 2) {
    const T other = shflDown(val, offset, 32, mask);
    if (lane + offset < lanes) val = op(val, other);
  }
  return val;
}

// True when the reduced thread dims are contiguous in the linear thread id (each segment
// is a run of consecutive threads): no kept dim lies below a reduced one, or it has size 1.
template <bool X_REDUCE, bool Y_REDUCE, bool Z_REDUCE>
KILN_DEVICE bool reducedContiguous() {
  bool contiguous = true;
  if (!X_REDUCE && (Y_REDUCE || Z_REDUCE)) contiguous = contiguous && blockX() == 1u;
  if (!Y_REDUCE && Z_REDUCE) contiguous = contiguous && blockY() == 1u;
  return contiguous;
}

// ---------------------------------------------------------------------------------------
// Block reduction over the thread dims selected by X_REDUCE/Y_REDUCE/Z_REDUCE.
//
// Returns the reduction of `val` over each segment; the result is valid in the threads
// whose reduced index is 0 (threadIdx.<d> == 0 for every reduced d), unspecified
// elsewhere. `smem`: blockDim.x*blockDim.y*blockDim.z elements of T. `init` is the
// identity of `op`. Ends with __syncthreads() (unless it used no shared memory).
//
// Paths (chosen per block at run time, block-uniformly):
//   * reduced threads contiguous in the linear thread id (e.g. reducing over x, or x and
//     y, or over y with blockDim.x == 1) and R = #reduced threads:
//       - R a multiple of 32: warp shuffles, one smem slot per warp, warp shuffles again.
//       - R a power of two <= 32 and the block a whole number of warps: shuffles only.
//       - R the whole block, of any size: shuffles over each warp (the last one partial),
//         one smem slot per warp, shuffles again.
//   * otherwise: shared-memory tree (first folds the part above the largest power of two).
template <bool X_REDUCE, bool Y_REDUCE, bool Z_REDUCE, typename T, typename Op>
__device__ T blockReduce(T val, Op op, T init, T* smem) {
  if constexpr (!X_REDUCE && !Y_REDUCE && !Z_REDUCE) {
    return val;
  } else {
    const unsigned R = threadCount<X_REDUCE, Y_REDUCE, Z_REDUCE>();
    const unsigned r = threadIndex<X_REDUCE, Y_REDUCE, Z_REDUCE>();
    const unsigned s = threadIndex<!X_REDUCE, !Y_REDUCE, !Z_REDUCE>();
    const unsigned nthreads = blockX() * blockY() * blockZ();
    if (R == 1) return val;
    const bool contiguous = reducedContiguous<X_REDUCE, Y_REDUCE, Z_REDUCE>();

    if (contiguous && R % 32 == 0) {
      // linear tid == s * R + r, segments start on warp boundaries.
      const unsigned tid = s * R + r;
      const unsigned W = R / 32;  // warps per segment, <= 32
      val = warpReduce(val, op);
      if (W == 1) return val;
      if ((tid & 31) == 0) smem[tid / 32] = val;
      __syncthreads();
      if (r < 32) {  // the first warp of each segment
        val = (r < W) ? smem[s * W + r] : init;
        val = warpReduce(val, op);
      }
      __syncthreads();
      return val;
    }
    if (contiguous && R < 32 && (R & (R - 1)) == 0 && nthreads % 32 == 0) {
      return warpReduce(val, op, (int)R);
    }
    if (contiguous && R == nthreads) {
      // One segment of any size (a row of 293 threads): shuffles within each warp, the
      // last one partial, then over the warps' partials. Two barriers, where the tree
      // below takes one per halving.
      const unsigned lane = r & 31, warp = r / 32, W = (R + 31) / 32;
      val = warpReduceLanes(val, op, R - warp * 32 < 32 ? R - warp * 32 : 32u, lane);
      if (W == 1) return val;
      if (lane == 0) smem[warp] = val;
      __syncthreads();
      if (warp == 0) {  // a whole warp: R > 32 here
        val = (lane < W) ? smem[lane] : init;
        val = warpReduce(val, op);
      }
      __syncthreads();
      return val;
    }

    // Generic shared-memory tree. Where threadIdx.x is not reduced, consecutive lanes of a
    // warp are consecutive segments: the reduced index is the major one in Shared memory
    // (r * S + s), so a warp's accesses are consecutive words instead of words R apart
    // (R-way bank conflicts: timm's LayerNorm2d, a double reduction over 16 thread rows of
    // 32 columns, took 86 us on an H100 where this layout takes 43).
    const unsigned S = nthreads / R;
    const unsigned off = X_REDUCE ? s * R + r : r * S + s;
    const unsigned step = X_REDUCE ? 1u : S;
    smem[off] = val;
    __syncthreads();
    unsigned np2 = 1u << (31 - __clz(R));  // largest power of two <= R
    if (np2 != R) {
      if (r + np2 < R) smem[off] = op(smem[off], smem[off + np2 * step]);
      __syncthreads();
    }
    for (unsigned factor = np2 / 2; factor > 0; factor /= 2) {
      if (r < factor) smem[off] = op(smem[off], smem[off + factor * step]);
      __syncthreads();
    }
    T result = smem[off];
    __syncthreads();
    return result;
  }
}

// Reduce over threadIdx.x only (each (y, z) row reduces separately); valid where
// threadIdx.x == 0.
template <typename T, typename Op>
__device__ T blockReduce(T val, Op op, T init, T* smem) {
  return blockReduce<true, false, false>(val, op, init, smem);
}

// Like blockReduce, but the result is valid in every thread of the segment.
// `smem`: blockDim.x*blockDim.y*blockDim.z elements of T.
template <bool X_REDUCE, bool Y_REDUCE, bool Z_REDUCE, typename T, typename Op>
__device__ T blockAllReduce(T val, Op op, T init, T* smem) {
  if constexpr (!X_REDUCE && !Y_REDUCE && !Z_REDUCE) {
    return val;
  } else {
    const unsigned R = threadCount<X_REDUCE, Y_REDUCE, Z_REDUCE>();
    const bool contiguous = reducedContiguous<X_REDUCE, Y_REDUCE, Z_REDUCE>();
    if (contiguous && R % 32 == 0) {
      // Segments are whole warps: every warp reduces the per-warp partials itself, so the
      // result reaches all threads after one barrier (plus the closing one) instead of four.
      const unsigned r = threadIndex<X_REDUCE, Y_REDUCE, Z_REDUCE>();
      const unsigned s = threadIndex<!X_REDUCE, !Y_REDUCE, !Z_REDUCE>();
      const unsigned W = R / 32;  // warps per segment, <= 32
      val = warpAllReduce(val, op);
      if (W == 1) return val;
      if ((r & 31) == 0) smem[s * W + r / 32] = val;
      __syncthreads();
      T x = ((r & 31) < W) ? smem[s * W + (r & 31)] : init;
      x = warpAllReduce(x, op);
      __syncthreads();
      return x;
    }
    T result = blockReduce<X_REDUCE, Y_REDUCE, Z_REDUCE>(val, op, init, smem);
    const unsigned s = threadIndex<!X_REDUCE, !Y_REDUCE, !Z_REDUCE>();
    if (threadIndex<X_REDUCE, Y_REDUCE, Z_REDUCE>() == 0) smem[s] = result;
    __syncthreads();
    result = smem[s];
    __syncthreads();
    return result;
  }
}

// Two block reductions over the same threads at once, results in every thread of the
// segment (`a` and `b` in, their reductions out). Where segments are whole warps, both go
// through one barrier pair, the shuffles of the two interleaved; otherwise one after the
// other. `smem`: blockDim.x*blockDim.y*blockDim.z elements of T (the warp partials of `b`
// sit after those of `a`).
template <bool X_REDUCE, bool Y_REDUCE, bool Z_REDUCE, typename T, typename Op1, typename Op2>
__device__ void blockAllReduce2(T& a, Op1 op1, T init1, T& b, Op2 op2, T init2, T* smem) {
  const unsigned R = threadCount<X_REDUCE, Y_REDUCE, Z_REDUCE>();
  const bool contiguous = reducedContiguous<X_REDUCE, Y_REDUCE, Z_REDUCE>();
  if (contiguous && R % 32 == 0) {
    const unsigned r = threadIndex<X_REDUCE, Y_REDUCE, Z_REDUCE>();
    const unsigned s = threadIndex<!X_REDUCE, !Y_REDUCE, !Z_REDUCE>();
    const unsigned W = R / 32;
    const unsigned second = (blockX() * blockY() * blockZ()) / 32;
    a = warpAllReduce(a, op1);
    b = warpAllReduce(b, op2);
    if (W == 1) return;
    if ((r & 31) == 0) {
      smem[s * W + r / 32] = a;
      smem[second + s * W + r / 32] = b;
    }
    __syncthreads();
    const bool mine = (r & 31) < W;
    T x = mine ? smem[s * W + (r & 31)] : init1;
    T y = mine ? smem[second + s * W + (r & 31)] : init2;
    a = warpAllReduce(x, op1);
    b = warpAllReduce(y, op2);
    __syncthreads();
    return;
  }
  a = blockAllReduce<X_REDUCE, Y_REDUCE, Z_REDUCE>(a, op1, init1, smem);
  b = blockAllReduce<X_REDUCE, Y_REDUCE, Z_REDUCE>(b, op2, init2, smem);
}

// ---------------------------------------------------------------------------------------
// Grid reductions.
//
// Template parameters: X_BLOCK/Y_BLOCK/Z_BLOCK select the reduced grid dims,
// X_THREAD/Y_THREAD/Z_THREAD the reduced thread dims (reduced first, in the block, with
// blockReduce). Names used below:
//   G   = number of reducing blocks    = blockCount<X_BLOCK, Y_BLOCK, Z_BLOCK>()
//   b   = a block's index among them   = blockIndex<X_BLOCK, Y_BLOCK, Z_BLOCK>()
//   seg = its output segment           = blockIndex<!X_BLOCK, !Y_BLOCK, !Z_BLOCK>()
//   NSEG = number of output segments   = blockCount<!X_BLOCK, !Y_BLOCK, !Z_BLOCK>()
//   P   = outputs per block            = threadCount<!X_THREAD, !Y_THREAD, !Z_THREAD>()
//   p   = a thread's output slot       = threadIndex<!X_THREAD, !Y_THREAD, !Z_THREAD>()
// Every thread of every block must call it (block-uniformly); pass `init` where a thread
// has no input. The result goes to `out` only in the thread that holds it and only if
// `write_pred`; the function returns true in exactly the threads that hold a result (one
// thread per (seg, p): the reduced-thread-index-0 threads of one block per segment).
// `smem`: blockDim.x*blockDim.y*blockDim.z elements of T. T must be 1, 2, 4 or 8 bytes.
// Work buffers are addressed with int64 offsets. If G == 1 nothing global is touched.
//
// gridReduce — the normal (parallel) protocol:
//   work_buf : NSEG * G * P elements of T  (P outputs per block x G reducing blocks per
//              segment); no initialisation needed.
//   sync_flags: NSEG int64 semaphores, ZERO-INITIALISED before the first launch.
//   Each block writes its partials to work_buf[(seg*G + b)*P + p], __threadfence(), and
//   then one thread does atomicAdd(&sync_flags[seg], 1). The block that sees G-1 is the
//   last to arrive: it stores 0 back into sync_flags[seg] (nobody else touches it again
//   in this launch) and combines the G partials with volatile loads. So the semaphores
//   END AT ZERO after every launch: the buffer is zero_init + resets_to_zero.
//
// gridReduceSerial — the serial protocol (deterministic order b = 0, 1, ..., G-1):
//   work_buf : NSEG * P elements of T (the running result); no initialisation needed
//              (block 0 writes before anyone reads).
//   sync_flags: NSEG int64 semaphores, ZERO-INITIALISED before the first launch.
//   Block b waits until sync_flags[seg] == b, reads the running result (b > 0), combines
//   acc = op(running, own partial), writes it back (b < G-1) or to `out` (b == G-1),
//   __threadfence(), and then sets sync_flags[seg] = b + 1 — except the last block, which
//   sets it to 0. So the semaphores END AT ZERO after every launch: zero_init +
//   resets_to_zero. Blocks spin, so a block may only wait on blocks with a smaller linear
//   blockIdx (true here: b-1 differs only in reduced coordinates, which are smaller); the
//   hardware dispatches blocks in linear order, so this cannot deadlock in practice.
template <bool X_BLOCK, bool Y_BLOCK, bool Z_BLOCK, bool X_THREAD, bool Y_THREAD, bool Z_THREAD,
          typename T, typename Op>
__device__ bool gridReduce(T& out, T in, Op op, T init, volatile T* work_buf, int64_t* sync_flags,
                           T* smem, bool write_pred) {
  __shared__ bool kiln_last_block;
  const T partial = blockReduce<X_THREAD, Y_THREAD, Z_THREAD>(in, op, init, smem);
  const bool holder = threadIndex<X_THREAD, Y_THREAD, Z_THREAD>() == 0;
  const int64_t G = blockCount<X_BLOCK, Y_BLOCK, Z_BLOCK>();
  if (G == 1) {
    if (holder && write_pred) out = partial;
    return holder;
  }
  const int64_t b = blockIndex<X_BLOCK, Y_BLOCK, Z_BLOCK>();
  const int64_t seg = blockIndex<!X_BLOCK, !Y_BLOCK, !Z_BLOCK>();
  const int64_t P = threadCount<!X_THREAD, !Y_THREAD, !Z_THREAD>();
  const int64_t p = threadIndex<!X_THREAD, !Y_THREAD, !Z_THREAD>();
  volatile T* seg_buf = work_buf + seg * G * P;

  // Only the threads that store a partial fence: a fence waits for every earlier write of
  // its thread (a whole row of outputs, in a row kernel) to drain. The barrier then orders
  // those fences before the signalling atomic.
  if (holder) {
    storeVolatile(seg_buf + b * P + p, partial);
    __threadfence();  // make the partial visible device-wide before signalling
  }
  __syncthreads();
  if (isFirstThread()) {
    const unsigned long long old =
        atomicAdd(reinterpret_cast<unsigned long long*>(sync_flags + seg), 1ULL);
    const bool last = old == (unsigned long long)(G - 1);
    if (last) {
      *reinterpret_cast<volatile int64_t*>(sync_flags + seg) = 0;  // reset for the next launch
      __threadfence();  // acquire: order the partial reads below after the atomic
    }
    kiln_last_block = last;
  }
  __syncthreads();
  if (!kiln_last_block) return false;  // block-uniform

  const unsigned R = threadCount<X_THREAD, Y_THREAD, Z_THREAD>();
  const unsigned r = threadIndex<X_THREAD, Y_THREAD, Z_THREAD>();
  T acc = init;
  for (int64_t i = r; i < G; i += R) acc = op(acc, loadVolatile(seg_buf + i * P + p));
  const T result = blockReduce<X_THREAD, Y_THREAD, Z_THREAD>(acc, op, init, smem);
  if (holder && write_pred) out = result;
  return holder;
}

template <bool X_BLOCK, bool Y_BLOCK, bool Z_BLOCK, bool X_THREAD, bool Y_THREAD, bool Z_THREAD,
          typename T, typename Op>
__device__ bool gridReduceSerial(T& out, T in, Op op, T init, volatile T* work_buf, int64_t* sync_flags,
                                 T* smem, bool write_pred) {
  const T partial = blockReduce<X_THREAD, Y_THREAD, Z_THREAD>(in, op, init, smem);
  const bool holder = threadIndex<X_THREAD, Y_THREAD, Z_THREAD>() == 0;
  const int64_t G = blockCount<X_BLOCK, Y_BLOCK, Z_BLOCK>();
  if (G == 1) {
    if (holder && write_pred) out = partial;
    return holder;
  }
  const int64_t b = blockIndex<X_BLOCK, Y_BLOCK, Z_BLOCK>();
  const int64_t seg = blockIndex<!X_BLOCK, !Y_BLOCK, !Z_BLOCK>();
  const int64_t P = threadCount<!X_THREAD, !Y_THREAD, !Z_THREAD>();
  const int64_t p = threadIndex<!X_THREAD, !Y_THREAD, !Z_THREAD>();
  volatile int64_t* flag = reinterpret_cast<volatile int64_t*>(sync_flags + seg);
  volatile T* slot = work_buf + seg * P + p;
  const bool last = b == G - 1;

  if (isFirstThread()) {
    while (*flag != b) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
      __nanosleep(64);
#endif
    }
    __threadfence();  // acquire: the predecessor's writes are visible after this
  }
  __syncthreads();
  bool result_here = false;
  if (holder) {
    const T acc = (b == 0) ? partial : op(loadVolatile(slot), partial);
    if (!last) {
      storeVolatile(slot, acc);
    } else {
      if (write_pred) out = acc;
      result_here = true;
    }
    __threadfence();  // release the running result before handing over the turn
  }
  __syncthreads();
  if (isFirstThread()) *flag = last ? 0 : b + 1;
  return result_here;
}

// ---------------------------------------------------------------------------------------
// mbarriers and bulk (TMA) copies: Hopper's asynchronous transaction barriers. The copy
// engine writes a bulk copy's bytes to Shared memory and counts them off the barrier's
// expected transaction bytes; a phase completes when its arrivals and its bytes are in.
// `mbarrierWait(bar, parity)` returns once the phase of that parity has completed. The
// lowering (rust/src/lower/circular_buffer.rs) places every call.
KILN_DEVICE unsigned smemAddress(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

// Asynchronous copies from Global to Shared memory (cp.async, sm_80+): each thread's copies
// land in the background in groups; `cpAsyncWait<N>()` returns once at most N of the
// thread's groups are in flight. An element of another size than 4, 8 or 16 bytes is
// stored at once. Before sm_80 every copy is a plain store and the waits do nothing.
template <typename T>
KILN_DEVICE void cpAsyncElem(T* dst, const T* src) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  if constexpr (sizeof(T) == 4 || sizeof(T) == 8 || sizeof(T) == 16) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smemAddress(dst)), "l"(src), "n"(sizeof(T))
                 : "memory");
  } else {
    *dst = *src;
  }
#else
  *dst = *src;
#endif
}
template <int Bytes, typename T>
KILN_DEVICE void cpAsyncBytes(T* dst, const T* src) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smemAddress(dst)), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(smemAddress(dst)), "l"(src), "n"(Bytes)
                 : "memory");
  }
#else
  for (int i = 0; i < Bytes / static_cast<int>(sizeof(T)); ++i) dst[i] = src[i];
#endif
}
KILN_DEVICE void cpAsyncCommit() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
KILN_DEVICE void cpAsyncWait() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
KILN_DEVICE void mbarrierInit(uint64_t* bar, unsigned arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smemAddress(bar)), "r"(arrivals) : "memory");
}
KILN_DEVICE void mbarrierInval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smemAddress(bar)) : "memory");
}
KILN_DEVICE void mbarrierArrive(uint64_t* bar) {
  asm volatile("{\n .reg .b64 kiln_state;\n mbarrier.arrive.shared::cta.b64 kiln_state, [%0];\n}" ::"r"(
                   smemAddress(bar))
               : "memory");
}
KILN_DEVICE void mbarrierArriveExpectTx(uint64_t* bar, unsigned bytes) {
  asm volatile(
      "{\n .reg .b64 kiln_state;\n mbarrier.arrive.expect_tx.shared::cta.b64 kiln_state, [%0], %1;\n}" ::"r"(
          smemAddress(bar)),
      "r"(bytes)
      : "memory");
}
KILN_DEVICE void mbarrierWait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred kiln_done;\n KILN_WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 kiln_done, [%0], %1;\n"
      " @!kiln_done bra KILN_WAIT_%=;\n}" ::"r"(smemAddress(bar)),
      "r"(parity)
      : "memory");
}
// Copy `elems` elements from Global `src` to Shared `dst`, completing on `bar` (one thread
// calls it). A copy of 16-byte aligned addresses and a multiple of 16 bytes is one bulk
// copy; any other (a row of odd length, an unaligned view) is this thread's element loop,
// then a plain arrival, whose release makes the elements visible to the barrier's waiters.
template <typename T>
KILN_DEVICE void bulkLoad(T* dst, const T* src, unsigned elems, uint64_t* bar) {
  const unsigned bytes = elems * static_cast<unsigned>(sizeof(T));
  const bool aligned = smemAddress(dst) % 16 == 0 && reinterpret_cast<size_t>(src) % 16 == 0 && bytes % 16 == 0;
  if (aligned && bytes > 0) {
    mbarrierArriveExpectTx(bar, bytes);
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
            smemAddress(dst)),
        "l"(src), "r"(bytes), "r"(smemAddress(bar))
        : "memory");
  } else {
    for (unsigned i = 0; i < elems; ++i) dst[i] = src[i];
    mbarrierArrive(bar);
  }
}
#else
// Before sm_90 there is no bulk copy: a kernel that uses one fails to compile here.
template <typename T>
KILN_DEVICE void bulkLoad(T*, const T*, unsigned, uint64_t*) {
  static_assert(sizeof(T) == 0, "kiln: ParallelType.Bulk copies (TMA) need an sm_90 or newer GPU");
}
template <typename B>
KILN_DEVICE void mbarrierInit(B*, unsigned) {}
template <typename B>
KILN_DEVICE void mbarrierInval(B*) {}
template <typename B>
KILN_DEVICE void mbarrierArrive(B*) {}
template <typename B>
KILN_DEVICE void mbarrierWait(B*, unsigned) {}
#endif

// ---------------------------------------------------------------------------------------
// Tensor memory (Blackwell, sm_100a/sm_101a/sm_103a; tcgen05). A CTA allocates a region of
// 32-bit columns (a power of two from 32 to 512) across its 128 lanes; tcgen05.alloc writes
// the region's address (lane in bits 31:16, column in 15:0) to Shared memory. Alloc,
// relinquish and dealloc are warp-wide (.sync.aligned): the whole first warp runs them.
// A kernel keeps a tensor in Tensor memory as thread-private cells: thread t of a block of
// at most 128 threads owns lane t, so warp w reads and writes lanes 32*w.. (the 32x32b
// shape gives each thread of a warp its own lane). Every ld/st is warp-wide too, and each is
// waited for at once (the value is in a register, or the store done, when it returns).
// Elsewhere each call is a static assertion naming what is needed.
#if defined(__CUDA_ARCH_FEAT_SM100_ALL) || defined(__CUDA_ARCH_FEAT_SM101_ALL) || defined(__CUDA_ARCH_FEAT_SM103_ALL)
#define KILN_HAS_TMEM 1
#endif
template <int = 0>
KILN_DEVICE bool isFirstWarp() { return (tidX() + blockX() * (tidY() + blockY() * tidZ())) / 32 == 0; }
template <int COLS>
KILN_DEVICE void tmemAlloc(uint32_t* slot) {
  static_assert(COLS >= 32 && COLS <= 512 && (COLS & (COLS - 1)) == 0, "tcgen05.alloc takes 32..512 columns, a power of two");
#ifdef KILN_HAS_TMEM
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;" ::"r"(smemAddress(slot)), "n"(COLS)
               : "memory");
#else
  static_assert(COLS == 0, "kiln: MemoryType.Tensor (tcgen05) needs an sm_100a GPU; compile for sm_100a");
#endif
}
template <int N = 0>
KILN_DEVICE void tmemRelinquish() {
#ifdef KILN_HAS_TMEM
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;" ::: "memory");
#else
  static_assert(N != 0, "kiln: MemoryType.Tensor (tcgen05) needs an sm_100a GPU; compile for sm_100a");
#endif
}
template <int COLS>
KILN_DEVICE void tmemDealloc(uint32_t addr) {
#ifdef KILN_HAS_TMEM
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;" ::"r"(addr), "n"(COLS) : "memory");
#else
  static_assert(COLS == 0, "kiln: MemoryType.Tensor (tcgen05) needs an sm_100a GPU; compile for sm_100a");
#endif
}
// The address of this thread's warp's lanes of a tensor at `lane_offset`/`column_offset` in
// the region whose base address is `base`.
template <int = 0>
KILN_DEVICE uint32_t tmemAddress(uint32_t base, uint32_t lane_offset, uint32_t column_offset) {
  const uint32_t warp = (tidX() + blockX() * (tidY() + blockY() * tidZ())) / 32;
  return base + ((lane_offset + 32u * (warp % 4u)) << 16) + column_offset;
}
template <typename T>
struct TmemRef {
  uint32_t addr;
  static_assert(sizeof(T) == 4, "Tensor memory holds 32-bit cells");
  KILN_DEVICE T load() const {
#ifdef KILN_HAS_TMEM
    uint32_t u;
    asm volatile("tcgen05.ld.sync.aligned.32x32b.x1.b32 {%0}, [%1];" : "=r"(u) : "r"(addr) : "memory");
    asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory");
    T v;
    memcpy(&v, &u, 4);
    return v;
#else
    static_assert(sizeof(T) == 0, "kiln: MemoryType.Tensor (tcgen05) needs an sm_100a GPU; compile for sm_100a");
    return T();
#endif
  }
  KILN_DEVICE operator T() const { return load(); }
  KILN_DEVICE const TmemRef& operator=(T v) const {
#ifdef KILN_HAS_TMEM
    uint32_t u;
    memcpy(&u, &v, 4);
    asm volatile("tcgen05.st.sync.aligned.32x32b.x1.b32 [%0], {%1};" ::"r"(addr), "r"(u) : "memory");
    asm volatile("tcgen05.wait::st.sync.aligned;" ::: "memory");
#else
    static_assert(sizeof(T) == 0, "kiln: MemoryType.Tensor (tcgen05) needs an sm_100a GPU; compile for sm_100a");
#endif
    return *this;
  }
};
// A Tensor-memory tensor indexed like a Local array: element i is column i of the lane.
template <typename T>
struct TmemTensor {
  uint32_t base;
  template <typename I>
  KILN_DEVICE TmemRef<T> operator[](I i) const {
    return TmemRef<T>{base + static_cast<uint32_t>(i)};
  }
};
template <typename To, typename T>
KILN_DEVICE To cast(TmemRef<T> x) {
  return cast<To>(x.load());
}

// ---------------------------------------------------------------------------------------
// Cluster reductions (sm_90+). A kernel launched in clusters along one block dimension
// (`__cluster_dims__`, the grid along it exactly one cluster) reduces over that dimension
// through distributed Shared memory: each block reduces its threads, writes its partial
// to its own workspace, and after a cluster barrier every thread reads the partials of
// all blocks in rank order (so every block computes the same bits). A second barrier
// keeps each block's workspace, and the block itself, alive until its peers have read it
// (its wait deferred with `pending`, below).
// `smem` is the block-reduction workspace (blockDim.x*blockDim.y*blockDim.z elements of T).

// The two halves of a cluster barrier: arrive, then (later) wait for every block to arrive.
template <int = 0>
KILN_DEVICE void clusterArrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
template <int = 0>
KILN_DEVICE void clusterWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
template <int = 0>
KILN_DEVICE void clusterSync() {
  clusterArrive();
  clusterWait();
}
// Completes the cluster barrier a reduction arrived at (`pending`): before this block's
// reduction workspace is written again, and before the block exits, every peer has read
// the partial it holds.
template <int = 0>
KILN_DEVICE void clusterSettle(bool& pending) {
  if (pending) {
    clusterWait();
    pending = false;
  }
}

// `*p` in the Shared memory of the cluster's block `rank` (p: an address of this block's).
template <typename T>
KILN_DEVICE T loadFromClusterBlock(const T* p, unsigned rank) {
  static_assert(sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8,
                "kiln::loadFromClusterBlock: T must be 1, 2, 4 or 8 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smemAddress(p)), "r"(rank));
  if constexpr (sizeof(T) == 8) {
    unsigned long long u;
    asm volatile("ld.shared::cluster.u64 %0, [%1];" : "=l"(u) : "r"(remote) : "memory");
    return bitCast<T>(u);
  } else if constexpr (sizeof(T) == 4) {
    unsigned u;
    asm volatile("ld.shared::cluster.u32 %0, [%1];" : "=r"(u) : "r"(remote) : "memory");
    return bitCast<T>(u);
  } else if constexpr (sizeof(T) == 2) {
    unsigned short u;
    asm volatile("ld.shared::cluster.u16 %0, [%1];" : "=h"(u) : "r"(remote) : "memory");
    return bitCast<T>(u);
  } else {
    unsigned u;
    asm volatile("ld.shared::cluster.u8 %0, [%1];" : "=r"(u) : "r"(remote) : "memory");
    return bitCast<T>(static_cast<unsigned char>(u));
  }
#else
  static_assert(sizeof(T) == 0, "kiln: cluster reductions need sm_90 or newer");
  return *p;
#endif
}

template <int = 0>
KILN_DEVICE unsigned clusterBlocks() {
  unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return n;
}

// The reduction of `val` over the threads X/Y/Z select and over every block of the
// cluster; the result is in every thread. Every thread of every block must call it. With
// `BLOCKS` (the cluster's size, 0: read at run time) known, the peers' partials are loaded
// together before they are combined, not one load's latency after another.
//
// With `pending` (kernels that end with `clusterSettle(pending)` and settle it before every
// other use of the workspace), the second barrier is only arrived at here: its wait comes
// at the next settle, so a block goes on with its row while slower peers read its partial.
template <bool X_REDUCE, bool Y_REDUCE, bool Z_REDUCE, unsigned BLOCKS = 0, typename T, typename Op>
__device__ T clusterAllReduce(T val, Op op, T init, T* smem, bool& pending) {
  clusterSettle(pending);
  const T part = blockAllReduce<X_REDUCE, Y_REDUCE, Z_REDUCE>(val, op, init, smem);
  const unsigned s = threadIndex<!X_REDUCE, !Y_REDUCE, !Z_REDUCE>();
  if (threadIndex<X_REDUCE, Y_REDUCE, Z_REDUCE>() == 0) smem[s] = part;
  clusterSync();
  T r;
  if constexpr (BLOCKS > 0) {
    T parts[BLOCKS];
#pragma unroll
    for (unsigned b = 0; b < BLOCKS; ++b) parts[b] = loadFromClusterBlock(&smem[s], b);
    r = parts[0];
#pragma unroll
    for (unsigned b = 1; b < BLOCKS; ++b) r = op(r, parts[b]);
  } else {
    const unsigned n = clusterBlocks();
    r = loadFromClusterBlock(&smem[s], 0);
    for (unsigned b = 1; b < n; ++b) r = op(r, loadFromClusterBlock(&smem[s], b));
  }
  clusterArrive();
  pending = true;
  return r;
}

template <bool X_REDUCE, bool Y_REDUCE, bool Z_REDUCE, unsigned BLOCKS = 0, typename T, typename Op>
__device__ T clusterAllReduce(T val, Op op, T init, T* smem) {
  bool pending = false;
  const T r = clusterAllReduce<X_REDUCE, Y_REDUCE, Z_REDUCE, BLOCKS>(val, op, init, smem, pending);
  clusterSettle(pending);
  return r;
}

}  // namespace kiln

// Defines kiln::blockX/Y/Z (see their declaration): constants, or blockDim's fields.
#define KILN_BLOCK_SHAPE(X, Y, Z)                                             \
  namespace kiln {                                                            \
  __device__ __forceinline__ unsigned blockX() { return (unsigned)(X); } \
  __device__ __forceinline__ unsigned blockY() { return (unsigned)(Y); } \
  __device__ __forceinline__ unsigned blockZ() { return (unsigned)(Z); } \
  }

#undef KILN_DEVICE
#endif  // KILN_RUNTIME_CUH
