//! GEMMs with the bias (and ReLU) fused into cuBLASLt's epilogue: `linear` and
//! `linear_relu` in one library call instead of a bias fill, a GEMM and a ReLU pass; and
//! weight-gradient GEMMs that also sum their output gradient's rows into the bias
//! gradient (`Epilogue::BiasGradA`), instead of a separate `sum_rows`.
//!
//! In: a row-major GEMM as [`Sgemm`] describes it for cuBLAS (operands swapped, so that
//! cuBLAS's `m` is the output's last axis and the bias runs along it), the operands'
//! element type, the device addresses, and the [`Epilogue`]. Out: the launch on the
//! device's stream, or `Ok(false)` when cuBLASLt has no algorithm for that problem (the
//! caller then runs the separate kernels).
//!
//! A plan (matmul descriptor, matrix layouts and the heuristic's algorithm) is made once
//! per problem — shape, transposes, leading dimensions, element type, epilogue and the
//! alignment of each address — and reused; only the bias address is set per call. The
//! alignments are part of the problem because the heuristic may choose an algorithm that
//! needs aligned operands: the preference tells it the alignment each address has.
//!
//! Precision follows the executor's GEMM mode: fp32 computes in fp32 (`COMPUTE_32F`, no
//! TF32), TF32 in `COMPUTE_32F_FAST_TF32`, bf16 operands with fp32 accumulation and an
//! fp32 result and bias — or, in a mixed-precision program, a bf16 result and bias (the
//! bias rounded to bf16 as the separate path's bias fill rounds it; the epilogue adds it
//! in fp32 and rounds the sum once). Only built behind [`super::cuda_available`].

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

use super::abi::{EpiloguePtrs, Sgemm};
use super::device::{GemmElem, GemmElems, GemmMath};

/// Bytes of the cuBLASLt workspace (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// The largest alignment the preferences are told about (cuBLASLt's default assumption).
const MAX_ALIGN: u64 = 256;

/// The alignment of a device address, in bytes, up to [`MAX_ALIGN`].
pub(crate) fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return MAX_ALIGN as u32;
    }
    (1u64 << ptr.trailing_zeros()).min(MAX_ALIGN) as u32
}

/// Whether cuBLASLt may take `bias` as an epilogue vector: 16-byte aligned (what its
/// vectorized epilogues read; other addresses take the separate kernels).
fn bias_fits(bias: u64) -> bool {
    alignment(bias) >= 16
}

/// The column-major matrices cuBLASLt is told about for `g` (as `cublasSgemm` takes it),
/// as stored, before any transpose: `(rows, cols, leading dimension)` of its first
/// operand (our right one, `m×k`, stored `k×m` when `transa`), its second (`k×n`, stored
/// `n×k` when `transb`) and the output `D` (`m×n`).
pub(crate) fn layouts(g: &Sgemm) -> [(u64, u64, i64); 3] {
    let (m, n, k) = (g.m as u64, g.n as u64, g.k as u64);
    let a = if g.transa { (k, m) } else { (m, k) };
    let b = if g.transb { (n, k) } else { (k, n) };
    [
        (a.0, a.1, g.lda as i64),
        (b.0, b.1, g.ldb as i64),
        (m, n, g.ldc as i64),
    ]
}

/// What the epilogue does with the vector at the bias pointer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    /// `D = A·B + bias` (bias along `m`).
    Bias,
    /// `D = max(A·B + bias, 0)`.
    ReluBias,
    /// `D = A·B`, and the bias pointer receives `Σ_k op(A)[i, k]` for each of the `m`
    /// rows (`CUBLASLT_EPILOGUE_BGRADA`): a bias gradient, when cuBLAS's first operand is
    /// the output gradient of a weight-gradient GEMM. `bf16`: the sums are stored in bf16
    /// (else f32), whatever the result's type.
    BiasGradA { bf16: bool },
}

/// One GEMM problem: everything the plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    g: Sgemm,
    bf16: bool,
    /// A bf16 result and bias (only with bf16 operands).
    out_bf16: bool,
    epilogue: Epilogue,
    /// Alignments of the first operand, the second and the output (which is also `C`).
    align: [u32; 3],
}

/// A matmul descriptor, its layouts and its algorithm (destroyed on drop).
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: created by `Lt::plan`, destroyed once, not in use (the stream that ran
        // them is synchronized before the executor drops).
        unsafe {
            for l in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

/// cuBLASLt on one device: its handle, workspace and plans.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    /// Owns the workspace memory (`workspace_ptr`).
    _workspace: CudaSlice<u8>,
    workspace_ptr: u64,
    math: GemmMath,
    /// `None`: cuBLASLt has no algorithm for the problem.
    plans: HashMap<Key, Option<Plan>>,
}

// SAFETY: the handle and plans are plain library objects; the executor uses them from one
// thread at a time (behind its state's mutex).
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created in `Lt::new`, destroyed once.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

fn err(what: &'static str) -> impl Fn(lt::CublasError) -> String {
    move |e| format!("cuBLASLt {what}: {e:?}")
}

/// Sets one attribute of a matmul descriptor.
///
/// # Safety
/// `desc` is a live descriptor and `T` the attribute's C type.
unsafe fn set_desc<T>(
    desc: sys::cublasLtMatmulDesc_t,
    attr: sys::cublasLtMatmulDescAttributes_t,
    value: &T,
) -> Result<(), String> {
    lt::set_matmul_desc_attribute(
        desc,
        attr,
        value as *const T as *const c_void,
        std::mem::size_of::<T>(),
    )
    .map_err(err("descriptor attribute"))
}

impl Lt {
    /// A handle and a workspace on `stream`'s device.
    pub fn new(stream: &Arc<CudaStream>, math: GemmMath) -> Result<Lt, String> {
        let handle = lt::create_handle().map_err(err("handle"))?;
        // SAFETY: the workspace is scratch memory cuBLASLt writes before it reads.
        let workspace = match unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) } {
            Ok(w) => w,
            Err(e) => {
                // SAFETY: created above, destroyed once.
                let _ = unsafe { lt::destroy_handle(handle) };
                return Err(format!("cannot allocate the cuBLASLt workspace: {e:?}"));
            }
        };
        let workspace_ptr = workspace.device_ptr(stream).0;
        Ok(Lt {
            handle,
            _workspace: workspace,
            workspace_ptr,
            math,
            plans: HashMap::new(),
        })
    }

    /// The plan of `key`, made on first use; `Ok(None)` when cuBLASLt has no algorithm.
    fn plan(&mut self, key: Key) -> Result<Option<&Plan>, String> {
        if !self.plans.contains_key(&key) {
            let made = self.make(key)?;
            self.plans.insert(key, made);
        }
        Ok(self.plans.get(&key).and_then(|p| p.as_ref()))
    }

    fn make(&self, key: Key) -> Result<Option<Plan>, String> {
        use sys::cublasComputeType_t as C;
        use sys::cudaDataType_t as T;
        let g = key.g;
        let compute = match (self.math, key.bf16) {
            (_, true) | (GemmMath::F32, false) | (GemmMath::Bf16, false) => C::CUBLAS_COMPUTE_32F,
            (GemmMath::Tf32, false) => C::CUBLAS_COMPUTE_32F_FAST_TF32,
        };
        let elem = if key.bf16 {
            T::CUDA_R_16BF
        } else {
            T::CUDA_R_32F
        };
        let desc = lt::create_matmul_desc(compute, T::CUDA_R_32F).map_err(err("descriptor"))?;
        // From here on the plan owns what is made, and frees it on an early return.
        let mut plan = Plan {
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let op = |t: bool| -> i32 { t as i32 };
        use sys::cublasLtEpilogue_t as E;
        let epilogue = match key.epilogue {
            Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS,
            Epilogue::ReluBias => E::CUBLASLT_EPILOGUE_RELU_BIAS,
            Epilogue::BiasGradA { .. } => E::CUBLASLT_EPILOGUE_BGRADA,
        };
        use sys::cublasLtMatmulDescAttributes_t as D;
        // SAFETY: a live descriptor; TRANSA/TRANSB are `int32_t` (`cublasOperation_t`),
        // EPILOGUE a `uint32_t` enum, BIAS_DATA_TYPE an `int32_t` (`cudaDataType`). A
        // bias has D's type, the default; a bias gradient's type is set.
        unsafe {
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &op(g.transa))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSB, &op(g.transb))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_EPILOGUE, &(epilogue as u32))?;
            if let Epilogue::BiasGradA { bf16 } = key.epilogue {
                let ty = if bf16 { T::CUDA_R_16BF } else { T::CUDA_R_32F };
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &(ty as i32))?;
            }
        }
        let [a, b, d] = layouts(&g);
        let out = if key.out_bf16 {
            T::CUDA_R_16BF
        } else {
            T::CUDA_R_32F
        };
        for (slot, (ty, (r, c, ld))) in [(elem, a), (elem, b), (out, d)].into_iter().enumerate() {
            plan.layouts[slot] =
                lt::create_matrix_layout(ty, r, c, ld).map_err(err("matrix layout"))?;
        }
        let pref = lt::create_matmul_pref().map_err(err("preference"))?;
        use sys::cublasLtMatmulPreferenceAttributes_t as P;
        let set_pref = |attr: P, value: *const c_void, size: usize| {
            // SAFETY: a live preference; the value has the attribute's C type.
            unsafe { lt::set_matmul_pref_attribute(pref, attr, value, size) }
                .map_err(err("preference attribute"))
        };
        let ws = WORKSPACE_BYTES as u64;
        let [aa, ab, ac_] = key.align;
        let prefs = set_pref(
            P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &ws as *const u64 as *const c_void,
            8,
        )
        .and_then(|_| {
            [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, aa),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, ab),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, ac_),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, ac_),
            ]
            .into_iter()
            .try_for_each(|(attr, a)| set_pref(attr, &a as *const u32 as *const c_void, 4))
        });
        let found = prefs.map(|()| {
            let [la, lb, lc] = plan.layouts;
            // No algorithm (`NOT_SUPPORTED`) or a problem the heuristic refuses: the
            // separate kernels run it (`gemm_bias` answers `false`).
            // SAFETY: live descriptor, layouts and preference (D is laid out as C).
            let h =
                unsafe { lt::get_matmul_algo_heuristic(self.handle, desc, la, lb, lc, lc, pref) };
            h.ok().map(|h| h.algo)
        });
        // SAFETY: created above, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(pref) };
        Ok(found?.map(|algo| {
            plan.algo = algo;
            plan
        }))
    }

    /// Row-major `c = a·b` with `g` as for `cublasSgemm` (cuBLAS's first operand at
    /// `b`, its second at `a`), operands of `elem` and the result `c` of `out`, and the
    /// epilogue's vector at `p.vector`: one element per output column (cuBLAS's `m`), of
    /// `out`'s type for a bias, of the type the epilogue names for a bias gradient.
    /// `Ok(false)`: cuBLASLt cannot run this problem (nothing was launched).
    pub fn gemm_epilogue(
        &mut self,
        stream: &CudaStream,
        g: &Sgemm,
        (elem, out): GemmElems,
        p: EpiloguePtrs,
        epilogue: Epilogue,
    ) -> Result<bool, String> {
        let EpiloguePtrs {
            a,
            b,
            c,
            vector: bias,
        } = p;
        if !bias_fits(bias) || (elem == GemmElem::F32 && out == GemmElem::Bf16) {
            return Ok(false);
        }
        let key = Key {
            g: *g,
            bf16: elem == GemmElem::Bf16,
            out_bf16: out == GemmElem::Bf16,
            epilogue,
            align: [alignment(b), alignment(a), alignment(c)],
        };
        let (handle, ws) = (self.handle, self.workspace_ptr);
        let Some(plan) = self.plan(key)? else {
            return Ok(false);
        };
        let (alpha, beta) = (1.0f32, 0.0f32);
        let [la, lb, lc] = plan.layouts;
        // SAFETY: the plan describes the operands at these addresses (sizes and leading
        // dimensions from `sgemm_args`, alignments checked by its key); the bias (or its
        // gradient) holds `m` elements of the epilogue's type; the workspace is the
        // handle's, on this device; the call is enqueued on the executor's stream and
        // reads alpha and beta before returning.
        unsafe {
            set_desc(
                plan.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                &bias,
            )?;
            lt::matmul(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                &beta as *const f32 as *const c_void,
                b as *const c_void,
                la,
                a as *const c_void,
                lb,
                c as *const c_void,
                lc,
                c as *mut c_void,
                lc,
                &plan.algo,
                ws as *mut c_void,
                WORKSPACE_BYTES,
                stream.cu_stream() as *mut _,
            )
        }
        .map_err(err("matmul"))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::abi::{sgemm_args, MatDesc};

    /// What cuBLASLt computes from [`layouts`]: column-major
    /// `D = op(first)·op(second) + bias` (bias along `m`), then ReLU, into a buffer of
    /// `ldc·n` elements. Each layout must be valid (`ld ≥ rows`).
    fn emulate(g: &Sgemm, first: &[f32], second: &[f32], bias: &[f32], relu: bool) -> Vec<f32> {
        let [a, b, d] = layouts(g);
        for (r, _, ld) in [a, b, d] {
            assert!(
                ld as u64 >= r.max(1),
                "leading dimension {ld} below {r} rows"
            );
        }
        // The sizes as cuBLASLt reads them: `D` is `m×n`, `op(first)` `m×k`, `op(second)`
        // `k×n`; the three must agree.
        let (m, n) = (d.0 as usize, d.1 as usize);
        let (am, k) = if g.transa { (a.1, a.0) } else { (a.0, a.1) };
        let (bk, bn) = if g.transb { (b.1, b.0) } else { (b.0, b.1) };
        assert_eq!(
            (am as usize, bk as usize, bn as usize),
            (m, k as usize, n),
            "{a:?} {b:?} {d:?}"
        );
        let k = k as usize;
        let (lda, ldb, ldc) = (a.2 as usize, b.2 as usize, d.2 as usize);
        let at = |i: usize, p: usize| {
            if g.transa {
                first[p + i * lda]
            } else {
                first[i + p * lda]
            }
        };
        let bt = |p: usize, j: usize| {
            if g.transb {
                second[j + p * ldb]
            } else {
                second[p + j * ldb]
            }
        };
        let mut out = vec![f32::NAN; ldc * n];
        for j in 0..n {
            for i in 0..m {
                let s: f32 = (0..k).map(|p| at(i, p) * bt(p, j)).sum::<f32>() + bias[i];
                out[i + j * ldc] = if relu { s.max(0.0) } else { s };
            }
        }
        out
    }

    /// Row-major `x·w + bias` (then ReLU) with `x [rows, k]` and `w [k, n]` read through
    /// their descriptions.
    fn direct(x: (&[f32], MatDesc), w: (&[f32], MatDesc), bias: &[f32], relu: bool) -> Vec<f32> {
        let (rows, k, n) = (x.1.rows, x.1.cols, w.1.cols);
        let mut out = Vec::with_capacity(rows * n);
        for r in 0..rows {
            for (c, b) in bias.iter().enumerate().take(n) {
                let s: f32 = (0..k)
                    .map(|p| x.0[r * x.1.rs + p * x.1.cs] * w.0[p * w.1.rs + c * w.1.cs])
                    .sum::<f32>()
                    + b;
                out.push(if relu { s.max(0.0) } else { s });
            }
        }
        out
    }

    /// The layouts, transposes and operand swap given to cuBLASLt compute row-major
    /// `x·w + bias` with the bias along the output's columns: for plain and transposed
    /// weights, and an input that is a strided view (rows further apart than `k`).
    #[test]
    fn lt_layouts_compute_the_row_major_linear() {
        let (rows, k, n) = (3usize, 4usize, 5usize);
        let val = |i: usize| ((i * 7 + 3) % 11) as f32 - 5.0;
        let bias: Vec<f32> = (0..n).map(|c| c as f32 * 0.5 - 1.0).collect();
        let xs: Vec<f32> = (0..rows * 6).map(val).collect();
        let ws: Vec<f32> = (0..k * n).map(|i| val(i + 40)).collect();
        let plain_x = MatDesc {
            rows,
            cols: k,
            rs: k,
            cs: 1,
        };
        let wide_x = MatDesc {
            rows,
            cols: k,
            rs: 6,
            cs: 1,
        };
        let plain_w = MatDesc {
            rows: k,
            cols: n,
            rs: n,
            cs: 1,
        };
        // `w` stored as `[n, k]` (a linear layer's `[out, in]`), read transposed.
        let trans_w = MatDesc {
            rows: k,
            cols: n,
            rs: 1,
            cs: k,
        };
        for (x, w) in [
            (plain_x, plain_w),
            (plain_x, trans_w),
            (wide_x, plain_w),
            (wide_x, trans_w),
        ] {
            let g = sgemm_args((rows, k, n), &x, &w, n).expect("cuBLAS reads both");
            for relu in [false, true] {
                let got = emulate(&g, &ws, &xs, &bias, relu);
                let want = direct((&xs, x), (&ws, w), &bias, relu);
                assert_eq!(got, want, "{x:?} · {w:?}, relu {relu}");
            }
        }
    }

    #[test]
    fn alignments_are_powers_of_two_up_to_256() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
        assert_eq!(alignment(0x7f00_0000_0004), 4);
        assert_eq!(alignment(0x7f00_0000_0002), 2);
        assert_eq!(alignment(0x7f00_0000_0180), 128);
        assert!(bias_fits(0x7f00_0000_0010));
        assert!(!bias_fits(0x7f00_0000_0008));
    }
}
