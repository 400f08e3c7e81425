//! One GPU through cudarc: its context and stream, the loaded modules, cuBLAS and
//! cuBLASLt handles, buffers from the stream-ordered pool, staged copies and launches.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaModule, DevicePtr};
use cudarc::nvrtc::Ptx;
use kiln_compiler::codegen::cuda::Work;

use crate::cuda::abi::{grid, pack_dims, EpiloguePtrs, GemmPtrs, Sgemm};
use crate::cuda::lt::Epilogue;

use super::*;

/// Words of the page-locked staging buffer (32 MiB).
pub(super) const STAGE_WORDS: usize = 8 << 20;
/// Copies of fewer words go straight from or to pageable memory.
pub(super) const STAGE_MIN: usize = 64 << 10;
/// Words per rayon task when copying between pageable and staging memory.
pub(super) const COPY_GRAIN: usize = 256 << 10;

/// A page-locked host buffer (`cuMemHostAlloc`): the driver copies it at the bus's full
/// speed, where pageable memory goes through the driver's own smaller bounce buffers.
/// Large transfers are staged through it, the pageable side copied by several threads
/// (which also spreads the page faults of a fresh destination).
pub(super) struct Staging {
    ctx: Arc<CudaContext>,
    ptr: *mut u32,
}

// SAFETY: the buffer is plain host memory owned by this struct and used under the
// device's mutex.
unsafe impl Send for Staging {}

impl Staging {
    fn new(ctx: &Arc<CudaContext>) -> Result<Staging, String> {
        // SAFETY: a fresh allocation of `STAGE_WORDS` words, freed in `drop`.
        let ptr = unsafe { cudarc::driver::result::malloc_host(4 * STAGE_WORDS, 0) }
            .map_err(drv("cannot allocate page-locked host memory"))?;
        Ok(Staging {
            ctx: ctx.clone(),
            ptr: ptr as *mut u32,
        })
    }

    fn slice(&mut self, n: usize) -> &mut [u32] {
        assert!(n <= STAGE_WORDS);
        // SAFETY: `ptr` addresses `STAGE_WORDS` words that only `self` uses.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, n) }
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: `ptr` came from `malloc_host` and is freed once.
        let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut c_void) };
    }
}

/// `dst.copy_from_slice(src)` by several threads.
pub(super) fn par_copy(dst: &mut [u32], src: &[u32]) {
    use rayon::prelude::*;
    dst.par_chunks_mut(COPY_GRAIN)
        .zip(src.par_chunks(COPY_GRAIN))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// cuBLAS's operation for a (not) transposed operand.
pub(super) fn blas_op(transposed: bool) -> cublasOperation_t {
    if transposed {
        cublasOperation_t::CUBLAS_OP_T
    } else {
        cublasOperation_t::CUBLAS_OP_N
    }
}

/// Keeps freed memory in the device's stream-ordered pool across synchronizations.
///
/// cudarc allocates with `cuMemAllocAsync` from the device's current pool, whose
/// release threshold is 0 by default: every synchronization (one per step) returns
/// the freed scratch — bf16 copies of the weights, contiguous copies, row indexes — to
/// the driver, and the next step maps it again. With the threshold at its maximum the
/// pool keeps it, as PyTorch's caching allocator does, and gives it back when an
/// allocation would fail ([`Gpu::alloc`]). No pool (no async allocation): nothing to
/// set.
pub(super) fn keep_pool_memory(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use cudarc::driver::sys::CUmemPool_attribute;
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    // SAFETY: the context is current (made so by `CudaContext::new`) and its device
    // supports memory pools; the release threshold is a `u64` attribute.
    unsafe {
        let pool = cudarc::driver::result::device::get_mem_pool(ctx.cu_device())
            .map_err(drv("cannot find the device's memory pool"))?;
        let mut threshold: u64 = u64::MAX;
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast::<c_void>(),
        )
        .map_err(drv("cannot set the memory pool's release threshold"))
    }
}

/// Loads `ptx` into `ctx` and its `functions` into `funcs`.
pub(super) fn load(
    ctx: &Arc<CudaContext>,
    ptx: Ptx,
    functions: &[(String, Work, usize)],
    funcs: &mut BTreeMap<String, Func>,
) -> Result<Arc<CudaModule>, String> {
    let module = ctx
        .load_module(ptx)
        .map_err(drv("cannot load the compiled module"))?;
    for (name, work, params) in functions {
        let f = module
            .load_function(name)
            .map_err(drv(&format!("cannot load function `{name}`")))?;
        funcs.insert(
            name.clone(),
            Func {
                f,
                work: *work,
                params: *params,
            },
        );
    }
    Ok(module)
}

impl Gpu {
    /// Device `ordinal` with the module `ptx` loaded, and the functions
    /// `(name, work, buffer parameter count)`.
    ///
    /// `gemm`: the element type GEMMs take their operands in. `Tf32`: cuBLAS may round
    /// f32 operands to TF32 on the tensor cores (fp32 accumulation); `Bf16`: the default
    /// math mode, in which bf16 `cublasGemmEx` calls use the tensor cores (f32 `sgemm`
    /// stays full fp32 there too); `F32`: pedantic fp32, the CPU executor's precision.
    pub fn new(
        ordinal: usize,
        ptx: Ptx,
        functions: &[(String, Work, usize)],
        gemm: GemmMath,
    ) -> Result<Gpu, String> {
        let ctx = CudaContext::new(ordinal).map_err(drv(&format!(
            "cannot create a CUDA context on device {ordinal}"
        )))?;
        // SAFETY: every buffer of this context is used on its default stream (the legacy
        // stream, which orders work across the executors of a device), so cudarc's
        // per-buffer events have no cross-stream order to keep; without them an
        // allocation (scratch, bf16 copies of weights) creates and destroys no events.
        unsafe { ctx.disable_event_tracking() };
        keep_pool_memory(&ctx)?;
        let stream = ctx.default_stream();
        let mut funcs = BTreeMap::new();
        let module = load(&ctx, ptx, functions, &mut funcs)?;
        let blas = CudaBlas::new(stream.clone()).map_err(drv("cannot create a cuBLAS handle"))?;
        // Plain fp32 GEMMs unless TF32 was asked for.
        let mode = match gemm {
            GemmMath::Tf32 => cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
            GemmMath::Bf16 => cublasMath_t::CUBLAS_DEFAULT_MATH,
            GemmMath::F32 => cublasMath_t::CUBLAS_PEDANTIC_MATH,
        };
        // SAFETY: a valid handle.
        unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode) }
            .result()
            .map_err(drv("cannot set cuBLAS's math mode"))?;
        Ok(Gpu {
            ctx,
            stream,
            blas,
            modules: vec![module],
            funcs,
            staging: std::sync::Mutex::new(None),
            math: gemm,
            lt: std::sync::Mutex::new(None),
        })
    }

    fn alloc_with(&self, words: usize, zero: bool) -> Result<Buf, String> {
        let n = words.max(1);
        let get = || {
            if zero {
                self.stream.alloc_zeros::<u32>(n)
            } else {
                // SAFETY: the caller writes the buffer before anything reads it.
                unsafe { self.stream.alloc::<u32>(n) }
            }
        };
        let slice = match get() {
            Ok(s) => Ok(s),
            Err(_) if self.release_cached().is_ok() => get(),
            Err(e) => Err(e),
        }
        .map_err(drv(&format!("cannot allocate {} bytes", 4 * words)))?;
        let ptr = slice.device_ptr(&self.stream).0;
        Ok(Buf {
            owner: Owner::Gpu(slice),
            ptr,
            words,
        })
    }

    /// Runs `f` with the staging buffer (allocated on first use).
    fn with_staging<T>(
        &self,
        f: impl FnOnce(&mut Staging) -> Result<T, String>,
    ) -> Result<T, String> {
        let mut st = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if st.is_none() {
            *st = Some(Staging::new(&self.ctx)?);
        }
        f(st.as_mut().expect("allocated"))
    }

    /// Waits for the stream, then returns the memory the pool holds unused to the driver.
    fn release_cached(&self) -> Result<(), String> {
        if !self.ctx.has_async_alloc() {
            return Err("no memory pool".to_string());
        }
        self.sync()?;
        // SAFETY: the context is bound (every caller of `alloc` binds it) and supports
        // memory pools; trimming releases only memory no allocation holds.
        unsafe {
            let pool = cudarc::driver::result::device::get_mem_pool(self.ctx.cu_device())
                .map_err(drv("cannot find the device's memory pool"))?;
            cudarc::driver::result::mem_pool::trim_to(pool, 0)
                .map_err(drv("cannot trim the device's memory pool"))
        }
    }
}

impl DeviceApi for Gpu {
    /// Loads another compiled module into the context and adds its `functions` (names
    /// must not clash with those already loaded).
    fn load_module(
        &mut self,
        unit: Unit,
        functions: &[(String, Work, usize)],
    ) -> Result<(), String> {
        #[cfg(feature = "emulate")]
        let Unit::Ptx(ptx) = unit
        else {
            return Err("internal: a unit compiled for another device".into());
        };
        #[cfg(not(feature = "emulate"))]
        let Unit::Ptx(ptx) = unit;
        if let Some((name, _, _)) = functions.iter().find(|f| self.funcs.contains_key(&f.0)) {
            return Err(format!("a function `{name}` is loaded already"));
        }
        let module = load(&self.ctx, ptx, functions, &mut self.funcs)?;
        self.modules.push(module);
        Ok(())
    }

    /// Whether a function `name` is loaded.
    fn has(&self, name: &str) -> bool {
        self.funcs.contains_key(name)
    }

    /// Makes the context current on the calling thread (runs may come from any thread).
    fn bind(&self) -> Result<(), String> {
        self.ctx
            .bind_to_thread()
            .map_err(drv("cannot bind the CUDA context"))
    }

    fn memory_info(&self) -> Option<(usize, usize)> {
        self.bind().ok()?;
        cudarc::driver::result::mem_get_info().ok()
    }

    /// `words` zeroed 4-byte words (at least one). When the device is out of memory, the
    /// pool's cached memory ([`keep_pool_memory`]) goes back to the driver and the
    /// allocation is tried once more: memory freed by a smaller arena, or by the scratch
    /// of earlier steps, is then available to a larger one.
    fn alloc(&self, words: usize) -> Result<Buf, String> {
        self.alloc_with(words, true)
    }

    /// [`Gpu::alloc`] without zeroing (no memset in the stream): for a buffer the next
    /// launch writes whole.
    fn alloc_uninit(&self, words: usize) -> Result<Buf, String> {
        self.alloc_with(words, false)
    }

    /// Copies `words` to `dst` and waits for the copy.
    fn write(&self, dst: u64, words: &[u32]) -> Result<(), String> {
        if words.is_empty() {
            return Ok(());
        }
        if words.len() >= STAGE_MIN {
            return self.with_staging(|st| {
                for (k, chunk) in words.chunks(STAGE_WORDS).enumerate() {
                    let stage = st.slice(chunk.len());
                    par_copy(stage, chunk);
                    let at = dst + 4 * (k * STAGE_WORDS) as u64;
                    // SAFETY: `dst` addresses `words.len()` words of a live buffer; the
                    // staging buffer is not touched again before the copy has finished
                    // (synchronized below).
                    unsafe {
                        cudarc::driver::result::memcpy_htod_async(
                            at,
                            &*stage,
                            self.stream.cu_stream(),
                        )
                    }
                    .map_err(drv("host-to-device copy"))?;
                    self.sync()?;
                }
                Ok(())
            });
        }
        // SAFETY: `dst` addresses at least `words.len()` words of a live buffer; the copy
        // completes before `words` can go away (synchronized below).
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, words, self.stream.cu_stream()) }
            .map_err(drv("host-to-device copy"))?;
        self.sync()
    }

    /// Copies `words` to `dst` in stream order without waiting for the stream: a copy of
    /// fewer than `STAGE_MIN` words from pageable memory, which the driver stages before
    /// the call returns (CUDA's API synchronization rules: no device synchronization);
    /// larger copies wait as [`Gpu::write`] does.
    fn write_enqueued(&self, dst: u64, words: &[u32]) -> Result<(), String> {
        if words.is_empty() {
            return Ok(());
        }
        if words.len() >= STAGE_MIN {
            return self.write(dst, words);
        }
        // SAFETY: `dst` addresses at least `words.len()` words of a live buffer, used in
        // stream order after the copy; `words` is pageable memory, copied to the driver's
        // staging buffer before the call returns.
        unsafe { cudarc::driver::result::memcpy_htod_async(dst, words, self.stream.cu_stream()) }
            .map_err(drv("host-to-device copy"))
    }

    /// `n` words at `src`, after everything queued before.
    fn read(&self, src: u64, n: usize) -> Result<Vec<u32>, String> {
        let mut out = vec![0u32; n];
        if n == 0 {
            return Ok(out);
        }
        if n >= STAGE_MIN {
            self.with_staging(|st| {
                for (k, chunk) in out.chunks_mut(STAGE_WORDS).enumerate() {
                    let stage = st.slice(chunk.len());
                    let at = src + 4 * (k * STAGE_WORDS) as u64;
                    // SAFETY: `src` addresses `n` words of a live buffer; the staging
                    // buffer is read only after the copy has finished (synchronized).
                    unsafe {
                        cudarc::driver::result::memcpy_dtoh_async(
                            &mut *stage,
                            at,
                            self.stream.cu_stream(),
                        )
                    }
                    .map_err(drv("device-to-host copy"))?;
                    self.sync()?;
                    par_copy(chunk, stage);
                }
                Ok(())
            })?;
            return Ok(out);
        }
        // SAFETY: `src` addresses at least `n` words of a live buffer; synchronized below
        // before `out` is used.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(&mut out, src, self.stream.cu_stream())
        }
        .map_err(drv("device-to-host copy"))?;
        self.sync()?;
        Ok(out)
    }

    /// Zeroes `words` words at `dst`.
    fn zero(&self, dst: u64, words: usize) -> Result<(), String> {
        if words == 0 {
            return Ok(());
        }
        // SAFETY: `dst` addresses at least `words` words of a live buffer.
        unsafe {
            cudarc::driver::result::memset_d8_async(dst, 0, 4 * words, self.stream.cu_stream())
        }
        .map_err(drv("memset"))
    }

    /// Copies `bytes` bytes device to device (bf16 buffers need not fill whole words).
    fn copy_bytes(&self, dst: u64, src: u64, bytes: usize) -> Result<(), String> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both address at least `bytes` bytes of live buffers.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream())
        }
        .map_err(drv("device-to-device copy"))
    }

    /// The stream everything of this device runs on (NCCL communicators are made on it).
    #[cfg(feature = "nccl")]
    fn stream(&self) -> Result<Arc<CudaStream>, String> {
        Ok(self.stream.clone())
    }

    /// Enqueues, on this device's stream, an in-place NCCL sum of `buf` (f32 values as
    /// words) over the ranks of `comm`, whose stream must be this device's. With several
    /// ranks driven from one thread, the calls of all ranks go between
    /// `cudarc::nccl::group_start` and `group_end`.
    #[cfg(feature = "nccl")]
    fn all_reduce_sum(&self, comm: &cudarc::nccl::Comm, buf: &mut Buf) -> Result<(), String> {
        if comm.stream().cu_stream() != self.stream.cu_stream() {
            return Err("an NCCL communicator of another stream".to_string());
        }
        let n = buf.words;
        // SAFETY: the buffer holds at least `n` 4-byte words; f32 and u32 have the same
        // size and alignment, and every bit pattern is an f32.
        #[cfg(feature = "emulate")]
        let Owner::Gpu(slice) = &mut buf.owner
        else {
            return Err("an NCCL all-reduce of a host buffer".to_string());
        };
        #[cfg(not(feature = "emulate"))]
        let Owner::Gpu(slice) = &mut buf.owner;
        let mut view = unsafe { slice.transmute_mut::<f32>(n) }
            .ok_or_else(|| format!("an all-reduce of {n} words over a smaller buffer"))?;
        comm.all_reduce_in_place(&mut view, &cudarc::nccl::ReduceOp::Sum)
            .map_err(drv("NCCL all-reduce"))?;
        Ok(())
    }

    fn sync(&self) -> Result<(), String> {
        self.stream
            .synchronize()
            .map_err(drv("the CUDA stream failed"))
    }

    /// A timed event recorded in the stream (see [`Device::mark`]).
    fn mark(&self) -> Result<Mark, String> {
        self.stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map(Mark::Gpu)
            .map_err(drv("cannot record a CUDA event"))
    }

    /// Launches generated function `name` on `ptrs` (its buffers, in order), `dims` and
    /// `items` (see the launch ABI of `codegen::cuda`); nothing for zero items.
    fn launch(&self, name: &str, ptrs: &[u64], dims: &[i64], items: usize) -> Result<(), String> {
        let func = launchable(&self.funcs, name, ptrs.len(), |f| f.params)?;
        let Some((g, b)) = grid(func.work, items) else {
            return Ok(());
        };
        let mut packed = pack_dims(dims).map_err(|e| format!("`{name}`: {e}"))?;
        let mut items = items as i64;
        let mut vals: Vec<u64> = ptrs.to_vec();
        let mut params: Vec<*mut c_void> = vals
            .iter_mut()
            .map(|v| v as *mut u64 as *mut c_void)
            .collect();
        params.push(&mut packed as *mut _ as *mut c_void);
        params.push(&mut items as *mut i64 as *mut c_void);
        // SAFETY: the parameters match the function's signature (pointers, the by-value
        // `kiln_dims`, `long long items`), checked by count above; `cuLaunchKernel` copies
        // the values before returning.
        unsafe {
            cudarc::driver::result::launch_kernel(
                func.f.cu_function(),
                (g, 1, 1),
                (b, 1, 1),
                0,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(drv(&format!("launching `{name}`")))
    }

    /// [`Device::sgemm`] with the operands `a` and `b` of element type `elem` and the
    /// result `c` of element type `out` (accumulation fp32): bf16 operands go through
    /// `cublasGemmEx`, with an f32 result or, in a mixed-precision program, a bf16 one
    /// (`beta` then reads the bf16 `c`). An f32 GEMM has an f32 result.
    fn gemm_checked(&self, g: &Sgemm, (elem, out): GemmElems, p: GemmPtrs) -> Result<(), String> {
        let GemmPtrs {
            a,
            b,
            c,
            beta,
            batch,
        } = p;
        if elem == GemmElem::F32 {
            return self.sgemm(g, p);
        }
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType};
        let alpha = 1.0f32;
        let h = *self.blas.handle();
        let bf = cudaDataType::CUDA_R_16BF;
        let f = match out {
            GemmElem::F32 => cudaDataType::CUDA_R_32F,
            GemmElem::Bf16 => cudaDataType::CUDA_R_16BF,
        };
        let compute = cublasComputeType_t::CUBLAS_COMPUTE_32F;
        let algo = cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
        let alpha_p = &alpha as *const f32 as *const c_void;
        let beta_p = &beta as *const f32 as *const c_void;
        // SAFETY: as `sgemm`: the pointers address bf16 operands laid out as the plan
        // describes (element strides, 2-byte elements) and a result of `out`'s type;
        // cuBLAS runs on the executor's stream and reads alpha and beta before returning.
        unsafe {
            match batch {
                None => cudarc::cublas::result::gemm_ex(
                    h,
                    blas_op(g.transa),
                    blas_op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    alpha_p,
                    b as *const c_void,
                    bf,
                    g.lda,
                    a as *const c_void,
                    bf,
                    g.ldb,
                    beta_p,
                    c as *mut c_void,
                    f,
                    g.ldc,
                    compute,
                    algo,
                ),
                Some((count, sa, sb, sc)) => cudarc::cublas::result::gemm_strided_batched_ex(
                    h,
                    blas_op(g.transa),
                    blas_op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    alpha_p,
                    b as *const c_void,
                    bf,
                    g.lda,
                    sb,
                    a as *const c_void,
                    bf,
                    g.ldb,
                    sa,
                    beta_p,
                    c as *mut c_void,
                    f,
                    g.ldc,
                    sc,
                    i32::try_from(count).map_err(|_| format!("{count} GEMMs in one batch"))?,
                    compute,
                    algo,
                ),
            }
        }
        .map_err(drv("cuBLAS GemmEx (bf16)"))
    }

    /// Row-major `c = a·b` in one cuBLASLt call with `epilogue` (`g` as for
    /// [`Device::sgemm`], `c` of element type `out`, `bias` one element per output column:
    /// a bias of `out`'s type, or the bias gradient it receives). `Ok(false)` when
    /// cuBLASLt has no algorithm for it: nothing was launched, and the caller runs the
    /// separate kernels.
    fn gemm_epilogue_checked(
        &self,
        g: &Sgemm,
        elems: GemmElems,
        p: EpiloguePtrs,
        epilogue: Epilogue,
    ) -> Result<bool, String> {
        let mut lt = self.lt.lock().unwrap_or_else(|p| p.into_inner());
        if lt.is_none() {
            *lt = Some(crate::cuda::lt::Lt::new(&self.stream, self.math)?);
        }
        lt.as_mut()
            .expect("made above")
            .gemm_epilogue(&self.stream, g, elems, p, epilogue)
    }

    /// Row-major `C = A·B (+ beta·C)` per [`Sgemm`] where `p` says.
    fn sgemm(&self, g: &Sgemm, p: GemmPtrs) -> Result<(), String> {
        let GemmPtrs {
            a,
            b,
            c,
            beta,
            batch,
        } = p;
        let alpha = 1.0f32;
        let h = *self.blas.handle();
        // SAFETY: the pointers address the operands the plan describes (sizes and leading
        // dimensions from `sgemm_args`); cuBLAS runs on the executor's stream.
        unsafe {
            match batch {
                None => cudarc::cublas::result::sgemm(
                    h,
                    blas_op(g.transa),
                    blas_op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    &alpha,
                    b as *const f32,
                    g.lda,
                    a as *const f32,
                    g.ldb,
                    &beta,
                    c as *mut f32,
                    g.ldc,
                ),
                Some((count, sa, sb, sc)) => cudarc::cublas::result::sgemm_strided_batched(
                    h,
                    blas_op(g.transa),
                    blas_op(g.transb),
                    g.m,
                    g.n,
                    g.k,
                    &alpha,
                    b as *const f32,
                    g.lda,
                    sb,
                    a as *const f32,
                    g.ldb,
                    sa,
                    &beta,
                    c as *mut f32,
                    g.ldc,
                    sc,
                    i32::try_from(count).map_err(|_| format!("{count} GEMMs in one batch"))?,
                ),
            }
        }
        .map_err(drv("cuBLAS sgemm"))
    }
}
