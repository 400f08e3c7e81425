//! The flash forward kernel and its sweep over the key tiles (which the query-side
//! backward reruns).

use super::tiles::{
    function, head, lines, load_tile, open_kernel, open_tiles, product, scores, store_rows, Product,
};
use super::{params, tile, Part};
use crate::codegen::cuda::text::{f32_lit, Elem, W};
use crate::codegen::cuda::CudaFunction;
use crate::codegen::rows::MaskKind;

/// The forward pass over all key tiles for the query tile at `q0` (`nq` rows): leaves
/// the unnormalized output in `os` (`T × dv`), the running max in `ms` and sum in `ls`.
pub(super) fn forward_sweep(w: &mut W, e: Elem, mask: MaskKind, dk: usize, dv: usize) {
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
