//! Every gradient rule of `autodiff` against central finite differences.
//!
//! In: tiny graphs `f = sum(op(x, ...) * r)`, built node by node, where `r` is a fixed
//! random input of the op's shape (so every output element matters). Out: pass/fail —
//! `gradients` must give a graph that verifies and prints deterministically, and every
//! element of every gradient must match the central difference of `f` through the
//! reference executor in f64, every input element perturbed in turn.
//!
//! # Tolerance
//!
//! `|analytic − numeric| ≤ 1e-6 · max(1, |numeric|)` with `h = 1e-6`. In f64 the central
//! difference has a truncation error of about `h² · |f'''| / 6 ≈ 1e-13` for these smooth,
//! O(1) functions, and a rounding error of about `ε · Σ|terms of f| / h`: with ε ≈ 1.1e-16,
//! at most a few dozen O(1) terms, that is ≲ 1e-8. The bound leaves two orders of
//! magnitude above both, and is still tight enough that a wrong rule (a missing factor, a
//! transposed matrix, a dropped contribution) fails by many orders of magnitude. Inputs
//! are kept away from kinks (relu at 0, ties in `max`) and singularities (log, sqrt, recip
//! and div near 0) except in the tests that check those points exactly.

use std::collections::BTreeMap;

use kiln_compiler::autodiff::{gradients, train_step};
use kiln_compiler::ir::{BinaryOp, CmpOp, Float, Init, ReduceOp, UnaryOp};
use kiln_compiler::printer::print_graph;
use kiln_compiler::reference::{self, Precision, RunOptions};
use kiln_compiler::tensor::Tensor;
use kiln_compiler::{DType, Dim, Graph, IrError, NodeId, Op, Shape, TensorType};

const H: f64 = 1e-6;
const TOL: f64 = 1e-6;

// ---------------------------------------------------------------------------------------
// Helpers.

/// A shape from dims written as numbers, symbol names or `t+2`-style sums.
fn shape(dims: &[&str]) -> Shape {
    Shape(
        dims.iter()
            .map(|d| {
                d.split('+')
                    .map(|t| t.parse::<i64>().map(Dim::c).unwrap_or_else(|_| Dim::sym(t)))
                    .fold(Dim::c(0), |acc, t| acc.add(&t))
            })
            .collect(),
    )
}

/// Philox draws (`rng::uniform01`) in sequence: a fixed stream of test values.
struct Rng {
    seed: u64,
    index: u64,
}

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng { seed, index: 0 }
    }

    /// Uniform in (lo, hi).
    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        self.index += 1;
        lo + (hi - lo) * kiln_compiler::rng::uniform01(self.seed, 0, self.index - 1)
    }
}

/// A graph under construction, with the values fed to it.
struct Case {
    g: Graph,
    dims: BTreeMap<String, i64>,
    inputs: BTreeMap<String, Tensor>,
    params: BTreeMap<String, Tensor>,
    /// The sources differentiated against.
    vars: Vec<NodeId>,
    rng: Rng,
    opts: RunOptions,
}

impl Case {
    fn new(dims: &[(&str, i64)]) -> Case {
        let mut g = Graph::new("case");
        for (d, _) in dims {
            g.add_dim(d);
        }
        Case {
            g,
            dims: dims.iter().map(|(d, v)| (d.to_string(), *v)).collect(),
            inputs: BTreeMap::new(),
            params: BTreeMap::new(),
            vars: vec![],
            rng: Rng::new(0x5EED),
            opts: RunOptions {
                precision: Precision::F64,
                ..RunOptions::default()
            },
        }
    }

    fn concrete(&self, s: &Shape) -> Vec<usize> {
        s.eval(&self.dims).unwrap()
    }

    /// A float input with the given values.
    fn input_values(&mut self, name: &str, dims: &[&str], v: Vec<f64>) -> NodeId {
        let s = shape(dims);
        let t = Tensor::f64(self.concrete(&s), v).unwrap();
        let id = self
            .g
            .add_input(name, TensorType::new(DType::F32, s))
            .unwrap();
        self.inputs.insert(name.to_string(), t);
        id
    }

    /// A float input uniform in [lo, hi), not differentiated against.
    fn fixed(&mut self, name: &str, dims: &[&str], lo: f64, hi: f64) -> NodeId {
        let n: usize = self.concrete(&shape(dims)).iter().product();
        let v = (0..n).map(|_| self.rng.uniform(lo, hi)).collect();
        self.input_values(name, dims, v)
    }

    /// A float input uniform in [lo, hi), differentiated against.
    fn var_in(&mut self, name: &str, dims: &[&str], lo: f64, hi: f64) -> NodeId {
        let id = self.fixed(name, dims, lo, hi);
        self.vars.push(id);
        id
    }

    /// A float input uniform in [-1, 1), differentiated against.
    fn var(&mut self, name: &str, dims: &[&str]) -> NodeId {
        self.var_in(name, dims, -1.0, 1.0)
    }

    /// A float input with the given values, differentiated against.
    fn var_values(&mut self, name: &str, dims: &[&str], v: Vec<f64>) -> NodeId {
        let id = self.input_values(name, dims, v);
        self.vars.push(id);
        id
    }

    /// A parameter (concrete shape) uniform in [-1, 1), differentiated against.
    fn param(&mut self, name: &str, dims: &[i64]) -> NodeId {
        let s = Shape::consts(dims);
        let n: usize = dims.iter().product::<i64>() as usize;
        let v = (0..n).map(|_| self.rng.uniform(-1.0, 1.0)).collect();
        let id = self
            .g
            .add_param(name, TensorType::new(DType::F32, s), Init::Zeros, "layer")
            .unwrap();
        let t = Tensor::f64(dims.iter().map(|&d| d as usize).collect(), v).unwrap();
        self.params.insert(name.to_string(), t);
        self.vars.push(id);
        id
    }

    fn ids(&mut self, name: &str, dims: &[&str], v: Vec<i32>) -> NodeId {
        let s = shape(dims);
        let t = Tensor::i32(self.concrete(&s), v).unwrap();
        self.inputs.insert(name.to_string(), t);
        self.g
            .add_input(name, TensorType::new(DType::I32, s))
            .unwrap()
    }

    fn bools(&mut self, name: &str, dims: &[&str], v: Vec<bool>) -> NodeId {
        let s = shape(dims);
        let t = Tensor::bool(self.concrete(&s), v).unwrap();
        self.inputs.insert(name.to_string(), t);
        self.g
            .add_input(name, TensorType::new(DType::Bool, s))
            .unwrap()
    }

    fn op(&mut self, op: Op, inputs: &[NodeId]) -> NodeId {
        self.g.add(op, inputs, "layer").unwrap()
    }

    fn unary(&mut self, u: UnaryOp, x: NodeId) -> NodeId {
        self.op(Op::Unary(u), &[x])
    }

    fn binary(&mut self, b: BinaryOp, x: NodeId, y: NodeId) -> NodeId {
        self.op(Op::Binary(b), &[x, y])
    }

    fn bcast(&mut self, x: NodeId, dims: &[&str]) -> NodeId {
        self.op(Op::Broadcast { shape: shape(dims) }, &[x])
    }

    fn reduce(&mut self, op: ReduceOp, axis: usize, x: NodeId) -> NodeId {
        self.op(Op::Reduce { op, axis }, &[x])
    }

    fn transpose(&mut self, x: NodeId) -> NodeId {
        let r = self.g.ty(x).shape.rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        self.op(Op::Permute { perm }, &[x])
    }

    /// The sum of every element, as a scalar.
    fn sum_all(&mut self, x: NodeId) -> NodeId {
        let numel = self.g.ty(x).shape.numel();
        let flat = self.op(
            Op::Reshape {
                shape: Shape(vec![numel]),
            },
            &[x],
        );
        let s = self.reduce(ReduceOp::Sum, 0, flat);
        self.op(
            Op::Reshape {
                shape: Shape::scalar(),
            },
            &[s],
        )
    }

    /// `f = sum(y * r)` with `r` a fresh random input of y's shape.
    fn objective(&mut self, y: NodeId) -> NodeId {
        let s = self.g.ty(y).shape.clone();
        let name = format!("r{}", self.inputs.len());
        let n: usize = self.concrete(&s).iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.rng.uniform(-1.0, 1.0)).collect();
        let t = Tensor::f64(self.concrete(&s), v).unwrap();
        let r = self
            .g
            .add_input(&name, TensorType::new(self.g.ty(y).dtype, s))
            .unwrap();
        self.inputs.insert(name, t);
        let yr = self.binary(BinaryOp::Mul, y, r);
        self.sum_all(yr)
    }

    fn eval(
        &self,
        g: &Graph,
        inputs: &BTreeMap<String, Tensor>,
        params: &BTreeMap<String, Tensor>,
        nodes: &[NodeId],
    ) -> Vec<Vec<f64>> {
        reference::run_nodes(g, inputs, params, &self.opts, nodes)
            .unwrap()
            .iter()
            .map(|t| t.to_f64_vec().unwrap())
            .collect()
    }

    /// The analytic gradients of `f` with respect to every var.
    fn analytic(&self, f: NodeId) -> Vec<Vec<f64>> {
        let (gg, grads) = gradients(&self.g, f, &self.vars).unwrap();
        gg.verify().unwrap();
        for (&v, &gv) in self.vars.iter().zip(&grads) {
            assert_eq!(gg.ty(v), gg.ty(gv), "the gradient has its variable's type");
        }
        // Deterministic: the same pass prints the same graph.
        let (again, grads2) = gradients(&self.g, f, &self.vars).unwrap();
        assert_eq!(print_graph(&gg), print_graph(&again));
        assert_eq!(grads, grads2);
        // New nodes are scoped under `grad`.
        for node in &gg.nodes[self.g.len()..] {
            assert!(
                &*node.scope == "grad" || node.scope.starts_with("grad/"),
                "scope `{}`",
                node.scope
            );
        }
        self.eval(&gg, &self.inputs, &self.params, &grads)
    }

    /// Checks the analytic gradients against central differences, except at the
    /// elements `skip(var, element)` names; returns the analytic gradients.
    fn check_except(&self, f: NodeId, skip: &dyn Fn(usize, usize) -> bool) -> Vec<Vec<f64>> {
        assert_eq!(self.g.ty(f).shape.rank(), 0);
        let analytic = self.analytic(f);
        let f_at = |inputs: &BTreeMap<String, Tensor>, params: &BTreeMap<String, Tensor>| {
            self.eval(&self.g, inputs, params, &[f])[0][0]
        };
        for (vi, &v) in self.vars.iter().enumerate() {
            let name = self.g.source_name(v).unwrap().to_string();
            let is_param = self.params.contains_key(&name);
            let base = if is_param {
                &self.params[&name]
            } else {
                &self.inputs[&name]
            };
            let values = base.to_f64_vec().unwrap();
            assert_eq!(values.len(), analytic[vi].len());
            for e in 0..values.len() {
                if skip(vi, e) {
                    continue;
                }
                let at = |delta: f64| {
                    let mut moved = values.clone();
                    moved[e] += delta;
                    let t = Tensor::f64(base.shape.clone(), moved).unwrap();
                    let (mut inputs, mut params) = (self.inputs.clone(), self.params.clone());
                    if is_param {
                        params.insert(name.clone(), t);
                    } else {
                        inputs.insert(name.clone(), t);
                    }
                    f_at(&inputs, &params)
                };
                let numeric = (at(H) - at(-H)) / (2.0 * H);
                let a = analytic[vi][e];
                assert!(
                    (a - numeric).abs() <= TOL * numeric.abs().max(1.0),
                    "d f / d {name}[{e}]: analytic {a}, numeric {numeric}"
                );
            }
        }
        analytic
    }

    fn check(&self, f: NodeId) -> Vec<Vec<f64>> {
        self.check_except(f, &|_, _| false)
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * b.abs().max(1.0)
}

// ---------------------------------------------------------------------------------------
// Views.

#[test]
fn reshape_and_permute() {
    let mut c = Case::new(&[("b", 2)]);
    let x = c.var("x", &["b", "3", "4"]);
    let y = c.op(
        Op::Reshape {
            shape: shape(&["3", "b", "2", "2"]),
        },
        &[x],
    );
    let y = c.unary(UnaryOp::Sin, y);
    let f = c.objective(y);
    c.check(f);

    // A permutation that is not its own inverse.
    let mut c = Case::new(&[("b", 2)]);
    let x = c.var("x", &["b", "3", "4"]);
    let y = c.op(
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[x],
    );
    let y = c.unary(UnaryOp::Sin, y);
    let f = c.objective(y);
    c.check(f);
}

#[test]
fn broadcast_of_every_kind() {
    // (operand dims, target dims)
    let cases: &[(&[&str], &[&str])] = &[
        (&[], &["2", "3"]),                             // scalar
        (&["3"], &["b", "3"]),                          // trailing
        (&["2", "1", "4"], &["2", "3", "4"]),           // middle size-1 axis
        (&["3", "4"], &["b", "2", "3", "4"]),           // prepended axes
        (&["1", "4"], &["b", "3", "4"]),                // prepended and size-1
        (&["b", "1"], &["b", "3"]),                     // trailing size-1, symbolic rest
        (&["2", "1"], &["2", "1"]),                     // nothing expands
        (&["1", "1", "3"], &["2", "b", "1", "4", "3"]), // a bit of everything
    ];
    for (from, to) in cases {
        let mut c = Case::new(&[("b", 2)]);
        let x = c.var("x", from);
        let y = c.bcast(x, to);
        let y = c.unary(UnaryOp::Sin, y);
        let f = c.objective(y);
        c.check(f);
    }
}

#[test]
fn slices_and_concats() {
    // Concat along each axis, symbolic sizes included.
    for axis in 0..3 {
        let mut c = Case::new(&[("b", 2), ("t", 3)]);
        let mut a_dims = vec!["b", "t", "2"];
        let mut b_dims = vec!["b", "t", "2"];
        a_dims[axis] = "2";
        b_dims[axis] = "1";
        let a = c.var("a", &a_dims);
        let k = c.fixed("k", &b_dims, -1.0, 1.0);
        let bb = c.var("b_", &b_dims);
        let y = c.op(Op::Concat { axis }, &[a, k, bb, a]);
        let y = c.unary(UnaryOp::Sin, y);
        let f = c.objective(y);
        c.check(f);
    }
    // Slices: in the middle, from the start, to the end, with symbolic bounds.
    // (axis, start, len, whether it covers the whole axis)
    let slices: &[(usize, Dim, Dim, bool)] = &[
        (1, Dim::c(1), Dim::c(2), false),
        (1, Dim::c(0), Dim::c(2), false),
        (1, Dim::c(2), Dim::sym("t"), false),
        (1, Dim::c(1), Dim::sym("t"), false),
        (0, Dim::c(0), Dim::sym("b"), true),
        (2, Dim::c(1), Dim::c(1), false),
    ];
    for (axis, start, len, whole) in slices {
        let mut c = Case::new(&[("b", 2), ("t", 3)]);
        // An input that binds `t` (the executor binds dims from plain-symbol axes).
        let _lengths = c.fixed("lengths", &["t"], 0.0, 1.0);
        let x = c.var("x", &["b", "t+2", "3"]);
        let op = Op::Slice {
            axis: *axis,
            start: start.clone(),
            len: len.clone(),
        };
        let y = c.op(op, &[x]);
        let y = c.unary(UnaryOp::Exp, y);
        let f = c.objective(y);
        let grads = c.check(f);
        // Elements outside the slice get exactly zero.
        assert_eq!(grads[0].contains(&0.0), !whole);
    }
}

// ---------------------------------------------------------------------------------------
// Elementwise.

#[test]
fn unary_ops() {
    let ops = [
        (UnaryOp::Neg, -2.0, 2.0),
        (UnaryOp::Exp, -2.0, 2.0),
        (UnaryOp::Log, 0.5, 3.0),
        (UnaryOp::Sqrt, 0.5, 3.0),
        (UnaryOp::Recip, 0.5, 3.0),
        (UnaryOp::Relu, -2.0, 2.0),
        (UnaryOp::Sin, -3.0, 3.0),
        (UnaryOp::Cos, -3.0, 3.0),
        (UnaryOp::Tanh, -3.0, 3.0),
        (UnaryOp::Sigmoid, -4.0, 4.0),
        (UnaryOp::Erf, -2.5, 2.5),
        (UnaryOp::Rsqrt, 0.5, 3.0),
        (UnaryOp::Silu, -4.0, 4.0),
    ];
    for (u, lo, hi) in ops {
        let mut c = Case::new(&[("b", 2)]);
        let x = c.var_in("x", &["b", "5"], lo, hi);
        let y = c.unary(u, x);
        let f = c.objective(y);
        c.check(f);
    }
    // Recip of negative values too.
    let mut c = Case::new(&[]);
    let x = c.var_in("x", &["6"], -3.0, -0.5);
    let y = c.unary(UnaryOp::Recip, x);
    let f = c.objective(y);
    c.check(f);
}

#[test]
fn relu_at_exactly_zero_has_zero_gradient() {
    let mut c = Case::new(&[]);
    let x = c.var_values("x", &["5"], vec![-1.0, 0.0, 0.5, 0.0, 2.0]);
    let y = c.unary(UnaryOp::Relu, x);
    let f = c.objective(y);
    // Central differences see half the slope at the kink; skip those two elements.
    let g = c.check_except(f, &|_, e| e == 1 || e == 3);
    let r = c.inputs["r1"].to_f64_vec().unwrap();
    assert_eq!(g[0][0], 0.0);
    assert_eq!(g[0][1], 0.0, "relu'(0) = 0, as in PyTorch");
    assert_eq!(g[0][3], 0.0);
    assert!(close(g[0][2], r[2]) && close(g[0][4], r[4]));
}

#[test]
fn binary_ops() {
    let ops = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
    ];
    for op in ops {
        let mut c = Case::new(&[("t", 3)]);
        let a = c.var_in("a", &["2", "t"], -2.0, 2.0);
        // Keep the divisor away from 0 (both signs).
        let b = c.var_values("b", &["2", "t"], vec![0.7, -1.3, 1.9, -0.6, 1.1, -2.2]);
        let y = c.binary(op, a, b);
        let f = c.objective(y);
        c.check(f);
    }
}

#[test]
fn binary_ops_with_one_operand_twice() {
    for op in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
    ] {
        let mut c = Case::new(&[]);
        let x = c.var_in("x", &["4"], 0.5, 2.0);
        let y = c.binary(op, x, x);
        let f = c.objective(y);
        let g = c.check(f);
        if op == BinaryOp::Max {
            // max(x, x) = x: the two halves of the tie add up to the whole gradient.
            let r = c.inputs["r1"].to_f64_vec().unwrap();
            for (gi, ri) in g[0].iter().zip(&r) {
                assert!(close(*gi, *ri));
            }
        }
    }
}

#[test]
fn max_splits_ties_evenly() {
    let mut c = Case::new(&[]);
    let a = c.var_values("a", &["4"], vec![1.0, 2.0, -0.5, 3.0]);
    let b = c.var_values("b", &["4"], vec![1.0, 1.5, -0.5, 4.0]);
    let y = c.binary(BinaryOp::Max, a, b);
    let f = c.objective(y);
    // A two-way tie is where central differences average the one-sided slopes, r/2 each:
    // exactly the even split, so every element is checked numerically as well.
    let g = c.check(f);
    let r = c.inputs["r2"].to_f64_vec().unwrap();
    assert!(close(g[0][0], r[0] / 2.0) && close(g[1][0], r[0] / 2.0));
    assert!(close(g[0][2], r[2] / 2.0) && close(g[1][2], r[2] / 2.0));
    assert!(close(g[0][1], r[1]) && g[1][1] == 0.0);
    assert!(g[0][3] == 0.0 && close(g[1][3], r[3]));
}

#[test]
fn where_and_non_float_paths() {
    let mut c = Case::new(&[("b", 2)]);
    let cond = c.bools(
        "c",
        &["b", "3"],
        vec![true, false, true, false, false, true],
    );
    let x = c.var("x", &["b", "3"]);
    let y = c.var("y", &["b", "3"]);
    let ex = c.unary(UnaryOp::Exp, x);
    let w = c.op(Op::Where, &[cond, ex, y]);
    // The same node in both branches gets the whole gradient.
    let w2 = c.op(Op::Where, &[cond, y, y]);
    let s = c.binary(BinaryOp::Add, w, w2);
    // No gradient through i32 (x away from integers, so the truncation is locally flat),
    // bool, comparisons or one_hot.
    let xi = c.op(Op::Cast { to: DType::I32 }, &[x]);
    let xf = c.op(Op::Cast { to: DType::F32 }, &[xi]);
    let gt = c.op(Op::Compare(CmpOp::Gt), &[x, y]);
    let gtf = c.op(Op::Cast { to: DType::F32 }, &[gt]);
    let ids = c.ids("ids", &["b"], vec![2, 0]);
    let oh = c.op(Op::OneHot { depth: Dim::c(3) }, &[ids]);
    let same = c.op(Op::Cast { to: DType::F32 }, &[s]);
    let t = c.binary(BinaryOp::Add, same, xf);
    let t = c.binary(BinaryOp::Add, t, gtf);
    let t = c.binary(BinaryOp::Mul, t, oh);
    let f = c.objective(t);
    c.check(f);
}

#[test]
fn cast_between_float_types_casts_back() {
    let mut g = Graph::new("cast");
    let x = g
        .add_input("x", TensorType::new(DType::F32, Shape::consts(&[3])))
        .unwrap();
    let h = g.add(Op::Cast { to: DType::BF16 }, &[x], "").unwrap();
    let e = g.add(Op::Unary(UnaryOp::Exp), &[h], "").unwrap();
    let s = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axis: 0,
            },
            &[e],
            "",
        )
        .unwrap();
    let (gg, grads) = gradients(&g, s, &[x]).unwrap();
    gg.verify().unwrap();
    let gx = gg.node(grads[0]);
    assert_eq!(gx.op, Op::Cast { to: DType::F32 });
    assert_eq!(gg.ty(gx.inputs[0]).dtype, DType::BF16);
}

// ---------------------------------------------------------------------------------------
// Reductions.

#[test]
fn reductions_over_each_axis() {
    for op in [ReduceOp::Sum, ReduceOp::Max] {
        for axis in 0..3 {
            let mut c = Case::new(&[("b", 2)]);
            let x = c.var("x", &["b", "3", "4"]);
            let y = c.reduce(op, axis, x);
            let y = c.unary(UnaryOp::Sin, y);
            let f = c.objective(y);
            let g = c.check(f);
            if op == ReduceOp::Max {
                // One winner per reduced row.
                let nonzero = g[0].iter().filter(|v| **v != 0.0).count();
                assert_eq!(nonzero, 24 / [2, 3, 4][axis]);
            }
        }
    }
}

#[test]
fn reduce_max_splits_ties_evenly() {
    let mut c = Case::new(&[]);
    // Rows: a three-way tie, a two-way tie, a single maximum.
    let x = c.var_values(
        "x",
        &["3", "4"],
        vec![
            2.0, 2.0, -1.0, 2.0, 0.5, 1.5, 1.5, 0.0, -3.0, -1.0, -2.0, -4.0,
        ],
    );
    let y = c.reduce(ReduceOp::Max, 1, x);
    let f = c.objective(y);
    // Central differences agree with the even split only for two-way ties; check the
    // three-way row by hand.
    let g = c.check_except(f, &|_, e| e < 4);
    let r = c.inputs["r1"].to_f64_vec().unwrap();
    let expect = [
        r[0] / 3.0,
        r[0] / 3.0,
        0.0,
        r[0] / 3.0,
        0.0,
        r[1] / 2.0,
        r[1] / 2.0,
        0.0,
        0.0,
        r[2],
        0.0,
        0.0,
    ];
    for (e, (a, want)) in g[0].iter().zip(expect).enumerate() {
        assert!(close(*a, want), "element {e}: {a} vs {want}");
    }
}

// ---------------------------------------------------------------------------------------
// Matmul, gather, scatter_add, dropout.

#[test]
fn matmul_in_every_form() {
    // (a dims, b dims)
    let cases: &[(&[&str], &[&str])] = &[
        (&["2", "3"], &["3", "4"]),                     // plain
        (&["b", "2", "3"], &["b", "3", "4"]),           // batched
        (&["b", "h", "2", "3"], &["b", "h", "3", "2"]), // batched over two axes
        (&["b", "t", "3"], &["3", "4"]),                // shared matrix, symbolic batch
        (&["b", "h", "t", "3"], &["3", "2"]),           // shared over three leading dims
    ];
    for (ad, bd) in cases {
        let mut c = Case::new(&[("b", 2), ("h", 2), ("t", 3)]);
        let a = c.var("a", ad);
        let b = c.var("w", bd);
        let y = c.op(Op::MatMul, &[a, b]);
        let f = c.objective(y);
        c.check(f);
    }
    // A shared parameter matrix, and one operand on both sides (x @ xᵀ).
    let mut c = Case::new(&[("b", 2), ("t", 3)]);
    let x = c.var("x", &["b", "t", "3"]);
    let w = c.param("w", &[3, 3]);
    let xw = c.op(Op::MatMul, &[x, w]);
    let xt = c.transpose(x);
    let y = c.op(Op::MatMul, &[xw, xt]);
    let f = c.objective(y);
    c.check(f);
}

#[test]
fn gather_accumulates_repeated_ids() {
    let mut c = Case::new(&[("b", 2)]);
    let table = c.param("emb", &[5, 3]);
    let ids = c.ids("ids", &["b", "4"], vec![1, 3, 1, 0, 3, 3, 4, 1]);
    let y = c.op(Op::Gather, &[table, ids]);
    let f = c.objective(y);
    let g = c.check(f);
    // Row 2 is never looked up.
    assert!(g[0][6..9].iter().all(|v| *v == 0.0));

    // A rank-1 table.
    let mut c = Case::new(&[]);
    let table = c.var("t", &["4"]);
    let ids = c.ids("ids", &["6"], vec![0, 2, 2, 3, 0, 2]);
    let y = c.op(Op::Gather, &[table, ids]);
    let f = c.objective(y);
    c.check(f);
}

#[test]
fn scatter_add_gathers_back() {
    let mut c = Case::new(&[("b", 2)]);
    let ids = c.ids("ids", &["b", "3"], vec![0, 2, 0, 3, 3, 2]);
    let src = c.var("src", &["b", "3", "2"]);
    let y = c.op(Op::ScatterAdd { rows: Dim::c(5) }, &[ids, src]);
    let y = c.unary(UnaryOp::Sin, y);
    let f = c.objective(y);
    c.check(f);
}

#[test]
fn dropout_uses_the_forward_mask() {
    let mut c = Case::new(&[("b", 2)]);
    c.opts.seed = 1234;
    c.opts.step = 7;
    let x = c.var("x", &["b", "4", "5"]);
    let y = c.op(
        Op::Dropout {
            p: Float::new(0.4),
            stream: 3,
        },
        &[x],
    );
    let y = c.unary(UnaryOp::Exp, y);
    let f = c.objective(y);
    let g = c.check(f);
    let dropped = g[0].iter().filter(|v| **v == 0.0).count();
    assert!(dropped > 0 && dropped < 40, "{dropped} of 40 dropped");
}

// ---------------------------------------------------------------------------------------
// Accumulation, dead branches, entry points.

#[test]
fn a_reused_node_accumulates_every_use() {
    let mut c = Case::new(&[("b", 2)]);
    let x = c.var_in("x", &["b", "3"], 0.5, 1.5);
    let w = c.var("w", &["3"]);
    let wb = c.bcast(w, &["b", "3"]);
    let y = c.binary(BinaryOp::Mul, x, wb); // y = x * w
    let y2 = c.binary(BinaryOp::Mul, y, y);
    let e = c.unary(UnaryOp::Exp, y);
    let s = c.unary(UnaryOp::Sin, y);
    let l = c.unary(UnaryOp::Log, x);
    let t = c.binary(BinaryOp::Add, y2, e);
    let t = c.binary(BinaryOp::Sub, t, s);
    let t = c.binary(BinaryOp::Div, t, x);
    let t = c.binary(BinaryOp::Add, t, l);
    let t = c.binary(BinaryOp::Mul, t, y);
    let m = c.reduce(ReduceOp::Max, 1, t);
    let mb = c.bcast(m, &["b", "3"]);
    let t = c.binary(BinaryOp::Sub, t, mb);
    let f = c.objective(t);
    c.check(f);
}

#[test]
fn unused_variables_get_zeros() {
    let mut c = Case::new(&[("b", 2)]);
    let x = c.var("x", &["b", "3"]);
    let unused = c.var("u", &["b", "2"]);
    let w = c.param("w", &[3]);
    let dead = c.unary(UnaryOp::Exp, unused);
    let _dead_too = c.binary(BinaryOp::Mul, dead, dead);
    let wb = c.bcast(w, &["b", "3"]);
    let y = c.binary(BinaryOp::Mul, x, wb);
    let f = c.objective(y);
    let g = c.check(f);
    assert!(g[1].iter().all(|v| *v == 0.0));

    // Nothing is added for a dead branch: only the zeros of `u` beyond the live rules.
    let (gg, grads) = gradients(&c.g, f, &[unused]).unwrap();
    let zeros = gg.node(grads[0]);
    assert!(matches!(zeros.op, Op::Broadcast { .. }));
    assert!(gg.len() <= c.g.len() + 2);
}

#[test]
fn gradient_with_respect_to_an_intermediate_node() {
    let mut c = Case::new(&[]);
    let x = c.var("x", &["3"]);
    let two = c.g.add_const(2.0, DType::F32);
    let two = c.bcast(two, &["3"]);
    let y = c.binary(BinaryOp::Mul, x, two);
    let e = c.unary(UnaryOp::Exp, y);
    let f = c.objective(e);
    let (gg, grads) = gradients(&c.g, f, &[y, x, f]).unwrap();
    let v = c.eval(
        &gg,
        &c.inputs,
        &c.params,
        &[grads[0], grads[1], grads[2], y],
    );
    let r = c.inputs["r1"].to_f64_vec().unwrap();
    for i in 0..3 {
        let want = v[3][i].exp() * r[i];
        assert!(close(v[0][i], want));
        assert!(close(v[1][i], 2.0 * want));
    }
    assert_eq!(v[2], vec![1.0]);

    // A non-scalar loss is differentiated as the sum of its elements.
    let (gg, grads) = gradients(&c.g, e, &[x]).unwrap();
    gg.verify().unwrap();
    let v = c.eval(&gg, &c.inputs, &c.params, &[grads[0], y]);
    for (gx, yv) in v[0].iter().zip(&v[1]) {
        assert!(close(*gx, 2.0 * yv.exp()));
    }
}

#[test]
fn malformed_requests_are_errors() {
    let mut c = Case::new(&[]);
    let x = c.var("x", &["3"]);
    let ids = c.ids("ids", &["3"], vec![0, 1, 2]);
    let f = c.objective(x);
    let err = gradients(&c.g, f, &[ids]).unwrap_err();
    assert!(matches!(err, IrError::Type(_)), "{err}");
    let err = gradients(&c.g, ids, &[x]).unwrap_err();
    assert!(matches!(err, IrError::Type(_)), "{err}");
    let err = gradients(&c.g, NodeId(999), &[x]).unwrap_err();
    assert!(matches!(err, IrError::Malformed(_)), "{err}");
    let err = gradients(&c.g, f, &[NodeId(999)]).unwrap_err();
    assert!(matches!(err, IrError::Malformed(_)), "{err}");
    // A model without an objective has no train_step.
    assert!(train_step(&c.g).is_err());
    // Nor does one whose objective is not a scalar.
    let mut g = c.g.clone();
    g.add_output("loss", x).unwrap();
    g.objective = Some("loss".into());
    assert!(matches!(train_step(&g), Err(IrError::Type(_))));
}

/// A small model: two layers, one parameter the objective does not use, a forward output.
fn small_model() -> Graph {
    let mut g = Graph::new("small");
    g.add_dim("b");
    let x = g
        .add_input("x", TensorType::new(DType::F32, shape(&["b", "3"])))
        .unwrap();
    let unused_input = g
        .add_input("aux", TensorType::new(DType::F32, shape(&["b"])))
        .unwrap();
    let f32 = |d: &[i64]| TensorType::new(DType::F32, Shape::consts(d));
    let w1 = g
        .add_param("l1.w", f32(&[3, 4]), Init::XavierUniform, "l1")
        .unwrap();
    let b1 = g.add_param("l1.b", f32(&[4]), Init::Zeros, "l1").unwrap();
    let head = g
        .add_param("head.w", f32(&[4, 2]), Init::XavierUniform, "head")
        .unwrap();
    let w2 = g
        .add_param("l2.w", f32(&[4, 1]), Init::XavierUniform, "l2")
        .unwrap();
    let h = g.add(Op::MatMul, &[x, w1], "l1").unwrap();
    let bb = g
        .add(
            Op::Broadcast {
                shape: shape(&["b", "4"]),
            },
            &[b1],
            "l1",
        )
        .unwrap();
    let h = g.add(Op::Binary(BinaryOp::Add), &[h, bb], "l1").unwrap();
    let h = g.add(Op::Unary(UnaryOp::Relu), &[h], "l1").unwrap();
    let logits = g.add(Op::MatMul, &[h, head], "head").unwrap();
    let y = g.add(Op::MatMul, &[h, w2], "l2").unwrap();
    let y = g.add(Op::Binary(BinaryOp::Mul), &[y, y], "").unwrap();
    let y = g
        .add(
            Op::Reshape {
                shape: shape(&["b"]),
            },
            &[y],
            "",
        )
        .unwrap();
    let y = g
        .add(Op::Binary(BinaryOp::Add), &[y, unused_input], "")
        .unwrap();
    let y = g
        .add(
            Op::Reduce {
                op: ReduceOp::Sum,
                axis: 0,
            },
            &[y],
            "",
        )
        .unwrap();
    let loss = g
        .add(
            Op::Reshape {
                shape: Shape::scalar(),
            },
            &[y],
            "",
        )
        .unwrap();
    g.add_output("logits", logits).unwrap();
    g.add_output("loss", loss).unwrap();
    g.objective = Some("loss".into());
    g
}

#[test]
fn train_step_outputs_and_zero_gradients() {
    let model = small_model();
    let step = train_step(&model).unwrap();
    step.verify().unwrap();
    let names: Vec<&str> = step.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(
        names,
        ["loss", "grad.l1.w", "grad.l1.b", "grad.head.w", "grad.l2.w"]
    );
    assert_eq!(step.objective.as_deref(), Some("loss"));
    // The signature is the objective's: `head.w` is not a parameter of it.
    let params: Vec<&str> = step
        .params
        .iter()
        .map(|&p| step.source_name(p).unwrap())
        .collect();
    assert_eq!(params, ["l1.w", "l1.b", "l2.w"]);
    let inputs: Vec<&str> = step
        .inputs
        .iter()
        .map(|&p| step.source_name(p).unwrap())
        .collect();
    assert_eq!(inputs, ["x", "aux"]);
    assert_eq!(step.dims, ["b"]);
    // Deterministic.
    assert_eq!(
        print_graph(&step),
        print_graph(&train_step(&model).unwrap())
    );

    // Run it, and check the gradients against those `gradients` gives directly.
    let mut rng = Rng::new(42);
    let mut vals = |n: usize| (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect::<Vec<_>>();
    let inputs: BTreeMap<String, Tensor> = [
        ("x".to_string(), Tensor::f64(vec![3, 3], vals(9)).unwrap()),
        ("aux".to_string(), Tensor::f64(vec![3], vals(3)).unwrap()),
    ]
    .into();
    let params: BTreeMap<String, Tensor> = [
        ("l1.w", vec![3, 4]),
        ("l1.b", vec![4]),
        ("head.w", vec![4, 2]),
        ("l2.w", vec![4, 1]),
    ]
    .into_iter()
    .map(|(n, s)| {
        let k = s.iter().product();
        (n.to_string(), Tensor::f64(s, vals(k)).unwrap())
    })
    .collect();
    let opts = RunOptions {
        precision: Precision::F64,
        ..RunOptions::default()
    };
    let out = reference::run(&step, &inputs, &params, &opts).unwrap();
    let head = &out[3].1;
    assert_eq!(head.shape, [4, 2]);
    assert!(head.to_f64_vec().unwrap().iter().all(|v| *v == 0.0));
    let loss_graph = model.prune(&["loss".to_string()]).unwrap();
    let loss = loss_graph.output("loss").unwrap();
    let (gg, grads) = gradients(&loss_graph, loss, &loss_graph.params).unwrap();
    let direct = reference::run_nodes(&gg, &inputs, &params, &opts, &grads).unwrap();
    for (k, i) in [(0, 1), (1, 2), (2, 4)] {
        assert_eq!(direct[k], out[i].1);
    }
    let l = reference::run(&loss_graph, &inputs, &params, &opts).unwrap();
    assert_eq!(l[0].1, out[0].1);
}
