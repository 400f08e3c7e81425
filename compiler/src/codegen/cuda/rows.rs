//! Row kernels as CUDA C: softmaxes, layer norm and its backward, the label-smoothed
//! cross-entropy. One block of [`THREADS`](crate::codegen::cuda::text::THREADS) threads
//! per row (or per block of rows); each thread owns the columns `j ≡ threadIdx.x (mod
//! blockDim.x)` in every pass, and row sums and maxima go through the prelude's fixed
//! block tree (`kiln_block_sum`, `kiln_block_max`).
//!
//! In: the element type of the float buffers (and the mask kind). Out: one
//! [`CudaFunction`]. Buffers and `dims` are the CPU kernels' ([`crate::codegen::rows`]):
//! the same order, the same `*_dims` arrays, the same aliasing allowances (an output may
//! be the input where the CPU kernel allows it: every thread reads an element before it
//! writes it, and a block barrier separates a pass that reads other threads' elements
//! from the writes). Items are the CPU kernels' items too (rows, or blocks of
//! [`LN_BWD_BLOCK`] rows), except for `add_layer_norm_bwd_finish` (tiles of 32 columns,
//! [`add_layer_norm_bwd_finish_items`]; the CPU's are columns) and the `xent_ls` helpers
//! documented below.
//!
//! The formulas are the CPU kernels', step for step; only the order of the row sums
//! differs (a block tree instead of four vector lanes).
//!
//! `xent_ls` runs as three kernels so that no value crosses to the host: [`xent_ls_count`]
//! (`den` = the non-pad targets, and `1/den`), [`xent_ls`] (the CPU kernel's per-row loss
//! and logits' gradient, reading `inv_den` from the count's buffer; in two passes over
//! the logits where the CPU takes three: an online max and sum of exponentials, then the
//! gradient, the exponentials computed again; `Σ(x − m)` as `Σx − v·m`), and
//! [`xent_ls_finish`] (`Σ row_loss / den` into the scalar loss).

use crate::codegen::cuda::text::{f32_lit, Elem, GROUP, W};
use crate::codegen::cuda::{
    for_cols, param, signature, CudaFunction, Param, Work, FOR_BLOCKS, FOR_WARPS, WARPS_HEAD,
};
use crate::codegen::rows::{MaskKind, LN_BWD_BLOCK};

fn function(name: &str, params: Vec<Param>, work: Work, items: &str, w: W) -> CudaFunction {
    CudaFunction {
        name: name.to_string(),
        params,
        work,
        items_rule: items.to_string(),
        text: w.finish(),
    }
}

/// Opens a row kernel: signature, shared scratch, the loop over rows `r`.
fn open_rows(w: &mut W, name: &str, params: &[Param]) {
    signature(w, name, params);
    w.l("__shared__ float sh[KILN_THREADS];");
}

/// The last two passes of a softmax into `outr` given the row max `m` and the value
/// expression `value` of element `j`: `e = exp(value − m)` summed, then `e · (1/Σe)`.
fn softmax_tail(w: &mut W, e: Elem, n: &str, value: &str) {
    w.l("float z = 0.0f;");
    w.open(for_cols(n));
    w.l(format!("const float ex = expf({value} - m);"));
    w.l(format!("outr[j] = {};", e.store("ex")));
    w.l("z = z + ex;");
    w.close();
    w.l("z = kiln_block_sum(z, sh);");
    w.l("const float rz = 1.0f / z;");
    w.open(for_cols(n));
    w.l(format!(
        "outr[j] = {};",
        e.store(&format!("{} * rz", e.load("outr[j]")))
    ));
    w.close();
}

/// `out[r, :] = softmax(x[r, :])`. Buffers `[x, out]`, dims `[c]`, items rows.
pub fn softmax(name: &str, e: Elem) -> CudaFunction {
    let params = vec![param("x", &e.ptr(true)), param("out", &e.ptr(false))];
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long c = dims.d[0];");
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* xr = x + r * c;", e.c_type()));
    w.l(format!("{}* outr = out + r * c;", e.c_type()));
    w.l(format!("float m = {};", f32_lit(f32::NEG_INFINITY)));
    w.open(for_cols("c"));
    w.l(format!("m = kiln_max_ref(m, {});", e.load("xr[j]")));
    w.close();
    w.l("m = kiln_block_max(m, sh);");
    softmax_tail(&mut w, e, "c", &e.load("xr[j]"));
    w.close();
    w.close();
    function(name, params, Work::Blocks, "rows", w)
}

/// `softmax(where(mask, x·scale, fill))` over the last axis of `x[b, h, tq, tk]`.
/// Buffers `[x, scale, out]` without a mask, else `[x, mask, scale, fill, out]` (mask
/// `int` 0/1: `[b, tk]` for `Key`, `[tq, tk]` for `Causal`); dims `[b, h, tq, tk]`; items
/// rows `b·h·tq`.
pub fn scale_mask_softmax(name: &str, mask: MaskKind, e: Elem) -> CudaFunction {
    let masked = mask != MaskKind::None;
    let mut params = vec![param("x", &e.ptr(true))];
    if masked {
        params.push(param("mask", "const int*"));
    }
    params.push(param("scale", "const float*"));
    if masked {
        params.push(param("fill", "const float*"));
    }
    params.push(param("out", &e.ptr(false)));
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    if mask == MaskKind::Key {
        w.l("const long long h = dims.d[1];");
    }
    if masked {
        w.l("const long long tq = dims.d[2];");
    }
    w.l("const long long tk = dims.d[3];");
    w.l("const float s = scale[0];");
    if masked {
        w.l("const float f = fill[0];");
    }
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* xr = x + r * tk;", e.c_type()));
    w.l(format!("{}* outr = out + r * tk;", e.c_type()));
    let value = match mask {
        MaskKind::None => format!("({} * s)", e.load("xr[j]")),
        _ => {
            let mrow = if mask == MaskKind::Key {
                "r / (h * tq)"
            } else {
                "r % tq"
            };
            w.l(format!("const int* mr = mask + ({mrow}) * tk;"));
            format!("(mr[j] != 0 ? {} * s : f)", e.load("xr[j]"))
        }
    };
    w.l(format!("float m = {};", f32_lit(f32::NEG_INFINITY)));
    w.open(for_cols("tk"));
    w.l(format!("m = kiln_max_ref(m, {value});"));
    w.close();
    w.l("m = kiln_block_max(m, sh);");
    softmax_tail(&mut w, e, "tk", &value);
    w.close();
    w.close();
    function(name, params, Work::Blocks, "rows b·h·tq", w)
}

/// `ds = p ∘ (dp − Σ p∘dp) · mult` per row. Buffers `[p, dp, mult, ds]` (`ds` may be
/// `dp`), dims `[c]`, items rows.
pub fn softmax_bwd(name: &str, e: Elem) -> CudaFunction {
    let params = vec![
        param("p", &e.ptr(true)),
        param("dp", &e.ptr(true)),
        param("mult", "const float*"),
        param("ds", &e.ptr(false)),
    ];
    let mut w = W::new();
    open_rows(&mut w, name, &params);
    w.l("const long long c = dims.d[0];");
    w.l("const float k = mult[0];");
    w.open(FOR_BLOCKS);
    w.l(format!("const {}* pr = p + r * c;", e.c_type()));
    w.l(format!("const {}* dpr = dp + r * c;", e.c_type()));
    w.l(format!("{}* dsr = ds + r * c;", e.c_type()));
    w.l("float dot = 0.0f;");
    w.open(for_cols("c"));
    w.l(format!(
        "dot = dot + {} * {};",
        e.load("pr[j]"),
        e.load("dpr[j]")
    ));
    w.close();
    w.l("dot = kiln_block_sum(dot, sh);");
    w.open(for_cols("c"));
    w.l(format!("const float d = {} - dot;", e.load("dpr[j]")));
    w.l(format!("const float v = {} * d;", e.load("pr[j]")));
    w.l(format!("dsr[j] = {};", e.store("v * k")));
    w.close();
    w.close();
    w.close();
    function(name, params, Work::Blocks, "rows", w)
}

/// `out = normalize(x + y)·γ + β` per row of `d`. Buffers `[x, y, gamma, beta, inv_d,
/// eps, out]` (`out` may be `x` or `y`), dims `[d]`, items rows, one warp a row
/// ([`Work::Warps`]): its lanes over the columns, the sums by shuffles.
///
/// A row of at most [`LN_LANE`] elements a lane (`d ≤ 1024` with warps of 32) is held
/// in registers: a lane issues all its loads before its first sum and writes `out` once.
/// Longer rows go through `out` in three passes (`x + y` stored, then read back twice),
/// where each pass's loads wait for the last pass's stores (`out` may be `x` or `y`).
/// Both paths give the same bits: a lane owns the columns `j ≡ lane (mod width)` and
/// sums them in order, and the variance and the result read `x + y` as stored.
pub fn add_layer_norm(name: &str, e: Elem) -> CudaFunction {
    add_layer_norm_with(name, e, LN_LANE)
}

/// Elements of a row a lane of [`add_layer_norm`] (and of the statistics of
/// [`add_layer_norm_bwd`]) holds in registers at most: rows of up to 1,024 with warps of
/// 32 (the big model's `d_model`).
pub const LN_LANE: usize = 32;

/// The elements a lane holds in registers for rows of `d` (a program's layer norms, whose
/// `d_model` is a constant): `⌈d / 32⌉`, so that a warp's registers hold a row and no
/// more (a lane's array is sized when the kernel is compiled, whatever `d` a launch
/// has). `0` (every row through memory) where `d` is not a constant or exceeds `32 ·`
/// [`LN_LANE`].
pub fn row_lane(d: Option<usize>) -> usize {
    match d {
        Some(d) if d > 0 && d <= 32 * LN_LANE => d.div_ceil(32),
        _ => 0,
    }
}

/// [`add_layer_norm`] with rows of up to `lane` elements a lane in registers (`0`: every
/// row through `out`); for tests of the two paths.
pub fn add_layer_norm_with(name: &str, e: Elem, lane: usize) -> CudaFunction {
    let params = vec![
        param("x", &e.ptr(true)),
        param("y", &e.ptr(true)),
        param("gamma", "const float*"),
        param("beta", "const float*"),
        param("inv_d", "const float*"),
        param("eps", "const float*"),
        param("out", &e.ptr(false)),
    ];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long d = dims.d[0];");
    w.l("const float c = inv_d[0];");
    w.l("const float ep = eps[0];");
    for l in WARPS_HEAD.lines() {
        w.l(l);
    }
    let lanes = "for (long long j = lane; j < d; j += width)";
    let row = |w: &mut W| {
        w.open(FOR_WARPS);
        w.l("const long long r = r0 + wi;");
        w.l("const bool live = wi < warps && r < items;");
        w.l(format!("const {}* xr = x + r * d;", e.c_type()));
        w.l(format!("const {}* yr = y + r * d;", e.c_type()));
        w.l(format!("{}* outr = out + r * d;", e.c_type()));
    };
    if lane > 0 {
        // Chosen once a launch, each path with its own loop over the rows (one loop with
        // both took 172 registers, each alone 40 and 56).
        w.open(format!("if (width == 32u && d <= {})", lane * 32));
        row(&mut w);
        w.l("// The row in registers (warps of 32): element u of the lane is column lane + 32·u.");
        w.l("const long long left = d - lane;");
        w.l(format!("const {}* xl = xr + lane;", e.c_type()));
        w.l(format!("const {}* yl = yr + lane;", e.c_type()));
        w.l(format!("{}* ol = outr + lane;", e.c_type()));
        w.l("const float* gl = gamma + lane;");
        w.l("const float* bl = beta + lane;");
        w.l(format!("float s[{lane}];"));
        w.l("float sum = 0.0f;");
        w.open("if (live)");
        sum_in_registers(&mut w, e, lane, None);
        if e == Elem::Bf16 {
            w.l("// x + y as the three-pass path stores and reads it back.");
            w.l("KILN_UNROLL");
            w.l(format!(
                "for (int u = 0; u < {lane}; ++u) s[u] = {};",
                e.load(&e.store("s[u]"))
            ));
        }
        w.close();
        w.l("sum = kiln_warp_sum(sum);");
        w.l("const float mean = sum * c;");
        w.l("float ssq = 0.0f;");
        w.open("if (live)");
        each_lane_element(&mut w, lane, &|w: &mut W| {
            w.l("const float xc = s[u] - mean;");
            w.l("ssq = ssq + xc * xc;");
        });
        w.close();
        w.l("ssq = kiln_warp_sum(ssq);");
        w.l("const float var = ssq * c;");
        w.l("const float rstd = 1.0f / sqrtf(var + ep);");
        w.open("if (live)");
        each_lane_element(&mut w, lane, &|w: &mut W| {
            w.l("const float xc = s[u] - mean;");
            w.l("const float xh = xc * rstd;");
            w.l("const float v = xh * gl[32 * u];");
            w.l(format!("ol[32 * u] = {};", e.store("v + bl[32 * u]")));
        });
        w.close();
        w.close();
        w.l("return;");
        w.close();
    }
    row(&mut w);
    w.l("// Pass 1: s = x + y into out, and its sum.");
    w.l("float sum = 0.0f;");
    w.open("if (live)");
    w.open(lanes);
    w.l(format!(
        "const float s = {} + {};",
        e.load("xr[j]"),
        e.load("yr[j]")
    ));
    w.l(format!("outr[j] = {};", e.store("s")));
    w.l("sum = sum + s;");
    w.close();
    w.close();
    w.l("sum = kiln_warp_sum(sum);");
    w.l("const float mean = sum * c;");
    w.l("// Pass 2: the sum of squared deviations.");
    w.l("float ssq = 0.0f;");
    w.open("if (live)");
    w.open(lanes);
    w.l(format!("const float xc = {} - mean;", e.load("outr[j]")));
    w.l("ssq = ssq + xc * xc;");
    w.close();
    w.close();
    w.l("ssq = kiln_warp_sum(ssq);");
    w.l("const float var = ssq * c;");
    w.l("const float rstd = 1.0f / sqrtf(var + ep);");
    w.l("// Pass 3: out = (s - mean)·rstd·γ + β.");
    w.open("if (live)");
    w.open(lanes);
    w.l(format!("const float xc = {} - mean;", e.load("outr[j]")));
    w.l("const float xh = xc * rstd;");
    w.l("const float v = xh * gamma[j];");
    w.l(format!("outr[j] = {};", e.store("v + beta[j]")));
    w.close();
    w.close();
    w.close();
    w.close();
    function(name, params, Work::Warps, "rows", w)
}

/// `body` for each element `u` a lane holds of a row in registers (column `lane + 32·u`,
/// those below `left`), unrolled so that the lane's arrays stay in registers.
fn each_lane_element(w: &mut W, lane: usize, body: &dyn Fn(&mut W)) {
    w.l("KILN_UNROLL");
    w.open(format!("for (int u = 0; u < {lane}; ++u)"));
    w.open("if (32 * u < left)");
    body(w);
    w.close();
    w.close();
}

/// A lane's `lane` elements `s[u] = x + y` of a row into registers (`xl`, `yl` its
/// first columns, `left` the columns from its first on), all loaded before the first is
/// added to `sum`, in column order; `also`, a statement of `u`, runs beside each load.
fn sum_in_registers(w: &mut W, e: Elem, lane: usize, also: Option<&str>) {
    w.l("KILN_UNROLL");
    w.open(format!("for (int u = 0; u < {lane}; ++u)"));
    w.l(format!(
        "s[u] = 32 * u < left ? {} + {} : 0.0f;",
        e.load("xl[32 * u]"),
        e.load("yl[32 * u]")
    ));
    if let Some(also) = also {
        w.l(also);
    }
    w.close();
    w.l("KILN_UNROLL");
    w.open(format!("for (int u = 0; u < {lane}; ++u)"));
    w.l("if (32 * u < left) sum = sum + s[u];");
    w.close();
}

/// The backward of [`add_layer_norm`] (the CPU kernel's formulas): `dx` per row and per
/// block of [`LN_BWD_BLOCK`] rows the partial `dγ`, `dβ` sums into `scratch[blk, 0..2d]`.
/// Buffers `[x, y, gamma, g, inv_d, eps, dx, scratch]` (`dx` may be `x`, `y` or `g`),
/// dims `[rows, d]`, items row blocks `ceil(rows / 16)`, one warp per row block
/// ([`Work::Warps`]).
///
/// Where a warp of 32 holds a row in registers (at most [`LN_BWD_LANE`] elements a
/// lane), it takes its block's rows one after another in one pass over memory: a lane
/// loads its `x + y` and `g` of the row (all its loads before its first sum), the row's
/// statistics come from shuffles (every lane gets the same sums), then it writes its `dx`
/// and adds to its columns' partial `dγ`, `dβ`, kept in registers for the block's rows
/// and stored once. No barrier, and `x`, `y` and `g` are read once.
///
/// Otherwise (longer rows, blocks narrower than a warp) in two phases with a barrier
/// between them: the statistics of the warp's rows (two passes each) into its shared
/// slots, then each lane its columns `j ≡ lane (mod width)` down the rows in order.
///
/// Both give the same bits: the sums of each row and the partials of each column are
/// added in the same order with the same formulas. Every thread makes the same shuffle
/// calls (a warp without a row sums zeros), as the host shim needs.
pub fn add_layer_norm_bwd(name: &str, e: Elem) -> CudaFunction {
    add_layer_norm_bwd_with(name, e, LN_BWD_LANE)
}

/// Elements of a row a lane of [`add_layer_norm_bwd`] holds in registers at most: rows
/// of up to 512 (the base model's `d_model`). A lane keeps four arrays of this many
/// floats (`x + y`, `g` and the two partials); at 32 (the big model) they would take
/// most of its registers, so longer rows take the two phases.
pub const LN_BWD_LANE: usize = 16;

/// The elements a lane of [`add_layer_norm_bwd`] holds in registers for rows of `d`:
/// [`row_lane`], or `0` (the two phases) above [`LN_BWD_LANE`].
pub fn bwd_row_lane(d: Option<usize>) -> usize {
    match row_lane(d) {
        l if l <= LN_BWD_LANE => l,
        _ => 0,
    }
}

/// [`add_layer_norm_bwd`] with rows of up to `lane` elements a lane in registers (`0`:
/// always the two phases); for tests of the two paths.
pub fn add_layer_norm_bwd_with(name: &str, e: Elem, lane: usize) -> CudaFunction {
    let params = vec![
        param("x", &e.ptr(true)),
        param("y", &e.ptr(true)),
        param("gamma", "const float*"),
        param("g", &e.ptr(true)),
        param("inv_d", "const float*"),
        param("eps", "const float*"),
        param("dx", &e.ptr(false)),
        param("scratch", "float*"),
    ];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long rows = dims.d[0];");
    w.l("const long long d = dims.d[1];");
    w.l("const float c = inv_d[0];");
    w.l("const float ep = eps[0];");
    for l in WARPS_HEAD.lines() {
        w.l(l);
    }
    let block = |w: &mut W| {
        w.open(FOR_WARPS);
        w.l("const long long r = r0 + wi;");
        w.l("const bool live = wi < warps && r < items;");
        w.l(format!("const long long lo = r * {LN_BWD_BLOCK};"));
        w.l(format!(
            "const long long hi = lo + {LN_BWD_BLOCK} < rows ? lo + {LN_BWD_BLOCK} : rows;"
        ));
    };
    let sums = |w: &mut W| {
        w.l("ssq = ssq + xc * xc;");
        w.l("sxc = sxc + xc;");
        w.l("sa = sa + a;");
        w.l("saxc = saxc + a * xc;");
    };
    let reduce = |w: &mut W| {
        w.l("ssq = kiln_warp_sum(ssq);");
        w.l("sxc = kiln_warp_sum(sxc);");
        w.l("sa = kiln_warp_sum(sa);");
        w.l("saxc = kiln_warp_sum(saxc);");
        w.l("const float var = ssq * c;");
        w.l("const float rstd = 1.0f / sqrtf(var + ep);");
        w.l("// dx_j = rstd·(a_j − c·Σa) − k·(xc_j − c·Σxc), k = c·rstd³·Σa·xc.");
        w.l("const float r3 = (rstd * rstd) * rstd;");
        w.l("const float csa = c * sa;");
        w.l("const float k3 = (c * r3) * saxc;");
        w.l("const float csxc = c * sxc;");
    };
    if lane > 0 {
        // Chosen once a launch, each path with its own loop over the row blocks.
        w.open(format!("if (width == 32u && d <= {})", lane * 32));
        block(&mut w);
        w.l("// Element u of the lane is column lane + 32·u.");
        w.l("const long long left = d - lane;");
        w.l("const float* gl = gamma + lane;");
        w.l(format!("float pg[{lane}], pb[{lane}];"));
        w.l("KILN_UNROLL");
        w.l(format!(
            "for (int u = 0; u < {lane}; ++u) {{ pg[u] = 0.0f; pb[u] = 0.0f; }}"
        ));
        w.open(format!("for (int i = 0; i < {LN_BWD_BLOCK}; ++i)"));
        w.l("const long long q = lo + i;");
        w.l("const bool on = live && q < hi;");
        w.l(format!("const {}* xl = x + q * d + lane;", e.c_type()));
        w.l(format!("const {}* yl = y + q * d + lane;", e.c_type()));
        w.l(format!("const {}* gq = g + q * d + lane;", e.c_type()));
        w.l(format!("{}* dl = dx + q * d + lane;", e.c_type()));
        w.l(format!("float s[{lane}], gv[{lane}];"));
        w.l("float sum = 0.0f;");
        w.open("if (on)");
        w.l("// Every load of the row before the first sum.");
        let g_load = format!("gv[u] = 32 * u < left ? {} : 0.0f;", e.load("gq[32 * u]"));
        sum_in_registers(&mut w, e, lane, Some(&g_load));
        w.close();
        w.l("sum = kiln_warp_sum(sum);");
        w.l("const float mean = sum * c;");
        w.l("// Σxc², Σxc, Σa, Σa·xc with xc = s − mean, a = g·γ.");
        w.l("float ssq = 0.0f, sxc = 0.0f, sa = 0.0f, saxc = 0.0f;");
        w.open("if (on)");
        each_lane_element(&mut w, lane, &|w: &mut W| {
            w.l("const float xc = s[u] - mean;");
            w.l("const float a = gv[u] * gl[32 * u];");
            sums(w);
        });
        w.close();
        reduce(&mut w);
        w.open("if (on)");
        each_lane_element(&mut w, lane, &|w: &mut W| {
            w.l("const float xc = s[u] - mean;");
            w.l("const float a = gv[u] * gl[32 * u];");
            w.l("const float t1 = rstd * (a - csa);");
            w.l("const float t2 = k3 * (xc - csxc);");
            w.l(format!("dl[32 * u] = {};", e.store("t1 - t2")));
            w.l("pg[u] = pg[u] + (gv[u] * xc) * rstd;");
            w.l("pb[u] = pb[u] + gv[u];");
        });
        w.close();
        w.close();
        w.open("if (live)");
        w.l("float* dg = scratch + r * 2 * d + lane;");
        each_lane_element(&mut w, lane, &|w: &mut W| {
            w.l("dg[32 * u] = pg[u];");
            w.l("dg[d + 32 * u] = pb[u];");
        });
        w.close();
        w.close();
        w.l("return;");
        w.close();
    }
    w.l(format!(
        "__shared__ float st[KILN_THREADS / 32 * {LN_BWD_BLOCK} * 5 + {LN_BWD_BLOCK} * 5];"
    ));
    w.l(format!("float* sw = st + wi * {LN_BWD_BLOCK} * 5;"));
    block(&mut w);
    w.l("// Phase 1: the statistics of the warp's rows, two passes each.");
    w.open(format!("for (int i = 0; i < {LN_BWD_BLOCK}; ++i)"));
    w.l("const long long q = lo + i;");
    w.l("const bool on = live && q < hi;");
    w.l("float sum = 0.0f;");
    w.open("if (on)");
    w.open("for (long long j = lane; j < d; j += width)");
    w.l(format!(
        "sum = sum + ({} + {});",
        e.load("x[q * d + j]"),
        e.load("y[q * d + j]")
    ));
    w.close();
    w.close();
    w.l("sum = kiln_warp_sum(sum);");
    w.l("const float mean = sum * c;");
    w.l("float ssq = 0.0f, sxc = 0.0f, sa = 0.0f, saxc = 0.0f;");
    w.open("if (on)");
    w.open("for (long long j = lane; j < d; j += width)");
    w.l(format!(
        "const float xc = ({} + {}) - mean;",
        e.load("x[q * d + j]"),
        e.load("y[q * d + j]")
    ));
    w.l(format!(
        "const float a = {} * gamma[j];",
        e.load("g[q * d + j]")
    ));
    sums(&mut w);
    w.close();
    w.close();
    reduce(&mut w);
    w.open("if (on && lane == 0)");
    w.l("sw[i * 5] = mean;");
    w.l("sw[i * 5 + 1] = rstd;");
    w.l("sw[i * 5 + 2] = csa;");
    w.l("sw[i * 5 + 3] = k3;");
    w.l("sw[i * 5 + 4] = csxc;");
    w.close();
    w.close();
    w.l("__syncthreads();");
    w.l(format!(
        "// Phase 2: dx, and the block's dγ, dβ partials, {LN_BWD_LOADS} rows at a time: a lane's"
    ));
    w.l("// loads of them come before its first store (dx may be x, y or g: the compiler");
    w.l("// could not move a later row's loads above an earlier row's store).");
    w.open("if (live)");
    w.l("float* dg = scratch + r * 2 * d;");
    w.l("float* db = dg + d;");
    w.open("for (long long j = lane; j < d; j += width)");
    w.l("const float gm = gamma[j];");
    w.l("float pg = 0.0f, pb = 0.0f;");
    w.open(format!(
        "for (int h = 0; h < {LN_BWD_BLOCK}; h += {LN_BWD_LOADS})"
    ));
    w.l(format!("float sv[{LN_BWD_LOADS}], gw[{LN_BWD_LOADS}];"));
    w.open(format!("for (int u = 0; u < {LN_BWD_LOADS}; ++u)"));
    w.l("const long long q = lo + h + u;");
    w.open("if (q < hi)");
    w.l(format!(
        "sv[u] = {} + {};",
        e.load("x[q * d + j]"),
        e.load("y[q * d + j]")
    ));
    w.l(format!("gw[u] = {};", e.load("g[q * d + j]")));
    w.close();
    w.close();
    w.open(format!("for (int u = 0; u < {LN_BWD_LOADS}; ++u)"));
    w.l("const long long q = lo + h + u;");
    w.l("if (q >= hi) break;");
    w.l("const float* sq = sw + (h + u) * 5;");
    w.l("const float mean = sq[0];");
    w.l("const float rstd = sq[1];");
    w.l("const float xc = sv[u] - mean;");
    w.l("const float gv = gw[u];");
    w.l("const float a = gv * gm;");
    w.l("const float t1 = rstd * (a - sq[2]);");
    w.l("const float t2 = sq[3] * (xc - sq[4]);");
    w.l(format!("dx[q * d + j] = {};", e.store("t1 - t2")));
    w.l("pg = pg + (gv * xc) * rstd;");
    w.l("pb = pb + gv;");
    w.close();
    w.close();
    w.l("dg[j] = pg;");
    w.l("db[j] = pb;");
    w.close();
    w.close();
    w.l("__syncthreads();");
    w.close();
    w.close();
    function(name, params, Work::Warps, "row blocks ceil(rows / 16)", w)
}

/// Rows whose loads [`add_layer_norm_bwd`]'s second phase issues together (registers
/// for `2 ·` this many floats a thread).
const LN_BWD_LOADS: usize = 8;

/// `dgamma[j] = Σ_k scratch[k, j]`, `dbeta[j] = Σ_k scratch[k, d + j]`: one block per
/// tile of [`COL_TILE`] columns of `dgamma`, then of `dbeta` (items
/// [`add_layer_norm_bwd_finish_items`]); a warp's lanes are the tile's columns, warp `w`
/// sums the partial blocks `k ≡ w` (mod warps) in order, then the warps' sums are added
/// in warp order (fixed for a block size; the CPU adds the blocks in order: the two agree
/// within rounding). Buffers `[scratch, dgamma, dbeta]`, dims `[blocks, d]`.
pub fn add_layer_norm_bwd_finish(name: &str) -> CudaFunction {
    let params = vec![
        param("scratch", "const float*"),
        param("dgamma", "float*"),
        param("dbeta", "float*"),
    ];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("__shared__ float sh[KILN_THREADS];");
    w.l("const long long blocks = dims.d[0];");
    w.l("const long long d = dims.d[1];");
    w.l(format!(
        "const long long tiles = (d + {COL_TILE} - 1) / {COL_TILE};"
    ));
    w.open(FOR_BLOCKS);
    w.l("const bool beta = r >= tiles;");
    w.l(format!(
        "const long long col0 = (beta ? r - tiles : r) * {COL_TILE};"
    ));
    w.l("const float* src = scratch + (beta ? d : 0);");
    w.l("float* dst = beta ? dbeta : dgamma;");
    column_tiles(
        &mut w,
        "blocks",
        &|k| format!("src[{k} * 2 * d + col]"),
        "dst[col] = t;",
    );
    w.close();
    w.close();
    function(
        name,
        params,
        Work::Blocks,
        "column tiles of dgamma then dbeta, 2·ceil(d / 32)",
        w,
    )
}

/// Columns of one block of the column-sum kernels ([`add_layer_norm_bwd_finish`],
/// [`crate::codegen::cuda::misc::sum_rows_finish`]): a warp's lanes.
pub const COL_TILE: usize = 32;

/// Running sums a lane of [`column_tiles`] keeps in flight (its loads are independent):
/// a finish runs on few blocks (two per 32 columns), so each lane's loads in flight set
/// its speed.
const COLUMN_SUMS: usize = 16;

/// C: the sum of `a[lo..hi]` as a balanced tree of pairs (`((a[0] + a[1]) + …)`).
fn pairwise(a: &str, lo: usize, hi: usize) -> String {
    if hi - lo == 1 {
        format!("{a}[{lo}]")
    } else {
        let mid = lo + (hi - lo).div_ceil(2);
        format!("({} + {})", pairwise(a, lo, mid), pairwise(a, mid, hi))
    }
}

/// Work items of [`add_layer_norm_bwd_finish`] for rows of `d`.
pub fn add_layer_norm_bwd_finish_items(d: usize) -> usize {
    2 * d.div_ceil(COL_TILE)
}

/// Inside a block loop with `col0` and `d` (the column count) defined: sums `k` from 0
/// to `count` of `load(k)` (an expression of the index it is given and `col`) for the
/// [`COL_TILE`] columns from `col0` — warp `w` the `k ≡ w` (mod warps), in
/// [`COLUMN_SUMS`] running sums (`k` in steps of `warps · COLUMN_SUMS`, the last few into
/// the first) added in a fixed tree, then the warps in order — and runs
/// `store` (a statement of `col` and the sum `t`) once per column. Uses `sh`
/// (`KILN_THREADS` floats) and two barriers; a block of fewer than 32 threads is one
/// warp whose lanes loop over the tile.
pub(crate) fn column_tiles(w: &mut W, count: &str, load: &dyn Fn(&str) -> String, store: &str) {
    w.l(format!(
        "const int width = blockDim.x < {COL_TILE} ? blockDim.x : {COL_TILE};"
    ));
    w.l(format!(
        "const int warps = blockDim.x < {COL_TILE} ? 1 : blockDim.x / {COL_TILE};"
    ));
    w.l("const int wi = threadIdx.x / width;");
    w.open("if (wi < warps)");
    w.open(format!(
        "for (int c = threadIdx.x % width; c < {COL_TILE}; c += width)"
    ));
    w.l("const long long col = col0 + c;");
    w.l("float s = 0.0f;");
    w.open("if (col < d)");
    w.l(format!(
        "// {COLUMN_SUMS} running sums in flight (k, k + warps, …), then the rest into the first;"
    ));
    w.l("// the sums are added in a fixed tree.");
    w.l(format!("float a[{COLUMN_SUMS}];"));
    w.l(format!(
        "for (int u = 0; u < {COLUMN_SUMS}; ++u) a[u] = 0.0f;"
    ));
    w.l("long long k = wi;");
    w.open(format!(
        "for (; k + {} * (long long)warps < {count}; k += {COLUMN_SUMS} * (long long)warps)",
        COLUMN_SUMS - 1
    ));
    w.l("KILN_UNROLL");
    w.open(format!("for (int u = 0; u < {COLUMN_SUMS}; ++u)"));
    w.l("const long long kk = k + u * (long long)warps;");
    w.l(format!("a[u] = a[u] + {};", load("kk")));
    w.close();
    w.close();
    w.open(format!("for (; k < {count}; k += warps)"));
    w.l(format!("a[0] = a[0] + {};", load("k")));
    w.close();
    w.l(format!("s = {};", pairwise("a", 0, COLUMN_SUMS)));
    w.close();
    w.l(format!("sh[wi * {COL_TILE} + c] = s;"));
    w.close();
    w.close();
    w.l("__syncthreads();");
    w.open("if (wi == 0)");
    w.open(format!(
        "for (int c = threadIdx.x % width; c < {COL_TILE}; c += width)"
    ));
    w.l("const long long col = col0 + c;");
    w.open("if (col < d)");
    w.l("float t = sh[c];");
    w.l(format!(
        "for (int l = 1; l < warps; ++l) t = t + sh[l * {COL_TILE} + c];"
    ));
    w.l(store);
    w.close();
    w.close();
    w.close();
    w.l("__syncthreads();");
}

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

fn xent_rows(name: &str, e: Elem, grad: bool, keep: usize) -> CudaFunction {
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
    // The first pass over one group `q` of index `k`.
    let group = |w: &mut W| {
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
    };
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
        held_groups(&mut w, keep, vn, &group);
        w.close();
        w.open("else");
    }
    w.open("for (long long k = threadIdx.x; k < nv; k += blockDim.x)");
    load_group(&mut w, e, "q", "xr");
    group(&mut w);
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
    // The second pass over one group `q` of index `k`.
    let gradient = |w: &mut W| {
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
    };
    if keep > 0 {
        w.open("if (held)");
        held_groups(&mut w, keep, vn, &gradient);
        w.close();
        w.open("else");
    }
    w.open("for (long long k = threadIdx.x; k < nv; k += blockDim.x)");
    load_group(&mut w, e, "q", "xr");
    gradient(&mut w);
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
