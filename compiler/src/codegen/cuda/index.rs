//! Index and mask primitives as CUDA C: `causal_mask`, `pad_mask`, `arange`, `concat`,
//! and `scatter_add` (the embedding gradient) over a host-built row index.
//!
//! In: the primitive (and for `concat` its operand count). Out: one [`CudaFunction`].
//! The CPU backend runs these through the eager executor's kernels, so there are no CPU
//! dims helpers to share: each function documents its own `dims` (and [`causal_mask_dims`]
//! … give them). Every element is 4 bytes (`int`, bools as 0/1); items are output
//! elements, one thread each. Semantics are the reference executor's:
//!
//! | kind          | buffers               | dims                              | `out[e]`                       |
//! |---------------|-----------------------|-----------------------------------|--------------------------------|
//! | `causal_mask` | out `[q, k]`          | `[q, k]`                          | `j ≤ i + (k − q)`              |
//! | `pad_mask`    | ids, out (same shape) | `[n, pad]`                        | `ids[e] ≠ pad`                 |
//! | `arange`      | out `[n]`             | `[n, start]`                      | `start + e` (the caller checks that it fits in `i32`) |
//! | `concat`      | in0 … in(N−1), out    | `[outer, inner, n0, …, n(N−1)]`   | the operand holding position `a` of the axis |
//!
//! `concat` views every operand as `[outer, n_k, inner]` (contiguous) and the output as
//! `[outer, Σ n_k, inner]`.
//!
//! `scatter_add(ids[n], src[n, w]) -> out[rows, w]` is [`scatter_rows`]: the caller
//! counting-sorts the ids (they are few: one per token) into `start[rows + 1]` and
//! `order[n]` — the positions landing on row `r` are `order[start[r]..start[r + 1]]`, in
//! increasing order — and each thread sums one output element over its row's positions
//! from `0.0` in that order: the CPU fallback's order, so bit-identical, and every output
//! element written (rows no id names are 0). `scatter_add_into(base, ids, src)` is
//! [`scatter_rows_onto_as`] over the same index: the sums added onto the base, in place.

use crate::codegen::cuda::misc::words;
use crate::codegen::cuda::text::{Elem, W};
use crate::codegen::cuda::{param, signature, CudaFunction, Work, FOR_THREADS};

fn threads(name: &str, params: Vec<crate::codegen::cuda::Param>, w: W) -> CudaFunction {
    CudaFunction {
        name: name.to_string(),
        params,
        work: Work::Threads,
        items_rule: "elements of the output".into(),
        text: w.finish(),
    }
}

/// The causal mask `[q, k]`.
pub fn causal_mask(name: &str) -> CudaFunction {
    let params = vec![param("out", "int*")];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long q = dims.d[0];");
    w.l("const long long k = dims.d[1];");
    w.open(FOR_THREADS);
    w.l("const long long row = i / k;");
    w.l("const long long j = i - row * k;");
    w.l("out[i] = j <= row + (k - q) ? 1 : 0;");
    w.close();
    w.close();
    threads(name, params, w)
}

/// Dims and items of [`causal_mask`].
pub fn causal_mask_dims(q: usize, k: usize) -> (Vec<i64>, usize) {
    (vec![q as i64, k as i64], q * k)
}

/// `out = ids ≠ pad`.
pub fn pad_mask(name: &str) -> CudaFunction {
    let params = vec![param("ids", "const int*"), param("out", "int*")];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long pad = dims.d[1];");
    w.open(FOR_THREADS);
    w.l("out[i] = (long long)ids[i] != pad ? 1 : 0;");
    w.close();
    w.close();
    threads(name, params, w)
}

/// Dims and items of [`pad_mask`] over `n` ids.
pub fn pad_mask_dims(n: usize, pad: i64) -> (Vec<i64>, usize) {
    (vec![n as i64, pad], n)
}

/// `out[e] = start + e`.
pub fn arange(name: &str) -> CudaFunction {
    let params = vec![param("out", "int*")];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long start = dims.d[1];");
    w.open(FOR_THREADS);
    w.l("out[i] = (int)(start + i);");
    w.close();
    w.close();
    threads(name, params, w)
}

/// Dims and items of [`arange`] of `n` values from `start`.
pub fn arange_dims(n: usize, start: i64) -> (Vec<i64>, usize) {
    (vec![n as i64, start], n)
}

/// The concatenation of `inputs` operands along an axis.
pub fn concat(name: &str, inputs: usize) -> Result<CudaFunction, String> {
    concat_as(name, &vec![Elem::F32; inputs], Elem::F32)
}

/// [`concat()`] of operands stored as `ins` into an output stored as `out`: elements move
/// unchanged where an operand's type is the output's, else widened or rounded (only
/// float values differ in storage).
pub fn concat_as(name: &str, ins: &[Elem], out: Elem) -> Result<CudaFunction, String> {
    let inputs = ins.len();
    if inputs == 0 || 2 + inputs > crate::codegen::cuda::text::MAX_DIMS {
        return Err(format!("concat of {inputs} operands"));
    }
    let mut params: Vec<_> = ins
        .iter()
        .enumerate()
        .map(|(k, &e)| param(&format!("in{k}"), &format!("const {}*", words(e))))
        .collect();
    params.push(param("out", &format!("{}*", words(out))));
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long inner = dims.d[1];");
    let total: Vec<String> = (0..inputs).map(|k| format!("dims.d[{}]", 2 + k)).collect();
    w.l(format!("const long long total = {};", total.join(" + ")));
    w.open(FOR_THREADS);
    w.l("const long long o = i / (total * inner);");
    w.l("const long long rem = i - o * (total * inner);");
    w.l("long long a = rem / inner;");
    w.l("const long long c = rem - a * inner;");
    for (k, &e) in ins.iter().enumerate() {
        let n = format!("dims.d[{}]", 2 + k);
        let at = format!("in{k}[(o * {n} + a) * inner + c]");
        let value = if e == out {
            at
        } else {
            narrow(out, &widen(e, &at))
        };
        let read = format!("out[i] = {value};");
        if k + 1 < inputs {
            w.open(format!("if (a < {n})"));
            w.l(read);
            w.l("continue;");
            w.close();
            w.l(format!("a = a - {n};"));
        } else {
            w.l(read);
        }
    }
    w.close();
    w.close();
    Ok(threads(name, params, w))
}

/// A stored float element (as [`words`] holds it) as a `float`.
fn widen(e: Elem, x: &str) -> String {
    match e {
        Elem::F32 => format!("__int_as_float((int){x})"),
        Elem::Bf16 => format!("kiln_bf16_to_f32({x})"),
    }
}

/// A `float` as the element [`words`] stores.
fn narrow(e: Elem, v: &str) -> String {
    match e {
        Elem::F32 => format!("(unsigned)__float_as_int({v})"),
        Elem::Bf16 => format!("kiln_f32_to_bf16({v})"),
    }
}

/// Dims and items of [`concat()`]: `outer` and `inner` around the axis, `sizes` the
/// operands' lengths along it.
pub fn concat_dims(outer: usize, inner: usize, sizes: &[usize]) -> (Vec<i64>, usize) {
    let mut dims = vec![outer as i64, inner as i64];
    dims.extend(sizes.iter().map(|&n| n as i64));
    let items = outer * inner * sizes.iter().sum::<usize>();
    (dims, items)
}

/// `out[r, j] = Σ_{k ∈ start[r]..start[r+1]} src[order[k], j]`, in that order from `0.0`.
/// Buffers `[start, order, src, out]`, dims `[rows, w]`, items `rows · w`.
pub fn scatter_rows(name: &str) -> CudaFunction {
    scatter_rows_as(name, Elem::F32, Elem::F32)
}

/// [`scatter_rows`] with `src` stored as `src` and `out` as `out` (the sums are `float`).
pub fn scatter_rows_as(name: &str, src: Elem, out: Elem) -> CudaFunction {
    scatter_rows_with(name, None, src, out)
}

/// `out[r, j] = base[r, j] + Σ_{k ∈ start[r]..start[r+1]} src[order[k], j]` for a row some
/// id names (the sum in that order from `0.0`, then added once: the reference's `base +
/// scatter_add(ids, src)`), `out[r, j] = base[r, j]` for the others — the CPU fallback's
/// values. Each thread reads its base element before it writes the same element of
/// `out`, so `out` may be `base` (`plan::in_place`). Buffers `[start, order, base, src,
/// out]`, dims `[rows, w]` ([`scatter_rows_dims`]), items `rows · w`.
pub fn scatter_rows_onto_as(name: &str, base: Elem, src: Elem, out: Elem) -> CudaFunction {
    scatter_rows_with(name, Some(base), src, out)
}

/// [`scatter_rows_as`], or with a `base` [`scatter_rows_onto_as`].
fn scatter_rows_with(name: &str, base: Option<Elem>, src: Elem, out: Elem) -> CudaFunction {
    let mut params = vec![param("start", "const int*"), param("order", "const int*")];
    if let Some(b) = base {
        // Not `const … __restrict__`: it may be `out` itself.
        params.push(param("base", &b.ptr(false)));
    }
    params.push(param("src", &src.ptr(true)));
    params.push(param("out", &out.ptr(false)));
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long width = dims.d[1];");
    w.open(FOR_THREADS);
    w.l("const long long r = i / width;");
    w.l("const long long j = i - r * width;");
    if let Some(b) = base {
        w.l(format!("const float b = {};", b.load("base[i]")));
        w.open("if (start[r] == start[r + 1])");
        w.l(format!("out[i] = {};", out.store("b")));
        w.l("continue;");
        w.close();
    }
    w.l("float s = 0.0f;");
    w.open("for (int k = start[r]; k < start[r + 1]; ++k)");
    w.l(format!(
        "s = s + {};",
        src.load("src[(long long)order[k] * width + j]")
    ));
    w.close();
    let sum = if base.is_some() { "b + s" } else { "s" };
    w.l(format!("out[i] = {};", out.store(sum)));
    w.close();
    w.close();
    threads(name, params, w)
}

/// Dims and items of [`scatter_rows`] into `[rows, w]`.
pub fn scatter_rows_dims(rows: usize, w: usize) -> (Vec<i64>, usize) {
    (vec![rows as i64, w as i64], rows * w)
}

/// The row index [`scatter_rows`] reads: `(start[rows + 1], order[n])` of `ids`, or the
/// first id outside `0..rows` as `Err((position, id))`.
pub fn scatter_index(ids: &[i32], rows: usize) -> Result<(Vec<i32>, Vec<i32>), (usize, i32)> {
    let mut start = vec![0i32; rows + 1];
    for (p, &id) in ids.iter().enumerate() {
        if id < 0 || id as usize >= rows {
            return Err((p, id));
        }
        start[id as usize + 1] += 1;
    }
    for r in 0..rows {
        start[r + 1] += start[r];
    }
    let mut fill: Vec<i32> = start[..rows].to_vec();
    let mut order = vec![0i32; ids.len()];
    for (p, &id) in ids.iter().enumerate() {
        let f = &mut fill[id as usize];
        order[*f as usize] = p as i32;
        *f += 1;
    }
    Ok((start, order))
}
