//! A C++ shim under which the generated CUDA C compiles and runs on the host.
//!
//! In: nothing. Out: [`SHIM`], C++20 text to put before [`super::text::prelude`] and the
//! kernels: `__global__`/`__device__` vanish, `__shared__` is a function static,
//! `threadIdx` is thread-local and the other launch coordinates are globals,
//! `__syncthreads()` waits on the `std::barrier` that `kiln_bar` points at,
//! `__shfl_xor_sync` goes through shared slots and a barrier, `__umulhi`,
//! `__int_as_float` and `__float_as_int` are plain C++ and the math functions are libm's.
//! `kiln_launch(grid, block, f)` runs each block as `blockDim.x` threads sharing a
//! barrier, blocks one after another (the kernels' grid-stride loops make any grid
//! valid). This is how the tests check the
//! emitted text on machines without CUDA (`g++ -std=c++20 -pthread`); it is no part of
//! the GPU path. [`FIBER_SHIM`] is the same with a block's threads as fibers of one host
//! thread, for the emulated device, where launches are many and must be cheap.

/// What both shims share: includes, the keywords, the launch coordinates and the
/// intrinsics, each shim then defining `__syncthreads` and `kiln_launch`.
macro_rules! common {
    () => {
        r#"
#include <cmath>
#include <cstdio>
#include <cstring>
#include <math.h>
#include <vector>
#define __global__
#define __launch_bounds__(...)
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct kiln_dim3 { unsigned x, y, z; };
static thread_local kiln_dim3 threadIdx;
static kiln_dim3 blockIdx, blockDim, gridDim;
static inline unsigned __umulhi(unsigned a, unsigned b) {
    return (unsigned)(((unsigned long long)a * b) >> 32);
}
static inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
static inline int __float_as_int(float f) { int x; std::memcpy(&x, &f, 4); return x; }
"#
    };
}

/// A warp shuffle on the host: every lane publishes its value in the slots of this call's
/// parity, a barrier, each reads its partner's. One barrier a call: a thread cannot write
/// the same parity again (two calls later) before every thread has passed the next call's
/// barrier, so after it has read. Each thread counts its calls (reset when a block
/// starts). Needs `__syncthreads`, so it holds for the kernels' uses: every thread of the
/// block makes the same calls (the prelude's reductions, the attention's row loops).
macro_rules! shuffle {
    () => {
        r#"static unsigned kiln_shfl_slot[2][1024];
static unsigned kiln_shfl_calls[1024];
// Lane `src` of this thread's warp (`src` below 32), the word `v` there.
static inline unsigned kiln_shfl_word(unsigned v, unsigned src) {
    const unsigned par = kiln_shfl_calls[threadIdx.x]++ & 1u;
    kiln_shfl_slot[par][threadIdx.x] = v;
    __syncthreads();
    return kiln_shfl_slot[par][(threadIdx.x & ~31u) | src];
}
static inline float __shfl_xor_sync(unsigned, float v, int m) {
    const unsigned x = kiln_shfl_word((unsigned)__float_as_int(v), (threadIdx.x & 31u) ^ (unsigned)m);
    return __int_as_float((int)x);
}
static inline unsigned __shfl_sync(unsigned, unsigned v, int src) {
    return kiln_shfl_word(v, (unsigned)src & 31u);
}
// The prelude's `kiln_mma` on the host: each lane publishes its six words, one barrier
// (the same call count and parity as a shuffle), then each sums its four outputs from
// its warp's words in k order.
#define KILN_HOST_MMA 1
static unsigned kiln_mma_slot[2][1024][6];
static inline float kiln_host_bf16(unsigned w, int k) {
    return __int_as_float((int)((k & 1) ? (w & 0xffff0000u) : (w << 16)));
}
static inline void kiln_host_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    const unsigned par = kiln_shfl_calls[threadIdx.x]++ & 1u;
    unsigned* mine = kiln_mma_slot[par][threadIdx.x];
    mine[0] = a0; mine[1] = a1; mine[2] = a2; mine[3] = a3; mine[4] = b0; mine[5] = b1;
    __syncthreads();
    const unsigned base = threadIdx.x & ~31u, lane = threadIdx.x & 31u, g = lane >> 2, t = lane & 3u;
    for (int q = 0; q < 4; ++q) {
        const unsigned row = g + 8u * (unsigned)(q >> 1), col = 2u * t + (unsigned)(q & 1);
        float acc = c[q];
        for (int k = 0; k < 16; ++k) {
            const unsigned* a = kiln_mma_slot[par][base + 4u * g + (unsigned)((k & 7) >> 1)];
            const unsigned* b = kiln_mma_slot[par][base + 4u * col + (unsigned)((k & 7) >> 1)];
            const float x = kiln_host_bf16(a[(row >= 8u ? 1 : 0) + (k >= 8 ? 2 : 0)], k);
            const float y = kiln_host_bf16(b[4 + (k >= 8 ? 1 : 0)], k);
            acc = acc + x * y;
        }
        c[q] = acc;
    }
}
"#
    };
}

/// The shim (see the module documentation).
pub const SHIM: &str = concat!(
    common!(),
    r#"#include <barrier>
#include <thread>
static std::barrier<>* kiln_bar;
static inline void __syncthreads() { kiln_bar->arrive_and_wait(); }
"#,
    shuffle!(),
    r#"// Runs f() as a grid of `grid` blocks of `block` threads, one block after another.
template <class F> static void kiln_launch(unsigned grid, unsigned block, F f) {
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    for (unsigned g = 0; g < grid; ++g) {
        blockIdx = {g, 0, 0};
        std::memset(kiln_shfl_calls, 0, sizeof kiln_shfl_calls);
        std::barrier<> bar(block);
        kiln_bar = &bar;
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < block; ++t) ts.emplace_back([&, t]() { threadIdx = {t, 0, 0}; f(); });
        for (auto& th : ts) th.join();
    }
}
"#
);

/// [`SHIM`] with a block's threads as fibers of one host thread: each runs until its
/// next `__syncthreads()` or its end, then the next, so every barrier holds until all
/// have reached it — the same results as [`SHIM`] for kernels that are correct under any
/// interleaving (those of `codegen::cuda`), without a thread per GPU thread. What the
/// emulated device (`kiln_exec::cuda::emulate`) launches with. Not reentrant: one
/// launch at a time in a process.
///
/// On x86-64 a fiber switch saves the callee-saved registers on the fiber's own stack and
/// swaps the stack pointer (`kiln_fiber_switch`, a few instructions): `swapcontext` also
/// saves the signal mask, a system call each way, which took nine tenths of an emulated
/// training step. Elsewhere the fibers are `ucontext`'s.
pub const FIBER_SHIM: &str = concat!(
    common!(),
    r#"#if defined(__x86_64__)
#define KILN_FAST_FIBERS 1
// Saves rbp, rbx, r12-r15 on the current stack, stores the stack pointer in *from,
// loads `to` and restores the same six from there (System V: the rest is the caller's).
extern "C" __attribute__((visibility("hidden"))) void kiln_fiber_switch(void** from, void* to);
asm(R"(
    .text
    .globl kiln_fiber_switch
    .hidden kiln_fiber_switch
    .type kiln_fiber_switch, @function
kiln_fiber_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kiln_fiber_switch, .-kiln_fiber_switch
)");
#else
#include <ucontext.h>
#endif
struct kiln_fibers {
#if KILN_FAST_FIBERS
    std::vector<void*> sp;
    void* sched = nullptr;
#else
    std::vector<ucontext_t> ctx;
    ucontext_t sched;
#endif
    std::vector<std::vector<char>> stacks;
    std::vector<char> done;
    unsigned cur = 0;
    void (*job)(void*) = nullptr;
    void* arg = nullptr;
};
static kiln_fibers* kiln_fib = new kiln_fibers;
static inline void __syncthreads() {
#if KILN_FAST_FIBERS
    kiln_fiber_switch(&kiln_fib->sp[kiln_fib->cur], kiln_fib->sched);
#else
    swapcontext(&kiln_fib->ctx[kiln_fib->cur], &kiln_fib->sched);
#endif
}
"#,
    shuffle!(),
    r#"#if KILN_FAST_FIBERS
// A fiber's first frame (entered by kiln_fiber_switch's `ret`): the job, then back to the
// scheduler for good.
[[noreturn]] static void kiln_fiber_main() {
    kiln_fib->job(kiln_fib->arg);
    kiln_fib->done[kiln_fib->cur] = 1;
    void* dead = nullptr;
    kiln_fiber_switch(&dead, kiln_fib->sched);
    __builtin_unreachable();
}
// A fresh fiber on `stack` (`size` bytes): the six saved registers (zero), then
// kiln_fiber_main as the return address, then a null frame, so that the fiber enters
// kiln_fiber_main with the stack aligned as after a call.
static void* kiln_fiber_start(char* stack, size_t size) {
    auto top = (reinterpret_cast<unsigned long long>(stack + size)) & ~15ull;
    auto* w = reinterpret_cast<void**>(top);
    w[-1] = nullptr;
    w[-2] = reinterpret_cast<void*>(&kiln_fiber_main);
    for (int r = 3; r <= 8; ++r) w[-r] = nullptr;
    return &w[-8];
}
#else
static void kiln_fiber_main() {
    kiln_fib->job(kiln_fib->arg);
    kiln_fib->done[kiln_fib->cur] = 1;
}
#endif
// Runs f() as a grid of `grid` blocks of `block` fibers, one block after another; in a
// block, the fibers in turn, each to its next barrier, until all have ended.
template <class F> static void kiln_launch(unsigned grid, unsigned block, F f) {
    const size_t stack = 256 << 10;
    kiln_fibers& k = *kiln_fib;
    gridDim = {grid, 1, 1};
    blockDim = {block, 1, 1};
    k.job = [](void* p) { (*static_cast<F*>(p))(); };
    k.arg = &f;
    if (k.stacks.size() < block) {
#if KILN_FAST_FIBERS
        k.sp.resize(block);
#else
        k.ctx.resize(block);
#endif
        k.stacks.resize(block);
        k.done.resize(block);
    }
    for (unsigned g = 0; g < grid; ++g) {
        blockIdx = {g, 0, 0};
        std::memset(kiln_shfl_calls, 0, sizeof kiln_shfl_calls);
        for (unsigned t = 0; t < block; ++t) {
            if (k.stacks[t].size() < stack) k.stacks[t].resize(stack);
#if KILN_FAST_FIBERS
            k.sp[t] = kiln_fiber_start(k.stacks[t].data(), stack);
#else
            getcontext(&k.ctx[t]);
            k.ctx[t].uc_stack.ss_sp = k.stacks[t].data();
            k.ctx[t].uc_stack.ss_size = stack;
            k.ctx[t].uc_link = &k.sched;
            makecontext(&k.ctx[t], kiln_fiber_main, 0);
#endif
            k.done[t] = 0;
        }
        for (bool running = true; running;) {
            running = false;
            for (unsigned t = 0; t < block; ++t) {
                if (k.done[t]) continue;
                k.cur = t;
                threadIdx = {t, 0, 0};
#if KILN_FAST_FIBERS
                kiln_fiber_switch(&k.sched, k.sp[t]);
#else
                swapcontext(&k.sched, &k.ctx[t]);
#endif
                running |= !k.done[t];
            }
        }
    }
    k.job = nullptr;
}
"#
);
