// Block reductions over every subset of {x, y, z}.
// block_reduce_<op>_<dtype>_<XYZ>(in, out): block b reduces in[b*nthreads .. +nthreads)
// (linear thread id, x fastest) over the dims flagged in XYZ; out[b*S + s] holds segment
// s (linear index over the non-reduced dims). Dynamic smem: nthreads * sizeof(T).
// block_allreduce_...: every thread writes its segment's result to out[b*nthreads + tid].

// The block's extents as launched (runtime.cuh, KILN_BLOCK_SHAPE).
KILN_BLOCK_SHAPE(blockDim.x, blockDim.y, blockDim.z)

extern __shared__ __align__(16) unsigned char kiln_test_smem[];

template <bool X, bool Y, bool Z, typename T, typename Op>
__device__ void blockReduceTest(const T* in, T* out, Op op) {
  T* smem = reinterpret_cast<T*>(kiln_test_smem);
  const int64_t nthreads = kiln::threadCount<true, true, true>();
  const unsigned tid = kiln::threadIndex<true, true, true>();
  const T v = in[blockIdx.x * nthreads + tid];
  const T r = kiln::blockReduce<X, Y, Z>(v, op, Op::template identity<T>(), smem);
  if (kiln::threadIndex<X, Y, Z>() == 0) {
    out[blockIdx.x * (int64_t)kiln::threadCount<!X, !Y, !Z>() + kiln::threadIndex<!X, !Y, !Z>()] = r;
  }
}

template <bool X, bool Y, bool Z, typename T, typename Op>
__device__ void blockAllReduceTest(const T* in, T* out, Op op) {
  T* smem = reinterpret_cast<T*>(kiln_test_smem);
  const int64_t nthreads = kiln::threadCount<true, true, true>();
  const unsigned tid = kiln::threadIndex<true, true, true>();
  const T v = in[blockIdx.x * nthreads + tid];
  out[blockIdx.x * nthreads + tid] = kiln::blockAllReduce<X, Y, Z>(v, op, Op::template identity<T>(), smem);
}

#define KILN_BR(OPNAME, OP, DNAME, T, X, Y, Z)                                                     \
  extern "C" __global__ void block_reduce_##OPNAME##_##DNAME##_##X##Y##Z(const T* in, T* out) {     \
    blockReduceTest<X, Y, Z, T>(in, out, OP());                                                    \
  }                                                                                                \
  extern "C" __global__ void block_allreduce_##OPNAME##_##DNAME##_##X##Y##Z(const T* in, T* out) {  \
    blockAllReduceTest<X, Y, Z, T>(in, out, OP());                                                 \
  }
#define KILN_BR_ALL_MASKS(OPNAME, OP, DNAME, T) \
  KILN_BR(OPNAME, OP, DNAME, T, 1, 0, 0)        \
  KILN_BR(OPNAME, OP, DNAME, T, 0, 1, 0)        \
  KILN_BR(OPNAME, OP, DNAME, T, 0, 0, 1)        \
  KILN_BR(OPNAME, OP, DNAME, T, 1, 1, 0)        \
  KILN_BR(OPNAME, OP, DNAME, T, 1, 0, 1)        \
  KILN_BR(OPNAME, OP, DNAME, T, 0, 1, 1)        \
  KILN_BR(OPNAME, OP, DNAME, T, 1, 1, 1)

KILN_BR_ALL_MASKS(sum, kiln::Sum, f32, float)
KILN_BR_ALL_MASKS(max, kiln::Max, f32, float)
KILN_BR_ALL_MASKS(min, kiln::Min, f32, float)
KILN_BR_ALL_MASKS(sum, kiln::Sum, f64, double)
KILN_BR_ALL_MASKS(sum, kiln::Sum, f16, __half)
KILN_BR_ALL_MASKS(max, kiln::Max, bf16, __nv_bfloat16)
KILN_BR_ALL_MASKS(sum, kiln::Sum, i64, int64_t)
KILN_BR_ALL_MASKS(max, kiln::Max, i32, int)

// The two-argument-template form: reduce over threadIdx.x only.
extern "C" __global__ void block_reduce_x_default_f32(const float* in, float* out) {
  float* smem = reinterpret_cast<float*>(kiln_test_smem);
  const int64_t nthreads = kiln::threadCount<true, true, true>();
  const float v = in[blockIdx.x * nthreads + kiln::threadIndex<true, true, true>()];
  const float r = kiln::blockReduce(v, kiln::Sum(), 0.0f, smem);
  if (threadIdx.x == 0) {
    out[blockIdx.x * (int64_t)kiln::threadCount<false, true, true>() + kiln::threadIndex<false, true, true>()] = r;
  }
}
