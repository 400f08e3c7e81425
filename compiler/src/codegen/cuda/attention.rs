//! Flash-style attention as CUDA C: tiled, online softmax, the `[tq, tk]` score matrix
//! never in global memory (DESIGN §5).
//!
//! In: the mask kind, the head sizes `dk` and `dv` (constants of the kernel graph), the
//! element type. Out: three [`CudaFunction`]s per (mask, dk, dv):
//!
//! - [`forward`] — `out = softmax(where(mask, q·kᵀ·scale, fill))·v`. One block per tile of
//!   `T` query rows of one head; key/value tiles of `T` rows stream through shared
//!   memory; each row keeps its running maximum `m`, sum `l` and unnormalized output
//!   (rescaled by `exp(m_old − m_new)` when the maximum grows), divided by `l` at the end.
//! - [`backward_q`] — recomputes the forward for its query tile (so `m`, `l` and `o`),
//!   then `D = Σ_c g·o / l` per row, writes `(m, l, D)` to the `stats` scratch
//!   (`f32[b·h·tq, 3]`) and streams the keys again for `dq = Σ_j ds_ij·k_j` with
//!   `p = exp(s − m)/l`, `dp = g·vᵀ`, `ds = p·(dp − D)·scale` (0 where masked).
//! - [`backward_kv`] — one block per tile of `T` keys: streams the query tiles (with their
//!   `stats`) for `dv = Σ_i p_ij·g_i` and `dk = Σ_i ds_ij·q_i`.
//! - [`backward_short`] — the two above in one kernel when every query and key row of a
//!   head fits one tile ([`fits_short`]; the Transformer's sentences mostly do): one block
//!   per head holds `q`, `k`, `v`, `g`, the probabilities and the score gradients in
//!   shared memory and computes `s`, `dp = g·vᵀ`, the softmax, `D = Σ_j p·dp` (the CPU
//!   `softmax_bwd`'s), `ds`, then `dq`, `dk`, `dv` — five products of the head's size
//!   instead of nine across the pair (which recompute the forward twice), one launch and
//!   no statistics scratch.
//!
//! The products over the shared tiles in the forward and in [`backward_short`] run with
//! 2×2 register tiles (each thread four outputs, four loads from shared memory for four
//! multiply-adds); each output's sum is still one thread's, in key order. Every output
//! element is summed by one thread in a fixed order: no atomics, the same bits on every
//! run. The formulas are the CPU attention's (`s = q·kᵀ`, the masked scaled
//! softmax, `softmax_bwd`, the zeroed masked gradient); only the rounding of the online
//! softmax differs from the CPU's two-pass one.
//!
//! # ABI
//!
//! The general one of [`super`] (`Work::Blocks`, any block size: every loop strides by
//! `blockDim.x`). Buffers, with `[mask]` and `[fill]` present unless the mask kind is
//! `None` (the CPU attention's operand order, then the results):
//!
//! - forward: `q, k, v, [mask], scale, [fill], out`;
//! - backward_q: `q, k, v, [mask], g, scale, [fill], dq, stats`;
//! - backward_kv: `q, k, v, [mask], g, scale, [fill], stats, dk, dv`;
//! - backward_short: `q, k, v, [mask], g, scale, [fill], dq, dk, dv`.
//!
//! `q [b, h, tq, dk]`, `k [b, h, tk, dk]`, `v [b, h, tk, dv]` and `g [b, h, tq, dv]` are
//! read through their strides (views of the projections need no copy), and `out`, `dq`,
//! `dk`, `dv` written through theirs (stored with the heads merged, `[b, t, h, d]`, the
//! output projection reads them as rows without a copy). The mask is `int` 0/1, `[b, tk]`
//! (key padding) or `[tq, tk]` (causal). dims ([`dims`]): `[b, h, tq, tk]`, then the four
//! element strides of `q`, `k`, `v`, then forward `out`'s, backward `g`'s, `dq`'s, `dk`'s
//! and `dv`'s. Items: tiles, `b·h·⌈tq/T⌉` (forward, backward_q) or
//! `b·h·⌈tk/T⌉` (backward_kv), `b·h` (backward_short), with `T` from [`tile`].

use crate::codegen::cuda::text::{f32_lit, Elem, W};
use crate::codegen::cuda::{param, signature, CudaFunction, Param, Work, FOR_BLOCKS};
use crate::codegen::rows::MaskKind;

/// The largest head size the flash kernels take (larger heads use the batched-GEMM path).
pub const MAX_HEAD: usize = 128;

/// Static shared memory a kernel may use (the limit without opting in to more).
pub const SHARED_BYTES: usize = 48 * 1024;

/// The three flash kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Forward,
    BackwardQ,
    BackwardKv,
    /// The whole backward of one head in one block ([`backward_short`]), when `tq` and
    /// `tk` both fit one tile.
    Short,
}

/// Shared memory of `part` with tiles of `t` rows, in bytes.
pub fn shared_bytes(part: Part, t: usize, dk: usize, dv: usize) -> usize {
    let floats = match part {
        // qs, ks, vs, ss, os, m/l/alpha
        Part::Forward => 2 * t * (dk + 1) + t * (dv + 1) + t * (t + 1) + t * dv + 3 * t,
        // qs, ks, vs, gs, ss, os (o, then dq), m/l/alpha/D
        Part::BackwardQ => {
            2 * t * (dk + 1) + 2 * t * (dv + 1) + t * (t + 1) + t * dk.max(dv) + 4 * t
        }
        // ks, vs, qs, gs, ps, dss, dks, dvs, m/l/D
        Part::BackwardKv => {
            2 * t * (dk + 1) + 2 * t * (dv + 1) + 2 * t * (t + 1) + t * dk + t * dv + 3 * t
        }
        // qs, ks, vs, gs, ps, dss, D
        Part::Short => 2 * t * (dk + 1) + 2 * t * (dv + 1) + 2 * t * (t + 1) + t,
    };
    4 * floats
}

/// Rows per tile of `part` for heads `dk`, `dv`: the largest of 32, 16, 8 whose shared
/// memory fits [`SHARED_BYTES`]; `None` past [`MAX_HEAD`].
pub fn tile(part: Part, dk: usize, dv: usize) -> Option<usize> {
    if dk == 0 || dv == 0 || dk > MAX_HEAD || dv > MAX_HEAD {
        return None;
    }
    [32, 16, 8]
        .into_iter()
        .find(|&t| shared_bytes(part, t, dk, dv) <= SHARED_BYTES)
}

/// dims of every flash kernel: `[b, h, tq, tk]` and the `[b, h, t, d]` element strides of
/// each operand and result in `strides` (`q, k, v, out` forward; `q, k, v, g, dq, dk, dv`
/// backward).
pub fn dims(b: usize, h: usize, tq: usize, tk: usize, strides: &[[usize; 4]]) -> Vec<i64> {
    let mut d = vec![b as i64, h as i64, tq as i64, tk as i64];
    for s in strides {
        d.extend(s.iter().map(|&x| x as i64));
    }
    d
}

/// Work items of `part` (tiles): `b·h·⌈tq/T⌉`, for `BackwardKv` `b·h·⌈tk/T⌉`, for
/// `Short` the heads `b·h`.
pub fn items(part: Part, t: usize, b: usize, h: usize, tq: usize, tk: usize) -> usize {
    match part {
        Part::Short => b * h,
        Part::BackwardKv => b * h * tk.div_ceil(t),
        _ => b * h * tq.div_ceil(t),
    }
}

/// Whether [`backward_short`] takes `tq` query and `tk` key rows with heads `dk`, `dv`:
/// both fit its tile.
pub fn fits_short(tq: usize, tk: usize, dk: usize, dv: usize) -> bool {
    tile(Part::Short, dk, dv).is_some_and(|t| tq <= t && tk <= t)
}

/// The buffer parameters of `part`.
pub(super) fn params(part: Part, mask: MaskKind, e: Elem) -> Vec<Param> {
    let masked = mask != MaskKind::None;
    let mut p = vec![
        param("q", &e.ptr(true)),
        param("k", &e.ptr(true)),
        param("v", &e.ptr(true)),
    ];
    if masked {
        p.push(param("mask", "const int*"));
    }
    if part != Part::Forward {
        p.push(param("g", &e.ptr(true)));
    }
    p.push(param("scale", "const float*"));
    if masked {
        p.push(param("fill", "const float*"));
    }
    match part {
        Part::Forward => p.push(param("out", &e.ptr(false))),
        Part::BackwardQ => {
            p.push(param("dq", &e.ptr(false)));
            p.push(param("stats", "float*"));
        }
        Part::Short => {
            p.push(param("dq", &e.ptr(false)));
            p.push(param("dk", &e.ptr(false)));
            p.push(param("dv", &e.ptr(false)));
        }
        Part::BackwardKv => {
            p.push(param("stats", "const float*"));
            p.push(param("dk", &e.ptr(false)));
            p.push(param("dv", &e.ptr(false)));
        }
    }
    p
}

/// The products of the tiles with 2×2 register tiles: over the `rows × cols` outputs
/// `acc(i, c) = init(i, c) + Σ_{j < k} a(i, j)·b(j, c)` (`j` in order, each term added as
/// the plain loops add it: the same bits), each thread item takes rows `i0`, `i0 + ⌈rows/2⌉`
/// and columns `c0`, `c0 + ⌈cols/2⌉`, so four loads from shared memory feed four
/// multiply-adds instead of eight. `a`, `b` and `init` give C expressions of their index
/// variables; `store(i, c, acc)` a statement (run once per output inside the bounds).
struct Product<'a> {
    rows: &'a str,
    cols: &'a str,
    k: &'a str,
    a: &'a Index2<'a>,
    b: &'a Index2<'a>,
    init: Option<&'a Index2<'a>>,
    store: &'a Store<'a>,
}

/// A C statement storing the accumulator `acc` at two index variables.
pub(super) type Store<'a> = dyn Fn(&str, &str, &str) -> String + 'a;

/// A C expression of two index variables.
pub(super) type Index2<'a> = dyn Fn(&str, &str) -> String + 'a;

fn product(w: &mut W, p: &Product<'_>) {
    w.open("");
    w.l(format!(
        "const int r2 = (int)(({} + 1) / 2), c2 = (int)(({} + 1) / 2);",
        p.rows, p.cols
    ));
    w.open("for (int e = tid; e < r2 * c2; e += nt)");
    w.l("const int i0 = e / c2, c0 = e % c2;");
    w.l("const int i1 = i0 + r2, c1 = c0 + c2;");
    w.l(format!(
        "const bool ri = i1 < {}, rc = c1 < {};",
        p.rows, p.cols
    ));
    match p.init {
        Some(init) => {
            w.l(format!("float s00 = {};", init("i0", "c0")));
            w.l(format!("float s01 = rc ? {} : 0.0f;", init("i0", "c1")));
            w.l(format!("float s10 = ri ? {} : 0.0f;", init("i1", "c0")));
            w.l(format!(
                "float s11 = ri && rc ? {} : 0.0f;",
                init("i1", "c1")
            ));
        }
        None => w.l("float s00 = 0.0f, s01 = 0.0f, s10 = 0.0f, s11 = 0.0f;"),
    }
    w.open(format!("for (int j = 0; j < {}; ++j)", p.k));
    w.l(format!("const float a0 = {};", (p.a)("i0", "j")));
    w.l(format!(
        "const float a1 = ri ? {} : 0.0f;",
        (p.a)("i1", "j")
    ));
    w.l(format!("const float b0 = {};", (p.b)("j", "c0")));
    w.l(format!(
        "const float b1 = rc ? {} : 0.0f;",
        (p.b)("j", "c1")
    ));
    w.l("s00 = s00 + a0 * b0;");
    w.l("s01 = s01 + a0 * b1;");
    w.l("s10 = s10 + a1 * b0;");
    w.l("s11 = s11 + a1 * b1;");
    w.close();
    w.l((p.store)("i0", "c0", "s00"));
    w.l(format!("if (rc) {}", (p.store)("i0", "c1", "s01")));
    w.open("if (ri)");
    w.l((p.store)("i1", "c0", "s10"));
    w.l(format!("if (rc) {}", (p.store)("i1", "c1", "s11")));
    w.close();
    w.close();
    w.close();
}

/// `Σ_c a[i, c]·b[j, c]` for every pair (i, j) of the shared tiles `a` and `b` (rows of
/// `d + 1` floats), each stored by `store`.
fn pair_dots(w: &mut W, d: usize, (a, b): (&str, &str), store: &Store<'_>) {
    let p = d + 1;
    product(
        w,
        &Product {
            rows: "T",
            cols: "T",
            k: &d.to_string(),
            a: &|i, c| format!("{a}[{i} * {p} + {c}]"),
            b: &|c, j| format!("{b}[{j} * {p} + {c}]"),
            init: None,
            store,
        },
    );
}

/// The masked, scaled scores `q·kᵀ` of the tiles `qs` and `ks` into `dst` (rows of
/// `T + 1`), 0 outside the head.
fn scores(w: &mut W, dk: usize, mask: MaskKind, dst: &str) {
    pair_dots(w, dk, ("qs", "ks"), &score_store(mask, dst));
}

/// `dss[i][j] = Σ_c g[i, c]·v[j, c]` (`dp`) for every pair of the shared tiles `gs` and
/// `vs`, 0 outside the head.
fn dp_product(w: &mut W, dv: usize) {
    pair_dots(w, dv, ("gs", "vs"), &|i, j, acc| {
        format!("dss[{i} * (T + 1) + {j}] = {i} < nq && {j} < nk ? {acc} : 0.0f;")
    });
}

/// A store of [`product`] for a score tile: `x` is the masked scaled score of `acc` (the
/// dot product) inside the head, 0 outside, written to `dst[i·(T+1) + j]`.
pub(super) fn score_store(mask: MaskKind, dst: &str) -> impl Fn(&str, &str, &str) -> String + '_ {
    move |i, j, acc| {
        format!(
            "{{ const int i = {i}, j = {j}; float x = 0.0f; if (i < nq && j < nk) {{ const long long qrow = q0 + i, krow = k0 + j; (void)qrow; (void)krow; const float d = {acc}; x = {}; }} {dst}[i * (T + 1) + j] = x; }}",
            masked_score(mask)
        )
    }
}

/// Writes `text` line by line at the writer's depth (`text` indents itself further).
pub(super) fn lines(w: &mut W, text: &str) {
    for line in text.lines() {
        if line.trim().is_empty() {
            continue;
        }
        w.l(line);
    }
}

/// The common head of every flash kernel: sizes, strides, scalars.
pub(super) fn head(w: &mut W, part: Part, mask: MaskKind) {
    lines(
        w,
        "const long long H = dims.d[1], tq = dims.d[2], tk = dims.d[3];
const long long qsb = dims.d[4], qsh = dims.d[5], qst = dims.d[6], qsd = dims.d[7];
const long long ksb = dims.d[8], ksh = dims.d[9], kst = dims.d[10], ksd = dims.d[11];
const long long vsb = dims.d[12], vsh = dims.d[13], vst = dims.d[14], vsd = dims.d[15];",
    );
    // The results' strides: `out` forward, `dq`, `dk`, `dv` backward (each kernel
    // declares those it writes).
    let results: &[(&str, usize)] = match part {
        Part::Forward => &[("out", 16)],
        Part::BackwardQ => &[("dq", 20)],
        Part::BackwardKv => &[("dk", 24), ("dv", 28)],
        Part::Short => &[("dq", 20), ("dk", 24), ("dv", 28)],
    };
    if part != Part::Forward {
        w.l("const long long gsb = dims.d[16], gsh = dims.d[17], gst = dims.d[18], gsd = dims.d[19];");
    }
    for (r, at) in results {
        w.l(format!(
            "const long long {r}_sb = dims.d[{at}], {r}_sh = dims.d[{}], {r}_st = dims.d[{}], {r}_sd = dims.d[{}];",
            at + 1,
            at + 2,
            at + 3
        ));
    }
    w.l("const float sc = scale[0];");
    if mask != MaskKind::None {
        w.l("const float fl = fill[0];");
    }
    w.l("const int tid = (int)threadIdx.x, nt = (int)blockDim.x;");
    // Warps of `wd` lanes (the block, when smaller than a warp), for the row softmaxes.
    w.l("const int lane = tid & 31, warp = tid >> 5, nw = (nt + 31) >> 5, wd = (int)kiln_width();");
    w.l("(void)lane; (void)warp; (void)nw; (void)wd;");
}

/// The score of query row `qrow` (global) against key row `krow` (global) given the
/// dot product `d`: `d·scale`, or `fill` where the mask is 0.
pub(super) fn masked_score(mask: MaskKind) -> &'static str {
    match mask {
        MaskKind::None => "d * sc",
        MaskKind::Key => "(mask[bi * tk + krow] != 0 ? d * sc : fl)",
        MaskKind::Causal => "(mask[qrow * tk + krow] != 0 ? d * sc : fl)",
    }
}

/// Whether the pair is masked out (its gradient is zero).
pub(super) fn masked_out(mask: MaskKind) -> &'static str {
    match mask {
        MaskKind::None => "false",
        MaskKind::Key => "(mask[bi * tk + krow] == 0)",
        MaskKind::Causal => "(mask[qrow * tk + krow] == 0)",
    }
}

/// Inside `if (i < nq && j < nk)`: the masked scaled score `x` of query row `i` and key
/// row `j` of the shared tiles (`const float x` when `declare`, else assigned).
fn score(w: &mut W, mask: MaskKind, dk: usize, declare: bool) {
    let pk = dk + 1;
    w.l("const long long qrow = q0 + i, krow = k0 + j;");
    w.l("(void)qrow; (void)krow;");
    w.l("float d = 0.0f;");
    w.l(format!(
        "for (int c = 0; c < {dk}; ++c) d = d + qs[i * {pk} + c] * ks[j * {pk} + c];"
    ));
    let lhs = if declare { "const float x" } else { "x" };
    w.l(format!("{lhs} = {};", masked_score(mask)));
}

/// Inside `if (i < nq && j < nk)` of a backward kernel: the score, then (into the
/// declared `p` and `dsv`) `p = exp(x − m)/l`, `dp = g·v`, `dsv = p·(dp − D)·scale` (0
/// where masked), with the row's statistics `m`, `l`, `D` as C expressions.
fn pair_gradient(w: &mut W, mask: MaskKind, dk: usize, dv: usize, (m, l, dd): (&str, &str, &str)) {
    let pv = dv + 1;
    score(w, mask, dk, true);
    w.l(format!("p = expf(x - {m}) / {l};"));
    w.l("float dp = 0.0f;");
    w.l(format!(
        "for (int c = 0; c < {dv}; ++c) dp = dp + gs[i * {pv} + c] * vs[j * {pv} + c];"
    ));
    w.l(format!(
        "dsv = {} ? 0.0f : p * (dp - {dd}) * sc;",
        masked_out(mask)
    ));
}

/// The signature, a comment, the tile size `T` and the shared arrays of a flash kernel.
fn open_kernel(
    w: &mut W,
    name: &str,
    ps: &[Param],
    what: &str,
    t: usize,
    arrays: &[(&str, String)],
) {
    signature(w, name, ps);
    w.l(format!("// flash attention {what}: tiles of T = {t} rows"));
    w.l(format!("enum {{ T = {t} }};"));
    for (n, size) in arrays {
        w.l(format!("__shared__ float {n}[{size}];"));
    }
}

/// Loads `n` rows (the rest of the tile zero) of a `[.., t, d]` operand into the shared
/// array `dst` (row pitch `d + 1`): `src` points at the head, rows from `row0`, strides
/// `<dst>t` and `<dst>d` (the operand's own: `qs` is `q`'s tile, `qst` its row stride).
fn load_tile(w: &mut W, e: Elem, dst: &str, src: &str, d: usize, row0: &str, n: &str) {
    let st = dst;
    w.open(format!("for (int e = tid; e < T * {d}; e += nt)"));
    w.l(format!("const int i = e / {d}, c = e % {d};"));
    w.l(format!(
        "{dst}[i * {} + c] = i < {n} ? {} : 0.0f;",
        d + 1,
        e.load(&format!("{src}[({row0} + i) * {st}t + c * {st}d]"))
    ));
    w.close();
}

/// The forward pass over all key tiles for the query tile at `q0` (`nq` rows): leaves
/// the unnormalized output in `os` (`T × dv`), the running max in `ms` and sum in `ls`.
fn forward_sweep(w: &mut W, e: Elem, mask: MaskKind, dk: usize, dv: usize) {
    let pv = dv + 1;
    lines(
        w,
        &format!(
            "for (int e = tid; e < T * {dv}; e += nt) os[e] = 0.0f;
for (int i = tid; i < T; i += nt) {{ ms[i] = {ninf}; ls[i] = 0.0f; }}",
            ninf = f32_lit(f32::NEG_INFINITY)
        ),
    );
    w.open("for (long long k0 = 0; k0 < tk; k0 += T)");
    w.l("const int nk = (int)(tk - k0 < T ? tk - k0 : T);");
    w.l("__syncthreads();");
    load_tile(w, e, "ks", "kh", dk, "k0", "nk");
    load_tile(w, e, "vs", "vh", dv, "k0", "nk");
    w.l("__syncthreads();");
    scores(w, dk, mask, "ss");
    w.l("__syncthreads();");
    lines(
        w,
        "// The online softmax's update, a warp per row, its lanes over the keys (every warp
// runs the same rows loop, as the host shim's shuffles need).
for (int i0 = 0; i0 < T; i0 += nw) {
    const int i = i0 + warp;
    const bool live = i < nq;
    float* sr = ss + (live ? i : 0) * (T + 1);
    const float m0 = live ? ms[i] : 0.0f;
    float mx = m0;
    if (live) for (int j = lane; j < nk; j += wd) mx = kiln_max_ref(mx, sr[j]);
    mx = kiln_warp_max(mx);
    float z = 0.0f;
    if (live) for (int j = lane; j < nk; j += wd) { const float p = expf(sr[j] - mx); sr[j] = p; z = z + p; }
    z = kiln_warp_sum(z);
    if (live && lane == 0) {
        const float al = m0 == mx ? 1.0f : expf(m0 - mx);
        ls[i] = ls[i] * al + z;
        ms[i] = mx;
        as_[i] = al;
    }
}
__syncthreads();",
    );
    product(
        w,
        &Product {
            rows: "nq",
            cols: &dv.to_string(),
            k: "nk",
            a: &|i, j| format!("ss[{i} * (T + 1) + {j}]"),
            b: &|j, c| format!("vs[{j} * {pv} + {c}]"),
            init: Some(&|i, c| format!("os[{i} * {dv} + {c}] * as_[{i}]")),
            store: &|i, c, acc| format!("os[{i} * {dv} + {c}] = {acc};"),
        },
    );
    w.close();
    w.l("__syncthreads();");
}

/// Opens the tile loop: `bh`, `bi`, `hi`, the tile's first row `r0` and row count `n0`
/// (over `rows`, `tq` or `tk`), and the operand heads `qh`, `kh`, `vh` (and `gh`).
pub(super) fn open_tiles(w: &mut W, e: Elem, part: Part, rows: &str) {
    let c = e.c_type();
    w.l(format!("const long long ntile = ({rows} + T - 1) / T;"));
    w.open(FOR_BLOCKS);
    lines(
        w,
        &format!(
            "const long long bh = r / ntile, bi = bh / H, hi = bh % H;
(void)bi;
const long long r0 = (r % ntile) * T;
const int n0 = (int)({rows} - r0 < T ? {rows} - r0 : T);
const {c}* qh = q + bi * qsb + hi * qsh;
const {c}* kh = k + bi * ksb + hi * ksh;
const {c}* vh = v + bi * vsb + hi * vsh;"
        ),
    );
    if part != Part::Forward {
        w.l(format!("const {c}* gh = g + bi * gsb + hi * gsh;"));
    }
}

/// Element (`bi`, `hi`, `row`, `c`) of the result `r`, through its strides (C expressions).
pub(super) fn at(r: &str, bi: &str, hi: &str, row: &str, c: &str) -> String {
    format!("{r}[{bi} * {r}_sb + {hi} * {r}_sh + ({row}) * {r}_st + ({c}) * {r}_sd]")
}

/// Writes the tile's first `n` rows of a result: `r[bi, hi, row0 + i, c] = src` for
/// `c < d` (`src` a C expression of `e = i·d + c` and `i`, stored as `e`'s type).
pub(super) fn store_rows(
    w: &mut W,
    e: Elem,
    (r, row0, n): (&str, &str, &str),
    d: usize,
    src: &str,
) {
    w.open(format!("for (int e = tid; e < {n} * {d}; e += nt)"));
    w.l(format!("const int i = e / {d}, c = e % {d};"));
    w.l(format!(
        "{} = {};",
        at(r, "bi", "hi", &format!("{row0} + i"), "c"),
        e.store(src)
    ));
    w.close();
}

pub(super) fn function(name: &str, params: Vec<Param>, items: &str, w: W) -> CudaFunction {
    CudaFunction {
        name: name.to_string(),
        params,
        work: Work::Blocks,
        items_rule: items.to_string(),
        text: w.finish(),
    }
}

/// The forward kernel (see the module documentation).
pub fn forward(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let t = tile(Part::Forward, dk, dv).expect("head sizes checked by the caller");
    let ps = params(Part::Forward, mask, e);
    let mut w = W::new();
    let what = format!("forward, heads dk = {dk}, dv = {dv}");
    open_kernel(
        &mut w,
        name,
        &ps,
        &what,
        t,
        &[
            ("qs", format!("T * {}", dk + 1)),
            ("ks", format!("T * {}", dk + 1)),
            ("vs", format!("T * {}", dv + 1)),
            ("ss", "T * (T + 1)".into()),
            ("os", format!("T * {dv}")),
            ("ms", "T".into()),
            ("ls", "T".into()),
            ("as_", "T".into()),
        ],
    );
    head(&mut w, Part::Forward, mask);
    open_tiles(&mut w, e, Part::Forward, "tq");
    w.l("const long long q0 = r0;");
    w.l("const int nq = n0;");
    w.l("__syncthreads();");
    load_tile(&mut w, e, "qs", "qh", dk, "q0", "nq");
    forward_sweep(&mut w, e, mask, dk, dv);
    store_rows(&mut w, e, ("out", "q0", "nq"), dv, "os[e] / ls[i]");
    w.close();
    w.close();
    function(name, ps, &format!("tiles b·h·⌈tq/{t}⌉"), w)
}

/// The query-side backward kernel: `dq` and the row statistics.
pub fn backward_q(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let t = tile(Part::BackwardQ, dk, dv).expect("head sizes checked by the caller");
    let (pk, pv) = (dk + 1, dv + 1);
    let ps = params(Part::BackwardQ, mask, e);
    let mut w = W::new();
    let what = format!("backward, query side, heads dk = {dk}, dv = {dv}");
    open_kernel(
        &mut w,
        name,
        &ps,
        &what,
        t,
        &[
            ("qs", format!("T * {pk}")),
            ("ks", format!("T * {pk}")),
            ("vs", format!("T * {pv}")),
            ("gs", format!("T * {pv}")),
            ("ss", "T * (T + 1)".into()),
            ("os", format!("T * {}", dk.max(dv))),
            ("ms", "T".into()),
            ("ls", "T".into()),
            ("as_", "T".into()),
            ("ds", "T".into()),
        ],
    );
    head(&mut w, Part::BackwardQ, mask);
    open_tiles(&mut w, e, Part::BackwardQ, "tq");
    w.l("const long long q0 = r0;");
    w.l("const int nq = n0;");
    w.l("__syncthreads();");
    load_tile(&mut w, e, "qs", "qh", dk, "q0", "nq");
    load_tile(&mut w, e, "gs", "gh", dv, "q0", "nq");
    forward_sweep(&mut w, e, mask, dk, dv);
    // D = Σ_c g·o / l, the statistics, then dq from zero.
    w.open("for (int i = tid; i < nq; i += nt)");
    w.l("float d = 0.0f;");
    w.l(format!(
        "for (int c = 0; c < {dv}; ++c) d = d + gs[i * {pv} + c] * os[i * {dv} + c];"
    ));
    stats_then_dq(&mut w, dk);
    load_tile(&mut w, e, "ks", "kh", dk, "k0", "nk");
    load_tile(&mut w, e, "vs", "vh", dv, "k0", "nk");
    w.l("__syncthreads();");
    w.open("for (int e = tid; e < T * T; e += nt)");
    w.l("const int i = e / T, j = e % T;");
    w.l("float p = 0.0f, dsv = 0.0f;");
    w.open("if (i < nq && j < nk)");
    pair_gradient(&mut w, mask, dk, dv, ("ms[i]", "ls[i]", "ds[i]"));
    w.close();
    w.l("(void)p;");
    w.l("ss[i * (T + 1) + j] = dsv;");
    w.close();
    w.l("__syncthreads();");
    w.open(format!("for (int e = tid; e < nq * {dk}; e += nt)"));
    w.l(format!("const int i = e / {dk}, c = e % {dk};"));
    w.l("const float* sr = ss + i * (T + 1);");
    w.l("float acc = os[e];");
    w.l(format!(
        "for (int j = 0; j < nk; ++j) acc = acc + sr[j] * ks[j * {pk} + c];"
    ));
    w.l("os[e] = acc;");
    w.close();
    w.close();
    w.l("__syncthreads();");
    store_rows(&mut w, e, ("dq", "q0", "nq"), dk, "os[e]");
    w.close();
    w.close();
    function(name, ps, &format!("tiles b·h·⌈tq/{t}⌉"), w)
}

/// The key-side backward kernel: `dk` and `dv` from the row statistics.
pub fn backward_kv(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let t = tile(Part::BackwardKv, dk, dv).expect("head sizes checked by the caller");
    let (pk, pv) = (dk + 1, dv + 1);
    let ps = params(Part::BackwardKv, mask, e);
    let mut w = W::new();
    let what = format!("backward, key side, heads dk = {dk}, dv = {dv}");
    open_kernel(
        &mut w,
        name,
        &ps,
        &what,
        t,
        &[
            ("ks", format!("T * {pk}")),
            ("vs", format!("T * {pv}")),
            ("qs", format!("T * {pk}")),
            ("gs", format!("T * {pv}")),
            ("ps", "T * (T + 1)".into()),
            ("dss", "T * (T + 1)".into()),
            ("dks", format!("T * {dk}")),
            ("dvs", format!("T * {dv}")),
            ("st", "T * 3".into()),
        ],
    );
    head(&mut w, Part::BackwardKv, mask);
    open_tiles(&mut w, e, Part::BackwardKv, "tk");
    w.l("const long long k0 = r0;");
    w.l("const int nk = n0;");
    w.l("__syncthreads();");
    load_tile(&mut w, e, "ks", "kh", dk, "k0", "nk");
    load_tile(&mut w, e, "vs", "vh", dv, "k0", "nk");
    w.l(format!(
        "for (int e = tid; e < T * {dk}; e += nt) dks[e] = 0.0f;"
    ));
    w.l(format!(
        "for (int e = tid; e < T * {dv}; e += nt) dvs[e] = 0.0f;"
    ));
    w.open("for (long long q0 = 0; q0 < tq; q0 += T)");
    w.l("const int nq = (int)(tq - q0 < T ? tq - q0 : T);");
    w.l("__syncthreads();");
    load_tile(&mut w, e, "qs", "qh", dk, "q0", "nq");
    load_tile(&mut w, e, "gs", "gh", dv, "q0", "nq");
    w.l("for (int e = tid; e < nq * 3; e += nt) st[e] = stats[(bh * tq + q0) * 3 + e];");
    w.l("__syncthreads();");
    w.l("// The scores and dp = g·vᵀ of every pair (0 outside the head), in register tiles.");
    scores(&mut w, dk, mask, "ps");
    dp_product(&mut w, dv);
    w.l("__syncthreads();");
    w.l("// p = exp(s − m)/l and ds = p·(dp − D)·scale (0 where masked and outside the head).");
    w.open("for (int e = tid; e < T * T; e += nt)");
    w.l("const int i = e / T, j = e % T;");
    w.l("float p = 0.0f, dsv = 0.0f;");
    w.open("if (i < nq && j < nk)");
    w.l("const long long qrow = q0 + i, krow = k0 + j;");
    w.l("(void)qrow; (void)krow;");
    w.l("p = expf(ps[i * (T + 1) + j] - st[i * 3]) / st[i * 3 + 1];");
    w.l(format!(
        "dsv = {} ? 0.0f : p * (dss[i * (T + 1) + j] - st[i * 3 + 2]) * sc;",
        masked_out(mask)
    ));
    w.close();
    w.l("ps[i * (T + 1) + j] = p;");
    w.l("dss[i * (T + 1) + j] = dsv;");
    w.close();
    w.l("__syncthreads();");
    w.l("// dv += pᵀ·g, dk += dsᵀ·q.");
    let p_ji = |j: &str, i: &str| format!("ps[{i} * (T + 1) + {j}]");
    let ds_ji = |j: &str, i: &str| format!("dss[{i} * (T + 1) + {j}]");
    let g_ic = |i: &str, c: &str| format!("gs[{i} * {pv} + {c}]");
    let q_ic = |i: &str, c: &str| format!("qs[{i} * {pk} + {c}]");
    let dv_init = |j: &str, c: &str| format!("dvs[{j} * {dv} + {c}]");
    let dk_init = |j: &str, c: &str| format!("dks[{j} * {dk} + {c}]");
    let dv_store = |j: &str, c: &str, acc: &str| format!("dvs[{j} * {dv} + {c}] = {acc};");
    let dk_store = |j: &str, c: &str, acc: &str| format!("dks[{j} * {dk} + {c}] = {acc};");
    let (dv_s, dk_s) = (dv.to_string(), dk.to_string());
    let sums: [(&str, &Index2, &Index2, &Index2, &Store); 2] = [
        (&dv_s, &p_ji, &g_ic, &dv_init, &dv_store),
        (&dk_s, &ds_ji, &q_ic, &dk_init, &dk_store),
    ];
    for (cols, a, b, init, store) in sums {
        product(
            &mut w,
            &Product {
                rows: "nk",
                cols,
                k: "nq",
                a,
                b,
                init: Some(init),
                store,
            },
        );
    }
    w.close();
    w.l("__syncthreads();");
    store_rows(&mut w, e, ("dk", "k0", "nk"), dk, "dks[e]");
    store_rows(&mut w, e, ("dv", "k0", "nk"), dv, "dvs[e]");
    w.close();
    w.close();
    function(name, ps, &format!("tiles b·h·⌈tk/{t}⌉"), w)
}

/// The whole backward of one head in one block (see the module documentation); the
/// caller checks [`fits_short`].
pub fn backward_short(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let t = tile(Part::Short, dk, dv).expect("head sizes checked by the caller");
    let (pk, pv) = (dk + 1, dv + 1);
    let ps = params(Part::Short, mask, e);
    let mut w = W::new();
    let what = format!("backward in one block per head, heads dk = {dk}, dv = {dv}");
    open_kernel(
        &mut w,
        name,
        &ps,
        &what,
        t,
        &[
            ("qs", format!("T * {pk}")),
            ("ks", format!("T * {pk}")),
            ("vs", format!("T * {pv}")),
            ("gs", format!("T * {pv}")),
            ("ps", "T * (T + 1)".into()),
            ("dss", "T * (T + 1)".into()),
            ("ds", "T".into()),
        ],
    );
    head(&mut w, Part::Short, mask);
    w.l("const int nq = (int)tq, nk = (int)tk;");
    w.l("const long long q0 = 0, k0 = 0;");
    w.open(FOR_BLOCKS);
    let c = e.c_type();
    lines(
        &mut w,
        &format!(
            "const long long bh = r, bi = bh / H, hi = bh % H;
(void)bi;
const {c}* qh = q + bi * qsb + hi * qsh;
const {c}* kh = k + bi * ksb + hi * ksh;
const {c}* vh = v + bi * vsb + hi * vsh;
const {c}* gh = g + bi * gsb + hi * gsh;"
        ),
    );
    w.l("__syncthreads();");
    load_tile(&mut w, e, "qs", "qh", dk, "q0", "nq");
    load_tile(&mut w, e, "ks", "kh", dk, "k0", "nk");
    load_tile(&mut w, e, "vs", "vh", dv, "k0", "nk");
    load_tile(&mut w, e, "gs", "gh", dv, "q0", "nq");
    w.l("__syncthreads();");
    w.l("// The scores and dp = g·vᵀ of every pair (0 outside the head).");
    scores(&mut w, dk, mask, "ps");
    dp_product(&mut w, dv);
    w.l("__syncthreads();");
    lines(
        &mut w,
        &format!(
            "// Each row's softmax and D = Σ_j p·dp, a warp per row, its lanes over the keys
// (every warp runs the same rows loop).
for (int i0 = 0; i0 < T; i0 += nw) {{
    const int i = i0 + warp;
    const bool live = i < nq;
    float* pr = ps + (live ? i : 0) * (T + 1);
    const float* dpr = dss + (live ? i : 0) * (T + 1);
    float mx = {ninf};
    if (live) for (int j = lane; j < nk; j += wd) mx = kiln_max_ref(mx, pr[j]);
    mx = kiln_warp_max(mx);
    float z = 0.0f;
    if (live) for (int j = lane; j < nk; j += wd) {{ const float x = expf(pr[j] - mx); pr[j] = x; z = z + x; }}
    z = kiln_warp_sum(z);
    float d = 0.0f;
    if (live) for (int j = lane; j < nk; j += wd) {{ const float p = pr[j] / z; pr[j] = p; d = d + p * dpr[j]; }}
    d = kiln_warp_sum(d);
    if (live && lane == 0) ds[i] = d;
}}
__syncthreads();",
            ninf = f32_lit(f32::NEG_INFINITY)
        ),
    );
    w.l("// ds = p·(dp − D)·scale, 0 where masked and outside the head.");
    w.open("for (int e = tid; e < T * T; e += nt)");
    w.l("const int i = e / T, j = e % T;");
    w.l("float dsv = 0.0f;");
    w.open("if (i < nq && j < nk)");
    w.l("const long long qrow = q0 + i, krow = k0 + j;");
    w.l("(void)qrow; (void)krow;");
    w.l("const float p = ps[i * (T + 1) + j];");
    w.l(format!(
        "dsv = {} ? 0.0f : p * (dss[i * (T + 1) + j] - ds[i]) * sc;",
        masked_out(mask)
    ));
    w.close();
    w.l("dss[i * (T + 1) + j] = dsv;");
    w.close();
    w.l("__syncthreads();");
    w.l("// dq = ds·k, dk = dsᵀ·q, dv = pᵀ·g.");
    let ds_ij = |i: &str, j: &str| format!("dss[{i} * (T + 1) + {j}]");
    let ds_ji = |j: &str, i: &str| format!("dss[{i} * (T + 1) + {j}]");
    let p_ji = |j: &str, i: &str| format!("ps[{i} * (T + 1) + {j}]");
    let k_jc = |j: &str, c: &str| format!("ks[{j} * {pk} + {c}]");
    let q_ic = |i: &str, c: &str| format!("qs[{i} * {pk} + {c}]");
    let g_ic = |i: &str, c: &str| format!("gs[{i} * {pv} + {c}]");
    let outputs: [(&str, &str, &str, usize, &Index2, &Index2); 3] = [
        ("dq", "tq", "nk", dk, &ds_ij, &k_jc),
        ("dk", "tk", "nq", dk, &ds_ji, &q_ic),
        ("dv", "tk", "nq", dv, &p_ji, &g_ic),
    ];
    for (out, len, k, d, a, b) in outputs {
        let rows = if len == "tq" { "nq" } else { "nk" };
        let store = |i: &str, c: &str, acc: &str| {
            format!("{} = {};", at(out, "bi", "hi", i, c), e.store(acc))
        };
        product(
            &mut w,
            &Product {
                rows,
                cols: &d.to_string(),
                k,
                a,
                b,
                init: None,
                store: &store,
            },
        );
    }
    w.close();
    w.close();
    function(name, ps, "heads b·h", w)
}

/// Ends a row loop that summed `d` (row `i`'s Σ g·o): `D = d / l` into `ds`, the row's
/// statistics `(m, l, D)` into `stats`, then zeroes the `dq` accumulators `os` and opens
/// the loop over key tiles (`k0`, `nk` keys), past its first barrier.
pub(super) fn stats_then_dq(w: &mut W, dk: usize) {
    w.l("ds[i] = d / ls[i];");
    w.l("float* st = stats + (bh * tq + q0 + i) * 3;");
    w.l("st[0] = ms[i];");
    w.l("st[1] = ls[i];");
    w.l("st[2] = ds[i];");
    w.close();
    w.l("__syncthreads();");
    w.l(format!(
        "for (int e = tid; e < T * {dk}; e += nt) os[e] = 0.0f;"
    ));
    w.open("for (long long k0 = 0; k0 < tk; k0 += T)");
    w.l("const int nk = (int)(tk - k0 < T ? tk - k0 : T);");
    w.l("__syncthreads();");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_fit_shared_memory() {
        for part in [
            Part::Forward,
            Part::BackwardQ,
            Part::BackwardKv,
            Part::Short,
        ] {
            for d in [1, 8, 64, 100, 128] {
                let t = tile(part, d, d).expect("a tile");
                assert!(shared_bytes(part, t, d, d) <= SHARED_BYTES);
            }
            assert_eq!(tile(part, 129, 64), None);
            assert_eq!(tile(part, 64, 0), None);
        }
        // The base and big Transformers' heads (64) get 32-row tiles forward and on the
        // query side.
        assert_eq!(tile(Part::Forward, 64, 64), Some(32));
        assert_eq!(tile(Part::BackwardQ, 64, 64), Some(32));
        assert_eq!(tile(Part::BackwardKv, 64, 64), Some(16));
        assert_eq!(items(Part::Forward, 32, 2, 8, 25, 40), 16);
        assert_eq!(items(Part::BackwardKv, 16, 2, 8, 25, 40), 48);
        assert_eq!(items(Part::Short, 32, 2, 8, 25, 25), 16);
        // The base Transformer's heads fit 32 rows in one block's shared memory.
        assert_eq!(tile(Part::Short, 64, 64), Some(32));
        assert!(fits_short(25, 32, 64, 64));
        assert!(!fits_short(33, 25, 64, 64));
        assert!(fits_short(16, 16, 128, 128) && !fits_short(17, 16, 128, 128));
    }
}
