//! Row kernels as CUDA C: softmaxes, layer norm and its backward, the label-smoothed
//! cross-entropy. One block of [`THREADS`](crate::codegen::cuda::text::THREADS) threads
//! per row (or per block of rows); each thread owns the columns `j ≡ threadIdx.x (mod
//! blockDim.x)` in every pass, and row sums and maxima go through the prelude's fixed
//! block tree (`kiln_block_sum`, `kiln_block_max`).
//!
//! In: the element type of the float buffers (and the mask kind). Out: one
//! [`CudaFunction`]. Buffers and `dims` are the CPU kernels' ([`crate::codegen::rows`]):
//! the same order, the same `*_dims` arrays, the same aliasing allowances (an output may
//! be the input where the CPU kernel allows it: every thread reads an element before it
//! writes it, and a block barrier separates a pass that reads other threads' elements
//! from the writes). Items are the CPU kernels' items too (rows, or blocks of
//! [`LN_BWD_BLOCK`] rows), except for `add_layer_norm_bwd_finish` (tiles of 32 columns,
//! [`add_layer_norm_bwd_finish_items`]; the CPU's are columns) and the `xent_ls` helpers
//! documented below.
//!
//! The formulas are the CPU kernels', step for step; only the order of the row sums
//! differs (a block tree instead of four vector lanes).
//!
//! `xent_ls` runs as three kernels so that no value crosses to the host: [`xent_ls_count`]
//! (`den` = the non-pad targets, and `1/den`), [`xent_ls`] (the CPU kernel's per-row loss
//! and logits' gradient, reading `inv_den` from the count's buffer; in two passes over
//! the logits where the CPU takes three: an online max and sum of exponentials, then the
//! gradient, the exponentials computed again; `Σ(x − m)` as `Σx − v·m`), and
//! [`xent_ls_finish`] (`Σ row_loss / den` into the scalar loss).

use crate::codegen::cuda::text::{f32_lit, Elem, GROUP, W};
use crate::codegen::cuda::{
    for_cols, param, signature, CudaFunction, Param, Work, FOR_BLOCKS, FOR_WARPS, WARPS_HEAD,
};
use crate::codegen::rows::{MaskKind, LN_BWD_BLOCK};

mod layer_norm;
mod layer_norm_bwd;
mod xent;

pub use layer_norm::*;
pub use layer_norm_bwd::*;
pub use xent::*;

fn function(name: &str, params: Vec<Param>, work: Work, items: &str, w: W) -> CudaFunction {
    CudaFunction::new(name, params, work, items, w)
}

/// Opens a row kernel: signature, shared scratch, the loop over rows `r`.
fn open_rows(w: &mut W, name: &str, params: &[Param]) {
    signature(w, name, params);
    w.l("__shared__ float sh[KILN_THREADS];");
}

/// The last two passes of a softmax into `outr` given the row max `m` and the value
/// expression `value` of element `j`: `e = exp(value − m)` summed, then `e · (1/Σe)`.
fn softmax_tail(w: &mut W, e: Elem, n: &str, value: &str) {
    w.l("float z = 0.0f;");
    w.open(for_cols(n));
    w.l(format!("const float ex = expf({value} - m);"));
    w.l(format!("outr[j] = {};", e.store("ex")));
    w.l("z = z + ex;");
    w.close();
    w.l("z = kiln_block_sum(z, sh);");
    w.l("const float rz = 1.0f / z;");
    w.open(for_cols(n));
    w.l(format!(
        "outr[j] = {};",
        e.store(&format!("{} * rz", e.load("outr[j]")))
    ));
    w.close();
}

/// `out[r, :] = softmax(x[r, :])`. Buffers `[x, out]`, dims `[c]`, items rows.
pub fn softmax(name: &str, e: Elem) -> CudaFunction {
    let params = vec![param("x", &e.ptr(true)), param("out", &e.ptr(false))];
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long c = dims.d[0];");
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* xr = x + r * c;", e.c_type()));
    w.l(format!("{}* outr = out + r * c;", e.c_type()));
    w.l(format!("float m = {};", f32_lit(f32::NEG_INFINITY)));
    w.open(for_cols("c"));
    w.l(format!("m = kiln_max_ref(m, {});", e.load("xr[j]")));
    w.close();
    w.l("m = kiln_block_max(m, sh);");
    softmax_tail(&mut w, e, "c", &e.load("xr[j]"));
    w.close();
    w.close();
    function(name, params, Work::Blocks, "rows", w)
}

/// `softmax(where(mask, x·scale, fill))` over the last axis of `x[b, h, tq, tk]`.
/// Buffers `[x, scale, out]` without a mask, else `[x, mask, scale, fill, out]` (mask
/// `int` 0/1: `[b, tk]` for `Key`, `[tq, tk]` for `Causal`); dims `[b, h, tq, tk]`; items
/// rows `b·h·tq`.
pub fn scale_mask_softmax(name: &str, mask: MaskKind, e: Elem) -> CudaFunction {
    let masked = mask != MaskKind::None;
    let mut params = vec![param("x", &e.ptr(true))];
    if masked {
        params.push(param("mask", "const int*"));
    }
    params.push(param("scale", "const float*"));
    if masked {
        params.push(param("fill", "const float*"));
    }
    params.push(param("out", &e.ptr(false)));
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    if mask == MaskKind::Key {
        w.l("const long long h = dims.d[1];");
    }
    if masked {
        w.l("const long long tq = dims.d[2];");
    }
    w.l("const long long tk = dims.d[3];");
    w.l("const float s = scale[0];");
    if masked {
        w.l("const float f = fill[0];");
    }
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* xr = x + r * tk;", e.c_type()));
    w.l(format!("{}* outr = out + r * tk;", e.c_type()));
    let value = match mask {
        MaskKind::None => format!("({} * s)", e.load("xr[j]")),
        _ => {
            let mrow = if mask == MaskKind::Key {
                "r / (h * tq)"
            } else {
                "r % tq"
            };
            w.l(format!("const int* mr = mask + ({mrow}) * tk;"));
            format!("(mr[j] != 0 ? {} * s : f)", e.load("xr[j]"))
        }
    };
    w.l(format!("float m = {};", f32_lit(f32::NEG_INFINITY)));
    w.open(for_cols("tk"));
    w.l(format!("m = kiln_max_ref(m, {value});"));
    w.close();
    w.l("m = kiln_block_max(m, sh);");
    softmax_tail(&mut w, e, "tk", &value);
    w.close();
    w.close();
    function(name, params, Work::Blocks, "rows b·h·tq", w)
}

/// `ds = p ∘ (dp − Σ p∘dp) · mult` per row. Buffers `[p, dp, mult, ds]` (`ds` may be
/// `dp`), dims `[c]`, items rows.
pub fn softmax_bwd(name: &str, e: Elem) -> CudaFunction {
    let params = vec![
        param("p", &e.ptr(true)),
        param("dp", &e.ptr(true)),
        param("mult", "const float*"),
        param("ds", &e.ptr(false)),
    ];
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long c = dims.d[0];");
    w.l("const float k = mult[0];");
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* pr = p + r * c;", e.c_type()));
    w.l(format!("const {}* dpr = dp + r * c;", e.c_type()));
    w.l(format!("{}* dsr = ds + r * c;", e.c_type()));
    w.l("float dot = 0.0f;");
    w.open(for_cols("c"));
    w.l(format!(
        "dot = dot + {} * {};",
        e.load("pr[j]"),
        e.load("dpr[j]")
    ));
    w.close();
    w.l("dot = kiln_block_sum(dot, sh);");
    w.open(for_cols("c"));
    w.l(format!("const float d = {} - dot;", e.load("dpr[j]")));
    w.l(format!("const float v = {} * d;", e.load("pr[j]")));
    w.l(format!("dsr[j] = {};", e.store("v * k")));
    w.close();
    w.close();
    w.close();
    function(name, params, Work::Blocks, "rows", w)
}
