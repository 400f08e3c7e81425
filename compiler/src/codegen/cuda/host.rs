//! A C++ shim under which the generated CUDA C compiles and runs on the host.
//!
//! In: nothing. Out: [`SHIM`], C++20 text to put before [`super::text::prelude`] and the
//! kernels: `__global__`/`__device__` vanish, `__shared__` is a function static,
//! `threadIdx` is thread-local and the other launch coordinates are globals,
//! `__syncthreads()` waits on the `std::barrier` that `kiln_bar` points at, `__umulhi`,
//! `__int_as_float` and `__float_as_int` are plain C++ and the math functions are libm's.
//! `kiln_launch(grid, block, f)` runs each block as `blockDim.x` threads sharing a
//! barrier, blocks one after another (the kernels' grid-stride loops make any grid
//! valid). This is how the tests check the
//! emitted text on machines without CUDA (`g++ -std=c++20 -pthread`); it is no part of
//! the GPU path.

/// The shim (see the module documentation).
pub const SHIM: &str = r#"
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <thread>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct kiln_dim3 { unsigned x, y, z; };
static thread_local kiln_dim3 threadIdx;
static kiln_dim3 blockIdx, blockDim, gridDim;
static std::barrier<>* kiln_bar;
static inline void __syncthreads() { kiln_bar->arrive_and_wait(); }
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
// Runs f() as a grid of `grid` blocks of `block` threads, one block after another.
template <class F> static void kiln_launch(unsigned grid, unsigned block, F f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned g = 0; g < grid; ++g) {
        blockIdx = {g, 0, 0};
        std::barrier<> bar(block);
        kiln_bar = &bar;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t) ts.emplace_back([&, t]() { threadIdx = {t, 0, 0}; f(); });
        for (auto& th : ts) th.join();
    }
}
"#;
