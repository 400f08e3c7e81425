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

use crate::codegen::cuda::text::{prelude, W};
use crate::codegen::cuda::{param, signature, CudaCode, CudaFunction, Work, FOR_THREADS};

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

/// The resident decoder's unit: the prelude and [`TAKE_ROWS`]. Deterministic text.
pub fn code() -> CudaCode {
    CudaCode {
        prelude: prelude(),
        functions: vec![take_rows()],
        kernels: Vec::new(),
    }
}
