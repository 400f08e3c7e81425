//! The decoder's state kept on the device between steps: the row gather that reorders it
//! when beam search reorders (and first expands) its hypotheses.
//!
//! In: nothing but each call's sizes. Out: [`code`] — a CUDA unit of its own (the
//! prelude and [`TAKE_ROWS`]), compiled by NVRTC next to an entry's module with the same
//! [`super::nvrtc_options`]:
//!
//! | function       | buffers              | dims           | does, per element `i < n·width` |
//! |----------------|----------------------|----------------|----------------------------------|
//! | [`TAKE_ROWS`]  | `[rows, src, out]`   | `[n, width]`   | `out[r, j] = src[rows[r], j]`    |
//!
//! Items `n·width` (one thread per element, `Work::Threads`). Elements are 4-byte words
//! (f32, i32 and bools as 0/1 alike), so one function serves every state tensor viewed
//! as `[rows, width]`; `rows` holds `n` row indices of the source, repeats allowed (the
//! host checks them). The copy is exact: the host's `take_rows`, bit for bit.
//!
//! # The best tokens of each row ([`row_top_k`])
//!
//! What beam search reads of a step's logits, so that they never leave the device: per
//! row, the log-sum-exp, the `k` best tokens and their log-probabilities, and the
//! end-of-sentence token's log-probability. Buffers `[logits, banned, vals, idx, eos]`:
//! `logits` (f32, or bf16 for a mixed-precision program: [`TOP_K_BF16`]) read as rows of
//! `v` values, row `r` starting at element `r·stride + offset` (the last position of a
//! `[rows, len, v]` tensor: `stride = len·v`, `offset = (len − 1)·v`); `banned` the token
//! ids never chosen (`int`, `nb` of them: padding, beginning of sentence); results `vals`
//! (`double[rows·k]`), `idx` (`int[rows·k]`), `eos` (`double[rows]`). Dims `[v, stride,
//! offset, k, nb, eos id]` ([`row_top_k_dims`]); items rows, one block each
//! (`Work::Blocks`).
//!
//! In f64, as the host's `log_softmax_rows`: `lse = m + log Σ exp(x − m)` over the row's
//! non-NaN values (`m` their maximum; a block tree sums them, so the last bits may differ
//! from the host's sequential sum), a log-probability is `x − lse`. The `k` chosen are
//! the first in the order *larger value, then smaller id* among the non-NaN, non-banned
//! tokens — the host's order for the same values; slots past the last such token hold id
//! `−1` and `−∞`. Each of the `k` rounds takes the best token after the previous one in
//! that order (a block arg-max: no scratch, any `k`).

use crate::codegen::cuda::text::{f32_lit, prelude, Elem, W};
use crate::codegen::cuda::{
    for_cols, param, signature, CudaCode, CudaFunction, Work, FOR_BLOCKS, FOR_THREADS,
};

/// `out[r, j] = src[rows[r], j]`.
pub const TAKE_ROWS: &str = "kiln_take_rows";

/// [`TAKE_ROWS`].
pub fn take_rows() -> CudaFunction {
    let params = vec![
        param("rows", "const int*"),
        param("src", "const unsigned*"),
        param("out", "unsigned*"),
    ];
    let mut w = W::new();
    signature(&mut w, TAKE_ROWS, &params);
    w.l("const long long width = dims.d[1];");
    w.open(FOR_THREADS);
    w.l("const long long r = i / width;");
    w.l("const long long j = i - r * width;");
    w.l("out[i] = src[(long long)rows[r] * width + j];");
    w.close();
    w.close();
    CudaFunction {
        name: TAKE_ROWS.to_string(),
        params,
        work: Work::Threads,
        items_rule: "elements of the output".to_string(),
        text: w.finish(),
    }
}

/// Dims and items of [`TAKE_ROWS`] for `n` rows of `width` words.
pub fn take_rows_dims(n: usize, width: usize) -> (Vec<i64>, usize) {
    (vec![n as i64, width as i64], n * width)
}

/// The best tokens of rows of f32 logits ([`row_top_k`]).
pub const TOP_K: &str = "kiln_row_top_k";
/// The best tokens of rows of bf16 logits ([`row_top_k`]).
pub const TOP_K_BF16: &str = "kiln_row_top_k_bf16";

/// [`TOP_K`] (`Elem::F32`) or [`TOP_K_BF16`] (see the module documentation).
pub fn row_top_k(e: Elem) -> CudaFunction {
    let name = match e {
        Elem::F32 => TOP_K,
        Elem::Bf16 => TOP_K_BF16,
    };
    let params = vec![
        param("logits", &e.ptr(true)),
        param("banned", "const int*"),
        param("vals", "double*"),
        param("idx", "int*"),
        param("eos", "double*"),
    ];
    let neg_inf = f32_lit(f32::NEG_INFINITY);
    let x = |j: &str| e.load(&format!("x[{j}]"));
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("__shared__ double shd[KILN_THREADS];");
    w.l("__shared__ float shv[KILN_THREADS];");
    w.l("__shared__ long long shi[KILN_THREADS];");
    w.l("const long long v = dims.d[0];");
    w.l("const long long stride = dims.d[1];");
    w.l("const long long offset = dims.d[2];");
    w.l("const long long k = dims.d[3];");
    w.l("const long long nb = dims.d[4];");
    w.l("const long long eos_id = dims.d[5];");
    w.l("const unsigned t = threadIdx.x;");
    w.open(FOR_BLOCKS);
    w.l(format!(
        "const {}* x = logits + r * stride + offset;",
        e.c_type()
    ));
    w.l("// The maximum of the non-NaN values (NaN compares false).");
    w.l(format!("float m = {neg_inf};"));
    w.open(for_cols("v"));
    w.l(format!("const float a = {};", x("j")));
    w.l("if (a > m) m = a;");
    w.close();
    w.l("shv[t] = m;");
    w.l("__syncthreads();");
    w.open("for (unsigned s = blockDim.x >> 1; s > 0; s >>= 1)");
    w.l("if (t < s && shv[t + s] > shv[t]) shv[t] = shv[t + s];");
    w.l("__syncthreads();");
    w.close();
    w.l("m = shv[0];");
    w.l("__syncthreads();");
    w.l("double sum = 0;");
    w.open(for_cols("v"));
    w.l(format!("const float a = {};", x("j")));
    w.l("if (a == a) sum = sum + exp((double)a - (double)m);");
    w.close();
    w.l("shd[t] = sum;");
    w.l("__syncthreads();");
    w.open("for (unsigned s = blockDim.x >> 1; s > 0; s >>= 1)");
    w.l("if (t < s) shd[t] = shd[t] + shd[t + s];");
    w.l("__syncthreads();");
    w.close();
    w.l("const double lse = (double)m + log(shd[0]);");
    w.l("__syncthreads();");
    w.l("// k rounds: the best token after the previous pick in (value desc, id asc).");
    w.l(format!("float pv = {neg_inf};"));
    w.l("long long pi = -1;");
    w.open("for (long long round = 0; round < k; ++round)");
    w.l(format!("float bv = {neg_inf};"));
    w.l("long long bi = -1;");
    w.open(for_cols("v"));
    w.l(format!("const float a = {};", x("j")));
    w.l("if (a != a) continue;");
    w.l("bool skip = false;");
    w.open("for (long long q = 0; q < nb; ++q)");
    w.l("if (banned[q] == j) skip = true;");
    w.close();
    w.l("if (skip) continue;");
    w.l("if (pi >= 0 && !(a < pv || (a == pv && j > pi))) continue;");
    w.l("if (bi < 0 || a > bv || (a == bv && j < bi)) { bv = a; bi = j; }");
    w.close();
    w.l("shv[t] = bv;");
    w.l("shi[t] = bi;");
    w.l("__syncthreads();");
    w.open("for (unsigned s = blockDim.x >> 1; s > 0; s >>= 1)");
    w.open("if (t < s)");
    w.l("const float ov = shv[t + s];");
    w.l("const long long oi = shi[t + s];");
    w.open("if (oi >= 0 && (shi[t] < 0 || ov > shv[t] || (ov == shv[t] && oi < shi[t])))");
    w.l("shv[t] = ov;");
    w.l("shi[t] = oi;");
    w.close();
    w.close();
    w.l("__syncthreads();");
    w.close();
    w.l("bv = shv[0];");
    w.l("bi = shi[0];");
    w.l("__syncthreads();");
    w.open("if (t == 0)");
    w.l(format!(
        "vals[r * k + round] = bi < 0 ? (double){neg_inf} : (double)bv - lse;"
    ));
    w.l("idx[r * k + round] = bi < 0 ? -1 : (int)bi;");
    w.close();
    w.l("pv = bv;");
    w.l("pi = bi;");
    w.l("if (bi < 0) pi = v;");
    w.close();
    w.open("if (t == 0)");
    w.l(format!(
        "eos[r] = (eos_id >= 0 && eos_id < v) ? (double){} - lse : (double){neg_inf};",
        x("eos_id")
    ));
    w.close();
    w.l("__syncthreads();");
    w.close();
    w.close();
    CudaFunction::new(name, params, Work::Blocks, "rows", w)
}

/// Dims and items of [`row_top_k`]: rows of `v` logits, row `r` at `r·stride + offset`,
/// the best `k`, `banned` ids, the end-of-sentence id.
pub fn row_top_k_dims(
    rows: usize,
    (v, stride, offset): (usize, usize, usize),
    k: usize,
    banned: usize,
    eos: i32,
) -> (Vec<i64>, usize) {
    (
        vec![
            v as i64,
            stride as i64,
            offset as i64,
            k as i64,
            banned as i64,
            i64::from(eos),
        ],
        rows,
    )
}

/// The resident decoder's unit: the prelude, [`TAKE_ROWS`], [`TOP_K`] and [`TOP_K_BF16`].
/// Deterministic text.
pub fn code() -> CudaCode {
    CudaCode {
        prelude: prelude(),
        functions: vec![take_rows(), row_top_k(Elem::F32), row_top_k(Elem::Bf16)],
        kernels: Vec::new(),
        storage: Vec::new(),
    }
}
