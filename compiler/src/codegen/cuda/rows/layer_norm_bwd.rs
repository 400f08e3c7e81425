//! The backward of `add_layer_norm` as CUDA C: `dx` and the partial `dγ`, `dβ` sums per
//! block of rows, then the sums over the blocks.

use super::*;
use crate::optimize::templates::LnForm;

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
    add_layer_norm_bwd_with(name, e, LN_BWD_LANE, LnForm::Add, false)
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
/// always the two phases; for tests of the two paths). In the `Plain` form the rows are
/// `x` alone and `y` is not read; in the `Carry` form the rows are `x` alone and `y` holds
/// a gradient added to `dx`.
pub fn add_layer_norm_bwd_with(
    name: &str,
    e: Elem,
    lane: usize,
    form: LnForm,
    rms: bool,
) -> CudaFunction {
    let add = form == LnForm::Add;
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
    if lane > 0 {
        in_registers(&mut w, e, lane, form, rms);
    }
    w.l(format!(
        "__shared__ float st[KILN_THREADS / 32 * {LN_BWD_BLOCK} * 5 + {LN_BWD_BLOCK} * 5];"
    ));
    w.l(format!("float* sw = st + wi * {LN_BWD_BLOCK} * 5;"));
    block(&mut w);
    statistics(&mut w, e, add, rms);
    dx_and_partials(&mut w, e, form);
    w.close();
    w.close();
    function(name, params, Work::Warps, "row blocks ceil(rows / 16)", w)
}

/// A warp's block of rows: `r`, whether it is live, and its rows `lo..hi`.
fn block(w: &mut W) {
    w.open(FOR_WARPS);
    w.l("const long long r = r0 + wi;");
    w.l("const bool live = wi < warps && r < items;");
    w.l(format!("const long long lo = r * {LN_BWD_BLOCK};"));
    w.l(format!(
        "const long long hi = lo + {LN_BWD_BLOCK} < rows ? lo + {LN_BWD_BLOCK} : rows;"
    ));
}

/// The four sums of a row's second pass.
fn sums(w: &mut W) {
    w.l("ssq = ssq + xc * xc;");
    w.l("sxc = sxc + xc;");
    w.l("sa = sa + a;");
    w.l("saxc = saxc + a * xc;");
}

/// The row's sums across the warp, and the terms of `dx` they give.
/// RMSNorm (`rms`) has no mean, so neither `c·Σa` nor `c·Σxc` enters its `dx`.
fn reduce(w: &mut W, rms: bool) {
    w.l("ssq = kiln_warp_sum(ssq);");
    w.l("sxc = kiln_warp_sum(sxc);");
    w.l("sa = kiln_warp_sum(sa);");
    w.l("saxc = kiln_warp_sum(saxc);");
    w.l("const float var = ssq * c;");
    w.l("const float rstd = 1.0f / sqrtf(var + ep);");
    w.l("// dx_j = rstd·(a_j − c·Σa) − k·(xc_j − c·Σxc), k = c·rstd³·Σa·xc.");
    w.l("const float r3 = (rstd * rstd) * rstd;");
    w.l(if rms {
        "const float csa = 0.0f;"
    } else {
        "const float csa = c * sa;"
    });
    w.l("const float k3 = (c * r3) * saxc;");
    w.l(if rms {
        "const float csxc = 0.0f;"
    } else {
        "const float csxc = c * sxc;"
    });
}

/// The path for rows of up to `lane` elements a lane: each row's elements in
/// registers, one loop over the row blocks.
fn in_registers(w: &mut W, e: Elem, lane: usize, form: LnForm, rms: bool) {
    let add = form == LnForm::Add;
    // Chosen once a launch, each path with its own loop over the row blocks.
    w.open(format!("if (width == 32u && d <= {})", lane * 32));
    block(w);
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
    if form != LnForm::Plain {
        w.l(format!("const {}* yl = y + q * d + lane;", e.c_type()));
    }
    w.l(format!("const {}* gq = g + q * d + lane;", e.c_type()));
    w.l(format!("{}* dl = dx + q * d + lane;", e.c_type()));
    w.l(format!("float s[{lane}], gv[{lane}];"));
    w.l("float sum = 0.0f;");
    w.open("if (on)");
    w.l("// Every load of the row before the first sum.");
    let g_load = format!("gv[u] = 32 * u < left ? {} : 0.0f;", e.load("gq[32 * u]"));
    sum_in_registers(w, e, lane, Some(&g_load), add);
    w.close();
    w.l("sum = kiln_warp_sum(sum);");
    w.l(mean_of_sum(rms));
    w.l("// Σxc², Σxc, Σa, Σa·xc with xc = s − mean, a = g·γ.");
    w.l("float ssq = 0.0f, sxc = 0.0f, sa = 0.0f, saxc = 0.0f;");
    w.open("if (on)");
    each_lane_element(w, lane, &|w: &mut W| {
        w.l("const float xc = s[u] - mean;");
        w.l("const float a = gv[u] * gl[32 * u];");
        sums(w);
    });
    w.close();
    reduce(w, rms);
    w.open("if (on)");
    each_lane_element(w, lane, &|w: &mut W| {
        w.l("const float xc = s[u] - mean;");
        w.l("const float a = gv[u] * gl[32 * u];");
        w.l("const float t1 = rstd * (a - csa);");
        w.l("const float t2 = k3 * (xc - csxc);");
        w.l(format!(
            "dl[32 * u] = {};",
            e.store(&dx_value(e, "yl[32 * u]", form))
        ));
        w.l("pg[u] = pg[u] + (gv[u] * xc) * rstd;");
        w.l("pb[u] = pb[u] + gv[u];");
    });
    w.close();
    w.close();
    w.open("if (live)");
    w.l("float* dg = scratch + r * 2 * d + lane;");
    each_lane_element(w, lane, &|w: &mut W| {
        w.l("dg[32 * u] = pg[u];");
        w.l("dg[d + 32 * u] = pb[u];");
    });
    w.close();
    w.close();
    w.l("return;");
    w.close();
}

/// Phase 1 of the two-phase path: the statistics of the warp's rows, into shared memory.
fn statistics(w: &mut W, e: Elem, add: bool, rms: bool) {
    w.l("// Phase 1: the statistics of the warp's rows, two passes each.");
    w.open(format!("for (int i = 0; i < {LN_BWD_BLOCK}; ++i)"));
    w.l("const long long q = lo + i;");
    w.l("const bool on = live && q < hi;");
    w.l("float sum = 0.0f;");
    w.open("if (on)");
    w.open("for (long long j = lane; j < d; j += width)");
    let s = plus_y(&e.load("x[q * d + j]"), &e.load("y[q * d + j]"), add);
    w.l(format!("sum = sum + ({s});"));
    w.close();
    w.close();
    w.l("sum = kiln_warp_sum(sum);");
    w.l(mean_of_sum(rms));
    w.l("float ssq = 0.0f, sxc = 0.0f, sa = 0.0f, saxc = 0.0f;");
    w.open("if (on)");
    w.open("for (long long j = lane; j < d; j += width)");
    w.l(format!("const float xc = ({s}) - mean;"));
    w.l(format!(
        "const float a = {} * gamma[j];",
        e.load("g[q * d + j]")
    ));
    sums(w);
    w.close();
    w.close();
    reduce(w, rms);
    w.open("if (on && lane == 0)");
    w.l("sw[i * 5] = mean;");
    w.l("sw[i * 5 + 1] = rstd;");
    w.l("sw[i * 5 + 2] = csa;");
    w.l("sw[i * 5 + 3] = k3;");
    w.l("sw[i * 5 + 4] = csxc;");
    w.close();
    w.close();
    w.l("__syncthreads();");
}

/// Phase 2 of the two-phase path: `dx`, and the block's dγ, dβ partials.
fn dx_and_partials(w: &mut W, e: Elem, form: LnForm) {
    let add = form == LnForm::Add;
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
        "sv[u] = {};",
        plus_y(&e.load("x[q * d + j]"), &e.load("y[q * d + j]"), add)
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
    w.l(format!(
        "dx[q * d + j] = {};",
        e.store(&dx_value(e, "y[q * d + j]", form))
    ));
    w.l("pg = pg + (gv * xc) * rstd;");
    w.l("pb = pb + gv;");
    w.close();
    w.close();
    w.l("dg[j] = pg;");
    w.l("db[j] = pb;");
    w.close();
    w.close();
    w.l("__syncthreads();");
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

/// A row element's `dx`, `t1 − t2`, plus the carried gradient `carried` in the `Carry`
/// form (read where it is written: `dx` may be `y`).
fn dx_value(e: Elem, carried: &str, form: LnForm) -> String {
    match form {
        LnForm::Carry => format!("{} + (t1 - t2)", e.load(carried)),
        _ => "t1 - t2".to_string(),
    }
}
