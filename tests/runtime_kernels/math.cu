// Every math function of runtime.cuh for every floating dtype, and the integer subset.
// Output layout: out[k * n + i] for function k (see MATH_FUNCS in test_runtime_header.py).

// The block's extents as launched (runtime.cuh, KILN_BLOCK_SHAPE).
KILN_BLOCK_SHAPE(blockDim.x, blockDim.y, blockDim.z)

template <typename T>
__device__ void mathFloating(const T* a, const T* b, T* out, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const T x = a[i], y = b[i];
  T* o = out + i;
  o[0 * n] = kiln::abs(x);
  o[1 * n] = kiln::neg(x);
  o[2 * n] = kiln::exp(x);
  o[3 * n] = kiln::log(x);
  o[4 * n] = kiln::sqrt(x);
  o[5 * n] = kiln::rsqrt(x);
  o[6 * n] = kiln::reciprocal(x);
  o[7 * n] = kiln::sin(x);
  o[8 * n] = kiln::cos(x);
  o[9 * n] = kiln::tanh(x);
  o[10 * n] = kiln::sigmoid(x);
  o[11 * n] = kiln::relu(x);
  o[12 * n] = kiln::pow(x, y);
  o[13 * n] = kiln::maximum(x, y);
  o[14 * n] = kiln::minimum(x, y);
  o[15 * n] = kiln::add(x, y);
  o[16 * n] = kiln::sub(x, y);
  o[17 * n] = kiln::mul(x, y);
  o[18 * n] = kiln::div(x, y);
  o[19 * n] = kiln::where(kiln::lt(x, y), x, y);
}

template <typename T>
__device__ void mathInteger(const T* a, const T* b, T* out, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  const T x = a[i], y = b[i];
  T* o = out + i;
  o[0 * n] = kiln::abs(x);
  o[1 * n] = kiln::neg(x);
  o[2 * n] = kiln::relu(x);
  o[3 * n] = kiln::pow(x, y);
  o[4 * n] = kiln::maximum(x, y);
  o[5 * n] = kiln::minimum(x, y);
  o[6 * n] = kiln::add(x, y);
  o[7 * n] = kiln::sub(x, y);
  o[8 * n] = kiln::mul(x, y);
  o[9 * n] = kiln::where(kiln::ge(x, y), x, y);
  o[10 * n] = kiln::ceilDiv(x, (T)3);
}

extern "C" __global__ void math_f32(const float* a, const float* b, float* out, int64_t n) {
  mathFloating<float>(a, b, out, n);
}
extern "C" __global__ void math_f64(const double* a, const double* b, double* out, int64_t n) {
  mathFloating<double>(a, b, out, n);
}
extern "C" __global__ void math_f16(const __half* a, const __half* b, __half* out, int64_t n) {
  mathFloating<__half>(a, b, out, n);
}
extern "C" __global__ void math_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out,
                                     int64_t n) {
  mathFloating<__nv_bfloat16>(a, b, out, n);
}
extern "C" __global__ void math_i32(const int* a, const int* b, int* out, int64_t n) {
  mathInteger<int>(a, b, out, n);
}
extern "C" __global__ void math_i64(const int64_t* a, const int64_t* b, int64_t* out, int64_t n) {
  mathInteger<int64_t>(a, b, out, n);
}
// bool: the functions that make sense on it.
extern "C" __global__ void math_bool(const bool* a, const bool* b, bool* out, int64_t n) {
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = kiln::maximum(a[i], b[i]);
  out[n + i] = kiln::minimum(a[i], b[i]);
  out[2 * n + i] = kiln::where(kiln::eq(a[i], b[i]), a[i], b[i]);
}
