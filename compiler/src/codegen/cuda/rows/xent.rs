//! The label-smoothed cross-entropy as CUDA C: the count of non-pad targets, the rows'
//! losses and the logits' gradient, the mean.

use super::*;

/// The count of non-pad targets: `stats[0] = den`, `stats[1] = 1/den` (`inf` and `NaN`
/// follow when every target is pad, as on the CPU). Buffers `[target, stats]` (`int
/// [rows]`, `float[2]`), dims `[rows, pad]`, items 1 (one block).
pub fn xent_ls_count(name: &str) -> CudaFunction {
    count_kernel(name, false)
}

/// [`xent_ls_count`] of the `seeded` form (a loss-scaled train_step): `stats[1] =
/// seed·(1/den)`, the gradient's weight per row, as on the CPU. Buffers `[target, seed,
/// stats]` (`seed`: `float[1]`).
pub fn xent_ls_count_seeded(name: &str) -> CudaFunction {
    count_kernel(name, true)
}

fn count_kernel(name: &str, seeded: bool) -> CudaFunction {
    let mut params = vec![param("target", "const int*")];
    if seeded {
        params.push(param("seed", "const float*"));
    }
    params.push(param("stats", "float*"));
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long rows = dims.d[0];");
    w.l("const long long pad = dims.d[1];");
    w.open(FOR_BLOCKS);
    w.l("// Per-thread counts are exact integers below 2^24; their sum is exact too.");
    w.l("float n = 0.0f;");
    w.open(for_cols("rows"));
    w.l("if ((long long)target[j] != pad) n = n + 1.0f;");
    w.close();
    w.l("n = kiln_block_sum(n, sh);");
    w.open("if (threadIdx.x == 0)");
    w.l("stats[0] = n;");
    w.l(if seeded {
        "stats[1] = seed[0] * (1.0f / n);"
    } else {
        "stats[1] = 1.0f / n;"
    });
    w.close();
    w.close();
    w.close();
    function(name, params, Work::Blocks, "1 (one block)", w)
}

/// The CPU kernel's label-smoothed cross-entropy per row and the logits' gradient.
/// Buffers `[logits, target, c_nll, c_smooth, inv_v, inv_den, row_loss, dlogits]`
/// (`inv_den` is `stats + 1` of [`xent_ls_count`]; `dlogits` may be `logits`), dims
/// `[v, pad]`, items rows.
pub fn xent_ls(name: &str, e: Elem) -> CudaFunction {
    xent_rows(name, e, true, 0)
}

/// [`xent_ls`] with up to `keep` groups of [`GROUP`] logits a thread held in registers
/// from the first pass to the second (`0`: none). Where a row's groups fit (`v` a
/// multiple of the group, aligned rows, `v / GROUP ≤ keep · blockDim.x`), a thread
/// issues the loads of all its groups before the first sum and the gradient reads them
/// from registers: the logits are read once instead of twice. The same groups, in the
/// same order, with the same arithmetic: the same bits as the two reads.
pub fn xent_ls_with(name: &str, e: Elem, keep: usize) -> CudaFunction {
    xent_rows(name, e, true, keep)
}

/// Groups a thread of [`xent_ls_with`] keeps for rows of `v` logits (a program's
/// vocabulary, a constant) in blocks of [`THREADS`](crate::codegen::cuda::text::THREADS):
/// in a bf16 program (a group is one 16-byte vector, four registers) up to
/// [`XENT_KEEP`]; `0` otherwise (f32 groups take eight registers each).
pub fn xent_keep(v: Option<usize>, e: Elem) -> usize {
    let threads = crate::codegen::cuda::text::THREADS as usize;
    match v {
        Some(v) if e == Elem::Bf16 && v > 0 && v % GROUP == 0 => {
            let k = (v / GROUP).div_ceil(threads);
            if k <= XENT_KEEP {
                k
            } else {
                0
            }
        }
        _ => 0,
    }
}

/// Groups of logits a thread of [`xent_ls_with`] holds at most (96 registers in bf16:
/// rows of up to 24 · 8 · 256 = 49,152, the base model's 37,000 included).
pub const XENT_KEEP: usize = 24;

/// [`xent_ls`] without the gradient, for a program that reads only the loss (the `loss`
/// entry): one read of each row. Buffers `[logits, target, c_nll, c_smooth, inv_v,
/// row_loss]`, dims and items as [`xent_ls`]'s.
pub fn xent_ls_loss(name: &str, e: Elem) -> CudaFunction {
    xent_rows(name, e, false, 0)
}

/// [`xent_ls`] (`grad`) or [`xent_ls_loss`].
/// Declares `q` (`kiln_v16[·]`) holding group `k` of the row at `row` (elements
/// `GROUP·k` to `GROUP·k + GROUP − 1`, stored as `e`).
fn load_group(w: &mut W, e: Elem, q: &str, row: &str) {
    let vn = e.v16_per_group();
    w.l(format!("kiln_v16 {q}[{vn}];"));
    w.l(format!(
        "for (int s = 0; s < {vn}; ++s) {q}[s] = ((const kiln_v16*){row})[k * {vn} + s];"
    ));
}

/// `body` (a pass over one group `q` of index `k`) for each of a thread's `keep` groups
/// held in `kq` ([`xent_ls_with`]), in order, unrolled so that `kq` stays in registers.
fn held_groups(w: &mut W, keep: usize, vn: usize, body: &dyn Fn(&mut W)) {
    w.l("KILN_UNROLL");
    w.open(format!("for (int i = 0; i < {keep}; ++i)"));
    w.l("const long long k = threadIdx.x + (long long)i * blockDim.x;");
    w.open("if (k < nv)");
    w.l(format!("const kiln_v16* q = kq + i * {vn};"));
    body(w);
    w.close();
    w.close();
}

/// `xent_rows`' parameters and the text before its loop over rows: the scalars, whether
/// rows go in 16-byte vectors, and whether a thread's groups stay in registers (`keep`
/// of them, only where it writes the gradient).
fn xent_head(name: &str, e: Elem, grad: bool, keep: usize) -> (Vec<Param>, W, usize) {
    let mut params = vec![
        param("logits", &e.ptr(true)),
        param("target", "const int*"),
        param("c_nll", "const float*"),
        param("c_smooth", "const float*"),
        param("inv_v", "const float*"),
    ];
    if grad {
        params.push(param("inv_den", "const float*"));
    }
    params.push(param("row_loss", "float*"));
    if grad {
        params.push(param("dlogits", &e.ptr(false)));
    }
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long v = dims.d[0];");
    w.l("const long long pad = dims.d[1];");
    w.l("const float vf = (float)v;");
    w.l("const float cn = c_nll[0];");
    w.l("const float cs = c_smooth[0];");
    w.l("const float iv = inv_v[0];");
    if grad {
        w.l("const float id = inv_den[0];");
    }
    let aligned = |b: &str| format!("((unsigned long long){b} & 15ull) == 0");
    w.l(format!(
        "// Rows in groups of {GROUP} (16-byte vectors) where every row starts on a vector."
    ));
    w.l(format!(
        "const bool vec = v % {GROUP} == 0 && {}{};",
        aligned("logits"),
        if grad {
            format!(" && {}", aligned("dlogits"))
        } else {
            String::new()
        }
    ));
    w.l(format!("const long long nv = vec ? v / {GROUP} : 0;"));
    let keep = if grad { keep } else { 0 };
    if keep > 0 {
        w.l("// A thread's groups in registers from one pass to the next where they fit.");
        w.l(format!(
            "const bool held = nv <= {keep}ll * (long long)blockDim.x;"
        ));
    }
    (params, w, keep)
}

fn xent_rows(name: &str, e: Elem, grad: bool, keep: usize) -> CudaFunction {
    let (params, mut w, keep) = xent_head(name, e, grad, keep);
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* xr = logits + r * v;", e.c_type()));
    if grad {
        w.l(format!("{}* dr = dlogits + r * v;", e.c_type()));
    }
    w.l("const long long t = target[r];");
    w.l("const float keep = t != pad ? 1.0f : 0.0f;");
    w.l("const bool in_range = (unsigned long long)t < (unsigned long long)v;");
    w.l("const long long ti = in_range ? t : 0;");
    if grad {
        w.l("// Read before any write (dlogits may be logits): the block reduction below is a");
        w.l("// barrier.");
    }
    w.l(format!("const float xt = {};", e.load("xr[ti]")));
    let ninf = f32_lit(f32::NEG_INFINITY);
    let (vw, vn) = (GROUP, e.v16_per_group());
    w.l("// Pass 1, online: each thread's max m, Σexp(x − m) rescaled as m grows, and Σx;");
    w.l("// whole groups of 16-byte vectors first (one rescale a group), then the rest one by");
    w.l("// one.");
    w.l(format!("float m = {ninf};"));
    w.l("float z = 0.0f, sx = 0.0f;");
    if keep > 0 {
        w.l(format!(
            "// The thread's groups k = threadIdx.x + i·blockDim.x (i < {keep}) in registers:"
        ));
        w.l("// all their loads first, the gradient reads them again from here.");
        w.l(format!("kiln_v16 kq[{}];", keep * vn));
        w.open("if (held)");
        w.l("KILN_UNROLL");
        w.open(format!("for (int i = 0; i < {keep}; ++i)"));
        w.l("const long long k = threadIdx.x + (long long)i * blockDim.x;");
        w.l(format!(
            "if (k < nv) for (int s = 0; s < {vn}; ++s) kq[i * {vn} + s] = ((const kiln_v16*)xr)[k * {vn} + s];"
        ));
        w.close();
        held_groups(&mut w, keep, vn, &|w: &mut W| first_pass_group(w, e));
        w.close();
        w.open("else");
    }
    w.open("for (long long k = threadIdx.x; k < nv; k += blockDim.x)");
    load_group(&mut w, e, "q", "xr");
    first_pass_group(&mut w, e);
    w.close();
    if keep > 0 {
        w.close();
    }
    w.open(format!(
        "for (long long j = nv * {vw} + threadIdx.x; j < v; j += blockDim.x)"
    ));
    w.l(format!("const float x = {};", e.load("xr[j]")));
    w.l("sx = sx + x;");
    w.l("const float mn = kiln_max_ref(m, x);");
    w.open("if (mn != m)");
    w.l("z = kiln_scaled(z, m, mn) + expf(x - mn);");
    w.l("m = mn;");
    w.close();
    w.open(format!("else if (m != {})", f32_lit(f32::NEG_INFINITY)));
    w.l("z = z + expf(x - m);");
    w.close();
    w.close();
    w.l("kiln_block_max_sum(&m, &z, sh);");
    w.l("sx = kiln_block_sum(sx, sh);");
    w.l("// A row of −inf (or NaN) has no finite sum: NaN, as the two-pass CPU kernel gives.");
    w.l(format!(
        "if (m == {}) z = __int_as_float(0x7fc00000);",
        f32_lit(f32::NEG_INFINITY)
    ));
    w.l("// Σ(x − m), the smoothing term's sum.");
    w.l("const float sxm = sx - vf * m;");
    w.l("const float lse = logf(z);");
    w.l("// −lp_t = m + lse − x_t; −Σlp = v·lse − Σ(x − m).");
    w.l("const float nll = in_range ? (m + lse) - xt : 0.0f;");
    w.l("const float smooth = (vf * lse - sxm) * iv;");
    w.l("const float loss = (nll * cn + smooth * cs) * keep;");
    w.l("if (threadIdx.x == 0) row_loss[r] = loss;");
    if !grad {
        w.close();
        w.close();
        return function(name, params, Work::Blocks, "rows", w);
    }
    w.l("// dlogits = e·(w·(c_nll + c_smooth·inv_v·v)/z) − w·c_smooth·inv_v, minus w·c_nll");
    w.l("// at the target; w = keep·inv_den.");
    w.l("const float wk = keep * id;");
    w.l("const float csi = cs * iv;");
    w.l("const float cp = (wk * (cn + csi * vf)) / z;");
    w.l("const float c0 = wk * csi;");
    w.l("const float wn = in_range ? wk * cn : 0.0f;");
    w.l("// Pass 2: the gradient, exp(x − m) computed again (x is read, never a rounded e);");
    w.l("// the vectors of pass 1, then the rest.");
    if keep > 0 {
        w.open("if (held)");
        held_groups(&mut w, keep, vn, &|w: &mut W| gradient_group(w, e));
        w.close();
        w.open("else");
    }
    w.open("for (long long k = threadIdx.x; k < nv; k += blockDim.x)");
    load_group(&mut w, e, "q", "xr");
    gradient_group(&mut w, e);
    w.close();
    if keep > 0 {
        w.close();
    }
    w.open(format!(
        "for (long long j = nv * {vw} + threadIdx.x; j < v; j += blockDim.x)"
    ));
    w.l(format!(
        "float gv = expf({} - m) * cp - c0;",
        e.load("xr[j]")
    ));
    w.l("if (j == ti) gv = gv - wn;");
    w.l(format!("dr[j] = {};", e.store("gv")));
    w.close();
    w.close();
    w.close();
    let mut f = function(name, params, Work::Blocks, "rows", w);
    if keep > 0 {
        // At most 128 registers a thread, so that two blocks share an SM: one block's
        // loads of a row then overlap the other's arithmetic.
        let head = format!("__global__ void {name}(");
        let bounded = format!("__global__ void __launch_bounds__(KILN_THREADS, 2) {name}(");
        f.text = f.text.replacen(&head, &bounded, 1);
    }
    f
}

/// `loss = Σ row_loss / den` (`den = stats[0]` of [`xent_ls_count`]). Buffers
/// `[row_loss, stats, loss]`, dims `[rows]`, items 1 (one block).
pub fn xent_ls_finish(name: &str) -> CudaFunction {
    let params = vec![
        param("row_loss", "const float*"),
        param("stats", "const float*"),
        param("loss", "float*"),
    ];
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long rows = dims.d[0];");
    w.open(FOR_BLOCKS);
    w.l("float num = 0.0f;");
    w.open(for_cols("rows"));
    w.l("num = num + row_loss[j];");
    w.close();
    w.l("num = kiln_block_sum(num, sh);");
    w.l("if (threadIdx.x == 0) loss[0] = num / stats[0];");
    w.close();
    w.close();
    function(name, params, Work::Blocks, "1 (one block)", w)
}

/// The first pass over one group `q` of index `k`: its max, Σx and Σexp(x − m), the
/// running sum rescaled where the max grows.
fn first_pass_group(w: &mut W, e: Elem) {
    let vw = GROUP;
    let ninf = f32_lit(f32::NEG_INFINITY);
    w.l(format!("float xs[{vw}];"));
    w.l(format!(
        "for (int u = 0; u < {vw}; ++u) xs[u] = {};",
        e.group_load("q", "u")
    ));
    w.l("float gm = xs[0];");
    w.l(format!(
        "for (int u = 1; u < {vw}; ++u) gm = kiln_max_ref(gm, xs[u]);"
    ));
    w.l(format!("for (int u = 0; u < {vw}; ++u) sx = sx + xs[u];"));
    w.l("const float mn = kiln_max_ref(m, gm);");
    w.open("if (mn != m)");
    w.l("z = kiln_scaled(z, m, mn);");
    w.l("m = mn;");
    w.close();
    w.open(format!("if (m != {ninf})"));
    w.l(format!(
        "for (int u = 0; u < {vw}; ++u) z = z + expf(xs[u] - m);"
    ));
    w.close();
}

/// The second pass over one group `q` of index `k`: its gradient.
fn gradient_group(w: &mut W, e: Elem) {
    let (vw, vn) = (GROUP, e.v16_per_group());
    w.l(format!("kiln_v16 o[{vn}];"));
    w.open(format!("for (int u = 0; u < {vw}; ++u)"));
    w.l(format!(
        "float gv = expf({} - m) * cp - c0;",
        e.group_load("q", "u")
    ));
    w.l(format!("if (k * {vw} + u == ti) gv = gv - wn;"));
    w.l(e.group_store("o", "u", "gv"));
    w.close();
    w.l(format!(
        "for (int s = 0; s < {vn}; ++s) ((kiln_v16*)dr)[k * {vn} + s] = o[s];"
    ));
}
