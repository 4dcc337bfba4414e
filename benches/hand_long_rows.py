"""Hand-written CUDA for bf16 RMSNorm and softmax over long rows, the reference that kiln's
clustered Shared-memory normalization is measured against (DEVELOPERS.md, "Rows split over a
cluster"). Each row is split over a thread-block cluster of CL blocks; each block keeps its part
of the row in Shared memory, copied in by its threads (``copy=threads``) or by one bulk copy
(``copy=bulk``, ``cp.async.bulk`` on an mbarrier); one (max, sum) pair (softmax, updated once
per 8-element vector) or one sum of squares (RMSNorm) is reduced per row over the cluster
through distributed Shared memory, then each block writes its part.

Every configuration is checked against float64 on three rows, then timed (CUDA events, L2
flushed, median of ``--runs``) as a fraction of a device-to-device copy of the same bytes
(read x, write y), [2^30 / N, N] as in benches/long_rows.py.

Run (needs a GPU with sm_90+ and CuPy)::

    python3 benches/hand_long_rows.py [N ...] [--runs 7]
"""

# ruff: noqa: E501
# (The CUDA source keeps each inline-PTX statement on one line.)
from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable, List

import cupy as cp

ELEMENTS = 1 << 30
SOURCE = r'''
#include <cuda_bf16.h>
constexpr int PART = NCOLS / CL;
constexpr int NV = PART / 8;
constexpr int VPT = (NV + NTH - 1) / NTH;
__device__ __forceinline__ unsigned saddr(const void* p){ return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void unpack(uint4 v, float* f){
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
  #pragma unroll
  for(int j=0;j<4;j++){ float2 a = __bfloat1622float2(h[j]); f[2*j]=a.x; f[2*j+1]=a.y; }
}
__device__ __forceinline__ uint4 pack(const float* f){
  uint4 v; __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
  #pragma unroll
  for(int j=0;j<4;j++) h[j] = __floats2bfloat162_rn(f[2*j], f[2*j+1]);
  return v;
}
struct P { float m, s; };
__device__ __forceinline__ P comb(P a, P b){
#if OP==1
  float m = fmaxf(a.m, b.m);
  if (m == -__int_as_float(0x7f800000)) return a;  // both empty
  float s = a.s * __expf(a.m - m) + b.s * __expf(b.m - m);
  return {m, s};
#else
  return {0.f, a.s+b.s};
#endif
}
__device__ __forceinline__ P warp_comb(P p){
  #pragma unroll
  for(int o=16;o>0;o>>=1){ P q{__shfl_xor_sync(0xffffffff,p.m,o), __shfl_xor_sync(0xffffffff,p.s,o)}; p = comb(p,q);} return p;
}
// One 8-element vector into a thread's pair: softmax's (max, sum of exp) rescaled once per
// vector, RMSNorm's sum of squares.
__device__ __forceinline__ void accumulate(P& acc, const float* f){
#if OP==1
  float m = acc.m;
  #pragma unroll
  for(int j=0;j<8;j++) m = fmaxf(m, f[j]);
  float s = acc.s * __expf(acc.m - m);
  #pragma unroll
  for(int j=0;j<8;j++) s += __expf(f[j]-m);
  acc = {m, s};
#else
  #pragma unroll
  for(int j=0;j<8;j++) acc.s += f[j]*f[j];
#endif
}
extern "C" __global__ void __cluster_dims__(CL,1,1) __launch_bounds__(NTH) kern(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w, __nv_bfloat16* __restrict__ y, float eps){
  extern __shared__ __align__(128) uint4 sm[];
  __shared__ P red[32];
  __shared__ P part;
  __shared__ __align__(8) unsigned long long mbar;
  const int rank = blockIdx.x % CL; const size_t row = blockIdx.x / CL;
  const size_t base = row * NCOLS + (size_t)rank * PART;
  const uint4* xs = reinterpret_cast<const uint4*>(x + base);
  uint4* ys = reinterpret_cast<uint4*>(y + base);
  const uint4* ws = reinterpret_cast<const uint4*>(w + (size_t)rank * PART);
  const int tid = threadIdx.x;
  P acc{-__int_as_float(0x7f800000), 0.f};
#if BULK
  if (tid == 0) {
    asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(saddr(&mbar)));
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  if (tid == 0) {
    asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;" :: "r"(saddr(&mbar)), "r"(PART*2));
    constexpr int CH = (PART*2) / NCHUNK;
    #pragma unroll
    for (int c = 0; c < NCHUNK; c++)
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        :: "r"(saddr(sm) + c*CH), "l"(reinterpret_cast<const char*>(xs) + c*CH), "r"(CH), "r"(saddr(&mbar)) : "memory");
  }
  {
    unsigned done = 0;
    while (!done) asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared.b64 p, [%1], 0; selp.u32 %0,1,0,p; }" : "=r"(done) : "r"(saddr(&mbar)) : "memory");
  }
  #pragma unroll
  for (int k = 0; k < VPT; k++) { int i = tid + k*NTH; if (NV % NTH == 0 || i < NV) { float f[8]; unpack(sm[i], f);
    accumulate(acc, f);
  } }
#else
  uint4 r[VPT];
  #pragma unroll
  for (int k = 0; k < VPT; k++) { int i = tid + k*NTH; if (NV % NTH == 0 || i < NV) r[k] = xs[i]; }
  #pragma unroll
  for (int k = 0; k < VPT; k++) { int i = tid + k*NTH; if (NV % NTH == 0 || i < NV) { sm[i] = r[k]; float f[8]; unpack(r[k], f);
    accumulate(acc, f);
  } }
#endif
  acc = warp_comb(acc);
  if ((tid & 31) == 0) red[tid >> 5] = acc;
  __syncthreads();
  if (tid < 32) {
    P p = tid < NTH/32 ? red[tid] : P{-__int_as_float(0x7f800000), 0.f};
    p = warp_comb(p);
    if (tid == 0) part = p;
  }
  // cluster exchange
  asm volatile("barrier.cluster.arrive.release.aligned;\n barrier.cluster.wait.acquire.aligned;" ::: "memory");
  if (tid < 32) {
    P p{-__int_as_float(0x7f800000), 0.f};
    if (tid < CL) {
      unsigned remote; asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(saddr(&part)), "r"(tid));
      asm volatile("ld.shared::cluster.v2.f32 {%0,%1}, [%2];" : "=f"(p.m), "=f"(p.s) : "r"(remote));
    }
    p = warp_comb(p);
    if (tid == 0) red[0] = p;
  }
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  __syncthreads();
  P tot = red[0];
#if OP==1
  float sc = 1.f / tot.s;
#else
  float sc = rsqrtf(tot.s / NCOLS + eps);
#endif
  #pragma unroll
  for (int k = 0; k < VPT; k++) { int i = tid + k*NTH; if (NV % NTH == 0 || i < NV) { float f[8]; unpack(sm[i], f);
#if OP==1
    #pragma unroll
    for(int j=0;j<8;j++) f[j] = __expf(f[j]-tot.m)*sc;
#else
    float g[8]; unpack(ws[i], g);
    #pragma unroll
    for(int j=0;j<8;j++) f[j] = __bfloat162float(__float2bfloat16(f[j]*sc))*g[j];
#endif
    uint4 o = pack(f);
    asm volatile("st.global.cs.v4.u32 [%0], {%1,%2,%3,%4};" :: "l"(ys+i), "r"(o.x), "r"(o.y), "r"(o.z), "r"(o.w) : "memory");
  } }
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
'''


def median_us(fn: Callable[[], Any], flush: Any, runs: int) -> float:
    """Median device time of ``fn`` in microseconds, L2 flushed before each call."""
    ts = []
    for _ in range(runs):
        flush.fill(1)
        a, b = cp.cuda.Event(), cp.cuda.Event()
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(cp.cuda.get_elapsed_time(a, b) * 1e3)
    return statistics.median(ts)


def bf16_to_f64(u: Any) -> Any:
    """bfloat16 bits (uint16) as float64."""
    return (u.astype(cp.uint32) << 16).view(cp.float32).astype(cp.float64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cols", nargs="*", type=int, default=[65536, 131072, 262144])
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    flush = cp.empty(1 << 28, dtype=cp.uint8)
    xf = cp.random.standard_normal(ELEMENTS, dtype=cp.float32)
    x = (xf.view(cp.uint32) >> 16).astype(cp.uint16)  # bfloat16 bits
    del xf
    y = cp.empty_like(x)
    copy_us = median_us(lambda: cp.cuda.runtime.memcpyAsync(y.data.ptr, x.data.ptr, 2 * ELEMENTS, 3, 0),
                        flush, args.runs)
    print(f"device-to-device copy: {4 * ELEMENTS / copy_us / 1e3:.0f} GB/s", flush=True)
    best: List[str] = []
    for op, name in ((0, "rmsnorm"), (1, "softmax")):
        for n in args.cols:
            m = ELEMENTS // n
            results = []
            for cl in (1, 2, 4, 8):
                part = n // cl
                if part * 2 > 200 * 1024 or part * 2 < 16 * 1024:
                    continue
                for threads in (256, 512, 1024):
                    if part // 8 < threads:
                        continue
                    for bulk in (0, 1):
                        opts = ("-std=c++17", f"-DNCOLS={n}", f"-DCL={cl}", f"-DNTH={threads}",
                                f"-DBULK={bulk}", "-DNCHUNK=1", f"-DOP={op}")
                        k = cp.RawModule(code=SOURCE, options=opts).get_function("kern")
                        k.max_dynamic_shared_size_bytes = part * 2
                        w = cp.full(n, 0x3F80, dtype=cp.uint16)  # 1.0
                        x2, y2 = x.reshape(m, n), y.reshape(m, n)

                        kargs = (x2, w, y2, cp.float32(1e-6))

                        def run(k: Any = k, grid: int = m * cl, threads: int = threads,
                                args: Any = kargs, smem: int = part * 2) -> None:
                            k((grid,), (threads,), args, shared_mem=smem)
                        run()
                        rows = [0, m // 2, m - 1]
                        xr = bf16_to_f64(x2[rows])
                        if op == 0:
                            ref = xr / cp.sqrt((xr * xr).mean(1, keepdims=True) + 1e-6)
                        else:
                            e = cp.exp(xr - xr.max(1, keepdims=True))
                            ref = e / e.sum(1, keepdims=True)
                        err = float(cp.abs(bf16_to_f64(y2[rows]) - ref).max() / cp.abs(ref).max())
                        if not err < 1e-2:
                            print(f"MISMATCH {name} N={n} CL={cl} threads={threads} bulk={bulk}: {err:.1e}")
                            continue
                        us = median_us(run, flush, args.runs)
                        copy = "bulk" if bulk else "threads"
                        line = f"{name:8s} N={n:7d} CL={cl} threads={threads:4d} copy={copy:7s}: {us:8.1f} us " \
                               f"{copy_us / us:.3f} of copy"
                        print(line, flush=True)
                        results.append((copy_us / us, line))
            if results:
                best.append(max(results)[1])
    print("\nbest per workload and N:")
    for line in best:
        print(line)


if __name__ == "__main__":
    main()
