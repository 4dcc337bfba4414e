// Grid reductions, both semaphore protocols (see runtime.cuh for buffer sizes).
// Dynamic smem for every kernel here: nthreads * sizeof(T).

// The block's extents as launched (runtime.cuh, KILN_BLOCK_SHAPE).
KILN_BLOCK_SHAPE(blockDim.x, blockDim.y, blockDim.z)

extern __shared__ __align__(16) unsigned char kiln_test_smem[];

// Sum of n floats into out[0]: any 1-D grid and block. work: gridDim.x floats
// (NSEG=1, P=1); sems: 1 int64.
extern "C" __global__ void grid_sum_f32(const float* in, float* out, float* work, int64_t* sems, int64_t n) {
  float* smem = reinterpret_cast<float*>(kiln_test_smem);
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    acc += in[i];
  }
  kiln::gridReduce<true, false, false, true, false, false>(out[0], acc, kiln::Sum(), 0.0f, work, sems, smem, true);
}
extern "C" __global__ void grid_sum_serial_f32(const float* in, float* out, float* work, int64_t* sems,
                                               int64_t n) {
  float* smem = reinterpret_cast<float*>(kiln_test_smem);
  float acc = 0.0f;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
    acc += in[i];
  }
  kiln::gridReduceSerial<true, false, false, true, false, false>(out[0], acc, kiln::Sum(), 0.0f, work, sems, smem,
                                                                 true);
}

// Row sums of a [rows, cols] float matrix. block (BX, BY): threadIdx.x reduces along
// columns, threadIdx.y picks the row within the block (not reduced: P = BY);
// grid (GX, ceil(rows/BY)): blockIdx.x reduced (G = GX), blockIdx.y = segment.
// work: gridDim.y * GX * BY floats (parallel) or gridDim.y * BY (serial); sems: gridDim.y.
template <bool SERIAL, typename Op>
__device__ void rowReduce(const float* in, float* out, float* work, int64_t* sems, int64_t rows, int64_t cols,
                          Op op) {
  float* smem = reinterpret_cast<float*>(kiln_test_smem);
  const int64_t row = blockIdx.y * (int64_t)blockDim.y + threadIdx.y;
  const bool valid = row < rows;
  float acc = Op::template identity<float>();
  if (valid) {
    for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < cols; c += (int64_t)gridDim.x * blockDim.x) {
      acc = op(acc, in[row * cols + c]);
    }
  }
  float& dst = out[valid ? row : 0];
  if constexpr (SERIAL) {
    kiln::gridReduceSerial<true, false, false, true, false, false>(dst, acc, op, Op::template identity<float>(),
                                                                   work, sems, smem, valid);
  } else {
    kiln::gridReduce<true, false, false, true, false, false>(dst, acc, op, Op::template identity<float>(), work,
                                                             sems, smem, valid);
  }
}
extern "C" __global__ void grid_rowsum_f32(const float* in, float* out, float* work, int64_t* sems, int64_t rows,
                                           int64_t cols) {
  rowReduce<false>(in, out, work, sems, rows, cols, kiln::Sum());
}
extern "C" __global__ void grid_rowsum_serial_f32(const float* in, float* out, float* work, int64_t* sems,
                                                  int64_t rows, int64_t cols) {
  rowReduce<true>(in, out, work, sems, rows, cols, kiln::Sum());
}
extern "C" __global__ void grid_rowmax_f32(const float* in, float* out, float* work, int64_t* sems, int64_t rows,
                                           int64_t cols) {
  rowReduce<false>(in, out, work, sems, rows, cols, kiln::Max());
}
extern "C" __global__ void grid_rowmax_serial_f32(const float* in, float* out, float* work, int64_t* sems,
                                                  int64_t rows, int64_t cols) {
  rowReduce<true>(in, out, work, sems, rows, cols, kiln::Max());
}

// Compile-only coverage: other dtypes, ops and dim masks, and two reductions in a row.
template <bool XB, bool YB, bool ZB, bool XT, bool YT, bool ZT, typename T, typename Op>
__device__ void gridBoth(const T* in, T* out, T* work, T* work_serial, int64_t* sems, int64_t* sems_serial, Op op) {
  T* smem = reinterpret_cast<T*>(kiln_test_smem);
  const int64_t gtid = (kiln::blockIndex<true, true, true>() * kiln::threadCount<true, true, true>()) +
                       kiln::threadIndex<true, true, true>();
  const T v = in[gtid];
  const T init = Op::template identity<T>();
  T a = init, b = init;
  kiln::gridReduce<XB, YB, ZB, XT, YT, ZT>(a, v, op, init, work, sems, smem, true);
  kiln::gridReduce<XB, YB, ZB, XT, YT, ZT>(b, a, op, init, work, sems, smem, true);
  kiln::gridReduceSerial<XB, YB, ZB, XT, YT, ZT>(a, v, op, init, work_serial, sems_serial, smem, true);
  out[gtid] = kiln::add(a, b);
}
#define KILN_GR(NAME, T, OP, XB, YB, ZB, XT, YT, ZT)                                                              \
  extern "C" __global__ void grid_both_##NAME(const T* in, T* out, T* work, T* ws, int64_t* sems, int64_t* ss) { \
    gridBoth<XB, YB, ZB, XT, YT, ZT, T>(in, out, work, ws, sems, ss, OP());                                      \
  }
KILN_GR(f64_max_xy_xy, double, kiln::Max, true, true, false, true, true, false)
KILN_GR(f16_sum_z_z, __half, kiln::Sum, false, false, true, false, false, true)
KILN_GR(bf16_min_x_none, __nv_bfloat16, kiln::Min, true, false, false, false, false, false)
KILN_GR(i64_sum_yz_x, int64_t, kiln::Sum, false, true, true, true, false, false)
KILN_GR(i32_max_xyz_xyz, int, kiln::Max, true, true, true, true, true, true)
KILN_GR(f32_sum_none_y, float, kiln::Sum, false, false, false, false, true, false)
