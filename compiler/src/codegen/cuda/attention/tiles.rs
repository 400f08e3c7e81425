//! The C the flash kernels share: the register-tiled products over shared tiles, the
//! masked scores, tile loads and result stores, the kernels' common head and tile loop.

use super::shared::{arrays, declare, Cores};
use super::{params, tile, Part};
use crate::codegen::cuda::text::{f32_lit, Elem, W};
use crate::codegen::cuda::{signature, CudaFunction, Param, Work, FOR_BLOCKS};
use crate::codegen::rows::MaskKind;

/// The products of the tiles with 2×2 register tiles: over the `rows × cols` outputs
/// `acc(i, c) = init(i, c) + Σ_{j < k} a(i, j)·b(j, c)` (`j` in order, each term added as
/// the plain loops add it: the same bits), each thread item takes rows `i0`, `i0 + ⌈rows/2⌉`
/// and columns `c0`, `c0 + ⌈cols/2⌉`, so four loads from shared memory feed four
/// multiply-adds instead of eight. `a`, `b` and `init` give C expressions of their index
/// variables; `store(i, c, acc)` a statement (run once per output inside the bounds).
pub(in crate::codegen::cuda) struct Product<'a> {
    pub(super) rows: &'a str,
    pub(super) cols: &'a str,
    pub(super) k: &'a str,
    pub(super) a: &'a Index2<'a>,
    pub(super) b: &'a Index2<'a>,
    pub(super) init: Option<&'a Index2<'a>>,
    pub(super) store: &'a Store<'a>,
}

/// A C statement storing the accumulator `acc` at two index variables.
pub(in crate::codegen::cuda) type Store<'a> = dyn Fn(&str, &str, &str) -> String + 'a;

/// A C expression of two index variables.
pub(in crate::codegen::cuda) type Index2<'a> = dyn Fn(&str, &str) -> String + 'a;

pub(in crate::codegen::cuda) fn product(w: &mut W, p: &Product<'_>) {
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
pub(in crate::codegen::cuda) fn pair_dots(
    w: &mut W,
    d: usize,
    (a, b): (&str, &str),
    store: &Store<'_>,
) {
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
pub(in crate::codegen::cuda) fn scores(w: &mut W, dk: usize, mask: MaskKind, dst: &str) {
    pair_dots(w, dk, ("qs", "ks"), &score_store(mask, dst));
}

/// `dss[i][j] = Σ_c g[i, c]·v[j, c]` (`dp`) for every pair of the shared tiles `gs` and
/// `vs`, 0 outside the head.
pub(in crate::codegen::cuda) fn dp_product(w: &mut W, dv: usize) {
    pair_dots(w, dv, ("gs", "vs"), &|i, j, acc| {
        format!("dss[{i} * (T + 1) + {j}] = {i} < nq && {j} < nk ? {acc} : 0.0f;")
    });
}

/// A store of [`product`] for a score tile: `x` is the masked scaled score of `acc` (the
/// dot product) inside the head, 0 outside, written to `dst[i·(T+1) + j]`.
pub(in crate::codegen::cuda) fn score_store(
    mask: MaskKind,
    dst: &str,
) -> impl Fn(&str, &str, &str) -> String + '_ {
    move |i, j, acc| {
        format!(
            "{{ const int i = {i}, j = {j}; float x = 0.0f; if (i < nq && j < nk) {{ const long long qrow = q0 + i, krow = k0 + j; (void)qrow; (void)krow; const float d = {acc}; x = {}; }} {dst}[i * (T + 1) + j] = x; }}",
            masked_score(mask)
        )
    }
}

/// Writes `text` line by line at the writer's depth (`text` indents itself further).
pub(in crate::codegen::cuda) fn lines(w: &mut W, text: &str) {
    for line in text.lines() {
        if line.trim().is_empty() {
            continue;
        }
        w.l(line);
    }
}

/// The common head of every flash kernel: sizes, strides, scalars.
pub(in crate::codegen::cuda) fn head(w: &mut W, part: Part, mask: MaskKind) {
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
pub(in crate::codegen::cuda) fn masked_score(mask: MaskKind) -> &'static str {
    match mask {
        MaskKind::None => "d * sc",
        MaskKind::Key => "(mask[bi * tk + krow] != 0 ? d * sc : fl)",
        MaskKind::Causal => "(mask[qrow * tk + krow] != 0 ? d * sc : fl)",
    }
}

/// Whether the pair is masked out (its gradient is zero).
pub(in crate::codegen::cuda) fn masked_out(mask: MaskKind) -> &'static str {
    match mask {
        MaskKind::None => "false",
        MaskKind::Key => "(mask[bi * tk + krow] == 0)",
        MaskKind::Causal => "(mask[qrow * tk + krow] == 0)",
    }
}

/// Inside `if (i < nq && j < nk)`: the masked scaled score `x` of query row `i` and key
/// row `j` of the shared tiles (`const float x` when `declare`, else assigned).
pub(in crate::codegen::cuda) fn score(w: &mut W, mask: MaskKind, dk: usize, declare: bool) {
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
pub(in crate::codegen::cuda) fn pair_gradient(
    w: &mut W,
    mask: MaskKind,
    dk: usize,
    dv: usize,
    (m, l, dd): (&str, &str, &str),
) {
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

/// The opening of `part`'s flash kernel on `cores`: its tile `T`, its parameters, and its
/// text so far (the signature, a comment `flash attention {what}, heads …` ([`Cores::what`]),
/// `T` and the shared arrays, the common [`head`]).
pub(in crate::codegen::cuda) fn begin(
    name: &str,
    (cores, part, mask, e): (Cores, Part, MaskKind, Elem),
    (dk, dv): (usize, usize),
) -> (usize, Vec<Param>, W) {
    let what = cores.what(part);
    let t = tile(part, dk, dv).expect("head sizes checked by the caller");
    let ps = params(part, mask, e);
    let mut w = W::new();
    signature(&mut w, name, &ps);
    w.l(format!(
        "// flash attention {what}, heads dk = {dk}, dv = {dv}: tiles of T = {t} rows"
    ));
    declare(&mut w, t, &arrays(cores, part, t, (dk, dv)));
    head(&mut w, part, mask);
    (t, ps, w)
}

/// Loads `n` rows (the rest of the tile zero) of a `[.., t, d]` operand into the shared
/// array `dst` (row pitch `d + 1`): `src` points at the head, rows from `row0`, strides
/// `<dst>t` and `<dst>d` (the operand's own: `qs` is `q`'s tile, `qst` its row stride).
pub(in crate::codegen::cuda) fn load_tile(
    w: &mut W,
    e: Elem,
    dst: &str,
    src: &str,
    d: usize,
    row0: &str,
    n: &str,
) {
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

/// Opens the tile loop: `bh`, `bi`, `hi`, the tile's first row `r0` and row count `n0`
/// (over `rows`, `tq` or `tk`), and the operand heads `qh`, `kh`, `vh` (and `gh`).
pub(in crate::codegen::cuda) fn open_tiles(w: &mut W, e: Elem, part: Part, rows: &str) {
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
pub(in crate::codegen::cuda) fn at(r: &str, bi: &str, hi: &str, row: &str, c: &str) -> String {
    format!("{r}[{bi} * {r}_sb + {hi} * {r}_sh + ({row}) * {r}_st + ({c}) * {r}_sd]")
}

/// Writes the tile's first `n` rows of a result: `r[bi, hi, row0 + i, c] = src` for
/// `c < d` (`src` a C expression of `e = i·d + c` and `i`, stored as `e`'s type).
pub(in crate::codegen::cuda) fn store_rows(
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

/// The key-side backward's sweep over the query tiles opened: the sums `dks`, `dvs`
/// zeroed, then per tile `q0` its `nq` rows, its `q` and `g` rows staged by `stage` and
/// its rows' statistics `st`. [`close_query_sweep`] ends it.
pub(in crate::codegen::cuda) fn open_query_sweep(
    w: &mut W,
    (dk, dv): (usize, usize),
    stage: impl FnOnce(&mut W),
) {
    w.l(format!(
        "for (int e = tid; e < T * {dk}; e += nt) dks[e] = 0.0f;"
    ));
    w.l(format!(
        "for (int e = tid; e < T * {dv}; e += nt) dvs[e] = 0.0f;"
    ));
    w.open("for (long long q0 = 0; q0 < tq; q0 += T)");
    w.l("const int nq = (int)(tq - q0 < T ? tq - q0 : T);");
    w.l("__syncthreads();");
    stage(w);
    w.l("for (int e = tid; e < nq * 3; e += nt) st[e] = stats[(bh * tq + q0) * 3 + e];");
    w.l("__syncthreads();");
}

/// Ends [`open_query_sweep`]: `dk` and `dv` stored from the sums.
pub(in crate::codegen::cuda) fn close_query_sweep(w: &mut W, e: Elem, (dk, dv): (usize, usize)) {
    w.close();
    w.l("__syncthreads();");
    store_rows(w, e, ("dk", "k0", "nk"), dk, "dks[e]");
    store_rows(w, e, ("dv", "k0", "nk"), dv, "dvs[e]");
}

/// The online softmax's update of the score tile `ss` into the rows' `ms`, `ls` and
/// rescaling `as_`: a warp per row, its lanes over the keys striding by `width` (a C
/// expression); `why` ends the comment on the rows loop.
pub(in crate::codegen::cuda) fn online_softmax(w: &mut W, width: &str, why: &str) {
    lines(
        w,
        &format!(
            "// The online softmax's update, a warp per row, its lanes over the keys (every warp
// runs the same rows loop{why}).
for (int i0 = 0; i0 < T; i0 += nw) {{
    const int i = i0 + warp;
    const bool live = i < nq;
    float* sr = ss + (live ? i : 0) * (T + 1);
    const float m0 = live ? ms[i] : 0.0f;
    float mx = m0;
    if (live) for (int j = lane; j < nk; j += {width}) mx = kiln_max_ref(mx, sr[j]);
    mx = kiln_warp_max(mx);
    float z = 0.0f;
    if (live) for (int j = lane; j < nk; j += {width}) {{ const float p = expf(sr[j] - mx); sr[j] = p; z = z + p; }}
    z = kiln_warp_sum(z);
    if (live && lane == 0) {{
        const float al = m0 == mx ? 1.0f : expf(m0 - mx);
        ls[i] = ls[i] * al + z;
        ms[i] = mx;
        as_[i] = al;
    }}
}}
__syncthreads();"
        ),
    );
}

/// Each row's softmax of the score tile `ps` (in place) and `D = Σ_j p·dp` into `ds`, `dp`
/// the tile `dss`: a warp per row, its lanes over the keys striding by `width`.
pub(in crate::codegen::cuda) fn softmax_and_d(w: &mut W, width: &str) {
    lines(
        w,
        &format!(
            "// Each row's softmax and D = Σ_j p·dp, a warp per row, its lanes over the keys
// (every warp runs the same rows loop).
for (int i0 = 0; i0 < T; i0 += nw) {{
    const int i = i0 + warp;
    const bool live = i < nq;
    float* pr = ps + (live ? i : 0) * (T + 1);
    const float* dpr = dss + (live ? i : 0) * (T + 1);
    float mx = {ninf};
    if (live) for (int j = lane; j < nk; j += {width}) mx = kiln_max_ref(mx, pr[j]);
    mx = kiln_warp_max(mx);
    float z = 0.0f;
    if (live) for (int j = lane; j < nk; j += {width}) {{ const float x = expf(pr[j] - mx); pr[j] = x; z = z + x; }}
    z = kiln_warp_sum(z);
    float d = 0.0f;
    if (live) for (int j = lane; j < nk; j += {width}) {{ const float p = pr[j] / z; pr[j] = p; d = d + p * dpr[j]; }}
    d = kiln_warp_sum(d);
    if (live && lane == 0) ds[i] = d;
}}
__syncthreads();",
            ninf = f32_lit(f32::NEG_INFINITY)
        ),
    );
}

/// The finished kernel: closes its tile loop and its body.
pub(in crate::codegen::cuda) fn function(
    name: &str,
    params: Vec<Param>,
    items: &str,
    mut w: W,
) -> CudaFunction {
    w.close();
    w.close();
    CudaFunction::new(name, params, Work::Blocks, items, w)
}

/// Ends a row loop that summed `d` (row `i`'s Σ g·o): `D = d / l` into `ds`, the row's
/// statistics `(m, l, D)` into `stats`, then zeroes the `dq` accumulators `os` and opens
/// the loop over key tiles (`k0`, `nk` keys), past its first barrier.
pub(in crate::codegen::cuda) fn stats_then_dq(w: &mut W, dk: usize) {
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
