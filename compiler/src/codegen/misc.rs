//! Small CPU kernels outside the fused templates' row families: the Adam update, bias
//! gradients (`sum_rows`), single-axis reductions, bias fills and ReLU epilogues, and the
//! materialization of strided views.
//!
//! Every kernel kind has a builder `kind(name, <static config>) -> Function` and a helper
//! `kind_dims(<sizes>) -> (dims, items)` giving the `dims` array and the number of work
//! items to launch. Buffers are 4-byte elements (see [`crate::codegen::clif`] for the
//! ABI); scalar operands are pointers to one `f32`.
//!
//! | kind            | args                                                           | dims                     | items                      |
//! |-----------------|----------------------------------------------------------------|--------------------------|----------------------------|
//! | `adam_update`   | p, g, m, v, b1, b2, c1, c2, eps, step_size, inv_sqrt_bc2, p', m', v' | `[n]`              | `⌈n / BLOCK⌉`              |
//! | `sum_rows`      | x `[A0, …, A(L−1), n]`, y `[n]`                                | `[A0, …, A(L−1), n]`     | `⌈n / GROUP⌉`              |
//! | `reduce` rows   | x `[outer, len]`, y `[outer]`                                  | `[outer, len, 1]`        | `outer`                    |
//! | `reduce` across | x `[outer, len, inner]`, y `[outer, inner]`                    | `[outer, len, inner]`    | `outer · ⌈inner / GROUP⌉`  |
//! | `fill_rows`     | b `[n]`, dst `[R, n]`                                          | `[n]`                    | `R`                        |
//! | `relu`          | y `[n]` (in place)                                             | `[n]`                    | `⌈n / BLOCK⌉`              |
//! | `bias_relu`     | b `[n]`, y `[R, n]` (in place)                                 | `[n]`                    | `R`                        |
//! | `copy_strided`  | src (element `(0, …, 0)` of the view), out                     | `[s0..s4, t0..t4]`       | `s0·s1·s2·s3`              |
//!
//! Results never depend on how the items are split across calls: every output element is
//! computed by one call, in an order fixed by the kernel alone.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::{types, BlockArg, Function, InstBuilder, Type, Value};

use crate::codegen::clif::{build_kernel, Kb, Reduce, LANES, UNROLL, VF};

/// Elements per work item of the flat elementwise kernels (`adam_update`, `relu`).
pub const BLOCK: i64 = 1024;
/// Columns per work item of the column-wise reductions (`sum_rows`, `reduce` across
/// rows): `UNROLL` vectors.
pub const GROUP: i64 = LANES * UNROLL;

fn blocks(n: usize, per: i64) -> usize {
    n.div_ceil(per as usize)
}

/// `[begin·per, min(end·per, n))`: the elements of the items `[begin, end)`.
fn item_span(kb: &mut Kb, per: i64, n: Value) -> (Value, Value) {
    let lo = kb.b.ins().imul_imm_s(kb.begin, per);
    let hi = kb.b.ins().imul_imm_s(kb.end, per);
    let hi = kb.b.ins().smin(hi, n);
    (lo, hi)
}

/// Splats a scalar to `ty` (no-op for `F32`).
fn as_ty(kb: &mut Kb, ty: Type, s: Value) -> Value {
    if ty.is_vector() {
        kb.b.ins().splat(ty, s)
    } else {
        s
    }
}

/// `max(a, b)` exactly as the reference's `fmax`: a NaN `a` wins, then a NaN `b`, then
/// the larger; on a tie (`0.0` vs `-0.0` included) `a`.
fn fmax_ref(kb: &mut Kb, a: Value, b: Value) -> Value {
    let ge = kb.b.ins().fcmp(FloatCC::GreaterThanOrEqual, a, b);
    let a_nan = kb.b.ins().fcmp(FloatCC::Unordered, a, a);
    let pick_a = kb.b.ins().bor(ge, a_nan);
    kb.select(pick_a, a, b)
}

/// The reference's `relu`: `x` if `x > 0` or `x` is NaN, else `+0.0` (so `-0.0 → 0.0`).
fn relu_ref(kb: &mut Kb, x: Value) -> Value {
    let ty = kb.ty(x);
    let zero = kb.fconst(ty, 0.0);
    let le = kb.b.ins().fcmp(FloatCC::LessThanOrEqual, x, zero);
    kb.select(le, zero, x)
}

fn combine_ref(kb: &mut Kb, op: Reduce, a: Value, b: Value) -> Value {
    match op {
        Reduce::Sum => kb.b.ins().fadd(a, b),
        Reduce::Max => fmax_ref(kb, a, b),
    }
}

fn identity(op: Reduce) -> f32 {
    match op {
        Reduce::Sum => 0.0,
        Reduce::Max => f32::NEG_INFINITY,
    }
}

/// Runs `body(col, ty, count)` over columns `[lo, hi)`: blocks of `UNROLL` vectors
/// (`count = UNROLL`), then single vectors, then scalars (`ty = F32`, `count = 1`). The
/// body handles `count` values of `ty` at columns `col + LANES·j`.
fn for_columns(
    kb: &mut Kb,
    lo: Value,
    hi: Value,
    mut body: impl FnMut(&mut Kb, Value, Type, usize),
) {
    let (i, _) = kb.for_range(lo, hi, GROUP, &[], |kb, c, _| {
        body(kb, c, VF, UNROLL as usize);
        vec![]
    });
    let (i, _) = kb.for_range(i, hi, LANES, &[], |kb, c, _| {
        body(kb, c, VF, 1);
        vec![]
    });
    kb.for_range(i, hi, 1, &[], |kb, c, _| {
        body(kb, c, types::F32, 1);
        vec![]
    });
}

/// `base + col + LANES·j`.
fn lane_index(kb: &mut Kb, base: Value, col: Value, j: usize) -> Value {
    let i = kb.b.ins().iadd(base, col);
    if j == 0 {
        i
    } else {
        kb.b.ins().iadd_imm_s(i, LANES * j as i64)
    }
}

// ---------------------------------------------------------------------------------------
// adam_update

/// One Adam step over `n` elements, bit-identical to `crate::adam::update` and the
/// runtime's optimizer (same op order, no FMA):
///
/// ```text
/// m' = b1·m + c1·g;  v' = b2·v + (c2·g)·g;  p' = p − (step_size·m') / (sqrt(v')·inv_sqrt_bc2 + eps)
/// ```
///
/// args `[p, g, m, v, b1, b2, c1, c2, eps, step_size, inv_sqrt_bc2, p_out, m_out, v_out]`
/// (the seven scalars are pointers to one `f32`; the outputs may be the very buffers
/// `p`, `m`, `v` — an update in place), dims `[n]`, items `⌈n / BLOCK⌉`
/// ([`adam_update_dims`]).
pub fn adam_update(name: &str) -> Function {
    build_kernel(name, |kb| {
        let n = kb.dim(0);
        let bufs: Vec<Value> = (0..4).map(|i| kb.ptr(i)).collect();
        let zero = kb.iconst(0);
        let scalars: Vec<Value> = (4..11)
            .map(|i| {
                let p = kb.ptr(i);
                kb.load(types::F32, p, zero)
            })
            .collect();
        let outs: Vec<Value> = (11..14).map(|i| kb.ptr(i)).collect();
        let vecs: Vec<Value> = scalars.iter().map(|&s| as_ty(kb, VF, s)).collect();
        let (lo, hi) = item_span(kb, BLOCK, n);
        kb.map_elems(lo, hi, |kb, i, ty| {
            let k = if ty.is_vector() { &vecs } else { &scalars };
            let (b1, b2, c1, c2, eps, step, inv) = (k[0], k[1], k[2], k[3], k[4], k[5], k[6]);
            let p = kb.load(ty, bufs[0], i);
            let g = kb.load(ty, bufs[1], i);
            let m = kb.load(ty, bufs[2], i);
            let v = kb.load(ty, bufs[3], i);
            let b1m = kb.b.ins().fmul(b1, m);
            let c1g = kb.b.ins().fmul(c1, g);
            let m2 = kb.b.ins().fadd(b1m, c1g);
            let b2v = kb.b.ins().fmul(b2, v);
            let c2g = kb.b.ins().fmul(c2, g);
            let c2gg = kb.b.ins().fmul(c2g, g);
            let v2 = kb.b.ins().fadd(b2v, c2gg);
            let root = kb.b.ins().sqrt(v2);
            let scaled = kb.b.ins().fmul(root, inv);
            let denom = kb.b.ins().fadd(scaled, eps);
            let num = kb.b.ins().fmul(step, m2);
            let delta = kb.b.ins().fdiv(num, denom);
            let p2 = kb.b.ins().fsub(p, delta);
            kb.store(p2, outs[0], i);
            kb.store(m2, outs[1], i);
            kb.store(v2, outs[2], i);
        });
    })
}

/// dims and items of [`adam_update`] over `n` elements.
pub fn adam_update_dims(n: usize) -> (Vec<i64>, usize) {
    (vec![n as i64], blocks(n, BLOCK))
}

// ---------------------------------------------------------------------------------------
// sum_rows

/// The sum over every leading axis: x `[A0, …, A(L−1), n]` → y `[n]`, with `lead = L ≥ 1`
/// leading axes, summed exactly as the `sum_rows` template does — axis `A0` first (one
/// sum per axis, each sequential in index order from `0.0`) — so the result is
/// bit-identical to the reference executor's.
///
/// args `[x, y]`, dims `[A0, …, A(L−1), n]`, items `⌈n / GROUP⌉` column groups
/// ([`sum_rows_dims`]); each column's sum is computed in a `GROUP`-wide block of vector
/// accumulators (or a vector or scalar tail), never split across calls.
pub fn sum_rows(name: &str, lead: usize) -> Function {
    assert!(lead >= 1, "sum_rows sums at least one leading axis");
    build_kernel(name, |kb| {
        let x = kb.ptr(0);
        let y = kb.ptr(1);
        let sizes: Vec<Value> = (0..lead).map(|i| kb.dim(i)).collect();
        let n = kb.dim(lead);
        // strides[k] = (A(k+1) · … · A(L−1)) · n elements.
        let mut strides = vec![n; lead];
        for k in (0..lead.saturating_sub(1)).rev() {
            strides[k] = kb.b.ins().imul(strides[k + 1], sizes[k + 1]);
        }
        let (lo, hi) = item_span(kb, GROUP, n);
        let zero = kb.iconst(0);
        for_columns(kb, lo, hi, |kb, col, ty, count| {
            let sums = nested_sum(kb, x, &sizes, &strides, lead, zero, col, ty, count);
            for (j, s) in sums.into_iter().enumerate() {
                let at = lane_index(kb, zero, col, j);
                kb.store(s, y, at);
            }
        });
    })
}

/// The sums over axes `0..level` of the rows starting at element `base`, for `count`
/// values of `ty` at columns `col + LANES·j`: the loop over axis `level − 1` is outermost.
#[allow(clippy::too_many_arguments)]
fn nested_sum(
    kb: &mut Kb,
    x: Value,
    sizes: &[Value],
    strides: &[Value],
    level: usize,
    base: Value,
    col: Value,
    ty: Type,
    count: usize,
) -> Vec<Value> {
    if level == 0 {
        return (0..count)
            .map(|j| {
                let at = lane_index(kb, base, col, j);
                kb.load(ty, x, at)
            })
            .collect();
    }
    let k = level - 1;
    let zero = kb.iconst(0);
    let init = kb.fconst(ty, 0.0);
    let (_, sums) = kb.for_range(zero, sizes[k], 1, &vec![init; count], |kb, a, acc| {
        let off = kb.b.ins().imul(a, strides[k]);
        let row = kb.b.ins().iadd(base, off);
        let t = nested_sum(kb, x, sizes, strides, k, row, col, ty, count);
        acc.iter()
            .zip(t)
            .map(|(&s, t)| kb.b.ins().fadd(s, t))
            .collect()
    });
    sums
}

/// dims and items of [`sum_rows`] for x of shape `[lead…, n]` (`shape` = every axis).
pub fn sum_rows_dims(shape: &[usize]) -> (Vec<i64>, usize) {
    assert!(shape.len() >= 2, "sum_rows needs [lead…, n]");
    let n = *shape.last().unwrap();
    (shape.iter().map(|&d| d as i64).collect(), blocks(n, GROUP))
}

// ---------------------------------------------------------------------------------------
// reduce

/// Which layout a [`reduce`] kernel is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceLayout {
    /// `inner == 1`: each output is a contiguous row of `len` elements, reduced with
    /// vector accumulators along the row; items = `outer`.
    Rows,
    /// Any `inner` (meant for `inner > 1`): vector accumulators over `inner`, the `len`
    /// rows visited in order; items = `outer · ⌈inner / GROUP⌉`.
    Across,
}

/// The reduction of x viewed as `[outer, len, inner]` over `len`: y `[outer, inner]`
/// (a kept axis is only a shape).
///
/// args `[x, y]`, dims `[outer, len, inner]` ([`reduce_dims`] gives the items of each
/// layout). `Max` equals the reference executor exactly, bits included: a NaN propagates
/// (the first NaN in index order), ties keep the first element (`-0.0` before `0.0`
/// stays `-0.0`), and an empty axis gives `-inf`. `Sum` starts from `0.0`; in the
/// `Across` layout it is sequential in index order (bit-identical to the reference), in
/// the `Rows` layout the row is summed in vector lanes (a different rounding order).
pub fn reduce(name: &str, op: Reduce, layout: ReduceLayout) -> Function {
    build_kernel(name, |kb| match layout {
        ReduceLayout::Rows => reduce_rows(kb, op),
        ReduceLayout::Across => reduce_across(kb, op),
    })
}

fn reduce_rows(kb: &mut Kb, op: Reduce) {
    let x = kb.ptr(0);
    let y = kb.ptr(1);
    let len = kb.dim(1);
    let (begin, end) = (kb.begin, kb.end);
    kb.for_range(begin, end, 1, &[], |kb, o, _| {
        let lo = kb.b.ins().imul(o, len);
        let hi = kb.b.ins().iadd(lo, len);
        let r = reduce_span(kb, op, x, lo, hi);
        let r = if op == Reduce::Max {
            first_of_max(kb, x, lo, hi, r)
        } else {
            r
        };
        kb.store(r, y, o);
        vec![]
    });
}

/// `op` over elements `[lo, hi)` of `x`: `UNROLL` vector accumulators, combined
/// pairwise, then one vector, then across lanes, then the scalar tail.
fn reduce_span(kb: &mut Kb, op: Reduce, x: Value, lo: Value, hi: Value) -> Value {
    let init = identity(op);
    let z = kb.fconst(VF, init);
    let accs = vec![z; UNROLL as usize];
    let (i, accs) = kb.for_range(lo, hi, LANES * UNROLL, &accs, |kb, i, acc| {
        (0..UNROLL as usize)
            .map(|u| {
                let j = kb.b.ins().iadd_imm_s(i, u as i64 * LANES);
                let t = kb.load(VF, x, j);
                combine_ref(kb, op, acc[u], t)
            })
            .collect()
    });
    let a01 = combine_ref(kb, op, accs[0], accs[1]);
    let a23 = combine_ref(kb, op, accs[2], accs[3]);
    let acc = combine_ref(kb, op, a01, a23);
    let (i, acc) = kb.for_range(i, hi, LANES, &[acc], |kb, i, acc| {
        let t = kb.load(VF, x, i);
        vec![combine_ref(kb, op, acc[0], t)]
    });
    let l: Vec<Value> = (0..LANES as u8)
        .map(|k| kb.b.ins().extractlane(acc[0], k))
        .collect();
    let a = combine_ref(kb, op, l[0], l[1]);
    let c = combine_ref(kb, op, l[2], l[3]);
    let s = combine_ref(kb, op, a, c);
    let (_, s) = kb.for_range(i, hi, 1, &[s], |kb, i, acc| {
        let t = kb.load(types::F32, x, i);
        vec![combine_ref(kb, op, acc[0], t)]
    });
    s[0]
}

/// The reference's max of `[lo, hi)` given its value `r` computed in another order: the
/// first element (in index order) that is NaN or equals `r`. Only a zero or NaN `r` can
/// differ in bits from that element, so only then is the row scanned.
fn first_of_max(kb: &mut Kb, x: Value, lo: Value, hi: Value, r: Value) -> Value {
    let zero = kb.fconst(types::F32, 0.0);
    let is_zero = kb.b.ins().fcmp(FloatCC::Equal, r, zero);
    let is_nan = kb.b.ins().fcmp(FloatCC::Unordered, r, r);
    let scan = kb.b.ins().bor(is_zero, is_nan);

    let header = kb.b.create_block();
    let body = kb.b.create_block();
    let join = kb.b.create_block();
    kb.b.append_block_param(header, types::I64);
    kb.b.append_block_param(join, types::F32);
    kb.b.ins().brif(
        scan,
        header,
        &[BlockArg::from(lo)],
        join,
        &[BlockArg::from(r)],
    );

    kb.b.switch_to_block(header);
    let i = kb.b.block_params(header)[0];
    let more = kb.b.ins().icmp(IntCC::SignedLessThan, i, hi);
    kb.b.ins().brif(more, body, &[], join, &[BlockArg::from(r)]);

    kb.b.switch_to_block(body);
    let v = kb.load(types::F32, x, i);
    let eq = kb.b.ins().fcmp(FloatCC::Equal, v, r);
    let nan = kb.b.ins().fcmp(FloatCC::Unordered, v, v);
    let hit = kb.b.ins().bor(eq, nan);
    let next = kb.b.ins().iadd_imm_s(i, 1);
    kb.b.ins().brif(
        hit,
        join,
        &[BlockArg::from(v)],
        header,
        &[BlockArg::from(next)],
    );

    kb.b.switch_to_block(join);
    kb.b.block_params(join)[0]
}

fn reduce_across(kb: &mut Kb, op: Reduce) {
    let x = kb.ptr(0);
    let y = kb.ptr(1);
    let len = kb.dim(1);
    let inner = kb.dim(2);
    let groups = kb.b.ins().iadd_imm_s(inner, GROUP - 1);
    let groups = kb.b.ins().udiv_imm_u(groups, GROUP);
    let (begin, end) = (kb.begin, kb.end);
    let zero = kb.iconst(0);
    kb.for_range(begin, end, 1, &[], |kb, item, _| {
        // Items exist only when inner > 0, so `groups` is not zero here.
        let o = kb.b.ins().udiv(item, groups);
        let g = kb.b.ins().urem(item, groups);
        let c0 = kb.b.ins().imul_imm_s(g, GROUP);
        let c1 = kb.b.ins().iadd_imm_s(c0, GROUP);
        let c1 = kb.b.ins().smin(c1, inner);
        let rows = kb.b.ins().imul(o, len);
        let xbase = kb.b.ins().imul(rows, inner);
        let ybase = kb.b.ins().imul(o, inner);
        for_columns(kb, c0, c1, |kb, col, ty, count| {
            let init = kb.fconst(ty, identity(op));
            let (_, acc) = kb.for_range(zero, len, 1, &vec![init; count], |kb, a, acc| {
                let off = kb.b.ins().imul(a, inner);
                let row = kb.b.ins().iadd(xbase, off);
                (0..count)
                    .map(|j| {
                        let at = lane_index(kb, row, col, j);
                        let t = kb.load(ty, x, at);
                        combine_ref(kb, op, acc[j], t)
                    })
                    .collect()
            });
            for (j, r) in acc.into_iter().enumerate() {
                let at = lane_index(kb, ybase, col, j);
                kb.store(r, y, at);
            }
        });
        vec![]
    });
}

/// dims and items of [`reduce`] over x viewed as `[outer, len, inner]`.
pub fn reduce_dims(
    layout: ReduceLayout,
    outer: usize,
    len: usize,
    inner: usize,
) -> (Vec<i64>, usize) {
    let dims = vec![outer as i64, len as i64, inner as i64];
    let items = match layout {
        ReduceLayout::Rows => {
            assert_eq!(inner, 1, "the Rows layout reduces contiguous rows");
            outer
        }
        ReduceLayout::Across => outer * blocks(inner, GROUP),
    };
    (dims, items)
}

/// The layout to build for `inner`: `Rows` when `inner == 1`.
pub fn reduce_layout(inner: usize) -> ReduceLayout {
    if inner == 1 {
        ReduceLayout::Rows
    } else {
        ReduceLayout::Across
    }
}

// ---------------------------------------------------------------------------------------
// fill_rows, relu, bias_relu

/// dst `[R, n]` ← the broadcast of b `[n]` (a bias pre-loaded before a GEMM that adds
/// into dst). args `[b, dst]`, dims `[n]`, items `R` rows ([`rows_dims`]).
pub fn fill_rows(name: &str) -> Function {
    bias_rows(name, |kb, b, dst, at, _| kb.store(b, dst, at))
}

/// A kernel over the rows of `[R, n]` (args[1]) with a bias `[n]` (args[0]): for each
/// element, `each(kb, b, dst, at, ty)` with the bias element `b` and the element's index
/// `at` in `dst`.
fn bias_rows(name: &str, each: impl Fn(&mut Kb, Value, Value, Value, Type)) -> Function {
    build_kernel(name, |kb| {
        let bias = kb.ptr(0);
        let dst = kb.ptr(1);
        let n = kb.dim(0);
        let (begin, end) = (kb.begin, kb.end);
        let zero = kb.iconst(0);
        kb.for_range(begin, end, 1, &[], |kb, r, _| {
            let base = kb.b.ins().imul(r, n);
            kb.map_elems(zero, n, |kb, j, ty| {
                let b = kb.load(ty, bias, j);
                let at = kb.b.ins().iadd(base, j);
                each(kb, b, dst, at, ty);
            });
            vec![]
        });
    })
}

/// In place `y = relu(y)` over `n` elements, exactly the reference's `relu` (`x` if
/// `x > 0` or NaN, else `+0.0`). args `[y]`, dims `[n]`, items `⌈n / BLOCK⌉`
/// ([`relu_dims`]).
pub fn relu(name: &str) -> Function {
    build_kernel(name, |kb| {
        let y = kb.ptr(0);
        let n = kb.dim(0);
        let (lo, hi) = item_span(kb, BLOCK, n);
        kb.map_elems(lo, hi, |kb, i, ty| {
            let v = kb.load(ty, y, i);
            let r = relu_ref(kb, v);
            kb.store(r, y, i);
        });
    })
}

/// dims and items of [`relu`] over `n` elements.
pub fn relu_dims(n: usize) -> (Vec<i64>, usize) {
    (vec![n as i64], blocks(n, BLOCK))
}

/// In place `y[r, :] = relu(y[r, :] + b)` (a GEMM epilogue; the reference's `add` then
/// `relu`, bit for bit). args `[b, y]`, dims `[n]`, items `R` rows ([`rows_dims`]).
pub fn bias_relu(name: &str) -> Function {
    bias_rows(name, |kb, b, y, at, ty| {
        let v = kb.load(ty, y, at);
        let s = kb.b.ins().fadd(v, b);
        let s = relu_ref(kb, s);
        kb.store(s, y, at);
    })
}

/// dims and items of [`fill_rows`] and [`bias_relu`] over `[rows, n]`.
pub fn rows_dims(rows: usize, n: usize) -> (Vec<i64>, usize) {
    (vec![n as i64], rows)
}

// ---------------------------------------------------------------------------------------
// copy_strided

/// The largest output rank of [`copy_strided`].
pub const MAX_COPY_RANK: usize = 5;

/// Materializes a strided view: out (contiguous, shape `[s0, …, s4]`) with
/// `out[i0, …, i4] = src[i0·t0 + … + i4·t4]`, strides `t` in elements of any sign (or 0).
///
/// args `[src, out]` where `src` points at the view's element `(0, …, 0)` (negative
/// strides reach below it), dims `[s0, s1, s2, s3, s4, t0, t1, t2, t3, t4]` (the shape
/// padded with leading 1s to rank 5, see [`copy_strided_dims`]), items = output rows
/// `s0·s1·s2·s3`. With `unit_inner` the innermost stride must be 1 and rows are copied
/// with vectors; otherwise each element is gathered (any strides).
pub fn copy_strided(name: &str, unit_inner: bool) -> Function {
    build_kernel(name, |kb| {
        let src = kb.ptr(0);
        let out = kb.ptr(1);
        let s: Vec<Value> = (0..MAX_COPY_RANK).map(|i| kb.dim(i)).collect();
        let t: Vec<Value> = (0..MAX_COPY_RANK)
            .map(|i| kb.dim(MAX_COPY_RANK + i))
            .collect();
        let (begin, end) = (kb.begin, kb.end);
        let zero = kb.iconst(0);
        let inner = s[MAX_COPY_RANK - 1];
        let t_inner = t[MAX_COPY_RANK - 1];
        kb.for_range(begin, end, 1, &[], |kb, row, _| {
            // row = ((i0·s1 + i1)·s2 + i2)·s3 + i3; the source offset Σ i_k·t_k.
            let mut rest = row;
            let mut off = zero;
            for k in (1..MAX_COPY_RANK - 1).rev() {
                let i = kb.b.ins().urem(rest, s[k]);
                rest = kb.b.ins().udiv(rest, s[k]);
                let d = kb.b.ins().imul(i, t[k]);
                off = kb.b.ins().iadd(off, d);
            }
            let d = kb.b.ins().imul(rest, t[0]);
            let off = kb.b.ins().iadd(off, d);
            let obase = kb.b.ins().imul(row, inner);
            if unit_inner {
                kb.map_elems(zero, inner, |kb, j, ty| {
                    let from = kb.b.ins().iadd(off, j);
                    let v = kb.load(ty, src, from);
                    let to = kb.b.ins().iadd(obase, j);
                    kb.store(v, out, to);
                });
            } else {
                kb.for_range(zero, inner, 1, &[off], |kb, j, from| {
                    let v = kb.load(types::I32, src, from[0]);
                    let to = kb.b.ins().iadd(obase, j);
                    kb.store(v, out, to);
                    vec![kb.b.ins().iadd(from[0], t_inner)]
                });
            }
            vec![]
        });
    })
}

/// dims and items of [`copy_strided`] for an output `shape` (rank ≤ 5) read with element
/// `strides` (one per axis).
pub fn copy_strided_dims(shape: &[usize], strides: &[i64]) -> (Vec<i64>, usize) {
    assert_eq!(shape.len(), strides.len(), "one stride per axis");
    assert!(
        shape.len() <= MAX_COPY_RANK,
        "copy_strided copies rank ≤ {MAX_COPY_RANK}"
    );
    let pad = MAX_COPY_RANK - shape.len();
    let mut dims: Vec<i64> = vec![1; pad];
    dims.extend(shape.iter().map(|&d| d as i64));
    dims.extend(std::iter::repeat_n(0, pad));
    dims.extend_from_slice(strides);
    let items = dims[..MAX_COPY_RANK - 1].iter().product::<i64>() as usize;
    (dims, items)
}
