//! Element-type conversion for GEMM operands: the CUDA executor's bf16 GEMMs
//! (`CudaOptions::bf16`) read f32 activations and parameters as bf16.
//!
//! In: nothing but the element count of each call. Out: [`code`] — a CUDA unit of its own
//! (the prelude and [`TO_BF16`]), compiled next to an entry's module with the same
//! [`super::nvrtc_options`]: buffers `[src (f32), dst (bf16)]`, dims `[n]`, items `n`,
//! `dst[i] = kiln_f32_to_bf16(src[i])` — round to nearest, ties to even, overflow to
//! infinity, NaN stays a quiet NaN (the `half` crate's conversion, bit for bit).

use crate::codegen::cuda::text::{prelude, W};
use crate::codegen::cuda::{param, signature, CudaCode, CudaFunction, Work, FOR_THREADS};

/// f32 → bf16, one element per thread.
pub const TO_BF16: &str = "kiln_to_bf16";

/// The [`TO_BF16`] function.
pub fn to_bf16() -> CudaFunction {
    let params = vec![param("src", "const float*"), param("dst", "kiln_bf16*")];
    let mut w = W::new();
    signature(&mut w, TO_BF16, &params);
    w.open(FOR_THREADS);
    w.l("dst[i] = kiln_f32_to_bf16(src[i]);");
    w.close();
    w.close();
    CudaFunction {
        name: TO_BF16.to_string(),
        params,
        work: Work::Threads,
        items_rule: "elements n".to_string(),
        text: w.finish(),
    }
}

/// The conversion unit: the prelude and [`TO_BF16`]. Deterministic text.
pub fn code() -> CudaCode {
    CudaCode {
        prelude: prelude(),
        functions: vec![to_bf16()],
        kernels: Vec::new(),
        storage: Vec::new(),
    }
}
