// loadVec/storeVec at every access width: 1, 2, 4, 8, 16 bytes and 32 bytes (2 x 16).
// vec_copy_<type>x<N>(in, out, nvec): out[i*N .. i*N+N) = in[i*N .. i*N+N), through a
// shared-memory round trip (also vectorized) so both global and shared accesses are used.

// The block's extents as launched (runtime.cuh, KILN_BLOCK_SHAPE).
KILN_BLOCK_SHAPE(blockDim.x, blockDim.y, blockDim.z)

template <typename T, int N>
__device__ void vecCopy(const T* in, T* out, int64_t nvec) {
  __shared__ kiln::Array<T, N> stage[128];
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= nvec || threadIdx.x >= 128) return;
  kiln::Array<T, N> buf;
  kiln::loadVec(buf, in + i * N);
  kiln::storeVec(reinterpret_cast<T*>(&stage[threadIdx.x]), buf);
  kiln::Array<T, N> back;
  kiln::loadVec(back, reinterpret_cast<const T*>(&stage[threadIdx.x]));
  kiln::storeVec(out + i * N, back);
}

#define KILN_VEC_KERNEL(NAME, TYPE, N)                                                      \
  extern "C" __global__ void vec_copy_##NAME##x##N(const TYPE* in, TYPE* out, int64_t nvec) { \
    vecCopy<TYPE, N>(in, out, nvec);                                                        \
  }
KILN_VEC_KERNEL(bool, bool, 1)
KILN_VEC_KERNEL(bool, bool, 2)
KILN_VEC_KERNEL(bool, bool, 4)
KILN_VEC_KERNEL(bool, bool, 8)
KILN_VEC_KERNEL(bool, bool, 16)
KILN_VEC_KERNEL(f16, __half, 1)
KILN_VEC_KERNEL(f16, __half, 2)
KILN_VEC_KERNEL(f16, __half, 4)
KILN_VEC_KERNEL(f16, __half, 8)
KILN_VEC_KERNEL(bf16, __nv_bfloat16, 2)
KILN_VEC_KERNEL(bf16, __nv_bfloat16, 8)
KILN_VEC_KERNEL(f32, float, 1)
KILN_VEC_KERNEL(f32, float, 2)
KILN_VEC_KERNEL(f32, float, 4)
KILN_VEC_KERNEL(f32, float, 8)
KILN_VEC_KERNEL(i32, int, 4)
KILN_VEC_KERNEL(f64, double, 1)
KILN_VEC_KERNEL(f64, double, 2)
KILN_VEC_KERNEL(i64, int64_t, 2)

// Array alignment: power-of-two divisor of the byte size, capped at 16.
static_assert(alignof(kiln::Array<float, 4>) == 16, "");
static_assert(alignof(kiln::Array<float, 8>) == 16, "");
static_assert(alignof(kiln::Array<float, 3>) == 4, "");
static_assert(alignof(kiln::Array<__half, 2>) == 4, "");
static_assert(alignof(kiln::Array<double, 1>) == 8, "");
static_assert(sizeof(kiln::Array<__half, 8>) == 16, "");
