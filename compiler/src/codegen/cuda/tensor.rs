//! Flash attention on tensor cores: the bf16 kernels of a mixed-precision program.
//!
//! In: the mask kind and the head sizes `dk`, `dv` (multiples of 16, see [`fits`]). Out:
//! [`forward`], [`backward_q`], [`backward_kv`] and [`backward_short`], drop-in
//! replacements of the CUDA-core kernels of [`super::attention`] with the same
//! parameters, dims, tiles `T`, work items and statistics scratch, for buffers stored as
//! bf16. The structure is theirs — a block per tile of `T` query (or key) rows or per
//! head, the other side's tiles streamed through shared memory, the online softmax a
//! warp per row — with every product over the tiles done by the prelude's `kiln_mma`
//! (PTX `mma.m16n8k16`, bf16 operands, f32 accumulators).
//!
//! Operand tiles live in shared memory as rows of bf16 pairs (`unsigned` words, a row of
//! `d` elements padded to `d/2 + 4` words, so that the eight rows a fragment load touches
//! fall in distinct banks). A fragment's word is one load when the product's `k` runs
//! along the stored rows, else two loads whose halves `kiln_pair_col` joins. Each warp
//! takes output tiles of 16×8 in turn; every warp of the block runs the same number of
//! iterations (an idle one multiplies tile 0 and stores nothing), as the host shim's
//! exchanges need.
//!
//! Numerics: products of bf16 values are exact and accumulate in f32, as on the CUDA
//! cores, in the tensor cores' order. What changes is what the second products read:
//! the probabilities (forward: `p·v`; backward: `pᵀ·g`) and the score gradients (`ds·k`,
//! `dsᵀ·q`) are rounded to bf16 first, as FlashAttention-2 does (relative error 2⁻⁹
//! a term); the row sums `l` and `D` are of the f32 values.
//!
//! The work items and launch follow `Work::Blocks`, and the block must be whole warps
//! (`blockDim.x` a multiple of 32; the executors launch [`super::text::THREADS`]).

use crate::codegen::cuda::attention::{
    arrays, at, begin, bytes, close_query_sweep, function, lines, masked_out, online_softmax,
    open_query_sweep, open_tiles, score_store, softmax_and_d, store_rows, tile, word_pitch, Cores,
    Index2, Part, Store,
};
use crate::codegen::cuda::text::{f32_lit, Elem, W};
use crate::codegen::cuda::{CudaFunction, Param, FOR_BLOCKS};
use crate::codegen::rows::MaskKind;

/// Whether the tensor-core kernels take heads `dk`, `dv`: both multiples of 16, and the
/// CUDA-core kernels' tile for `part` a multiple of 16 rows (the tiles are the same).
pub fn fits(part: Part, dk: usize, dv: usize) -> bool {
    dk.is_multiple_of(16)
        && dv.is_multiple_of(16)
        && tile(part, dk, dv).is_some_and(|t| t.is_multiple_of(16))
}

/// Shared memory of the tensor-core kernel for `part`, in bytes.
pub fn shared_bytes(part: Part, t: usize, dk: usize, dv: usize) -> usize {
    bytes(t, &arrays(Cores::Tensor, part, t, (dk, dv)))
}

/// A C expression of the bf16 pair `(M[row][k], M[row][k + 1])` (`k` even) of a matrix
/// stored as rows of pairs: one word.
fn along(s: &str, pitch: usize) -> impl Fn(&str, &str) -> String + '_ {
    move |row, k| format!("{s}[({row}) * {pitch} + (({k}) >> 1)]")
}

/// A C expression of the pair `(M[k][n], M[k + 1][n])` (`k` even) of a matrix stored as
/// rows of pairs: a column's two elements from two rows.
fn across(s: &str, pitch: usize) -> impl Fn(&str, &str) -> String + '_ {
    move |k, n| {
        format!(
            "kiln_pair_col({s}[({k}) * {pitch} + (({n}) >> 1)], {s}[(({k}) + 1) * {pitch} + (({n}) >> 1)], ({n}) & 1)"
        )
    }
}

/// A product over shared tiles on tensor cores: `acc(i, c) = init(i, c) + Σ_k A[i][k]·B[k][c]`
/// for `i < rows`, `c < cols`, `k < depth` (`shape`: multiples of 16, 8 and 16; the tiles
/// zero past their rows). `a(i, k)` gives A's pair at `(i, k)`, `k + 1`; `b(k, c)` B's at
/// `(k, c)`, `(k + 1, c)`; `store(i, c, acc)` a statement, run for every output (the
/// caller bounds it).
struct Tc<'a> {
    shape: (usize, usize, usize),
    a: &'a Index2<'a>,
    b: &'a Index2<'a>,
    init: Option<&'a Index2<'a>>,
    store: &'a Store<'a>,
}

fn tc_product(w: &mut W, p: &Tc<'_>) {
    let (rows, cols, depth) = p.shape;
    let (n, steps) = (cols / 8, depth / 16);
    let tiles = rows / 16 * n;
    w.open("");
    w.open(format!(
        "for (int it = 0; it < ({tiles} + nw - 1) / nw; ++it)"
    ));
    w.l("const int tl = warp + it * nw;");
    w.l(format!("const bool on = tl < {tiles};"));
    w.l(format!(
        "const int mt = on ? tl / {n} : 0, nn = on ? tl % {n} : 0;"
    ));
    w.l("const int ra = mt * 16 + fg, rb = ra + 8, ca = nn * 8 + 2 * ft, cb = ca + 1, nb = nn * 8 + fg;");
    w.l("(void)rb; (void)cb;");
    match p.init {
        Some(init) => w.l(format!(
            "float c[4] = {{{}, {}, {}, {}}};",
            init("ra", "ca"),
            init("ra", "cb"),
            init("rb", "ca"),
            init("rb", "cb")
        )),
        None => w.l("float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};"),
    }
    w.open(format!("for (int s = 0; s < {steps}; ++s)"));
    w.l("const int kk0 = s * 16 + 2 * ft, kk1 = kk0 + 8;");
    w.l(format!(
        "kiln_mma(c, {}, {}, {}, {}, {}, {});",
        (p.a)("ra", "kk0"),
        (p.a)("rb", "kk0"),
        (p.a)("ra", "kk1"),
        (p.a)("rb", "kk1"),
        (p.b)("kk0", "nb"),
        (p.b)("kk1", "nb")
    ));
    w.close();
    w.open("if (on)");
    for (i, col, q) in [
        ("ra", "ca", 0),
        ("ra", "cb", 1),
        ("rb", "ca", 2),
        ("rb", "cb", 3),
    ] {
        w.l((p.store)(i, col, &format!("c[{q}]")));
    }
    w.close();
    w.close();
    w.close();
}

/// `x·yᵀ` of the staged word tiles `x` and `y` (`t` rows of width `d` each): `store(i, j,
/// acc)` for every `t × t` output.
fn by_transposed(w: &mut W, (t, d): (usize, usize), (x, y): (&str, &str), store: &Store<'_>) {
    let p = word_pitch(d);
    tc_product(
        w,
        &Tc {
            shape: (t, t, d),
            a: &along(x, p),
            b: &|k, j| along(y, p)(j, k),
            init: None,
            store,
        },
    );
}

/// `dst[i·d + c] = dst[i·d + c] (· scale[i], when given) + Σ_k A[i][k]·B[k][c]` over the
/// `t × d` float tile `dst` in shared memory, `k < t`.
fn accumulate(
    w: &mut W,
    (t, d): (usize, usize),
    (a, b): (&Index2<'_>, &Index2<'_>),
    dst: &str,
    scale: Option<&str>,
) {
    let scaled = |i: &str| scale.map_or(String::new(), |s| format!(" * {s}[{i}]"));
    tc_product(
        w,
        &Tc {
            shape: (t, d, t),
            a,
            b,
            init: Some(&|i, c| format!("{dst}[{i} * {d} + {c}]{}", scaled(i))),
            store: &|i, c, acc| format!("{dst}[{i} * {d} + {c}] = {acc};"),
        },
    );
}

/// Copies `n` rows (the rest of the tile zero) of the `[.., t, d]` operand `x` (head
/// pointer `xh`, strides `xst`, `xsd`, pair loads when `xw`) into the shared words `dst`.
fn stage(w: &mut W, dst: &str, x: &str, d: usize, row0: &str, n: &str) {
    let (half, pw) = (d / 2, word_pitch(d));
    w.open(format!("for (int e = tid; e < T * {half}; e += nt)"));
    w.l(format!(
        "const int i = e / {half}, cw = e % {half}, c = 2 * cw;"
    ));
    w.l("unsigned x = 0u;");
    w.open(format!("if (i < {n})"));
    w.l(format!("const long long o = ({row0} + i) * {x}st;"));
    w.l(format!(
        "x = {x}w ? *(const unsigned*)({x}h + o + c) : ((unsigned){x}h[o + c * {x}sd] | ((unsigned){x}h[o + (c + 1) * {x}sd] << 16));"
    ));
    w.close();
    w.l(format!("{dst}[i * {pw} + cw] = x;"));
    w.close();
}

/// The common head after [`head`]: the lane's fragment coordinates and whether each
/// operand's pairs are aligned words (unit element stride, even strides, aligned base).
fn tc_head(w: &mut W, operands: &[&str]) {
    w.l("const int fg = lane >> 2, ft = lane & 3;");
    for x in operands {
        w.l(format!(
            "const bool {x}w = {x}sd == 1 && (({x}sb | {x}sh | {x}st) & 1) == 0 && ((unsigned long long){x} & 3ull) == 0;"
        ));
    }
}

/// The forward pass over all key tiles for the query tile at `q0` (`nq` rows, staged in
/// `qs`): leaves the unnormalized output in `os` (`T × dv`), the running max in `ms` and
/// sum in `ls` (`ks`, `vs`, `ss`, `ps`, `as_` its scratch).
fn sweep(w: &mut W, mask: MaskKind, t: usize, dk: usize, dv: usize) {
    let (pv, pp) = (word_pitch(dv), word_pitch(t));
    lines(
        w,
        &format!(
            "for (int e = tid; e < T * {dv}; e += nt) os[e] = 0.0f;
for (int i = tid; i < T; i += nt) {{ ms[i] = {ninf}; ls[i] = 0.0f; as_[i] = 1.0f; }}",
            ninf = f32_lit(f32::NEG_INFINITY)
        ),
    );
    w.open("for (long long k0 = 0; k0 < tk; k0 += T)");
    w.l("const int nk = (int)(tk - k0 < T ? tk - k0 : T);");
    w.l("__syncthreads();");
    stage(w, "ks", "k", dk, "k0", "nk");
    stage(w, "vs", "v", dv, "k0", "nk");
    w.l("__syncthreads();");
    w.l("// s = q·kᵀ, masked and scaled (0 outside the head).");
    by_transposed(w, (t, dk), ("qs", "ks"), &score_store(mask, "ss"));
    w.l("__syncthreads();");
    online_softmax(w, "32", "");
    w.l("// The probabilities as bf16 pairs (0 outside the head).");
    w.open(format!("for (int e = tid; e < T * {}; e += nt)", t / 2));
    w.l(format!(
        "const int i = e / {h}, jw = e % {h}, j = 2 * jw;",
        h = t / 2
    ));
    w.l("const unsigned lo = i < nq && j < nk ? (unsigned)kiln_f32_to_bf16(ss[i * (T + 1) + j]) : 0u;");
    w.l("const unsigned hi = i < nq && j + 1 < nk ? (unsigned)kiln_f32_to_bf16(ss[i * (T + 1) + j + 1]) : 0u;");
    w.l(format!("ps[i * {pp} + jw] = lo | (hi << 16);"));
    w.close();
    w.l("__syncthreads();");
    w.l("// o = o·alpha + p·v.");
    let (a, b) = (along("ps", pp), across("vs", pv));
    accumulate(w, (t, dv), (&a, &b), "os", Some("as_"));
    w.close();
    w.l("__syncthreads();");
}

/// The opening of `part`'s tensor-core kernel ([`begin`], then [`tc_head`] for its
/// operands); the caller checks [`fits`].
fn tc_begin(
    name: &str,
    (part, mask): (Part, MaskKind),
    (dk, dv): (usize, usize),
) -> (usize, Vec<Param>, W) {
    assert!(fits(part, dk, dv), "tensor-core heads");
    let cores = (Cores::Tensor, part, mask, Elem::Bf16);
    let (t, ps, mut w) = begin(name, cores, (dk, dv));
    let operands: &[&str] = match part {
        Part::Forward => &["q", "k", "v"],
        _ => &["q", "k", "v", "g"],
    };
    tc_head(&mut w, operands);
    (t, ps, w)
}

/// The tensor-core forward (see the module documentation); the caller checks [`fits`].
pub fn forward(name: &str, mask: MaskKind, dk: usize, dv: usize) -> CudaFunction {
    let e = Elem::Bf16;
    let (t, ps, mut w) = tc_begin(name, (Part::Forward, mask), (dk, dv));
    open_tiles(&mut w, e, Part::Forward, "tq");
    w.l("const long long q0 = r0;");
    w.l("const int nq = n0;");
    w.l("__syncthreads();");
    stage(&mut w, "qs", "q", dk, "q0", "nq");
    sweep(&mut w, mask, t, dk, dv);
    store_rows(&mut w, e, ("out", "q0", "nq"), dv, "os[e] / ls[i]");
    function(name, ps, &format!("tiles b·h·⌈tq/{t}⌉ (tensor cores)"), w)
}

/// The tensor-core backward of one head in one block (see the module documentation); the
/// caller checks [`fits`] for `Part::Short` and that the lengths fit the tile.
pub fn backward_short(name: &str, mask: MaskKind, dk: usize, dv: usize) -> CudaFunction {
    let e = Elem::Bf16;
    let (t, ps, mut w) = tc_begin(name, (Part::Short, mask), (dk, dv));
    let (pk, pv, pp) = (word_pitch(dk), word_pitch(dv), word_pitch(t));
    w.l("const int nq = (int)tq, nk = (int)tk;");
    w.l("const long long q0 = 0, k0 = 0;");
    w.open(FOR_BLOCKS);
    lines(
        &mut w,
        "const long long bh = r, bi = bh / H, hi = bh % H;
(void)bi;
const kiln_bf16* qh = q + bi * qsb + hi * qsh;
const kiln_bf16* kh = k + bi * ksb + hi * ksh;
const kiln_bf16* vh = v + bi * vsb + hi * vsh;
const kiln_bf16* gh = g + bi * gsb + hi * gsh;",
    );
    w.l("__syncthreads();");
    stage(&mut w, "qs", "q", dk, "q0", "nq");
    stage(&mut w, "ks", "k", dk, "k0", "nk");
    stage(&mut w, "vs", "v", dv, "k0", "nk");
    stage(&mut w, "gs", "g", dv, "q0", "nq");
    w.l("__syncthreads();");
    w.l("// s = q·kᵀ (masked, scaled) and dp = g·vᵀ, 0 outside the head.");
    scores_and_dp(&mut w, mask, t, dk, dv, ("ps", "dss"));
    w.l("__syncthreads();");
    softmax_and_d(&mut w, "32");
    w.l("// p and ds = p·(dp − D)·scale as bf16 pairs, 0 where masked and outside the head.");
    pair_words(
        &mut w,
        mask,
        t,
        ("ps[i * (T + 1) + j]", "dss", "ds[i]"),
        Some("pw"),
    );
    w.l("__syncthreads();");
    w.l("// dq = ds·k, dk = dsᵀ·q, dv = pᵀ·g.");
    let store_to = |out: &'static str, bound: &'static str| {
        move |i: &str, c: &str, acc: &str| {
            format!(
                "if ({i} < {bound}) {} = {};",
                at(out, "bi", "hi", i, c),
                e.store(acc)
            )
        }
    };
    let (sq, sk, sv) = (
        store_to("dq", "nq"),
        store_to("dk", "nk"),
        store_to("dv", "nk"),
    );
    let ds_t = |j: &str, i: &str| across("dw", pp)(i, j);
    let p_t = |j: &str, i: &str| across("pw", pp)(i, j);
    let products: [(usize, &Index2, &Index2, &Store); 3] = [
        (dk, &along("dw", pp), &across("ks", pk), &sq),
        (dk, &ds_t, &across("qs", pk), &sk),
        (dv, &p_t, &across("gs", pv), &sv),
    ];
    for (d, a, b, store) in products {
        tc_product(
            &mut w,
            &Tc {
                shape: (t, d, t),
                a,
                b,
                init: None,
                store,
            },
        );
    }
    function(name, ps, "heads b·h (tensor cores)", w)
}

/// The probability `p` and `ds = p·(dp − D)·scale` of the tile's pairs as bf16 pairs into
/// `pw` (when given) and `dw`, 0 where masked and outside the head: `p` and `D` are C
/// expressions of `i` and `j`, `dp` the float tile of `g·vᵀ`.
fn pair_words(
    w: &mut W,
    mask: MaskKind,
    t: usize,
    (p, dp, d): (&str, &str, &str),
    pw: Option<&str>,
) {
    let pp = word_pitch(t);
    w.open(format!("for (int e = tid; e < T * {}; e += nt)", t / 2));
    w.l(format!("const int i = e / {h}, jw = e % {h};", h = t / 2));
    w.l("unsigned pv2 = 0u, dv2 = 0u;");
    w.open("for (int u = 0; u < 2; ++u)");
    w.l("const int j = 2 * jw + u;");
    w.l("float p = 0.0f, dsv = 0.0f;");
    w.open("if (i < nq && j < nk)");
    w.l("const long long qrow = q0 + i, krow = k0 + j;");
    w.l("(void)qrow; (void)krow;");
    w.l(format!("p = {p};"));
    w.l(format!(
        "dsv = {} ? 0.0f : p * ({dp}[i * (T + 1) + j] - {d}) * sc;",
        masked_out(mask)
    ));
    w.close();
    w.l("pv2 |= (unsigned)kiln_f32_to_bf16(p) << (16 * u);");
    w.l("dv2 |= (unsigned)kiln_f32_to_bf16(dsv) << (16 * u);");
    w.close();
    if let Some(pw) = pw {
        w.l(format!("{pw}[i * {pp} + jw] = pv2;"));
    } else {
        w.l("(void)pv2;");
    }
    w.l(format!("dw[i * {pp} + jw] = dv2;"));
    w.close();
}

/// `s = q·kᵀ` (masked, scaled) into `s` and `dp = g·vᵀ` into `dp` over the staged tiles
/// `qs`, `ks`, `gs`, `vs`, both 0 outside the head.
fn scores_and_dp(w: &mut W, mask: MaskKind, t: usize, dk: usize, dv: usize, (s, dp): (&str, &str)) {
    by_transposed(w, (t, dk), ("qs", "ks"), &score_store(mask, s));
    by_transposed(w, (t, dv), ("gs", "vs"), &|i, j, acc| {
        format!("{dp}[{i} * (T + 1) + {j}] = {i} < nq && {j} < nk ? {acc} : 0.0f;")
    });
}

/// The tensor-core query-side backward (`dq` and the row statistics, as
/// [`super::attention::backward_q`]); the caller checks [`fits`].
pub fn backward_q(name: &str, mask: MaskKind, dk: usize, dv: usize) -> CudaFunction {
    let e = Elem::Bf16;
    let (t, ps, mut w) = tc_begin(name, (Part::BackwardQ, mask), (dk, dv));
    let (pk, pv, pp) = (word_pitch(dk), word_pitch(dv), word_pitch(t));
    open_tiles(&mut w, e, Part::BackwardQ, "tq");
    w.l("const long long q0 = r0;");
    w.l("const int nq = n0;");
    w.l("__syncthreads();");
    stage(&mut w, "qs", "q", dk, "q0", "nq");
    stage(&mut w, "gs", "g", dv, "q0", "nq");
    sweep(&mut w, mask, t, dk, dv);
    w.l("// D = Σ_c g·o / l and the statistics, then dq from zero.");
    w.open("for (int i = tid; i < nq; i += nt)");
    w.l("float d = 0.0f;");
    w.open(format!("for (int cw = 0; cw < {}; ++cw)", dv / 2));
    w.l(format!("const unsigned x = gs[i * {pv} + cw];"));
    w.l(format!("d = d + kiln_bf16_lo(x) * os[i * {dv} + 2 * cw];"));
    w.l(format!(
        "d = d + kiln_bf16_hi(x) * os[i * {dv} + 2 * cw + 1];"
    ));
    w.close();
    super::attention::stats_then_dq(&mut w, dk);
    stage(&mut w, "ks", "k", dk, "k0", "nk");
    stage(&mut w, "vs", "v", dv, "k0", "nk");
    w.l("__syncthreads();");
    scores_and_dp(&mut w, mask, t, dk, dv, ("ss", "dss"));
    w.l("__syncthreads();");
    let p = "expf(ss[i * (T + 1) + j] - ms[i]) / ls[i]";
    pair_words(&mut w, mask, t, (p, "dss", "ds[i]"), None);
    w.l("__syncthreads();");
    w.l("// dq += ds·k.");
    let (a, b) = (along("dw", pp), across("ks", pk));
    accumulate(&mut w, (t, dk), (&a, &b), "os", None);
    w.close();
    w.l("__syncthreads();");
    store_rows(&mut w, e, ("dq", "q0", "nq"), dk, "os[e]");
    function(name, ps, &format!("tiles b·h·⌈tq/{t}⌉ (tensor cores)"), w)
}

/// The tensor-core key-side backward (`dk`, `dv` from the row statistics, as
/// [`super::attention::backward_kv`]); the caller checks [`fits`].
pub fn backward_kv(name: &str, mask: MaskKind, dk: usize, dv: usize) -> CudaFunction {
    let e = Elem::Bf16;
    let (t, ps, mut w) = tc_begin(name, (Part::BackwardKv, mask), (dk, dv));
    let (pk, pv, pp) = (word_pitch(dk), word_pitch(dv), word_pitch(t));
    open_tiles(&mut w, e, Part::BackwardKv, "tk");
    w.l("const long long k0 = r0;");
    w.l("const int nk = n0;");
    w.l("__syncthreads();");
    stage(&mut w, "ks", "k", dk, "k0", "nk");
    stage(&mut w, "vs", "v", dv, "k0", "nk");
    open_query_sweep(&mut w, (dk, dv), |w| {
        stage(w, "qs", "q", dk, "q0", "nq");
        stage(w, "gs", "g", dv, "q0", "nq");
    });
    scores_and_dp(&mut w, mask, t, dk, dv, ("ps", "dss"));
    w.l("__syncthreads();");
    let p = "expf(ps[i * (T + 1) + j] - st[i * 3]) / st[i * 3 + 1]";
    pair_words(&mut w, mask, t, (p, "dss", "st[i * 3 + 2]"), Some("pw"));
    w.l("__syncthreads();");
    w.l("// dv += pᵀ·g, dk += dsᵀ·q.");
    let p_t = |j: &str, i: &str| across("pw", pp)(i, j);
    let ds_t = |j: &str, i: &str| across("dw", pp)(i, j);
    accumulate(&mut w, (t, dv), (&p_t, &across("gs", pv)), "dvs", None);
    accumulate(&mut w, (t, dk), (&ds_t, &across("qs", pk)), "dks", None);
    close_query_sweep(&mut w, e, (dk, dv));
    function(name, ps, &format!("tiles b·h·⌈tk/{t}⌉ (tensor cores)"), w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::cuda::attention::SHARED_BYTES;

    #[test]
    fn tensor_core_tiles_fit_and_are_the_cuda_core_tiles() {
        for d in [16, 32, 48, 64, 96, 128] {
            for part in [
                Part::Forward,
                Part::BackwardQ,
                Part::BackwardKv,
                Part::Short,
            ] {
                let t = tile(part, d, d).expect("a tile");
                // The key side of heads of 128 gets 8-row tiles: the CUDA cores keep it
                // (and, with it, the query side).
                let wide_kv = part == Part::BackwardKv && d == 128;
                assert_eq!(fits(part, d, d), !wide_kv, "{part:?} d={d}");
                assert_eq!(t.is_multiple_of(16), !wide_kv, "{part:?} d={d}");
                assert!(
                    shared_bytes(part, t, d, d) <= SHARED_BYTES,
                    "{part:?} d={d}"
                );
            }
        }
        assert!(!fits(Part::Forward, 8, 16) && !fits(Part::Forward, 64, 40));
        // The Transformer's heads: 32-row tiles.
        assert_eq!(tile(Part::Forward, 64, 64), Some(32));
        assert_eq!(tile(Part::Short, 64, 64), Some(32));
        // Fragment rows land in distinct banks: pitches are 4 mod 8 words.
        for d in [16, 32, 64, 128] {
            assert_eq!(word_pitch(d) % 8, 4);
        }
    }
}
