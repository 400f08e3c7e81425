//! Small kernels as CUDA C: Adam, bias gradients (`sum_rows`), single-axis reductions,
//! bias fill, relu, strided copy.
//!
//! In: each kind's static configuration (leading axes, reduce op and layout, element
//! type). Out: one [`CudaFunction`]. Buffers and `dims` are the CPU kernels'
//! ([`crate::codegen::misc`]); items differ where the CPU groups elements per item:
//!
//! | kind            | items (GPU)                         | CPU items                |
//! |-----------------|-------------------------------------|--------------------------|
//! | `adam_update`   | elements `n`                        | `⌈n / BLOCK⌉`            |
//! | `sum_rows`      | chunks × column tiles, then tiles   | `⌈n / GROUP⌉`            |
//! | `reduce` rows   | rows `outer` (one block each)       | `outer`                  |
//! | `reduce` across | outputs `outer · inner`             | `outer · ⌈inner / GROUP⌉`|
//! | `fill_rows`     | elements `R · n`                    | `R`                      |
//! | `relu`          | elements `n`                        | `⌈n / BLOCK⌉`            |
//! | `copy_strided`  | elements `s0 · … · s4`, four a thread | `s0 · s1 · s2 · s3`    |
//!
//! The `_as` forms take the element type of each activation buffer (a mixed-precision
//! program's, [`crate::codegen::cuda::storage`]): loads widen bf16 to `float`, stores
//! round, sums stay `float`; `copy_strided_as` moves 2-byte elements unchanged.
//!
//! Every output element is computed by one thread in the CPU kernel's order where that
//! order is sequential (`adam_update`, `reduce` across rows: bit-identical
//! with [`crate::codegen::cuda::nvrtc_options`]); a row reduction uses the block tree and
//! then, for `max`, returns the first element equal to the maximum or NaN, as the
//! reference does. `sum_rows` (bias gradients, up to tens of thousands of rows) sums in
//! two passes for parallelism: partial sums of row chunks, then the chunks in order.

use crate::codegen::clif::Reduce;
use crate::codegen::cuda::rows::{column_tiles, COL_TILE};
use crate::codegen::cuda::text::{f32_lit, Elem, W};
use crate::codegen::cuda::{
    for_cols, param, signature, CudaFunction, Param, Work, FOR_BLOCKS, FOR_QUADS, FOR_THREADS,
};
use crate::codegen::misc::{ReduceLayout, MAX_COPY_RANK};

/// The C type that moves one element of `e` unchanged.
pub(crate) fn words(e: Elem) -> &'static str {
    match e {
        Elem::F32 => "unsigned",
        Elem::Bf16 => "kiln_bf16",
    }
}

fn function(name: &str, params: Vec<Param>, work: Work, items: &str, w: W) -> CudaFunction {
    CudaFunction::new(name, params, work, items, w)
}

/// One Adam step per element, the CPU kernel's op order:
///
/// ```text
/// m' = b1·m + c1·g;  v' = b2·v + (c2·g)·g;  p' = p − (step_size·m') / (sqrt(v')·inv_sqrt_bc2 + eps)
/// ```
///
/// Buffers `[p, g, m, v, b1, b2, c1, c2, eps, step_size, inv_sqrt_bc2, p_out, m_out,
/// v_out]` (the outputs may be `p`, `m`, `v`), dims `[n]`, items `n`.
pub fn adam_update(name: &str, e: Elem) -> CudaFunction {
    let t = e.c_type();
    let mut params: Vec<Param> = ["p", "g", "m", "v"]
        .iter()
        .map(|n| param(n, &format!("const {t}*")))
        .collect();
    for s in ["b1", "b2", "c1", "c2", "eps", "step_size", "inv_sqrt_bc2"] {
        params.push(param(s, "const float*"));
    }
    for o in ["p_out", "m_out", "v_out"] {
        params.push(param(o, &format!("{t}*")));
    }
    let mut w = W::new();
    signature(&mut w, name, &params);
    for s in ["b1", "b2", "c1", "c2", "eps", "step_size", "inv_sqrt_bc2"] {
        w.l(format!("const float k_{s} = {s}[0];"));
    }
    w.open(FOR_THREADS);
    for b in ["p", "g", "m", "v"] {
        w.l(format!(
            "const float {b}i = {};",
            e.load(&format!("{b}[i]"))
        ));
    }
    adam_math(&mut w);
    w.l(format!("p_out[i] = {};", e.store("p2")));
    w.l(format!("m_out[i] = {};", e.store("m2")));
    w.l(format!("v_out[i] = {};", e.store("v2")));
    w.close();
    w.close();
    function(name, params, Work::Threads, "elements n", w)
}

/// Adam's arithmetic on `pi`, `gi`, `mi`, `vi` and the constants `k_b1`, `k_b2`, `k_c1`,
/// `k_c2`, `k_eps`, `k_step_size`, `k_inv_sqrt_bc2`, giving `m2`, `v2` and `p2` in the
/// host optimizer's op order (`kiln_train::optim::Adam::step`).
pub(crate) fn adam_math(w: &mut W) {
    w.l("const float m2 = k_b1 * mi + k_c1 * gi;");
    w.l("const float v2 = k_b2 * vi + (k_c2 * gi) * gi;");
    w.l("const float denom = sqrtf(v2) * k_inv_sqrt_bc2 + k_eps;");
    w.l("const float p2 = pi - (k_step_size * m2) / denom;");
}

/// Rows of one `sum_rows` partial sum (one block sums this many rows of
/// [`SUM_ROWS_COLS`] columns).
pub const SUM_ROWS_CHUNK: usize = 128;
/// Columns of one `sum_rows` block: each lane of a warp [`SUM_ROWS_PER_LANE`] of them,
/// adjacent (one vector load a row) where the rows allow it, else 32 apart (a warp reads
/// 32 consecutive values of a row with each of its loads, that many loads in flight).
pub const SUM_ROWS_COLS: usize = 128;
/// Columns of one lane of `sum_rows` (a warp of 32).
pub const SUM_ROWS_PER_LANE: usize = SUM_ROWS_COLS / 32;

/// The number of partial sums per column: `⌈rows / SUM_ROWS_CHUNK⌉`, at least 1.
pub fn sum_rows_chunks(rows: usize) -> usize {
    rows.div_ceil(SUM_ROWS_CHUNK).max(1)
}

/// Work items of [`sum_rows`]: one block per (chunk of [`SUM_ROWS_CHUNK`] rows, tile of
/// [`SUM_ROWS_COLS`] columns).
pub fn sum_rows_items(rows: usize, n: usize) -> usize {
    sum_rows_chunks(rows) * n.div_ceil(SUM_ROWS_COLS)
}

/// Opens either `sum_rows` kernel: the signature, shared scratch if `shared`, the column
/// count `n` and the row count `rows = A0·…·A(L−1)` from dims `[A0, …, A(L−1), n]`.
fn open_sum_rows(name: &str, lead: usize, params: &[Param], shared: bool) -> Result<W, String> {
    if lead == 0 {
        return Err("sum_rows sums at least one leading axis".into());
    }
    let mut w = W::new();
    signature(&mut w, name, params);
    if shared {
        w.l("__shared__ float sh[KILN_THREADS];");
    }
    w.l(format!("const long long n = dims.d[{lead}];"));
    let rows: Vec<String> = (0..lead).map(|k| format!("dims.d[{k}]")).collect();
    w.l(format!("const long long rows = {};", rows.join(" * ")));
    Ok(w)
}

/// Closes a `sum_rows` kernel's loop over blocks and its body: the function, one block a
/// work item (`what`).
fn close_sum_rows(mut w: W, name: &str, params: Vec<Param>, what: &str) -> CudaFunction {
    w.close();
    w.close();
    function(name, params, Work::Blocks, what, w)
}

/// The first of the two kernels summing the `lead` leading axes of `x[A0, …, A(L−1), n]`
/// (read as `rows × n`, `rows = A0·…·A(L−1)`): block `(chunk, tile)` sums rows
/// `[chunk·CHUNK, (chunk+1)·CHUNK)` of [`SUM_ROWS_COLS`] columns — each of the block's
/// `blockDim / 32` warps every `blockDim / 32`-th row, a lane four columns of the tile in
/// registers, then the warps' sums in warp order — into `part[chunk, n]`. The four are
/// adjacent (one vector load a row, four rows at a time) where `n` is a multiple of 4
/// and `x` aligned, else `c`, `c + 32`, `c + 64`, `c + 96`; each column's rows are added
/// in the same order either way. [`sum_rows_finish`] adds the chunks in order. The order is fixed
/// for a block size (the executor's is always `THREADS`) but not the CPU kernel's
/// sequential one: the two agree within float rounding. Buffers `[x, part]`, dims
/// `[A0, …, A(L−1), n]`, items [`sum_rows_items`].
pub fn sum_rows(name: &str, lead: usize) -> Result<CudaFunction, String> {
    sum_rows_as(name, lead, Elem::F32)
}

/// [`sum_rows`] over `x` stored as `x` (the partial sums are `float`).
pub fn sum_rows_as(name: &str, lead: usize, x: Elem) -> Result<CudaFunction, String> {
    let xe = x;
    let params = vec![param("x", &xe.ptr(true)), param("part", "float*")];
    let mut w = open_sum_rows(name, lead, &params, false)?;
    // The warps' column sums: warps × SUM_ROWS_COLS floats (at most KILN_THREADS / 32 ×
    // 128, or one warp's 128 in a block of fewer than 32 threads).
    w.l(format!(
        "__shared__ float sh[KILN_THREADS / 32 * {SUM_ROWS_COLS} > {SUM_ROWS_COLS} ? KILN_THREADS / 32 * {SUM_ROWS_COLS} : {SUM_ROWS_COLS}];"
    ));
    w.l(format!(
        "const long long tiles = (n + {SUM_ROWS_COLS} - 1) / {SUM_ROWS_COLS};"
    ));
    // Warps of 32 threads, each summing every `lanes`-th row of the chunk; a block of
    // fewer than 32 threads is one warp of `width` lanes, looping over the tile.
    w.l("const int width = blockDim.x < 32 ? blockDim.x : 32;");
    w.l("const int lanes = blockDim.x < 32 ? 1 : blockDim.x / 32;");
    w.l("const int lane = threadIdx.x / width;");
    w.l(format!(
        "const bool vec = (n & 3) == 0 && ((unsigned long long)x & {}u) == 0;",
        4 * xe.bytes() - 1
    ));
    w.open(FOR_BLOCKS);
    w.l("const long long chunk = r / tiles;");
    w.l(format!(
        "const long long col0 = (r % tiles) * {SUM_ROWS_COLS};"
    ));
    w.l(format!("const long long r0 = chunk * {SUM_ROWS_CHUNK};"));
    w.l(format!(
        "const long long r1 = r0 + {SUM_ROWS_CHUNK} < rows ? r0 + {SUM_ROWS_CHUNK} : rows;"
    ));
    let per = SUM_ROWS_PER_LANE;
    w.open("if (lane < lanes && vec)");
    // Rows of a multiple of 4 from an aligned start: a lane sums 4 adjacent columns,
    // each row one vector load, four rows' loads at a time (the same rows in the same
    // order as below).
    let q = xe.quad();
    w.open(format!(
        "for (int cb = 4 * (threadIdx.x % width); cb < {SUM_ROWS_COLS}; cb += 4 * width)"
    ));
    w.l("float s[4];");
    w.l("for (int u = 0; u < 4; ++u) s[u] = 0.0f;");
    w.open("if (col0 + cb < n)");
    w.l("const long long at = col0 + cb;");
    w.l("long long k = r0 + lane;");
    w.open("for (; k + 3 * (long long)lanes < r1; k += 4 * (long long)lanes)");
    w.l(format!("{q} a[4];"));
    w.l(format!(
        "for (int h = 0; h < 4; ++h) a[h] = *(const {q}*)(x + (k + h * (long long)lanes) * n + at);"
    ));
    w.open("for (int h = 0; h < 4; ++h)");
    w.l(format!(
        "for (int u = 0; u < 4; ++u) s[u] = s[u] + {};",
        xe.quad_lane("a[h]", "u")
    ));
    w.close();
    w.close();
    w.open("for (; k < r1; k += lanes)");
    w.l(format!("const {q} a = *(const {q}*)(x + k * n + at);"));
    w.l(format!(
        "for (int u = 0; u < 4; ++u) s[u] = s[u] + {};",
        xe.quad_lane("a", "u")
    ));
    w.close();
    w.close();
    w.l(format!(
        "for (int u = 0; u < 4; ++u) sh[lane * {SUM_ROWS_COLS} + cb + u] = s[u];"
    ));
    w.close();
    w.close();
    w.open("else if (lane < lanes)");
    w.open(format!(
        "for (int cb = threadIdx.x % width; cb < {SUM_ROWS_COLS}; cb += width * {per})"
    ));
    w.l(format!("float s[{per}];"));
    w.l(format!("for (int u = 0; u < {per}; ++u) s[u] = 0.0f;"));
    w.open("for (long long k = r0 + lane; k < r1; k += lanes)");
    w.l(format!(
        "const {}* xk = x + k * n + col0 + cb;",
        xe.c_type()
    ));
    w.open(format!("for (int u = 0; u < {per}; ++u)"));
    w.open("if (col0 + cb + u * width < n)");
    w.l(format!("s[u] = s[u] + {};", xe.load("xk[u * width]")));
    w.close();
    w.close();
    w.close();
    w.l(format!(
        "for (int u = 0; u < {per}; ++u) sh[lane * {SUM_ROWS_COLS} + cb + u * width] = s[u];"
    ));
    w.close();
    w.close();
    w.l("__syncthreads();");
    w.open("if (lane == 0)");
    w.open(format!(
        "for (int c = threadIdx.x % width; c < {SUM_ROWS_COLS}; c += width)"
    ));
    w.l("const long long col = col0 + c;");
    w.open("if (col < n)");
    w.l("float t = sh[c];");
    w.open("for (int l = 1; l < lanes; ++l)");
    w.l(format!("t = t + sh[l * {SUM_ROWS_COLS} + c];"));
    w.close();
    w.l("part[chunk * n + col] = t;");
    w.close();
    w.close();
    w.close();
    w.l("__syncthreads();");
    Ok(close_sum_rows(w, name, params, "row chunks × column tiles"))
}

/// The second `sum_rows` kernel: `y[j] = Σ_chunk part[chunk, j]`, one block per tile of
/// 32 columns (items [`sum_rows_finish_items`]), the chunks summed as
/// [`crate::codegen::cuda::rows::add_layer_norm_bwd_finish`] sums its partial blocks.
/// Buffers `[part, y]`, dims those of [`sum_rows`].
pub fn sum_rows_finish(name: &str, lead: usize) -> Result<CudaFunction, String> {
    sum_rows_finish_as(name, lead, Elem::F32)
}

/// Work items of [`sum_rows_finish`]: tiles of 32 of the `n` columns.
pub fn sum_rows_finish_items(n: usize) -> usize {
    n.div_ceil(COL_TILE)
}

/// [`sum_rows_finish`] writing `y` stored as `y`.
pub fn sum_rows_finish_as(name: &str, lead: usize, y: Elem) -> Result<CudaFunction, String> {
    let ye = y;
    let params = vec![param("part", "const float*"), param("y", &ye.ptr(false))];
    let mut w = open_sum_rows(name, lead, &params, true)?;
    w.l(format!(
        "const long long chunks = rows > 0 ? (rows + {SUM_ROWS_CHUNK} - 1) / {SUM_ROWS_CHUNK} : 0;"
    ));
    w.l("const long long d = n;");
    w.open(FOR_BLOCKS);
    w.l(format!("const long long col0 = r * {COL_TILE};"));
    column_tiles(
        &mut w,
        "chunks",
        &|k| format!("part[{k} * n + col]"),
        &format!("y[col] = {};", ye.store("t")),
    );
    Ok(close_sum_rows(w, name, params, "column tiles ceil(n / 32)"))
}

/// The reduction of `x` viewed as `[outer, len, inner]` over `len`, into `y[outer, inner]`.
/// Buffers `[x, y]`, dims `[outer, len, inner]`. `Rows` (`inner = 1`): one block per row;
/// `Across`: one thread per output, sequential over `len`.
pub fn reduce(name: &str, op: Reduce, layout: ReduceLayout) -> CudaFunction {
    reduce_as(name, op, layout, Elem::F32, Elem::F32)
}

/// [`reduce`] with `x` stored as `xe` and `y` as `ye`.
pub fn reduce_as(name: &str, op: Reduce, layout: ReduceLayout, xe: Elem, ye: Elem) -> CudaFunction {
    let params = vec![param("x", &xe.ptr(true)), param("y", &ye.ptr(false))];
    let (init, combine) = match op {
        Reduce::Sum => ("0.0f".to_string(), "acc + v"),
        Reduce::Max => (f32_lit(f32::NEG_INFINITY), "kiln_max_ref(acc, v)"),
    };
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long len = dims.d[1];");
    match layout {
        ReduceLayout::Rows => {
            w.l("__shared__ float sh[KILN_THREADS];");
            w.open(FOR_BLOCKS);
            let head = for_cols("len");
            fold(
                &mut w,
                xe,
                ("xr", "x + r * len"),
                (&head, "xr[j]"),
                (&init, combine),
            );
            match op {
                Reduce::Sum => w.l("acc = kiln_block_sum(acc, sh);"),
                Reduce::Max => {
                    w.l("acc = kiln_block_max(acc, sh);");
                    w.l("// The reference's bits: the first element that is NaN or equals the");
                    w.l("// max (only a zero or NaN max can differ from it in bits).");
                    w.open("if (threadIdx.x == 0 && (acc == 0.0f || acc != acc))");
                    w.open("for (long long j = 0; j < len; ++j)");
                    w.l(format!("const float xj = {};", xe.load("xr[j]")));
                    w.open("if (xj == acc || xj != xj)");
                    w.l("acc = xj;");
                    w.l("break;");
                    w.close();
                    w.close();
                    w.close();
                }
            }
            w.l(format!("if (threadIdx.x == 0) y[r] = {};", ye.store("acc")));
            w.close();
            w.close();
            function(name, params, Work::Blocks, "rows outer", w)
        }
        ReduceLayout::Across => {
            w.l("const long long inner = dims.d[2];");
            w.open(FOR_THREADS);
            w.l("const long long o = i / inner;");
            w.l("const long long c = i - o * inner;");
            let head = "for (long long a = 0; a < len; ++a)";
            let x = ("xo", "x + o * len * inner + c");
            fold(&mut w, xe, x, (head, "xo[a * inner]"), (&init, combine));
            w.l(format!("y[i] = {};", ye.store("acc")));
            w.close();
            w.close();
            function(name, params, Work::Threads, "outputs outer·inner", w)
        }
    }
}

/// `float acc`: `init`, then `acc = combine` of each `v = x[index]` over the loop `head`,
/// `x` read through the pointer `name = at` (elements `xe`).
fn fold(
    w: &mut W,
    xe: Elem,
    (name, at): (&str, &str),
    (head, index): (&str, &str),
    (init, combine): (&str, &str),
) {
    w.l(format!("const {}* {name} = {at};", xe.c_type()));
    w.l(format!("float acc = {init};"));
    w.open(head);
    w.l(format!("const float v = {};", xe.load(index)));
    w.l(format!("acc = {combine};"));
    w.close();
}

/// `dst[r, :] = b` (the bias pre-loaded before a GEMM with `beta = 1`). Buffers `[b, dst]`,
/// dims `[n]`, items elements `R·n`.
pub fn fill_rows(name: &str, e: Elem) -> CudaFunction {
    let params = vec![
        param("b", "const float*"),
        param("dst", &format!("{}*", e.c_type())),
    ];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long n = dims.d[0];");
    w.open(FOR_THREADS);
    w.l(format!("dst[i] = {};", e.store("b[i % n]")));
    w.close();
    w.close();
    function(name, params, Work::Threads, "elements R·n", w)
}

/// In place `y = relu(y)` (`x` if `x > 0` or NaN, else `+0`). Buffers `[y]`, dims `[n]`,
/// items elements `n`.
pub fn relu(name: &str, e: Elem) -> CudaFunction {
    let params = vec![param("y", &format!("{}*", e.c_type()))];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.open(FOR_THREADS);
    w.l(format!(
        "y[i] = {};",
        e.store(&format!("kiln_relu({})", e.load("y[i]")))
    ));
    w.close();
    w.close();
    function(name, params, Work::Threads, "elements n", w)
}

/// Materializes a strided view of 4-byte elements: `out[i0, …, i4] = src[Σ i_k·t_k]`.
/// Buffers `[src, out]` (`src` at the view's element `(0, …, 0)`; strides of any sign),
/// dims `[s0, …, s4, t0, …, t4]` ([`crate::codegen::misc::copy_strided_dims`]), items
/// elements `s0·…·s4`.
pub fn copy_strided(name: &str) -> CudaFunction {
    copy_strided_as(name, Elem::F32)
}

/// [`copy_strided`] of elements of `e`'s size (`Elem::Bf16`: 2-byte elements).
pub fn copy_strided_as(name: &str, e: Elem) -> CudaFunction {
    let word = words(e);
    let params = vec![
        param("src", &format!("const {word}*")),
        param("out", &format!("{word}*")),
    ];
    let r = MAX_COPY_RANK;
    let mut w = W::new();
    signature(&mut w, name, &params);
    // Four elements a thread: the first one's index by division, then the innermost
    // index steps and carries.
    w.open(FOR_QUADS);
    w.l("const long long i0 = g << 2;");
    w.l("long long rest = i0;");
    for k in (1..r).rev() {
        w.l(format!("const long long q{k} = rest / dims.d[{k}];"));
        w.l(format!("long long j{k} = rest - q{k} * dims.d[{k}];"));
        w.l(format!("rest = q{k};"));
    }
    w.l("long long j0 = rest;");
    w.open("for (int u = 0; u < 4; ++u)");
    w.l("const long long i = i0 + u;");
    w.l("if (i >= items) break;");
    w.open("if (u > 0)");
    for k in (1..r).rev() {
        w.open(format!("if (++j{k} == dims.d[{k}])"));
        w.l(format!("j{k} = 0;"));
    }
    w.l("++j0;");
    for _ in 1..r {
        w.close();
    }
    w.close();
    let off: Vec<String> = (0..r)
        .map(|k| format!("j{k} * dims.d[{}]", r + k))
        .collect();
    w.l(format!("out[i] = src[{}];", off.join(" + ")));
    w.close();
    w.close();
    w.close();
    function(
        name,
        params,
        Work::Quads,
        "elements s0·…·s4, four per thread",
        w,
    )
}
