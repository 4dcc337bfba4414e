// kiln::cast<To>(From) for all 49 pairs of {bool, int32, int64, half, bf16, float, double}.
// cast_from_<src>(in, o_bool, o_i32, o_i64, o_f16, o_bf16, o_f32, o_f64, n).

// The block's extents as launched (runtime.cuh, KILN_BLOCK_SHAPE).
KILN_BLOCK_SHAPE(blockDim.x, blockDim.y, blockDim.z)

template <typename From>
__device__ void castAll(const From* in, bool* ob, int* oi, int64_t* ol, __half* oh, __nv_bfloat16* obf,
                        float* of, double* od, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const From x = in[i];
  ob[i] = kiln::cast<bool>(x);
  oi[i] = kiln::cast<int>(x);
  ol[i] = kiln::cast<int64_t>(x);
  oh[i] = kiln::cast<__half>(x);
  obf[i] = kiln::cast<__nv_bfloat16>(x);
  of[i] = kiln::cast<float>(x);
  od[i] = kiln::cast<double>(x);
}

#define KILN_CAST_KERNEL(NAME, TYPE)                                                              \
  extern "C" __global__ void cast_from_##NAME(const TYPE* in, bool* ob, int* oi, int64_t* ol,    \
                                              __half* oh, __nv_bfloat16* obf, float* of,          \
                                              double* od, int64_t n) {                            \
    castAll<TYPE>(in, ob, oi, ol, oh, obf, of, od, n);                                            \
  }
KILN_CAST_KERNEL(bool, bool)
KILN_CAST_KERNEL(i32, int)
KILN_CAST_KERNEL(i64, int64_t)
KILN_CAST_KERNEL(f16, __half)
KILN_CAST_KERNEL(bf16, __nv_bfloat16)
KILN_CAST_KERNEL(f32, float)
KILN_CAST_KERNEL(f64, double)

// Numeric limits and identities of the reduction functors, per dtype.
extern "C" __global__ void identities(float* of, double* od, __half* oh, __nv_bfloat16* obf, int* oi,
                                      int64_t* ol, bool* ob) {
  of[0] = kiln::Sum::identity<float>();
  of[1] = kiln::Max::identity<float>();
  of[2] = kiln::Min::identity<float>();
  od[0] = kiln::Sum::identity<double>();
  od[1] = kiln::Max::identity<double>();
  od[2] = kiln::Min::identity<double>();
  oh[0] = kiln::Sum::identity<__half>();
  oh[1] = kiln::Max::identity<__half>();
  oh[2] = kiln::Min::identity<__half>();
  obf[0] = kiln::Sum::identity<__nv_bfloat16>();
  obf[1] = kiln::Max::identity<__nv_bfloat16>();
  obf[2] = kiln::Min::identity<__nv_bfloat16>();
  oi[0] = kiln::Sum::identity<int>();
  oi[1] = kiln::Max::identity<int>();
  oi[2] = kiln::Min::identity<int>();
  ol[0] = kiln::Sum::identity<int64_t>();
  ol[1] = kiln::Max::identity<int64_t>();
  ol[2] = kiln::Min::identity<int64_t>();
  ob[0] = kiln::Max::identity<bool>();
  ob[1] = kiln::Min::identity<bool>();
  of[3] = kiln::to_float(kiln::from_float<__half>(1.5f)) + kiln::to_float(kiln::from_float<__nv_bfloat16>(2.5f));
}
