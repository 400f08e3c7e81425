//! The flash backward kernels: the query side, the key/value side, and both in one block
//! when a head fits one tile.

use super::forward::forward_sweep;
use super::shared::Cores;
use super::tiles::{
    at, begin, close_query_sweep, dp_product, function, lines, load_tile, masked_out,
    open_query_sweep, open_tiles, pair_gradient, product, scores, softmax_and_d, stats_then_dq,
    store_rows, Index2, Product, Store,
};
use super::Part;
use crate::codegen::cuda::text::Elem;
use crate::codegen::cuda::{CudaFunction, FOR_BLOCKS};
use crate::codegen::rows::MaskKind;

/// The query-side backward kernel: `dq` and the row statistics.
pub fn backward_q(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let (t, ps, mut w) = begin(name, (Cores::Cuda, Part::BackwardQ, mask, e), (dk, dv));
    let (pk, pv) = (dk + 1, dv + 1);
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
    function(name, ps, &format!("tiles b·h·⌈tq/{t}⌉"), w)
}

/// The key-side backward kernel: `dk` and `dv` from the row statistics.
pub fn backward_kv(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let (t, ps, mut w) = begin(name, (Cores::Cuda, Part::BackwardKv, mask, e), (dk, dv));
    let (pk, pv) = (dk + 1, dv + 1);
    open_tiles(&mut w, e, Part::BackwardKv, "tk");
    w.l("const long long k0 = r0;");
    w.l("const int nk = n0;");
    w.l("__syncthreads();");
    load_tile(&mut w, e, "ks", "kh", dk, "k0", "nk");
    load_tile(&mut w, e, "vs", "vh", dv, "k0", "nk");
    open_query_sweep(&mut w, (dk, dv), |w| {
        load_tile(w, e, "qs", "qh", dk, "q0", "nq");
        load_tile(w, e, "gs", "gh", dv, "q0", "nq");
    });
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
    close_query_sweep(&mut w, e, (dk, dv));
    function(name, ps, &format!("tiles b·h·⌈tk/{t}⌉"), w)
}

/// The whole backward of one head in one block (see the module documentation); the
/// caller checks [`super::fits_short`].
pub fn backward_short(name: &str, mask: MaskKind, dk: usize, dv: usize, e: Elem) -> CudaFunction {
    let (_, ps, mut w) = begin(name, (Cores::Cuda, Part::Short, mask, e), (dk, dv));
    let (pk, pv) = (dk + 1, dv + 1);
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
    softmax_and_d(&mut w, "wd");
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
    function(name, ps, "heads b·h", w)
}
