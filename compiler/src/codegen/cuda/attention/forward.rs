//! The flash forward kernel and its sweep over the key tiles (which the query-side
//! backward reruns).

use super::shared::Cores;
use super::tiles::{
    begin, function, lines, load_tile, online_softmax, open_tiles, product, scores, store_rows,
    Product,
};
use super::Part;
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
    online_softmax(w, "wd", ", as the host shim's shuffles need");
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
    let (t, ps, mut w) = begin(name, (Cores::Cuda, Part::Forward, mask, e), (dk, dv));
    open_tiles(&mut w, e, Part::Forward, "tq");
    w.l("const long long q0 = r0;");
    w.l("const int nq = n0;");
    w.l("__syncthreads();");
    load_tile(&mut w, e, "qs", "qh", dk, "q0", "nq");
    forward_sweep(&mut w, e, mask, dk, dv);
    store_rows(&mut w, e, ("out", "q0", "nq"), dv, "os[e] / ls[i]");
    function(name, ps, &format!("tiles b·h·⌈tq/{t}⌉"), w)
}
