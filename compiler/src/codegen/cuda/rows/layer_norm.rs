//! `add_layer_norm` as CUDA C: a row a block, or a row a warp in registers.

use super::*;

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
    add_layer_norm_with(name, e, LN_LANE, true, false)
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
/// row through `out`; for tests of the two paths); without `add` (the template's `plain`
/// form) the rows are `x` alone and `y` is not read; with `rms` (RMSNorm) the mean is
/// zero and there is no `β` (not read).
pub fn add_layer_norm_with(name: &str, e: Elem, lane: usize, add: bool, rms: bool) -> CudaFunction {
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
        if add {
            w.l(format!("const {}* yr = y + r * d;", e.c_type()));
        }
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
        if add {
            w.l(format!("const {}* yl = yr + lane;", e.c_type()));
        }
        w.l(format!("{}* ol = outr + lane;", e.c_type()));
        w.l("const float* gl = gamma + lane;");
        if !rms {
            w.l("const float* bl = beta + lane;");
        }
        w.l(format!("float s[{lane}];"));
        w.l("float sum = 0.0f;");
        w.open("if (live)");
        sum_in_registers(&mut w, e, lane, None, add);
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
        w.l(mean_of_sum(rms));
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
            let v = if rms { "v" } else { "v + bl[32 * u]" };
            w.l(format!("ol[32 * u] = {};", e.store(v)));
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
        "const float s = {};",
        plus_y(&e.load("xr[j]"), &e.load("yr[j]"), add)
    ));
    w.l(format!("outr[j] = {};", e.store("s")));
    w.l("sum = sum + s;");
    w.close();
    w.close();
    w.l("sum = kiln_warp_sum(sum);");
    w.l(mean_of_sum(rms));
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
    let v = if rms { "v" } else { "v + beta[j]" };
    w.l(format!("outr[j] = {};", e.store(v)));
    w.close();
    w.close();
    w.close();
    w.close();
    function(name, params, Work::Warps, "rows", w)
}

/// `body` for each element `u` a lane holds of a row in registers (column `lane + 32·u`,
/// those below `left`), unrolled so that the lane's arrays stay in registers.
pub(super) fn each_lane_element(w: &mut W, lane: usize, body: &dyn Fn(&mut W)) {
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
pub(super) fn sum_in_registers(w: &mut W, e: Elem, lane: usize, also: Option<&str>, add: bool) {
    w.l("KILN_UNROLL");
    w.open(format!("for (int u = 0; u < {lane}; ++u)"));
    w.l(format!(
        "s[u] = 32 * u < left ? {} : 0.0f;",
        plus_y(&e.load("xl[32 * u]"), &e.load("yl[32 * u]"), add)
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

/// `x + y`, or `x` alone for a layer norm that does not add.
pub(super) fn plus_y(x: &str, y: &str, add: bool) -> String {
    if add {
        format!("{x} + {y}")
    } else {
        x.to_string()
    }
}

/// The row's mean from its warp-summed `sum`; RMSNorm's is zero (`sum` is still read by
/// the warp sum before it, so every lane makes the same shuffles).
pub(super) fn mean_of_sum(rms: bool) -> &'static str {
    if rms {
        "const float mean = 0.0f;"
    } else {
        "const float mean = sum * c;"
    }
}
