//! Row kernels: softmaxes, layer norms and the label-smoothed cross-entropy, one work item
//! per row (or per block of rows), every row handled by a few vectorized passes.
//!
//! Every kernel follows the ABI of [`crate::codegen::clif`]: `args` are buffer pointers
//! (every element 4 bytes: `f32`, `i32`, bools as `i32` 0/1; a scalar operand is a
//! pointer to one `f32`), `dims` are `i64` sizes, `[begin, end)` are work items. Each
//! builder documents its `args` and `dims` layout; each `*_dims` helper returns the dims
//! array and the number of items to launch. Buffers are contiguous, row-major.
//!
//! - [`softmax`] — rows of length `c`;
//! - [`scale_mask_softmax`] — `softmax(where(mask, x·scale, fill))` over the last axis of
//!   `x[b, h, tq, tk]`, mask none, key (`bool[b, 1, 1, tk]`) or causal (`bool[tq, tk]`);
//! - [`softmax_bwd`] — `dS = P ∘ (dP − Σ P∘dP) · mult`, the softmax backward of attention;
//! - [`add_layer_norm`] — `normalize(x + y)·γ + β` over the last axis;
//! - [`add_layer_norm_bwd`] and [`add_layer_norm_bwd_finish`] — `dx` per row, `dγ`, `dβ`
//!   as per-block partial sums in a scratch buffer, then summed in block order (so the
//!   result does not depend on how items are split across threads);
//! - [`xent_ls`] and [`xent_ls_finish`] — the label-smoothed cross-entropy: per-row
//!   losses into a scratch, the logits' gradient, then the mean in row order.
//!
//! Where a kernel allows an output to alias an input, it says so: every pass reads an
//! element before it writes the element at the same index, and later passes read only
//! what earlier passes wrote.

use cranelift_codegen::ir::condcodes::IntCC;
use cranelift_codegen::ir::{types, Function, InstBuilder, Type, Value};

use crate::codegen::clif::{build_kernel, int_of, mem, Kb, Reduce, LANES, VF};
use crate::optimize::templates::LnForm;

/// A scalar held both as `F32` and splatted to `F32X4`.
#[derive(Clone, Copy)]
struct Sc {
    s: Value,
    v: Value,
}

impl Sc {
    fn new(kb: &mut Kb, s: Value) -> Sc {
        let v = kb.b.ins().splat(VF, s);
        Sc { s, v }
    }
    /// The scalar `f32` operand behind the pointer `args[i]`.
    fn arg(kb: &mut Kb, i: usize) -> Sc {
        let p = kb.ptr(i);
        let s = kb.b.ins().load(types::F32, mem(), p, 0);
        Sc::new(kb, s)
    }
    fn get(self, ty: Type) -> Value {
        if ty.is_vector() {
            self.v
        } else {
            self.s
        }
    }
}

/// `base + 4·(row·len)`: the first element of row `row` of a `[_, len]` buffer.
fn row_ptr(kb: &mut Kb, base: Value, row: Value, len: Value) -> Value {
    let off = kb.b.ins().imul(row, len);
    kb.elem_addr(base, off)
}

/// Runs `body(row)` for every row in `[lo, hi)`.
fn for_rows(kb: &mut Kb, lo: Value, hi: Value, mut body: impl FnMut(&mut Kb, Value)) {
    kb.for_range(lo, hi, 1, &[], |kb, r, _| {
        body(kb, r);
        vec![]
    });
}

/// `n` sums over elements `[lo, hi)` at once: `term(index, ty)` returns `n` terms (vectors,
/// or scalars in the tail). `unroll` vectors per main-loop iteration, so `n·unroll` vector
/// accumulators; they are combined pairwise, then across lanes, then with the tail.
fn sums(
    kb: &mut Kb,
    lo: Value,
    hi: Value,
    n: usize,
    unroll: usize,
    mut term: impl FnMut(&mut Kb, Value, Type) -> Vec<Value>,
) -> Vec<Value> {
    let z = kb.fconst(VF, 0.0);
    let init = vec![z; n * unroll];
    let (i, accs) = kb.for_range(lo, hi, LANES * unroll as i64, &init, |kb, i, acc| {
        let mut out = acc.to_vec();
        for u in 0..unroll {
            let j = kb.b.ins().iadd_imm_s(i, u as i64 * LANES);
            let t = term(kb, j, VF);
            for k in 0..n {
                out[u * n + k] = kb.b.ins().fadd(acc[u * n + k], t[k]);
            }
        }
        out
    });
    // Pairwise over the unrolled copies.
    let mut groups: Vec<Vec<Value>> = accs.chunks(n).map(|c| c.to_vec()).collect();
    while groups.len() > 1 {
        let mut next = Vec::new();
        for pair in groups.chunks(2) {
            if pair.len() == 2 {
                let c: Vec<Value> = (0..n)
                    .map(|k| kb.b.ins().fadd(pair[0][k], pair[1][k]))
                    .collect();
                next.push(c);
            } else {
                next.push(pair[0].clone());
            }
        }
        groups = next;
    }
    let acc = groups.pop().expect("unroll is at least 1");
    let (i, acc) = kb.for_range(i, hi, LANES, &acc, |kb, i, acc| {
        let t = term(kb, i, VF);
        (0..n).map(|k| kb.b.ins().fadd(acc[k], t[k])).collect()
    });
    let s: Vec<Value> = acc.iter().map(|&v| kb.horizontal(Reduce::Sum, v)).collect();
    let (_, s) = kb.for_range(i, hi, 1, &s, |kb, i, acc| {
        let t = term(kb, i, types::F32);
        (0..n).map(|k| kb.b.ins().fadd(acc[k], t[k])).collect()
    });
    s
}

/// `1 / x` (scalar).
fn recip(kb: &mut Kb, x: Value) -> Value {
    let one = kb.fconst(types::F32, 1.0);
    kb.b.ins().fdiv(one, x)
}

/// The last two passes of a softmax over `[0, len)`, given the row maximum `m` and the
/// row's values `value(index, ty)`: `out = exp(value − m)` summed, then `out *= 1/sum`.
fn softmax_tail(
    kb: &mut Kb,
    len: Value,
    out: Value,
    m: Value,
    mut value: impl FnMut(&mut Kb, Value, Type) -> Value,
) {
    let zero = kb.iconst(0);
    let mv = Sc::new(kb, m);
    let z = kb.sum_elems_padded(zero, len, |kb, j, ty| {
        let x = value(kb, j, ty);
        let d = kb.b.ins().fsub(x, mv.get(ty));
        let e = kb.exp_nonpositive(d);
        kb.store(e, out, j);
        e
    });
    let r = recip(kb, z);
    let r = Sc::new(kb, r);
    kb.map_elems(zero, len, |kb, j, ty| {
        let e = kb.load(ty, out, j);
        let p = kb.b.ins().fmul(e, r.get(ty));
        kb.store(p, out, j);
    });
}

// ---------------------------------------------------------------------------------------
// softmax

/// `out[r, :] = softmax(x[r, :])` (`e = exp(x − max x); e / Σe`) over rows of length `c`.
///
/// - args: `[x, out]` (`f32[rows, c]` both; `out` may be `x`);
/// - dims: `[c]` (see [`softmax_dims`]);
/// - items: rows.
pub fn softmax(name: &str) -> Function {
    build_kernel(name, |kb| {
        let x = kb.ptr(0);
        let out = kb.ptr(1);
        let c = kb.dim(0);
        let (begin, end) = (kb.begin, kb.end);
        for_rows(kb, begin, end, |kb, r| {
            let xr = row_ptr(kb, x, r, c);
            let or = row_ptr(kb, out, r, c);
            let zero = kb.iconst(0);
            let m = kb.reduce_elems(zero, c, f32::NEG_INFINITY, Reduce::Max, |kb, j, ty| {
                kb.load(ty, xr, j)
            });
            softmax_tail(kb, c, or, m, |kb, j, ty| kb.load(ty, xr, j));
        });
    })
}

/// Dims and items of [`softmax`] over `rows` rows of length `c`.
pub fn softmax_dims(rows: usize, c: usize) -> (Vec<i64>, usize) {
    (vec![c as i64], rows)
}

// ---------------------------------------------------------------------------------------
// scale_mask_softmax

/// The mask of a [`scale_mask_softmax`] (the template's variants).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MaskKind {
    /// No mask (and no `fill` operand).
    None,
    /// Key padding, `bool[b, 1, 1, tk]`: row `r` uses mask row `r / (h·tq)`.
    Key,
    /// Causal, `bool[tq, tk]`: row `r` uses mask row `r % tq`.
    Causal,
}

/// `out = softmax(where(mask, x·scale, fill))` over the last axis of `x[b, h, tq, tk]`.
///
/// - args, `mask = None`: `[x, scale, out]`; otherwise `[x, mask, scale, fill, out]`
///   (`x`, `out`: `f32[b, h, tq, tk]`; `mask`: `i32` 0/1, `[b, tk]` for `Key`,
///   `[tq, tk]` for `Causal`; `scale`, `fill`: one `f32` each). `out` may be `x`.
/// - dims: `[b, h, tq, tk]` (see [`scale_mask_softmax_dims`]). To run on one head's
///   `[tq, tk]` block, pass shifted `x`/`out`/`mask` pointers with `b = h = 1`.
/// - items: rows, `b·h·tq`.
///
/// A fully masked row is `fill` everywhere, so uniform (as the definition says).
pub fn scale_mask_softmax(name: &str, mask: MaskKind) -> Function {
    build_kernel(name, |kb| {
        let masked = mask != MaskKind::None;
        let x = kb.ptr(0);
        let (mp, scale, fill, out) = if masked {
            let mp = kb.ptr(1);
            let scale = Sc::arg(kb, 2);
            let fill = Sc::arg(kb, 3);
            (Some(mp), scale, Some(fill), kb.ptr(4))
        } else {
            let scale = Sc::arg(kb, 1);
            (None, scale, None, kb.ptr(2))
        };
        let h = kb.dim(1);
        let tq = kb.dim(2);
        let tk = kb.dim(3);
        let (begin, end) = (kb.begin, kb.end);
        for_rows(kb, begin, end, |kb, r| {
            let xr = row_ptr(kb, x, r, tk);
            let or = row_ptr(kb, out, r, tk);
            let mr = mp.map(|mp| {
                let mrow = match mask {
                    MaskKind::Key => {
                        let htq = kb.b.ins().imul(h, tq);
                        kb.b.ins().udiv(r, htq)
                    }
                    _ => kb.b.ins().urem(r, tq),
                };
                row_ptr(kb, mp, mrow, tk)
            });
            let mut value = move |kb: &mut Kb, j: Value, ty: Type| {
                let v = kb.load(ty, xr, j);
                let v = kb.b.ins().fmul(v, scale.get(ty));
                match (mr, fill) {
                    (Some(mr), Some(fill)) => {
                        let m = kb.load(int_of(ty), mr, j);
                        let z = kb.i32const(int_of(ty), 0);
                        let keep = kb.b.ins().icmp(IntCC::NotEqual, m, z);
                        kb.select(keep, v, fill.get(ty))
                    }
                    _ => v,
                }
            };
            let zero = kb.iconst(0);
            let m = kb.reduce_elems(zero, tk, f32::NEG_INFINITY, Reduce::Max, &mut value);
            softmax_tail(kb, tk, or, m, value);
        });
    })
}

/// Dims and items of [`scale_mask_softmax`] on `x[b, h, tq, tk]`.
pub fn scale_mask_softmax_dims(b: usize, h: usize, tq: usize, tk: usize) -> (Vec<i64>, usize) {
    (vec![b as i64, h as i64, tq as i64, tk as i64], b * h * tq)
}

// ---------------------------------------------------------------------------------------
// softmax_bwd

/// The softmax backward of attention: `ds[r, :] = p ∘ (dp − Σ_j p_j·dp_j) · mult` over
/// rows of length `c`.
///
/// - args: `[p, dp, mult, ds]` (`f32[rows, c]`, `mult` one `f32`; `ds` may be `dp`);
/// - dims: `[c]` (see [`softmax_bwd_dims`]);
/// - items: rows.
pub fn softmax_bwd(name: &str) -> Function {
    build_kernel(name, |kb| {
        let p = kb.ptr(0);
        let dp = kb.ptr(1);
        let mult = Sc::arg(kb, 2);
        let ds = kb.ptr(3);
        let c = kb.dim(0);
        let (begin, end) = (kb.begin, kb.end);
        for_rows(kb, begin, end, |kb, r| {
            let pr = row_ptr(kb, p, r, c);
            let dpr = row_ptr(kb, dp, r, c);
            let dsr = row_ptr(kb, ds, r, c);
            let zero = kb.iconst(0);
            let dot = kb.reduce_elems(zero, c, 0.0, Reduce::Sum, |kb, j, ty| {
                let a = kb.load(ty, pr, j);
                let b = kb.load(ty, dpr, j);
                kb.b.ins().fmul(a, b)
            });
            let dot = Sc::new(kb, dot);
            kb.map_elems(zero, c, |kb, j, ty| {
                let a = kb.load(ty, pr, j);
                let b = kb.load(ty, dpr, j);
                let d = kb.b.ins().fsub(b, dot.get(ty));
                let v = kb.b.ins().fmul(a, d);
                let v = kb.b.ins().fmul(v, mult.get(ty));
                kb.store(v, dsr, j);
            });
        });
    })
}

/// Dims and items of [`softmax_bwd`] over `rows` rows of length `c`.
pub fn softmax_bwd_dims(rows: usize, c: usize) -> (Vec<i64>, usize) {
    (vec![c as i64], rows)
}

// ---------------------------------------------------------------------------------------
// add_layer_norm

/// `out = normalize(x + y)·γ + β` over rows of length `d`: with `s = x + y`,
/// `mean = inv_d·Σs`, `var = inv_d·Σ(s − mean)²`, `out = (s − mean)·(1/√(var + eps))·γ + β`.
///
/// - args: `[x, y, gamma, beta, inv_d, eps, out]` (`x`, `y`, `out`: `f32[rows, d]`;
///   `gamma`, `beta`: `f32[d]`; `inv_d`, `eps`: one `f32` each). `out` may be `x` or `y`
///   (it holds `s` between the passes). Without `add` (the template's `plain` form),
///   `s = x` and `y` is not read. With `rms` (RMSNorm), `mean = 0` and no `β`:
///   `out = s·(1/√(inv_d·Σs² + eps))·γ`, and `beta` is not read.
/// - dims: `[d]` (see [`add_layer_norm_dims`]);
/// - items: rows.
pub fn add_layer_norm(name: &str, add: bool, rms: bool) -> Function {
    build_kernel(name, |kb| {
        let x = kb.ptr(0);
        let y = kb.ptr(1);
        let gamma = kb.ptr(2);
        let beta = kb.ptr(3);
        let inv_d = Sc::arg(kb, 4);
        let eps = Sc::arg(kb, 5);
        let out = kb.ptr(6);
        let d = kb.dim(0);
        let (begin, end) = (kb.begin, kb.end);
        for_rows(kb, begin, end, |kb, r| {
            let xr = row_ptr(kb, x, r, d);
            let yr = row_ptr(kb, y, r, d);
            let or = row_ptr(kb, out, r, d);
            let zero = kb.iconst(0);
            // Pass 1: s = x + y into out, Σs.
            let sum = kb.reduce_elems(zero, d, 0.0, Reduce::Sum, |kb, j, ty| {
                let s = row_sum(kb, ty, xr, add.then_some(yr), j);
                kb.store(s, or, j);
                s
            });
            let mean = if rms {
                kb.fconst(types::F32, 0.0)
            } else {
                kb.b.ins().fmul(sum, inv_d.s)
            };
            let mean = Sc::new(kb, mean);
            // Pass 2: Σ(s − mean)².
            let ssq = kb.reduce_elems(zero, d, 0.0, Reduce::Sum, |kb, j, ty| {
                let s = kb.load(ty, or, j);
                let xc = kb.b.ins().fsub(s, mean.get(ty));
                kb.b.ins().fmul(xc, xc)
            });
            let var = kb.b.ins().fmul(ssq, inv_d.s);
            let ve = kb.b.ins().fadd(var, eps.s);
            let sd = kb.b.ins().sqrt(ve);
            let rstd = recip(kb, sd);
            let rstd = Sc::new(kb, rstd);
            // Pass 3: out = (s − mean)·rstd·γ + β.
            kb.map_elems(zero, d, |kb, j, ty| {
                let s = kb.load(ty, or, j);
                let xc = kb.b.ins().fsub(s, mean.get(ty));
                let xh = kb.b.ins().fmul(xc, rstd.get(ty));
                let g = kb.load(ty, gamma, j);
                let b = (!rms).then(|| kb.load(ty, beta, j));
                let v = kb.b.ins().fmul(xh, g);
                let v = match b {
                    Some(b) => kb.b.ins().fadd(v, b),
                    None => v,
                };
                kb.store(v, or, j);
            });
        });
    })
}

/// Dims and items of [`add_layer_norm`] over `rows` rows of length `d`.
pub fn add_layer_norm_dims(rows: usize, d: usize) -> (Vec<i64>, usize) {
    (vec![d as i64], rows)
}

// ---------------------------------------------------------------------------------------
// add_layer_norm_bwd

/// Rows per work item of [`add_layer_norm_bwd`] (one scratch row pair per block).
pub const LN_BWD_BLOCK: usize = 16;

/// The backward of [`add_layer_norm`] for upstream gradient `g`: `dx` (the gradient of
/// both `x` and `y`) per row, and per block of [`LN_BWD_BLOCK`] rows the partial sums of
/// `dγ = Σ_rows g∘(s − mean)·rstd` and `dβ = Σ_rows g` into a scratch buffer (finished by
/// [`add_layer_norm_bwd_finish`]). With `c = inv_d`, `a = g∘γ`, `xc = s − mean`:
/// `dx_j = rstd·(a_j − c·Σa) − c·rstd³·(xc_j − c·Σxc)·Σ(a∘xc)` (exact for any `c`).
///
/// In the `Plain` form `s = x` and `y` is not read; in the `Carry` form `s = x` and `y`
/// holds a gradient added to `dx` (the residual path's, past a pre-LN norm). With `rms`
/// (RMSNorm: `mean = 0`, no β) the `c·Σa` and `c·Σxc` terms are zero; the `dβ` partials
/// are still written.
///
/// - args: `[x, y, gamma, g, inv_d, eps, dx, scratch]` (`x`, `y`, `g`, `dx`:
///   `f32[rows, d]`; `gamma`: `f32[d]`; `inv_d`, `eps`: one `f32` each; `scratch`:
///   `f32[blocks, 2·d]`, block `k`'s `dγ` partial at `[k, 0..d]` and its `dβ` partial at
///   `[k, d..2d]`, fully overwritten; see [`add_layer_norm_bwd_scratch`]). `dx` may be
///   `x`, `y` or `g`.
/// - dims: `[rows, d]` (see [`add_layer_norm_bwd_dims`]);
/// - items: row blocks, `ceil(rows / LN_BWD_BLOCK)`.
pub fn add_layer_norm_bwd(name: &str, form: LnForm, rms: bool) -> Function {
    let add = form == LnForm::Add;
    build_kernel(name, |kb| {
        let x = kb.ptr(0);
        let y = kb.ptr(1);
        let gamma = kb.ptr(2);
        let g = kb.ptr(3);
        let c = Sc::arg(kb, 4);
        let eps = Sc::arg(kb, 5);
        let dx = kb.ptr(6);
        let scratch = kb.ptr(7);
        let rows = kb.dim(0);
        let d = kb.dim(1);
        let (begin, end) = (kb.begin, kb.end);
        for_rows(kb, begin, end, |kb, blk| {
            let d2 = kb.b.ins().iadd(d, d);
            let dg = row_ptr(kb, scratch, blk, d2);
            let db = kb.elem_addr(dg, d);
            let zero = kb.iconst(0);
            kb.map_elems(zero, d2, |kb, j, ty| {
                let z = kb.fconst(ty, 0.0);
                kb.store(z, dg, j);
            });
            let lo = kb.b.ins().imul_imm_s(blk, LN_BWD_BLOCK as i64);
            let hi = kb.b.ins().iadd_imm_s(lo, LN_BWD_BLOCK as i64);
            let hi = kb.b.ins().smin(hi, rows);
            for_rows(kb, lo, hi, |kb, r| {
                let xr = row_ptr(kb, x, r, d);
                let yr = row_ptr(kb, y, r, d);
                let gr = row_ptr(kb, g, r, d);
                let dxr = row_ptr(kb, dx, r, d);
                let zero = kb.iconst(0);
                // Pass 1: Σs (RMSNorm: no mean).
                let mean = if rms {
                    kb.fconst(types::F32, 0.0)
                } else {
                    let sum = kb.reduce_elems(zero, d, 0.0, Reduce::Sum, |kb, j, ty| {
                        row_sum(kb, ty, xr, add.then_some(yr), j)
                    });
                    kb.b.ins().fmul(sum, c.s)
                };
                let mean = Sc::new(kb, mean);
                // Pass 2: Σxc², Σxc, Σa, Σa∘xc.
                let s = sums(kb, zero, d, 4, 2, |kb, j, ty| {
                    let s = row_sum(kb, ty, xr, add.then_some(yr), j);
                    let xc = kb.b.ins().fsub(s, mean.get(ty));
                    let gv = kb.load(ty, gr, j);
                    let gm = kb.load(ty, gamma, j);
                    let av = kb.b.ins().fmul(gv, gm);
                    let xc2 = kb.b.ins().fmul(xc, xc);
                    let axc = kb.b.ins().fmul(av, xc);
                    vec![xc2, xc, av, axc]
                });
                let (ssq, sum_xc, sum_a, sum_axc) = (s[0], s[1], s[2], s[3]);
                let var = kb.b.ins().fmul(ssq, c.s);
                let ve = kb.b.ins().fadd(var, eps.s);
                let sd = kb.b.ins().sqrt(ve);
                let rstd = recip(kb, sd);
                // dx_j = rstd·a_j − rstd·c·Σa − k·xc_j + k·c·Σxc, k = c·rstd³·Σa∘xc.
                // RMSNorm has no mean, so neither term of its gradient:
                // dx_j = rstd·a_j − k·s_j.
                let no_mean = |kb: &mut Kb, v: Value| {
                    if rms {
                        kb.fconst(types::F32, 0.0)
                    } else {
                        kb.b.ins().fmul(c.s, v)
                    }
                };
                let ca = no_mean(kb, sum_a);
                let r2 = kb.b.ins().fmul(rstd, rstd);
                let r3 = kb.b.ins().fmul(r2, rstd);
                let k = kb.b.ins().fmul(c.s, r3);
                let k = kb.b.ins().fmul(k, sum_axc);
                let cx = no_mean(kb, sum_xc);
                let rstd = Sc::new(kb, rstd);
                let ca = Sc::new(kb, ca);
                let k = Sc::new(kb, k);
                let cx = Sc::new(kb, cx);
                // Pass 3: dx, and the block's dγ, dβ.
                kb.map_elems(zero, d, |kb, j, ty| {
                    let s = row_sum(kb, ty, xr, add.then_some(yr), j);
                    let xc = kb.b.ins().fsub(s, mean.get(ty));
                    let gv = kb.load(ty, gr, j);
                    let gm = kb.load(ty, gamma, j);
                    let av = kb.b.ins().fmul(gv, gm);
                    let t1 = kb.b.ins().fsub(av, ca.get(ty));
                    let t1 = kb.b.ins().fmul(rstd.get(ty), t1);
                    let t2 = kb.b.ins().fsub(xc, cx.get(ty));
                    let t2 = kb.b.ins().fmul(k.get(ty), t2);
                    let mut v = kb.b.ins().fsub(t1, t2);
                    if form == LnForm::Carry {
                        let carried = kb.load(ty, yr, j);
                        v = kb.b.ins().fadd(carried, v);
                    }
                    let pg = kb.load(ty, dg, j);
                    let pb = kb.load(ty, db, j);
                    let gx = kb.b.ins().fmul(gv, xc);
                    let gx = kb.b.ins().fmul(gx, rstd.get(ty));
                    let pg = kb.b.ins().fadd(pg, gx);
                    let pb = kb.b.ins().fadd(pb, gv);
                    kb.store(v, dxr, j);
                    kb.store(pg, dg, j);
                    kb.store(pb, db, j);
                });
            });
        });
    })
}

/// Element `j` of `x + y`, or of `x` alone.
fn row_sum(kb: &mut Kb, ty: Type, x: Value, y: Option<Value>, j: Value) -> Value {
    let a = kb.load(ty, x, j);
    match y {
        Some(y) => {
            let b = kb.load(ty, y, j);
            kb.b.ins().fadd(a, b)
        }
        None => a,
    }
}

/// Dims and items of [`add_layer_norm_bwd`] over `rows` rows of length `d`.
pub fn add_layer_norm_bwd_dims(rows: usize, d: usize) -> (Vec<i64>, usize) {
    (vec![rows as i64, d as i64], rows.div_ceil(LN_BWD_BLOCK))
}

/// The elements (`f32`) of the scratch buffer of [`add_layer_norm_bwd`]:
/// `ceil(rows / LN_BWD_BLOCK)·2·d`.
pub fn add_layer_norm_bwd_scratch(rows: usize, d: usize) -> usize {
    rows.div_ceil(LN_BWD_BLOCK) * 2 * d
}

/// Sums the per-block partials of [`add_layer_norm_bwd`] in block order:
/// `dgamma[j] = Σ_k scratch[k, j]`, `dbeta[j] = Σ_k scratch[k, d + j]`.
///
/// - args: `[scratch, dgamma, dbeta]` (`scratch`: `f32[blocks, 2·d]`; `dgamma`, `dbeta`:
///   `f32[d]`);
/// - dims: `[blocks, d]` (see [`add_layer_norm_bwd_finish_dims`]);
/// - items: columns `j` of `[0, d)`; each column's sum is the same however items split.
pub fn add_layer_norm_bwd_finish(name: &str) -> Function {
    build_kernel(name, |kb| {
        let scratch = kb.ptr(0);
        let dgamma = kb.ptr(1);
        let dbeta = kb.ptr(2);
        let blocks = kb.dim(0);
        let d = kb.dim(1);
        let d2 = kb.b.ins().iadd(d, d);
        let (begin, end) = (kb.begin, kb.end);
        for (dst, off) in [(dgamma, None), (dbeta, Some(d))] {
            let src = match off {
                Some(o) => kb.elem_addr(scratch, o),
                None => scratch,
            };
            kb.map_elems(begin, end, |kb, j, ty| {
                let z = kb.fconst(ty, 0.0);
                let zero = kb.iconst(0);
                let (_, acc) = kb.for_range(zero, blocks, 1, &[z], |kb, k, acc| {
                    let row = row_ptr(kb, src, k, d2);
                    let v = kb.load(ty, row, j);
                    vec![kb.b.ins().fadd(acc[0], v)]
                });
                kb.store(acc[0], dst, j);
            });
        }
    })
}

/// Dims and items of [`add_layer_norm_bwd_finish`] for [`add_layer_norm_bwd`] over
/// `rows` rows of length `d`.
pub fn add_layer_norm_bwd_finish_dims(rows: usize, d: usize) -> (Vec<i64>, usize) {
    (vec![rows.div_ceil(LN_BWD_BLOCK) as i64, d as i64], d)
}

// ---------------------------------------------------------------------------------------
// xent_ls

/// The label-smoothed cross-entropy per row of `logits[rows, v]` and its gradient. With
/// `lp = log_softmax(logits_r)`, `t = target[r]`, `keep = (t ≠ pad)`, `p = softmax`:
///
/// - `row_loss[r] = keep·(c_nll·(−lp_t) + c_smooth·inv_v·(−Σ_j lp_j))` (`lp_t = 0` when
///   `t` is outside `[0, v)`; the caller rejects such targets unless they are `pad`);
/// - `dlogits[r, j] = keep·inv_den·(c_nll·(p_j − [j = t]) + c_smooth·inv_v·(v·p_j − 1))`,
///   the gradient of `Σ_r row_loss[r] / den` with `inv_den = 1/den`.
///
/// The mean loss is [`xent_ls_finish`]`(row_loss, den)`, `den = Σ_r keep`.
///
/// - args: `[logits, target, c_nll, c_smooth, inv_v, inv_den, row_loss, dlogits]`
///   (`logits`, `dlogits`: `f32[rows, v]`; `target`: `i32[rows]`; `c_nll`, `c_smooth`,
///   `inv_v`, `inv_den`: one `f32` each; `row_loss`: `f32[rows]` scratch). `dlogits`
///   may be `logits`.
/// - dims: `[v, pad]` (see [`xent_ls_dims`]);
/// - items: rows.
pub fn xent_ls(name: &str) -> Function {
    xent_rows(name, true)
}

/// [`xent_ls`] without the gradient, for a program that reads only the loss (the `loss`
/// entry): two reads of each row and no writes but `row_loss`.
///
/// - args: `[logits, target, c_nll, c_smooth, inv_v, row_loss]`, as [`xent_ls`]'s;
/// - dims and items: as [`xent_ls`]'s.
pub fn xent_ls_loss(name: &str) -> Function {
    xent_rows(name, false)
}

/// [`xent_ls`] (`grad`) or [`xent_ls_loss`].
fn xent_rows(name: &str, grad: bool) -> Function {
    build_kernel(name, |kb| {
        let logits = kb.ptr(0);
        let target = kb.ptr(1);
        let c_nll = Sc::arg(kb, 2);
        let c_smooth = Sc::arg(kb, 3);
        let inv_v = Sc::arg(kb, 4);
        let (inv_den, row_loss, dlogits) = if grad {
            (Some(Sc::arg(kb, 5)), kb.ptr(6), Some(kb.ptr(7)))
        } else {
            (None, kb.ptr(5), None)
        };
        let v = kb.dim(0);
        let pad = kb.dim(1);
        let vf = kb.b.ins().fcvt_from_sint(types::F32, v);
        let (begin, end) = (kb.begin, kb.end);
        for_rows(kb, begin, end, |kb, r| {
            let xr = row_ptr(kb, logits, r, v);
            let dr = dlogits.map(|d| row_ptr(kb, d, r, v));
            let t = kb.load(types::I32, target, r);
            let t = kb.b.ins().sextend(types::I64, t);
            let keep = kb.b.ins().icmp(IntCC::NotEqual, t, pad);
            let one = kb.fconst(types::F32, 1.0);
            let zf = kb.fconst(types::F32, 0.0);
            let keep = kb.select(keep, one, zf);
            // In range: 0 ≤ t < v (unsigned).
            let in_range = kb.b.ins().icmp(IntCC::UnsignedLessThan, t, v);
            let zero = kb.iconst(0);
            let ti = kb.b.ins().select(in_range, t, zero);
            // Read before any write (dlogits may be logits).
            let xt = kb.load(types::F32, xr, ti);

            let m = kb.reduce_elems(zero, v, f32::NEG_INFINITY, Reduce::Max, |kb, j, ty| {
                kb.load(ty, xr, j)
            });
            let mv = Sc::new(kb, m);
            // Pass 2: e = exp(x − m) (into dlogits for the gradient); Σe and Σ(x − m).
            let s = sums(kb, zero, v, 2, 2, |kb, j, ty| {
                let x = kb.load(ty, xr, j);
                let xm = kb.b.ins().fsub(x, mv.get(ty));
                let e = kb.exp_nonpositive(xm);
                if let Some(dr) = dr {
                    kb.store(e, dr, j);
                }
                vec![e, xm]
            });
            let (z, sxm) = (s[0], s[1]);
            let lse = kb.log(z);
            // −lp_t = m + lse − x_t; −Σlp = v·lse − Σ(x − m).
            let ml = kb.b.ins().fadd(m, lse);
            let nll = kb.b.ins().fsub(ml, xt);
            let nll = kb.b.ins().select(in_range, nll, zf);
            let vl = kb.b.ins().fmul(vf, lse);
            let nsl = kb.b.ins().fsub(vl, sxm);
            let smooth = kb.b.ins().fmul(nsl, inv_v.s);
            let a = kb.b.ins().fmul(nll, c_nll.s);
            let b = kb.b.ins().fmul(smooth, c_smooth.s);
            let loss = kb.b.ins().fadd(a, b);
            let loss = kb.b.ins().fmul(loss, keep);
            kb.store(loss, row_loss, r);
            let (Some(inv_den), Some(dr)) = (&inv_den, dr) else {
                return;
            };

            // dlogits = e·(w·(c_nll + c_smooth·inv_v·v)/z) − w·c_smooth·inv_v, minus
            // w·c_nll at the target; w = keep·inv_den.
            let w = kb.b.ins().fmul(keep, inv_den.s);
            let csi = kb.b.ins().fmul(c_smooth.s, inv_v.s);
            let csv = kb.b.ins().fmul(csi, vf);
            let cp = kb.b.ins().fadd(c_nll.s, csv);
            let cp = kb.b.ins().fmul(w, cp);
            let cp = kb.b.ins().fdiv(cp, z);
            let c0 = kb.b.ins().fmul(w, csi);
            let cp = Sc::new(kb, cp);
            let c0 = Sc::new(kb, c0);
            kb.map_elems(zero, v, |kb, j, ty| {
                let e = kb.load(ty, dr, j);
                let g = kb.b.ins().fmul(e, cp.get(ty));
                let g = kb.b.ins().fsub(g, c0.get(ty));
                kb.store(g, dr, j);
            });
            // The target's one-hot term (nothing when t is out of range).
            let wn = kb.b.ins().fmul(w, c_nll.s);
            let wn = kb.b.ins().select(in_range, wn, zf);
            let gt = kb.load(types::F32, dr, ti);
            let gt = kb.b.ins().fsub(gt, wn);
            kb.store(gt, dr, ti);
        });
    })
}

/// The buffers of an `xent_ls` launch, on either backend: the kernel's five operands
/// (logits, targets, then the three scalars), then — the gradient's form — the loss
/// weight, the row losses and the gradient, or — the loss-only form ([`xent_ls_loss`])
/// — the row losses alone.
pub fn xent_ls_buffers<T: Copy>(
    (logits, target, scalars): (T, T, [T; 3]),
    row_loss: T,
    grad: Option<(T, T)>,
) -> Vec<T> {
    let mut b = vec![logits, target];
    b.extend(scalars);
    match grad {
        Some((weight, gradient)) => b.extend([weight, row_loss, gradient]),
        None => b.push(row_loss),
    }
    b
}

/// Dims and items of [`xent_ls`] over `rows` rows of `v` logits with pad id `pad`.
pub fn xent_ls_dims(rows: usize, v: usize, pad: i64) -> (Vec<i64>, usize) {
    (vec![v as i64, pad], rows)
}

/// The mean loss from [`xent_ls`]'s `row_loss`: `(Σ_r row_loss[r], in row order) / den`,
/// `den = Σ_r (target[r] ≠ pad)` (`NaN` when every row is pad, as the definition).
pub fn xent_ls_finish(row_loss: &[f32], den: f32) -> f32 {
    let mut num = 0.0f32;
    for &l in row_loss {
        num += l;
    }
    num / den
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::clif::text;

    #[test]
    fn every_kernel_verifies() {
        let isa = crate::codegen::jit::host_isa().expect("host isa");
        let funcs = [
            softmax("softmax"),
            scale_mask_softmax("sms_none", MaskKind::None),
            scale_mask_softmax("sms_key", MaskKind::Key),
            scale_mask_softmax("sms_causal", MaskKind::Causal),
            softmax_bwd("softmax_bwd"),
            add_layer_norm("ln", true, false),
            add_layer_norm("ln_plain", false, false),
            add_layer_norm("ln_rms", false, true),
            add_layer_norm_bwd("ln_bwd", LnForm::Add, false),
            add_layer_norm_bwd("ln_bwd_plain", LnForm::Plain, false),
            add_layer_norm_bwd("ln_bwd_carry", LnForm::Carry, false),
            add_layer_norm_bwd("ln_bwd_rms_carry", LnForm::Carry, true),
            add_layer_norm_bwd_finish("ln_bwd_finish"),
            xent_ls("xent"),
            xent_ls_loss("xent_loss"),
        ];
        for f in &funcs {
            cranelift_codegen::verify_function(f, isa.as_ref())
                .unwrap_or_else(|e| panic!("{e}\n{}", text(f)));
        }
    }
}
