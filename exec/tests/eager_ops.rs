//! The eager executor against the reference executor, op by op.
//!
//! In: small graphs built node by node, fed seeded random tensors (odd sizes, size-1 and
//! zero-size axes, batch 1, NaN and infinities where an op has rules for them). Out:
//! pass/fail — every output of the eager executor must match the reference's:
//!
//! - i32 and bool values, shapes and dtypes: exactly;
//! - f32 values from elementwise ops, views, gathers, `scatter_add`, dropout, masks and
//!   reductions over a non-last axis: **bit for bit** (same operations in the same
//!   order; NaN matches NaN);
//! - sums over the last axis (16 interleaved lanes instead of one running sum):
//!   `|eager - ref| <= 1e-5 * (1 + |ref|)`. The inputs lie in [-1, 1] and rows hold at
//!   most a few thousand elements, so both orders are within `n * 2^-24 * Σ|x|` of the
//!   exact sum, far inside that bound;
//! - matmuls (FMA, `gemm`'s blocking): `|eager - ref| <= 2 * k * 2^-24 * Σ_p |a_ip b_pj|`,
//!   the classic bound on the difference of two summation orders of a length-`k` dot
//!   product (each is within `k * u * Σ|a b|` of the exact value, `u = 2^-24`), plus
//!   `1e-30` so exact zeros compare.
//!
//! It also checks errors (same text as the reference), the precision option, and that
//! results do not depend on the number of rayon threads.

use kiln_exec::executor::Exec;
use std::collections::BTreeMap;

use kiln_compiler::ir::{BinaryOp, CmpOp, Float, Init, ReduceOp, UnaryOp};
use kiln_compiler::reference::{self, ExecError, Precision, RunOptions};
use kiln_compiler::rng;
use kiln_compiler::tensor::{Tensor, TensorData};
use kiln_compiler::{DType, Dim, Graph, NodeId, Op, Shape, TensorType};
use kiln_exec::Eager;

// ---------------------------------------------------------------------------------------
// Helpers.

fn shape(dims: &[&str]) -> Shape {
    Shape(
        dims.iter()
            .map(|d| d.parse::<i64>().map(Dim::c).unwrap_or_else(|_| Dim::sym(d)))
            .collect(),
    )
}

fn input(g: &mut Graph, name: &str, dtype: DType, dims: &[&str]) -> NodeId {
    for d in dims {
        if d.parse::<i64>().is_err() {
            g.add_dim(d);
        }
    }
    g.add_input(name, TensorType::new(dtype, shape(dims)))
        .unwrap()
}

fn param(g: &mut Graph, name: &str, dims: &[i64]) -> NodeId {
    g.add_param(
        name,
        TensorType::new(DType::F32, Shape::consts(dims)),
        Init::Zeros,
        "layer",
    )
    .unwrap()
}

fn op(g: &mut Graph, op: Op, args: &[NodeId]) -> NodeId {
    g.add(op, args, "").unwrap()
}

fn out(g: &mut Graph, name: &str, id: NodeId) {
    g.add_output(name, id).unwrap();
}

fn bcast(g: &mut Graph, x: NodeId, dims: &[i64]) -> NodeId {
    op(
        g,
        Op::Broadcast {
            shape: Shape::consts(dims),
        },
        &[x],
    )
}

fn permute(g: &mut Graph, x: NodeId, perm: &[usize]) -> NodeId {
    op(
        g,
        Op::Permute {
            perm: perm.to_vec(),
        },
        &[x],
    )
}

fn reshape(g: &mut Graph, x: NodeId, dims: &[i64]) -> NodeId {
    op(
        g,
        Op::Reshape {
            shape: Shape::consts(dims),
        },
        &[x],
    )
}

fn bin(g: &mut Graph, b: BinaryOp, x: NodeId, y: NodeId) -> NodeId {
    op(g, Op::Binary(b), &[x, y])
}

/// Seeded uniform values in [-1, 1); `stream` tells tensors apart.
fn rand(shape: &[usize], stream: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n as u64)
        .map(|i| (2.0 * rng::uniform01(17, stream, i) - 1.0) as f32)
        .collect();
    Tensor::f32(shape.to_vec(), v).unwrap()
}

/// Seeded ids in `lo..hi`.
fn rand_ids(shape: &[usize], lo: i32, hi: i32, stream: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let span = f64::from(hi - lo);
    let v = (0..n as u64)
        .map(|i| lo + (rng::uniform01(5, stream, i) * span) as i32)
        .collect();
    Tensor::i32(shape.to_vec(), v).unwrap()
}

fn rand_bool(shape: &[usize], stream: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v = (0..n as u64)
        .map(|i| rng::uniform01(3, stream, i) < 0.5)
        .collect();
    Tensor::bool(shape.to_vec(), v).unwrap()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

fn f32t(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::f32(shape.to_vec(), v.to_vec()).unwrap()
}

fn map(list: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
    list.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// How closely f32 outputs must agree.
#[derive(Clone, Copy, Debug)]
enum Tol {
    /// Bit for bit (NaN matches NaN).
    Exact,
    /// `|e - r| <= tol * (1 + |r|)`.
    Rel(f64),
    /// Per element `|e - r| <= bound[i]` (matmul bounds, computed by the caller).
    Bound,
}

fn opts() -> RunOptions {
    RunOptions {
        seed: 1234,
        step: 7,
        ..RunOptions::default()
    }
}

/// Named outputs, as `run` returns them.
type Outputs = Vec<(String, Tensor)>;

/// Runs both executors and returns (eager, reference) outputs.
fn both(
    g: &Graph,
    inputs: &BTreeMap<String, Tensor>,
    params: &BTreeMap<String, Tensor>,
) -> (Outputs, Outputs) {
    let e = Eager::new(g.clone())
        .unwrap()
        .run(inputs, params, &opts())
        .unwrap();
    let r = reference::run(g, inputs, params, &opts()).unwrap();
    (e, r)
}

fn assert_same(name: &str, e: &Tensor, r: &Tensor, tol: Tol, bound: Option<&[f64]>) {
    assert_eq!(e.shape, r.shape, "{name}: shapes");
    match (&e.data, &r.data) {
        (TensorData::F32(ev), TensorData::F32(rv)) => {
            for (i, (&a, &b)) in ev.iter().zip(rv).enumerate() {
                let ok = match tol {
                    Tol::Exact => a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    _ if a.is_nan() || b.is_nan() => a.is_nan() && b.is_nan(),
                    _ if a.is_infinite() || b.is_infinite() => a == b,
                    Tol::Rel(t) => {
                        (f64::from(a) - f64::from(b)).abs() <= t * (1.0 + f64::from(b).abs())
                    }
                    Tol::Bound => {
                        let bound = bound.expect("bounds given")[i];
                        (f64::from(a) - f64::from(b)).abs() <= bound
                    }
                };
                assert!(ok, "{name}[{i}]: eager {a:e} vs reference {b:e} ({tol:?})");
            }
        }
        (a, b) => assert_eq!(a, b, "{name}"),
    }
}

/// Every output of `g`, eager vs reference, at `tol`.
fn check(g: &Graph, inputs: Vec<(&str, Tensor)>, params: Vec<(&str, Tensor)>, tol: Tol) {
    let (inputs, params) = (map(inputs), map(params));
    let (e, r) = both(g, &inputs, &params);
    assert_eq!(e.len(), r.len());
    for ((ne, te), (nr, tr)) in e.iter().zip(&r) {
        assert_eq!(ne, nr);
        assert_same(ne, te, tr, tol, None);
    }
}

fn err_both(g: &Graph, inputs: Vec<(&str, Tensor)>, params: Vec<(&str, Tensor)>) -> String {
    let (inputs, params) = (map(inputs), map(params));
    let e = Eager::new(g.clone())
        .unwrap()
        .run(&inputs, &params, &opts())
        .unwrap_err()
        .to_string();
    let r = reference::run(g, &inputs, &params, &opts())
        .unwrap_err()
        .to_string();
    assert_eq!(e, r, "eager and reference errors differ");
    e
}

// ---------------------------------------------------------------------------------------
// Elementwise.

/// Values with every special case an elementwise op has rules for.
fn special(n: usize, stream: u64) -> Tensor {
    let mut t = rand(&[n], stream);
    if let TensorData::F32(v) = &mut t.data {
        let specials = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            1e30,
            -1e-30,
            -3.5,
        ];
        for (i, s) in specials.iter().enumerate() {
            if i * 3 < v.len() {
                v[i * 3] = *s;
            }
        }
    }
    t
}

#[test]
fn unary_ops_are_bit_exact() {
    for n in [1usize, 7, 33, 100_003] {
        let mut g = Graph::new("t");
        let x = input(&mut g, "x", DType::F32, &[&n.to_string()]);
        for u in [
            UnaryOp::Neg,
            UnaryOp::Exp,
            UnaryOp::Log,
            UnaryOp::Sqrt,
            UnaryOp::Recip,
            UnaryOp::Relu,
            UnaryOp::Sin,
            UnaryOp::Cos,
            UnaryOp::Tanh,
            UnaryOp::Sigmoid,
            UnaryOp::Erf,
            UnaryOp::Rsqrt,
            UnaryOp::Silu,
        ] {
            let y = op(&mut g, Op::Unary(u), &[x]);
            out(&mut g, &format!("{u:?}"), y);
        }
        check(&g, vec![("x", special(n, 1))], vec![], Tol::Exact);
    }
    // i32 neg and relu wrap/saturate like the reference, including i32::MIN.
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::I32, &["5"]);
    let n = op(&mut g, Op::Unary(UnaryOp::Neg), &[x]);
    let r = op(&mut g, Op::Unary(UnaryOp::Relu), &[x]);
    out(&mut g, "neg", n);
    out(&mut g, "relu", r);
    let ids = Tensor::i32(vec![5], vec![i32::MIN, -3, 0, 4, i32::MAX]).unwrap();
    check(&g, vec![("x", ids)], vec![], Tol::Exact);
}

#[test]
fn binary_ops_are_bit_exact_including_in_place_paths() {
    for n in [1usize, 9, 70_001] {
        let dims = [n.to_string()];
        let dims: Vec<&str> = dims.iter().map(|s| s.as_str()).collect();
        let mut g = Graph::new("t");
        let x = input(&mut g, "x", DType::F32, &dims);
        let y = input(&mut g, "y", DType::F32, &dims);
        for b in [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Max,
        ] {
            let z = bin(&mut g, b, x, y);
            out(&mut g, &format!("{b:?}"), z);
            // A computed left operand that dies here (written in place), a computed
            // right operand that dies here, and an operand used twice.
            let ex = op(&mut g, Op::Unary(UnaryOp::Neg), &[x]);
            let l = bin(&mut g, b, ex, y);
            let ey = op(&mut g, Op::Unary(UnaryOp::Exp), &[y]);
            let r = bin(&mut g, b, x, ey);
            let sq = bin(&mut g, b, l, l);
            out(&mut g, &format!("{b:?}_left"), r);
            out(&mut g, &format!("{b:?}_twice"), sq);
        }
        check(
            &g,
            vec![("x", special(n, 2)), ("y", special(n, 3))],
            vec![],
            Tol::Exact,
        );
    }
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::I32, &["6"]);
    let y = input(&mut g, "y", DType::I32, &["6"]);
    for b in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Max] {
        let z = bin(&mut g, b, x, y);
        out(&mut g, &format!("{b:?}"), z);
    }
    let xs = Tensor::i32(vec![6], vec![i32::MAX, i32::MIN, -7, 0, 3, 65536]).unwrap();
    let ys = Tensor::i32(vec![6], vec![1, -1, 9, -4, 3, 65536]).unwrap();
    check(&g, vec![("x", xs), ("y", ys)], vec![], Tol::Exact);
}

#[test]
fn broadcasts_of_every_kind() {
    // (from, to): scalar, trailing vector, column, middle axis, new leading axes,
    // size-1 to size-1, zero-size targets.
    let cases: Vec<(Vec<usize>, Vec<i64>)> = vec![
        (vec![], vec![3, 4, 5]),
        (vec![5], vec![3, 4, 5]),
        (vec![4, 1], vec![3, 4, 5]),
        (vec![3, 1, 5], vec![3, 4, 5]),
        (vec![1, 4, 1], vec![2, 3, 4, 7]),
        (vec![1], vec![7]),
        (vec![1, 1], vec![2, 3]),
        (vec![1], vec![1]),
        (vec![5], vec![0, 5]),
        (vec![0], vec![3, 0]),
        (vec![17], vec![300, 17]),
        (vec![300, 1], vec![300, 17]),
    ];
    for (i, (from, to)) in cases.into_iter().enumerate() {
        let mut g = Graph::new("t");
        let dims: Vec<String> = from.iter().map(|d| d.to_string()).collect();
        let dims: Vec<&str> = dims.iter().map(|s| s.as_str()).collect();
        let x = input(&mut g, "x", DType::F32, &dims);
        let tdims: Vec<String> = to.iter().map(|d| d.to_string()).collect();
        let tdims: Vec<&str> = tdims.iter().map(|s| s.as_str()).collect();
        let y = input(&mut g, "y", DType::F32, &tdims);
        let b = bcast(&mut g, x, &to);
        out(&mut g, "b", b);
        let s = bin(&mut g, BinaryOp::Add, y, b);
        out(&mut g, "y_plus_b", s);
        let s2 = bin(&mut g, BinaryOp::Sub, b, y);
        out(&mut g, "b_minus_y", s2);
        let to_us: Vec<usize> = to.iter().map(|&d| d as usize).collect();
        check(
            &g,
            vec![
                ("x", rand(&from, 10 + i as u64)),
                ("y", rand(&to_us, 40 + i as u64)),
            ],
            vec![],
            Tol::Exact,
        );
    }
    // A broadcast of a permuted (strided) value, and a permute of a broadcast.
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["3", "4"]);
    let y = input(&mut g, "y", DType::F32, &["2", "4", "3"]);
    let xt = permute(&mut g, x, &[1, 0]);
    let b = bcast(&mut g, xt, &[2, 4, 3]);
    let s = bin(&mut g, BinaryOp::Mul, b, y);
    out(&mut g, "mul", s);
    let col = input(&mut g, "col", DType::F32, &["4", "1"]);
    let bc = bcast(&mut g, col, &[4, 3]);
    let bt = permute(&mut g, bc, &[1, 0]);
    out(&mut g, "bt", bt);
    check(
        &g,
        vec![
            ("x", rand(&[3, 4], 1)),
            ("y", rand(&[2, 4, 3], 2)),
            ("col", rand(&[4, 1], 3)),
        ],
        vec![],
        Tol::Exact,
    );
}

#[test]
fn permutes_and_reshapes() {
    let perms: [[usize; 3]; 6] = [
        [0, 1, 2],
        [0, 2, 1],
        [1, 0, 2],
        [1, 2, 0],
        [2, 0, 1],
        [2, 1, 0],
    ];
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "3", "5"]);
    for p in perms {
        let y = permute(&mut g, x, &p);
        out(&mut g, &format!("p{p:?}"), y);
        let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[y]);
        out(&mut g, &format!("exp{p:?}"), e);
        let r = reshape(&mut g, y, &[30]);
        out(&mut g, &format!("flat{p:?}"), r);
    }
    // Split and merge heads: [b, t, h*d] -> [b, h, t, d] -> [b, t, h*d].
    let h = input(&mut g, "h", DType::F32, &["2", "5", "12"]);
    let split = reshape(&mut g, h, &[2, 5, 3, 4]);
    let heads = permute(&mut g, split, &[0, 2, 1, 3]);
    out(&mut g, "heads", heads);
    let back = permute(&mut g, heads, &[0, 2, 1, 3]);
    let merged = reshape(&mut g, back, &[2, 5, 12]);
    out(&mut g, "merged", merged);
    let kt = permute(&mut g, heads, &[0, 1, 3, 2]);
    let ktr = reshape(&mut g, kt, &[6, 4, 5]);
    out(&mut g, "kt", ktr);
    // Scalars and zero sizes.
    let one = input(&mut g, "one", DType::F32, &["1", "1"]);
    let s = op(
        &mut g,
        Op::Reshape {
            shape: Shape::scalar(),
        },
        &[one],
    );
    out(&mut g, "scalar", s);
    let z = input(&mut g, "z", DType::F32, &["2", "0", "3"]);
    let zp = permute(&mut g, z, &[2, 0, 1]);
    let zr = reshape(&mut g, zp, &[0, 6]);
    out(&mut g, "zero", zr);
    // A large transposed materialization (parallel walker over strided rows).
    let big = input(&mut g, "big", DType::F32, &["301", "257"]);
    let bt = permute(&mut g, big, &[1, 0]);
    let btr = reshape(&mut g, bt, &[257 * 301]);
    out(&mut g, "big_t", btr);
    // Batched transposes (copied in bands), with and without merged leading axes.
    let b3 = input(&mut g, "b3", DType::F32, &["3", "40", "70"]);
    let b3t = permute(&mut g, b3, &[0, 2, 1]);
    let b3r = reshape(&mut g, b3t, &[3 * 70 * 40]);
    out(&mut g, "b3_t", b3r);
    let b4 = input(&mut g, "b4", DType::F32, &["2", "3", "33", "65"]);
    let b4t = permute(&mut g, b4, &[0, 1, 3, 2]);
    let b4r = reshape(&mut g, b4t, &[6, 65 * 33]);
    out(&mut g, "b4_t", b4r);
    let b4p = permute(&mut g, b4, &[1, 0, 3, 2]);
    let b4pr = reshape(&mut g, b4p, &[6 * 65 * 33]);
    out(&mut g, "b4_pt", b4pr);
    check(
        &g,
        vec![
            ("x", rand(&[2, 3, 5], 1)),
            ("h", rand(&[2, 5, 12], 2)),
            ("one", f32t(&[1, 1], &[4.5])),
            ("z", rand(&[2, 0, 3], 3)),
            ("big", rand(&[301, 257], 4)),
            ("b3", rand(&[3, 40, 70], 5)),
            ("b4", rand(&[2, 3, 33, 65], 6)),
        ],
        vec![],
        Tol::Exact,
    );
}

#[test]
fn where_compare_and_cast() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["40"]);
    let y = input(&mut g, "y", DType::F32, &["40"]);
    let i = input(&mut g, "i", DType::I32, &["40"]);
    let j = input(&mut g, "j", DType::I32, &["40"]);
    let c = input(&mut g, "c", DType::Bool, &["40"]);
    for cmp in [
        CmpOp::Eq,
        CmpOp::Ne,
        CmpOp::Lt,
        CmpOp::Le,
        CmpOp::Gt,
        CmpOp::Ge,
    ] {
        let f = op(&mut g, Op::Compare(cmp), &[x, y]);
        let n = op(&mut g, Op::Compare(cmp), &[i, j]);
        out(&mut g, &format!("f{cmp:?}"), f);
        out(&mut g, &format!("i{cmp:?}"), n);
    }
    let wf = op(&mut g, Op::Where, &[c, x, y]);
    let wi = op(&mut g, Op::Where, &[c, i, j]);
    let lt = op(&mut g, Op::Compare(CmpOp::Lt), &[x, y]);
    let wb = op(&mut g, Op::Where, &[c, lt, c]);
    out(&mut g, "wf", wf);
    out(&mut g, "wi", wi);
    out(&mut g, "wb", wb);
    for (src, name) in [(x, "x"), (i, "i"), (c, "c")] {
        for to in [DType::F32, DType::I32, DType::Bool] {
            let z = op(&mut g, Op::Cast { to }, &[src]);
            out(&mut g, &format!("cast_{name}_{to}"), z);
        }
    }
    // A mask broadcast over rows (the attention pattern).
    let m = input(&mut g, "m", DType::Bool, &["1", "8"]);
    let s = input(&mut g, "s", DType::F32, &["5", "8"]);
    let mb = bcast(&mut g, m, &[5, 8]);
    let neg = g.add_const(-1e9, DType::F32);
    let negb = bcast(&mut g, neg, &[5, 8]);
    let w = op(&mut g, Op::Where, &[mb, s, negb]);
    out(&mut g, "masked", w);
    let mut xs = special(40, 7);
    if let TensorData::F32(v) = &mut xs.data {
        v[5] = 3e9;
        v[6] = -3e9;
        v[7] = 2.9;
        v[8] = -2.9;
    }
    let mut ys = rand(&[40], 8);
    if let (TensorData::F32(v), TensorData::F32(xv)) = (&mut ys.data, &xs.data) {
        v[1] = xv[1];
        v[2] = f32::NAN;
    }
    check(
        &g,
        vec![
            ("x", xs),
            ("y", ys),
            ("i", rand_ids(&[40], -3, 3, 1)),
            ("j", rand_ids(&[40], -3, 3, 2)),
            ("c", rand_bool(&[40], 3)),
            ("m", rand_bool(&[1, 8], 4)),
            ("s", rand(&[5, 8], 5)),
        ],
        vec![],
        Tol::Exact,
    );
}

// ---------------------------------------------------------------------------------------
// Reductions.

#[test]
fn reductions_over_every_axis() {
    let shapes: Vec<Vec<usize>> = vec![
        vec![17],
        vec![1, 17],
        vec![3, 4, 5],
        vec![2, 0, 3],
        vec![40, 33],
        vec![2, 1000],
        vec![64, 1024],
        vec![20000, 3],
        vec![3, 1, 20000],
    ];
    for (k, s) in shapes.iter().enumerate() {
        let dims: Vec<String> = s.iter().map(|d| d.to_string()).collect();
        let dims: Vec<&str> = dims.iter().map(|s| s.as_str()).collect();
        let mut g = Graph::new("t");
        let x = input(&mut g, "x", DType::F32, &dims);
        let i = input(&mut g, "i", DType::I32, &dims);
        let mut last_axis_sums = Vec::new();
        for axis in 0..s.len() {
            let sum = op(
                &mut g,
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axis,
                },
                &[x],
            );
            let max = op(
                &mut g,
                Op::Reduce {
                    op: ReduceOp::Max,
                    axis,
                },
                &[x],
            );
            let isum = op(
                &mut g,
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axis,
                },
                &[i],
            );
            let imax = op(
                &mut g,
                Op::Reduce {
                    op: ReduceOp::Max,
                    axis,
                },
                &[i],
            );
            let name = format!("sum{axis}");
            if axis + 1 == s.len() || s[axis + 1..].iter().product::<usize>() == 1 {
                last_axis_sums.push(name.clone());
            }
            out(&mut g, &name, sum);
            out(&mut g, &format!("max{axis}"), max);
            out(&mut g, &format!("isum{axis}"), isum);
            out(&mut g, &format!("imax{axis}"), imax);
        }
        let mut xs = rand(s, 20 + k as u64);
        if let TensorData::F32(v) = &mut xs.data {
            // NaN in a short row, and in the middle of a long one (lane folding).
            match k {
                2 => v[7] = f32::NAN,
                5 => v[1500] = f32::NAN,
                _ => {}
            }
        }
        let inputs = map(vec![
            ("x", xs),
            ("i", rand_ids(s, i32::MIN / 2, i32::MAX / 2, k as u64)),
        ]);
        let (e, r) = both(&g, &inputs, &BTreeMap::new());
        for ((name, te), (_, tr)) in e.iter().zip(&r) {
            let tol = if last_axis_sums.contains(name) {
                Tol::Rel(1e-5)
            } else {
                Tol::Exact
            };
            assert_same(&format!("{s:?} {name}"), te, tr, tol, None);
        }
    }
    // A reduction of a permuted view, and a full sum the DSL way (every axis, then a
    // reshape to a scalar).
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["6", "35"]);
    let xt = permute(&mut g, x, &[1, 0]);
    let s1 = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 1,
        },
        &[xt],
    );
    out(&mut g, "t_sum", s1);
    let a0 = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 0,
        },
        &[x],
    );
    let a1 = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 1,
        },
        &[a0],
    );
    let total = op(
        &mut g,
        Op::Reshape {
            shape: Shape::scalar(),
        },
        &[a1],
    );
    out(&mut g, "total", total);
    check(&g, vec![("x", rand(&[6, 35], 3))], vec![], Tol::Rel(1e-5));
}

// ---------------------------------------------------------------------------------------
// Matmul.

/// `Σ_p |a_ip| |b_pj|` in f64 for row-major `a [batch, m, k]`, `b [batch or 1, k, n]`.
fn abs_products(
    a: &[f32],
    b: &[f32],
    (batch, m, k, n): (usize, usize, usize, usize),
    shared: bool,
) -> Vec<f64> {
    let mut out = Vec::with_capacity(batch * m * n);
    for bi in 0..batch {
        let b0 = if shared { 0 } else { bi * k * n };
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    s += f64::from(a[bi * m * k + i * k + p].abs())
                        * f64::from(b[b0 + p * n + j].abs());
                }
                out.push(s);
            }
        }
    }
    out
}

/// Multiplies `x` (batch dims `batch`, `[m, k]`) by `y` (`[k, n]` shared, or batched) —
/// both given row-major as inputs — and also through transposed operands: `a` stored as
/// `[.., k, m]` and permuted, `b` stored as `[.., n, k]` and permuted.
fn check_matmul(batch: &[usize], m: usize, k: usize, n: usize, shared: bool) {
    let label = format!("{batch:?} {m}x{k}x{n} shared={shared}");
    let nb: usize = batch.iter().product();
    let r = batch.len();
    let dims = |tail: &[usize], with_batch: bool| -> Vec<String> {
        let mut d: Vec<usize> = if with_batch { batch.to_vec() } else { vec![] };
        d.extend_from_slice(tail);
        d.iter().map(|x| x.to_string()).collect()
    };
    let (a_dims, at_dims) = (dims(&[m, k], true), dims(&[k, m], true));
    let (b_dims, bt_dims) = (dims(&[k, n], !shared), dims(&[n, k], !shared));
    let mut g = Graph::new("t");
    let a = input(&mut g, "a", DType::F32, &strs(&a_dims));
    let at = input(&mut g, "at", DType::F32, &strs(&at_dims));
    let b = input(&mut g, "b", DType::F32, &strs(&b_dims));
    let bt = input(&mut g, "bt", DType::F32, &strs(&bt_dims));
    let swap = |rank: usize| -> Vec<usize> {
        let mut p: Vec<usize> = (0..rank).collect();
        p.swap(rank - 2, rank - 1);
        p
    };
    let a_from_t = permute(&mut g, at, &swap(r + 2));
    let b_rank = if shared { 2 } else { r + 2 };
    let b_from_t = permute(&mut g, bt, &swap(b_rank));
    let plain = op(&mut g, Op::MatMul, &[a, b]);
    let ta = op(&mut g, Op::MatMul, &[a_from_t, b]);
    let tb = op(&mut g, Op::MatMul, &[a, b_from_t]);
    let tab = op(&mut g, Op::MatMul, &[a_from_t, b_from_t]);
    for (name, id) in [("plain", plain), ("ta", ta), ("tb", tb), ("tab", tab)] {
        out(&mut g, name, id);
    }
    let mut bshape: Vec<usize> = if shared { vec![] } else { batch.to_vec() };
    let av = rand(&[batch, &[m, k]].concat(), 100);
    let bv = rand(&[&bshape[..], &[k, n]].concat(), 101);
    // The transposed copies hold the same matrices.
    let transpose = |t: &Tensor, count: usize, rows: usize, cols: usize| -> Vec<f32> {
        let v = t.as_f32().unwrap();
        let mut o = vec![0.0; v.len()];
        for c in 0..count {
            for i in 0..rows {
                for j in 0..cols {
                    o[c * rows * cols + j * rows + i] = v[c * rows * cols + i * cols + j];
                }
            }
        }
        o
    };
    let atv = Tensor::f32([batch, &[k, m]].concat(), transpose(&av, nb, m, k)).unwrap();
    let bcount = if shared { 1 } else { nb };
    bshape.extend_from_slice(&[n, k]);
    let btv = Tensor::f32(bshape, transpose(&bv, bcount, k, n)).unwrap();
    let bound: Vec<f64> = abs_products(
        av.as_f32().unwrap(),
        bv.as_f32().unwrap(),
        (nb, m, k, n),
        shared,
    )
    .into_iter()
    .map(|s| 2.0 * k as f64 * f64::from(f32::EPSILON / 2.0) * s + 1e-30)
    .collect();
    let inputs = map(vec![("a", av), ("at", atv), ("b", bv), ("bt", btv)]);
    let (e, rf) = both(&g, &inputs, &BTreeMap::new());
    for ((name, te), (_, tr)) in e.iter().zip(&rf) {
        assert_same(&format!("{label} {name}"), te, tr, Tol::Bound, Some(&bound));
    }
}

#[test]
fn matmul_rank_2_odd_and_zero_sizes() {
    for (m, k, n) in [
        (1, 1, 1),
        (3, 5, 7),
        (17, 33, 9),
        (1, 64, 1),
        (2, 1, 2),
        (64, 128, 96),
        (0, 4, 3),
        (3, 4, 0),
        (3, 0, 4),
        (200, 300, 130),
    ] {
        check_matmul(&[], m, k, n, true);
    }
}

#[test]
fn matmul_batched_rank_3_and_4() {
    check_matmul(&[2], 5, 7, 3, false);
    check_matmul(&[1], 5, 7, 3, false);
    check_matmul(&[2, 3], 5, 4, 6, false);
    check_matmul(&[2, 3], 0, 4, 6, false);
    check_matmul(&[2, 3], 5, 0, 6, false);
    check_matmul(&[1, 1], 1, 1, 1, false);
    // Many small products (attention-like: run in parallel over the batch).
    check_matmul(&[16, 8], 25, 16, 25, false);
    // Few large ones (each GEMM parallel).
    check_matmul(&[2], 150, 130, 170, false);
}

#[test]
fn matmul_with_a_shared_right_operand() {
    check_matmul(&[2], 5, 4, 6, true);
    check_matmul(&[2, 3], 5, 4, 6, true);
    check_matmul(&[1], 1, 3, 1, true);
    check_matmul(&[4, 25], 1, 32, 40, true);
    check_matmul(&[3], 0, 4, 6, true);
    check_matmul(&[3], 4, 0, 6, true);
    check_matmul(&[8, 25], 1, 64, 300, true);
}

#[test]
fn matmul_of_permuted_heads_and_non_mergeable_rows() {
    // q @ transpose(k) with heads split by a permute: every operand is strided.
    let (b, t, h, d) = (2, 5, 3, 4);
    let mut g = Graph::new("t");
    let q = input(&mut g, "q", DType::F32, &["2", "5", "12"]);
    let kk = input(&mut g, "k", DType::F32, &["2", "5", "12"]);
    let split = |g: &mut Graph, x| {
        let r = reshape(g, x, &[b, t, h, d]);
        permute(g, r, &[0, 2, 1, 3])
    };
    let qh = split(&mut g, q);
    let kh = split(&mut g, kk);
    let kt = permute(&mut g, kh, &[0, 1, 3, 2]);
    let s = op(&mut g, Op::MatMul, &[qh, kt]);
    out(&mut g, "scores", s);
    let ctx = op(&mut g, Op::MatMul, &[s, qh]);
    out(&mut g, "ctx", ctx);
    // A left operand whose batch and row axes do not merge, times a shared matrix.
    let x = input(&mut g, "x", DType::F32, &["5", "3", "4"]);
    let w = param(&mut g, "w", &[4, 6]);
    let xp = permute(&mut g, x, &[1, 0, 2]);
    let y = op(&mut g, Op::MatMul, &[xp, w]);
    out(&mut g, "y", y);
    // A tied projection: x @ transpose(embedding table).
    let table = param(&mut g, "table", &[37, 12]);
    let tt = permute(&mut g, table, &[1, 0]);
    let logits = op(&mut g, Op::MatMul, &[q, tt]);
    out(&mut g, "logits", logits);
    // All values are O(1) sums of at most 12 products: 1e-5 relative is loose enough.
    check(
        &g,
        vec![
            ("q", rand(&[2, 5, 12], 1)),
            ("k", rand(&[2, 5, 12], 2)),
            ("x", rand(&[5, 3, 4], 3)),
        ],
        vec![("w", rand(&[4, 6], 4)), ("table", rand(&[37, 12], 5))],
        Tol::Rel(1e-5),
    );
}

// ---------------------------------------------------------------------------------------
// Indexing, masks, concat, slice, dropout.

#[test]
fn gather_scatter_one_hot() {
    let mut g = Graph::new("t");
    let table = param(&mut g, "table", &[10, 3]);
    let ids = input(&mut g, "ids", DType::I32, &["b", "s"]);
    let e = op(&mut g, Op::Gather, &[table, ids]);
    out(&mut g, "emb", e);
    let vec_table = input(&mut g, "v", DType::I32, &["10"]);
    let ev = op(&mut g, Op::Gather, &[vec_table, ids]);
    out(&mut g, "gather_i32", ev);
    let sa = op(&mut g, Op::ScatterAdd { rows: Dim::c(10) }, &[ids, e]);
    out(&mut g, "scatter", sa);
    let oh = op(&mut g, Op::OneHot { depth: Dim::c(10) }, &[ids]);
    out(&mut g, "one_hot", oh);
    check(
        &g,
        vec![
            (
                "ids",
                Tensor::i32(vec![2, 4], vec![0, 9, 3, 3, 9, 0, 1, 3]).unwrap(),
            ),
            ("v", rand_ids(&[10], -50, 50, 9)),
        ],
        vec![("table", rand(&[10, 3], 1))],
        Tol::Exact,
    );
    // Large enough for the parallel paths; zero-size ids.
    let mut g = Graph::new("t");
    let table = param(&mut g, "table", &[500, 96]);
    let ids = input(&mut g, "ids", DType::I32, &["b", "s"]);
    let e = op(&mut g, Op::Gather, &[table, ids]);
    out(&mut g, "emb", e);
    let src = input(&mut g, "src", DType::F32, &["b", "s", "96"]);
    let sa = op(&mut g, Op::ScatterAdd { rows: Dim::c(500) }, &[ids, src]);
    out(&mut g, "scatter", sa);
    let oh = op(&mut g, Op::OneHot { depth: Dim::c(500) }, &[ids]);
    out(&mut g, "one_hot", oh);
    for (b, s) in [(16, 40), (0, 3), (1, 1)] {
        check(
            &g,
            vec![
                ("ids", rand_ids(&[b, s], 0, 500, 3)),
                ("src", rand(&[b, s, 96], 4)),
            ],
            vec![("table", rand(&[500, 96], 5))],
            Tol::Exact,
        );
    }
    // Out-of-range ids: the same error as the reference, for each op.
    for bad in [-1, 500, i32::MAX] {
        let ids = Tensor::i32(vec![1, 3], vec![2, bad, 7]).unwrap();
        let msg = err_both(
            &g,
            vec![("ids", ids), ("src", rand(&[1, 3, 96], 4))],
            vec![("table", rand(&[500, 96], 5))],
        );
        assert!(msg.contains("out of range"), "{msg}");
    }
    let mut g2 = Graph::new("t");
    let ids = input(&mut g2, "ids", DType::I32, &["4"]);
    let src = input(&mut g2, "src", DType::F32, &["4", "2"]);
    let sa = op(&mut g2, Op::ScatterAdd { rows: Dim::c(3) }, &[ids, src]);
    out(&mut g2, "scatter", sa);
    let msg = err_both(
        &g2,
        vec![
            ("ids", Tensor::i32(vec![4], vec![0, 1, 3, 2]).unwrap()),
            ("src", rand(&[4, 2], 1)),
        ],
        vec![],
    );
    assert!(msg.contains("the result has 3 rows"), "{msg}");
    let mut g3 = Graph::new("t");
    let ids = input(&mut g3, "ids", DType::I32, &["4"]);
    let oh = op(&mut g3, Op::OneHot { depth: Dim::c(3) }, &[ids]);
    out(&mut g3, "oh", oh);
    let msg = err_both(
        &g3,
        vec![("ids", Tensor::i32(vec![4], vec![0, -2, 1, 2]).unwrap())],
        vec![],
    );
    assert!(msg.contains("the depth is 3"), "{msg}");
}

#[test]
fn concat_and_slice_including_an_empty_cache() {
    // A key/value cache with 0 past positions grows by one.
    let mut g = Graph::new("t");
    let past = input(&mut g, "past", DType::F32, &["b", "2", "t", "4"]);
    let new = input(&mut g, "new", DType::F32, &["b", "2", "1", "4"]);
    let cat = op(&mut g, Op::Concat { axis: 2 }, &[past, new]);
    out(&mut g, "cache", cat);
    let q = input(&mut g, "q", DType::F32, &["b", "2", "1", "4"]);
    let kt = permute(&mut g, cat, &[0, 1, 3, 2]);
    let s = op(&mut g, Op::MatMul, &[q, kt]);
    out(&mut g, "scores", s);
    let ctx = op(&mut g, Op::MatMul, &[s, cat]);
    out(&mut g, "ctx", ctx);
    // The last position, read back with a symbolic start.
    let last = op(
        &mut g,
        Op::Slice {
            axis: 2,
            start: Dim::sym("t"),
            len: Dim::c(1),
        },
        &[cat],
    );
    out(&mut g, "last", last);
    for t in [0usize, 1, 6] {
        check(
            &g,
            vec![
                ("past", rand(&[3, 2, t, 4], 1)),
                ("new", rand(&[3, 2, 1, 4], 2)),
                ("q", rand(&[3, 2, 1, 4], 3)),
            ],
            vec![],
            Tol::Rel(1e-5),
        );
    }
    // Concat on every axis, of permuted parts, for each dtype; slices of each axis.
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "3", "4"]);
    let y = input(&mut g, "y", DType::F32, &["4", "3", "2"]);
    let yp = permute(&mut g, y, &[2, 1, 0]);
    let i = input(&mut g, "i", DType::I32, &["2", "3", "4"]);
    let c = input(&mut g, "c", DType::Bool, &["2", "3", "4"]);
    for axis in 0..3 {
        let f = op(&mut g, Op::Concat { axis }, &[x, yp, x]);
        out(&mut g, &format!("f{axis}"), f);
        let n = op(&mut g, Op::Concat { axis }, &[i, i]);
        out(&mut g, &format!("i{axis}"), n);
        let b = op(&mut g, Op::Concat { axis }, &[c]);
        out(&mut g, &format!("b{axis}"), b);
        for (start, len) in [(0, 1), (1, 1), (0, 2), (1, 0)] {
            let s = op(
                &mut g,
                Op::Slice {
                    axis,
                    start: Dim::c(start),
                    len: Dim::c(len),
                },
                &[yp],
            );
            let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[s]);
            out(&mut g, &format!("s{axis}_{start}_{len}"), e);
        }
    }
    check(
        &g,
        vec![
            ("x", rand(&[2, 3, 4], 1)),
            ("y", rand(&[4, 3, 2], 2)),
            ("i", rand_ids(&[2, 3, 4], -9, 9, 3)),
            ("c", rand_bool(&[2, 3, 4], 4)),
        ],
        vec![],
        Tol::Exact,
    );
    // A slice outside its axis: the reference's error.
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["n", "3"]);
    let s = op(
        &mut g,
        Op::Slice {
            axis: 0,
            start: Dim::sym("n").sub(&Dim::c(1)),
            len: Dim::c(2),
        },
        &[x],
    );
    out(&mut g, "s", s);
    let msg = err_both(&g, vec![("x", rand(&[4, 3], 1))], vec![]);
    assert!(msg.contains("outside axis 0"), "{msg}");
}

#[test]
fn masks_arange_and_constants() {
    let mut g = Graph::new("t");
    let ids = input(&mut g, "ids", DType::I32, &["b", "s"]);
    let _q = input(&mut g, "q", DType::F32, &["tq", "1"]);
    let _k = input(&mut g, "k", DType::F32, &["tk", "1"]);
    let pm = op(&mut g, Op::PadMask { pad: 0 }, &[ids]);
    out(&mut g, "pad", pm);
    let cm = op(
        &mut g,
        Op::CausalMask {
            q: Dim::sym("tq"),
            k: Dim::sym("tk"),
        },
        &[],
    );
    out(&mut g, "causal", cm);
    let ar = op(
        &mut g,
        Op::Arange {
            start: Dim::sym("tk").sub(&Dim::c(3)),
            len: Dim::sym("tq"),
        },
        &[],
    );
    out(&mut g, "arange", ar);
    for (dtype, v) in [(DType::F32, -2.5), (DType::I32, 7.0), (DType::Bool, 1.0)] {
        let c = g.add_const(v, dtype);
        out(&mut g, &format!("const_{dtype}"), c);
        let cb = bcast(&mut g, c, &[2, 3]);
        out(&mut g, &format!("const_b_{dtype}"), cb);
    }
    for (tq, tk) in [(3usize, 3usize), (2, 5), (5, 2), (0, 4), (4, 0), (1, 1)] {
        check(
            &g,
            vec![
                ("ids", rand_ids(&[2, 5], 0, 3, 1)),
                ("q", rand(&[tq, 1], 1)),
                ("k", rand(&[tk, 1], 2)),
            ],
            vec![],
            Tol::Exact,
        );
    }
}

#[test]
fn dropout_masks_are_the_references_bit_for_bit() {
    for (n, p) in [
        (1usize, 0.5),
        (7, 0.1),
        (1003, 0.0),
        (1003, 0.1),
        (50_001, 0.5),
        (70_000, 0.3),
    ] {
        let mut g = Graph::new("t");
        let x = input(&mut g, "x", DType::F32, &[&n.to_string()]);
        let drop = |g: &mut Graph, x, stream| {
            op(
                g,
                Op::Dropout {
                    p: Float::new(p),
                    stream,
                },
                &[x],
            )
        };
        // In place (the operand dies here) and copying (it is used again).
        let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
        let d1 = drop(&mut g, e, 3);
        let d2 = drop(&mut g, x, 4);
        let y = bin(&mut g, BinaryOp::Add, d2, x);
        out(&mut g, "in_place", d1);
        out(&mut g, "copy", d2);
        out(&mut g, "y", y);
        // Dropout of a permuted view: the mask follows the output's row-major index.
        if n == 1003 {
            let m = reshape(&mut g, x, &[17, 59]);
            let t = permute(&mut g, m, &[1, 0]);
            let dt = drop(&mut g, t, 5);
            out(&mut g, "t", dt);
        }
        check(&g, vec![("x", special(n, 11))], vec![], Tol::Exact);
    }
}

// ---------------------------------------------------------------------------------------
// Binding, options, run_nodes.

#[test]
fn binding_errors_match_the_reference() {
    let mut g = Graph::new("t");
    let src = input(&mut g, "src", DType::I32, &["batch", "src_len"]);
    let tgt = input(&mut g, "tgt", DType::I32, &["batch", "tgt_len"]);
    let w = param(&mut g, "w", &[4, 2]);
    let a = op(&mut g, Op::PadMask { pad: 0 }, &[src]);
    let b = op(&mut g, Op::PadMask { pad: 0 }, &[tgt]);
    out(&mut g, "a", a);
    out(&mut g, "b", b);
    let wt = permute(&mut g, w, &[1, 0]);
    out(&mut g, "wt", wt);
    let ids = |shape: &[usize]| rand_ids(shape, 0, 5, 1);
    // Missing input.
    let msg = err_both(
        &g,
        vec![("src", ids(&[2, 3]))],
        vec![("w", rand(&[4, 2], 1))],
    );
    assert!(msg.contains("missing input `tgt`"), "{msg}");
    // Dim conflict.
    let msg = err_both(
        &g,
        vec![("src", ids(&[2, 3])), ("tgt", ids(&[3, 3]))],
        vec![("w", rand(&[4, 2], 1))],
    );
    assert!(msg.contains("dim `batch`"), "{msg}");
    // Wrong rank, wrong dtype, i64 ids out of i32 range.
    err_both(
        &g,
        vec![("src", ids(&[6])), ("tgt", ids(&[2, 3]))],
        vec![("w", rand(&[4, 2], 1))],
    );
    err_both(
        &g,
        vec![("src", rand(&[2, 3], 1)), ("tgt", ids(&[2, 3]))],
        vec![("w", rand(&[4, 2], 1))],
    );
    let big = Tensor::i64(vec![1, 2], vec![1, 1 << 40]).unwrap();
    let msg = err_both(
        &g,
        vec![("src", big), ("tgt", ids(&[1, 2]))],
        vec![("w", rand(&[4, 2], 1))],
    );
    assert!(msg.contains("does not fit in i32"), "{msg}");
    // Parameter missing, mis-shaped, of the wrong dtype.
    let feeds = || vec![("src", ids(&[2, 3])), ("tgt", ids(&[2, 4]))];
    let msg = err_both(&g, feeds(), vec![]);
    assert!(msg.contains("parameter `w` is not provided"), "{msg}");
    err_both(&g, feeds(), vec![("w", rand(&[2, 4], 1))]);
    err_both(&g, feeds(), vec![("w", ids(&[4, 2]))]);
    // I64 ids that fit and F64 parameters are accepted (converted).
    let i64ids = Tensor::i64(vec![2, 2], vec![0, 1, 2, 3]).unwrap();
    let w64 = Tensor::f64(vec![4, 2], (0..8).map(|v| v as f64 / 3.0).collect()).unwrap();
    check(
        &g,
        vec![("src", i64ids), ("tgt", ids(&[2, 1]))],
        vec![("w", w64)],
        Tol::Exact,
    );
}

#[test]
fn precision_other_than_f32_is_a_clear_error() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2"]);
    out(&mut g, "x", x);
    let e = Eager::new(g).unwrap();
    let opts = RunOptions {
        precision: Precision::F64,
        ..RunOptions::default()
    };
    let err = e
        .run(&map(vec![("x", rand(&[2], 1))]), &BTreeMap::new(), &opts)
        .unwrap_err();
    assert!(matches!(err, ExecError::Unsupported(_)));
    assert!(err.to_string().contains("f32 only"), "{err}");
}

#[test]
fn run_nodes_returns_intermediates_and_skips_unneeded_nodes() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2"]);
    let ids = input(&mut g, "ids", DType::I32, &["1"]);
    let table = input(&mut g, "table", DType::F32, &["2", "2"]);
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let n = op(&mut g, Op::Unary(UnaryOp::Neg), &[e]);
    let bad = op(&mut g, Op::Gather, &[table, ids]);
    out(&mut g, "n", n);
    out(&mut g, "bad", bad);
    let inputs = map(vec![
        ("x", f32t(&[2], &[0.0, 1.0])),
        ("ids", Tensor::i32(vec![1], vec![9]).unwrap()),
        ("table", f32t(&[2, 2], &[0.; 4])),
    ]);
    let eager = Eager::new(g.clone()).unwrap();
    let none = BTreeMap::new();
    let got = eager
        .run_nodes(&inputs, &none, &opts(), &[e, n, e, x])
        .unwrap();
    let want = reference::run_nodes(&g, &inputs, &none, &opts(), &[e, n, e, x]).unwrap();
    assert_eq!(got, want);
    let e_err = eager.run(&inputs, &none, &opts()).unwrap_err().to_string();
    let r_err = reference::run(&g, &inputs, &none, &opts())
        .unwrap_err()
        .to_string();
    assert_eq!(e_err, r_err);
    let e_err = eager
        .run_nodes(&inputs, &none, &opts(), &[NodeId(99)])
        .unwrap_err()
        .to_string();
    let r_err = reference::run_nodes(&g, &inputs, &none, &opts(), &[NodeId(99)])
        .unwrap_err()
        .to_string();
    assert_eq!(e_err, r_err);
    // A binding error is reported before a bad node id, as the reference does.
    let mut partial = inputs.clone();
    partial.remove("x");
    let e_err = eager
        .run_nodes(&partial, &none, &opts(), &[NodeId(99)])
        .unwrap_err()
        .to_string();
    let r_err = reference::run_nodes(&g, &partial, &none, &opts(), &[NodeId(99)])
        .unwrap_err()
        .to_string();
    assert_eq!(e_err, r_err);
    assert!(e_err.contains("missing input `x`"), "{e_err}");
}

#[test]
fn a_profiled_run_gives_the_same_values_and_times_each_op_kind() {
    let g = block_graph();
    let (inputs, params) = block_feeds();
    let eager = Eager::new(g.clone()).unwrap();
    let plain = eager.run(&inputs, &params, &opts()).unwrap();
    let (values, times) = eager.run_profiled(&inputs, &params, &opts()).unwrap();
    assert_eq!(bits(&plain), bits(&values));
    let matmul = times
        .iter()
        .find(|t| t.op == "matmul")
        .expect("matmuls timed");
    let count = g.nodes.iter().filter(|n| n.op == Op::MatMul).count();
    assert_eq!(matmul.nodes, count);
    assert!(times.windows(2).all(|w| w[0].seconds >= w[1].seconds));
}

// ---------------------------------------------------------------------------------------
// Determinism.

/// An attention block with a label-smoothed loss: every kind of kernel, at sizes that
/// take the parallel paths.
fn block_graph() -> Graph {
    let (b, t, d, h, v) = (4i64, 24i64, 64i64, 4i64, 700i64);
    let mut g = Graph::new("block");
    let ids = input(&mut g, "ids", DType::I32, &["4", "24"]);
    let emb = param(&mut g, "emb", &[v, d]);
    let wq = param(&mut g, "wq", &[d, d]);
    let w1 = param(&mut g, "w1", &[d, 4 * d]);
    let w2 = param(&mut g, "w2", &[4 * d, d]);
    let x = op(&mut g, Op::Gather, &[emb, ids]);
    let x = op(
        &mut g,
        Op::Dropout {
            p: Float::new(0.1),
            stream: 1,
        },
        &[x],
    );
    let q = op(&mut g, Op::MatMul, &[x, wq]);
    let split = |g: &mut Graph, x| {
        let r = reshape(g, x, &[b, t, h, d / h]);
        permute(g, r, &[0, 2, 1, 3])
    };
    let qh = split(&mut g, q);
    let kh = split(&mut g, x);
    let kt = permute(&mut g, kh, &[0, 1, 3, 2]);
    let s = op(&mut g, Op::MatMul, &[qh, kt]);
    let mask = op(
        &mut g,
        Op::CausalMask {
            q: Dim::c(t),
            k: Dim::c(t),
        },
        &[],
    );
    let mask = bcast(&mut g, mask, &[b, h, t, t]);
    let neg = g.add_const(-1e9, DType::F32);
    let neg = bcast(&mut g, neg, &[b, h, t, t]);
    let s = op(&mut g, Op::Where, &[mask, s, neg]);
    let mx = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Max,
            axis: 3,
        },
        &[s],
    );
    let mx = bcast(&mut g, mx, &[b, h, t, t]);
    let e = bin(&mut g, BinaryOp::Sub, s, mx);
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[e]);
    let z = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 3,
        },
        &[e],
    );
    let z = bcast(&mut g, z, &[b, h, t, t]);
    let p = bin(&mut g, BinaryOp::Div, e, z);
    let c = op(&mut g, Op::MatMul, &[p, qh]);
    let c = permute(&mut g, c, &[0, 2, 1, 3]);
    let c = reshape(&mut g, c, &[b, t, d]);
    let f = op(&mut g, Op::MatMul, &[c, w1]);
    let f = op(&mut g, Op::Unary(UnaryOp::Relu), &[f]);
    let f = op(&mut g, Op::MatMul, &[f, w2]);
    let y = bin(&mut g, BinaryOp::Add, f, x);
    let et = permute(&mut g, emb, &[1, 0]);
    let logits = op(&mut g, Op::MatMul, &[y, et]);
    out(&mut g, "logits", logits);
    let lm = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Max,
            axis: 2,
        },
        &[logits],
    );
    let lm = bcast(&mut g, lm, &[b, t, v]);
    let sh = bin(&mut g, BinaryOp::Sub, logits, lm);
    let ex = op(&mut g, Op::Unary(UnaryOp::Exp), &[sh]);
    let se = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 2,
        },
        &[ex],
    );
    let ls = op(&mut g, Op::Unary(UnaryOp::Log), &[se]);
    let ls = bcast(&mut g, ls, &[b, t, v]);
    let lp = bin(&mut g, BinaryOp::Sub, sh, ls);
    let oh = op(&mut g, Op::OneHot { depth: Dim::c(v) }, &[ids]);
    let nll = bin(&mut g, BinaryOp::Mul, lp, oh);
    let a0 = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 0,
        },
        &[nll],
    );
    let a1 = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 1,
        },
        &[a0],
    );
    let a2 = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 2,
        },
        &[a1],
    );
    out(&mut g, "loss", a2);
    let grad = op(&mut g, Op::ScatterAdd { rows: Dim::c(v) }, &[ids, y]);
    out(&mut g, "scatter", grad);
    g
}

fn block_feeds() -> (BTreeMap<String, Tensor>, BTreeMap<String, Tensor>) {
    let inputs = map(vec![("ids", rand_ids(&[4, 24], 0, 700, 1))]);
    let scale = |t: Tensor, s: f32| {
        let v = t.as_f32().unwrap().iter().map(|x| x * s).collect();
        Tensor::f32(t.shape.clone(), v).unwrap()
    };
    let params = map(vec![
        // Small enough that logits are O(1): the loss is then a well-conditioned sum of
        // O(1) log-probabilities (with a dominant diagonal it would be a tiny number left
        // after cancellation, and a relative check of it meaningless).
        ("emb", scale(rand(&[700, 64], 2), 0.15)),
        ("wq", scale(rand(&[64, 64], 3), 0.2)),
        ("w1", scale(rand(&[64, 256], 4), 0.2)),
        ("w2", scale(rand(&[256, 64], 5), 0.1)),
    ]);
    (inputs, params)
}

fn bits(outs: &[(String, Tensor)]) -> Vec<Vec<u32>> {
    outs.iter()
        .map(|(_, t)| t.as_f32().unwrap().iter().map(|x| x.to_bits()).collect())
        .collect()
}

#[test]
fn results_do_not_depend_on_the_number_of_threads() {
    let g = block_graph();
    let (inputs, params) = block_feeds();
    let eager = Eager::new(g.clone()).unwrap();
    let run_with = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| eager.run(&inputs, &params, &opts()).unwrap())
    };
    let one = run_with(1);
    let two = run_with(2);
    let three = run_with(3);
    assert_eq!(bits(&one), bits(&two), "1 vs 2 threads");
    assert_eq!(bits(&one), bits(&three), "1 vs 3 threads");
    assert_eq!(bits(&two), bits(&run_with(2)), "run to run");
    // And the block agrees with the reference.
    let r = reference::run(&g, &inputs, &params, &opts()).unwrap();
    for ((name, te), (_, tr)) in two.iter().zip(&r) {
        let tol = if name == "scatter" {
            Tol::Rel(1e-5)
        } else {
            Tol::Rel(1e-4)
        };
        assert_same(name, te, tr, tol, None);
    }
}

#[test]
fn a_large_gemm_does_not_depend_on_the_number_of_threads() {
    // Big enough that gemm splits the work between threads.
    let mut g = Graph::new("t");
    let a = input(&mut g, "a", DType::F32, &["384", "520"]);
    let w = param(&mut g, "w", &[520, 700]);
    let wt = param(&mut g, "wt", &[700, 520]);
    let y = op(&mut g, Op::MatMul, &[a, w]);
    let t = permute(&mut g, wt, &[1, 0]);
    let z = op(&mut g, Op::MatMul, &[a, t]);
    out(&mut g, "y", y);
    out(&mut g, "z", z);
    let eager = Eager::new(g).unwrap();
    let inputs = map(vec![("a", rand(&[384, 520], 1))]);
    let params = map(vec![
        ("w", rand(&[520, 700], 2)),
        ("wt", rand(&[700, 520], 3)),
    ]);
    let run_with = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| eager.run(&inputs, &params, &opts()).unwrap())
    };
    let one = run_with(1);
    assert_eq!(bits(&one), bits(&run_with(2)), "1 vs 2 threads");
    assert_eq!(bits(&one), bits(&run_with(4)), "1 vs 4 threads");
}

/// A result larger than the machine's memory is an error that names the op, its shape,
/// the dims and the bytes, before anything is allocated (not "memory allocation of N
/// bytes failed" and an abort); the same graph runs at a size that fits.
#[test]
fn a_result_larger_than_the_machine_is_an_error_not_an_abort() {
    let mut g = Graph::new("outer");
    g.add_dim("n");
    let a = g
        .add_input("a", TensorType::new(DType::F32, shape(&["n", "1"])))
        .unwrap();
    let b = g
        .add_input("b", TensorType::new(DType::F32, shape(&["1", "n"])))
        .unwrap();
    let c = g.add(Op::MatMul, &[a, b], "outer").unwrap();
    let d = g.add(Op::Unary(UnaryOp::Exp), &[c], "outer").unwrap();
    g.add_output("d", d).unwrap();
    let eager = Eager::new(g).unwrap();
    let feeds = |n: usize| -> BTreeMap<String, Tensor> {
        [
            (
                "a".to_string(),
                Tensor::f32(vec![n, 1], vec![0.5; n]).unwrap(),
            ),
            (
                "b".to_string(),
                Tensor::f32(vec![1, n], vec![0.25; n]).unwrap(),
            ),
        ]
        .into_iter()
        .collect()
    };
    let err = eager
        .run(&feeds(1 << 20), &BTreeMap::new(), &RunOptions::default())
        .unwrap_err();
    let ExecError::Memory(oom) = &err else {
        panic!("expected a memory error, got {err}");
    };
    assert_eq!(oom.need, 4 << 40, "{err}");
    let text = err.to_string();
    assert!(
        text.starts_with(
            "the eager executor's `matmul` in `outer` (f32 [1048576, 1048576]) at n=1048576 \
             would allocate 4.0 TiB, but "
        ) && text.contains("run smaller batches"),
        "{text}"
    );
    // The reference executor checks the same way (in f64, twice the bytes).
    let graph = eager.graph().clone();
    let f64_opts = RunOptions {
        precision: Precision::F64,
        ..RunOptions::default()
    };
    let err = reference::run(&graph, &feeds(1 << 20), &BTreeMap::new(), &f64_opts).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, ExecError::Memory(_))
            && text.starts_with(
                "the reference executor's `matmul` in `outer` (f32 [1048576, 1048576]) at \
                 n=1048576 would allocate 8.0 TiB, but "
            ),
        "{text}"
    );
    let out = eager
        .run(&feeds(3), &BTreeMap::new(), &RunOptions::default())
        .unwrap();
    assert_eq!(out[0].1.as_f32().unwrap(), &[0.125f32.exp(); 9]);
    let want = reference::run(&graph, &feeds(3), &BTreeMap::new(), &RunOptions::default());
    assert_eq!(want.unwrap(), out);
}
