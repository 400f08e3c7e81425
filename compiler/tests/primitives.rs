//! Every primitive through the reference executor, against hand-computed values.
//!
//! In: tiny graphs built node by node. Out: pass/fail — each test states the exact values
//! it expects, worked out by hand (or, for transcendental functions, to 16 digits).

use std::collections::BTreeMap;

use kiln_compiler::ir::{BinaryOp, Float, Init, ReduceOp, UnaryOp};
use kiln_compiler::reference::{self, ExecError, Precision, RunOptions};
use kiln_compiler::rng;
use kiln_compiler::tensor::{Tensor, TensorData};
use kiln_compiler::{DType, Dim, Graph, NodeId, Op, Shape, TensorType};

// ---------------------------------------------------------------------------------------
// Helpers.

/// A shape from dims written as numbers or symbol names.
fn shape(dims: &[&str]) -> Shape {
    Shape(
        dims.iter()
            .map(|d| d.parse::<i64>().map(Dim::c).unwrap_or_else(|_| Dim::sym(d)))
            .collect(),
    )
}

fn ty(dtype: DType, dims: &[&str]) -> TensorType {
    TensorType::new(dtype, shape(dims))
}

fn f32t(shape: &[usize], v: &[f32]) -> Tensor {
    Tensor::f32(shape.to_vec(), v.to_vec()).unwrap()
}

fn i32t(shape: &[usize], v: &[i32]) -> Tensor {
    Tensor::i32(shape.to_vec(), v.to_vec()).unwrap()
}

fn boolt(shape: &[usize], v: &[bool]) -> Tensor {
    Tensor::bool(shape.to_vec(), v.to_vec()).unwrap()
}

fn map(list: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
    list.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

fn try_run(
    g: &Graph,
    inputs: Vec<(&str, Tensor)>,
    params: Vec<(&str, Tensor)>,
    opts: RunOptions,
) -> Result<BTreeMap<String, Tensor>, ExecError> {
    Ok(reference::run(g, &map(inputs), &map(params), &opts)?
        .into_iter()
        .collect())
}

/// Runs in f32 with no parameters and default options.
fn run(g: &Graph, inputs: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
    try_run(g, inputs, vec![], RunOptions::default()).unwrap()
}

fn run_f64(g: &Graph, inputs: Vec<(&str, Tensor)>) -> BTreeMap<String, Tensor> {
    let opts = RunOptions {
        precision: Precision::F64,
        ..RunOptions::default()
    };
    try_run(g, inputs, vec![], opts).unwrap()
}

fn err_text(r: Result<BTreeMap<String, Tensor>, ExecError>) -> String {
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e.to_string(),
    }
}

fn assert_contains(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "`{p}` missing from: {msg}");
    }
}

fn f32s(t: &Tensor) -> &[f32] {
    t.as_f32()
        .unwrap_or_else(|| panic!("expected f32, got {}", t.dtype_name()))
}

fn f64s(t: &Tensor) -> &[f64] {
    t.as_f64()
        .unwrap_or_else(|| panic!("expected f64, got {}", t.dtype_name()))
}

fn assert_close(got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(g) - w).abs() <= tol,
            "element {i}: got {g}, want {w} (all: {got:?})"
        );
    }
}

fn assert_close64(got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol,
            "element {i}: got {g}, want {w} (all: {got:?})"
        );
    }
}

fn input(g: &mut Graph, name: &str, dtype: DType, dims: &[&str]) -> NodeId {
    for d in dims {
        if d.parse::<i64>().is_err() {
            g.add_dim(d);
        }
    }
    g.add_input(name, ty(dtype, dims)).unwrap()
}

fn op(g: &mut Graph, op: Op, args: &[NodeId]) -> NodeId {
    g.add(op, args, "").unwrap()
}

fn out(g: &mut Graph, name: &str, id: NodeId) {
    g.add_output(name, id).unwrap();
}

// ---------------------------------------------------------------------------------------
// Sources and views.

#[test]
fn const_of_each_dtype() {
    let mut g = Graph::new("t");
    let f = g.add_const(2.5, DType::F32);
    let i = g.add_const(-3.0, DType::I32);
    let b = g.add_const(1.0, DType::Bool);
    out(&mut g, "f", f);
    out(&mut g, "i", i);
    out(&mut g, "b", b);
    let r = run(&g, vec![]);
    assert_eq!(r["f"].shape, Vec::<usize>::new());
    assert_eq!(f32s(&r["f"]), &[2.5]);
    assert_eq!(r["i"].as_i32(), Some(&[-3][..]));
    assert_eq!(r["b"].as_bool(), Some(&[true][..]));
    assert_eq!(f64s(&run_f64(&g, vec![])["f"]), &[2.5]);
}

#[test]
fn params_are_read_by_name() {
    let mut g = Graph::new("t");
    let w = g
        .add_param("lin.w", ty(DType::F32, &["2"]), Init::Zeros, "lin")
        .unwrap();
    out(&mut g, "w", w);
    let params = vec![
        ("lin.w", f32t(&[2], &[0.5, -1.0])),
        ("unused", f32t(&[1], &[9.0])),
    ];
    let r = try_run(&g, vec![], params, RunOptions::default()).unwrap();
    assert_eq!(f32s(&r["w"]), &[0.5, -1.0]);
}

#[test]
fn reshape_is_row_major() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "3"]);
    let y = op(
        &mut g,
        Op::Reshape {
            shape: shape(&["3", "2"]),
        },
        &[x],
    );
    let z = op(
        &mut g,
        Op::Reshape {
            shape: shape(&["6"]),
        },
        &[x],
    );
    out(&mut g, "y", y);
    out(&mut g, "z", z);
    let r = run(&g, vec![("x", f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.]))]);
    assert_eq!(r["y"].shape, vec![3, 2]);
    assert_eq!(f32s(&r["y"]), &[1., 2., 3., 4., 5., 6.]);
    assert_eq!(r["z"].shape, vec![6]);

    // A symbolic reshape: [b, s, 2] -> [b*s, 2].
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::I32, &["b", "s", "2"]);
    let bs = Dim::sym("b").mul(&Dim::sym("s"));
    let y = op(
        &mut g,
        Op::Reshape {
            shape: Shape(vec![bs, Dim::c(2)]),
        },
        &[x],
    );
    out(&mut g, "y", y);
    let v: Vec<i32> = (0..12).collect();
    let r = run(&g, vec![("x", i32t(&[2, 3, 2], &v))]);
    assert_eq!(r["y"].shape, vec![6, 2]);
    assert_eq!(r["y"].as_i32().unwrap(), &v[..]);
}

#[test]
fn permute_of_a_2x3x4_tensor() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "3", "4"]);
    let y = op(
        &mut g,
        Op::Permute {
            perm: vec![2, 0, 1],
        },
        &[x],
    );
    out(&mut g, "y", y);
    // x[a][b][c] = 100a + 10b + c, so every element says where it came from.
    let mut v = Vec::new();
    for a in 0..2 {
        for b in 0..3 {
            for c in 0..4 {
                v.push((100 * a + 10 * b + c) as f32);
            }
        }
    }
    let r = run(&g, vec![("x", f32t(&[2, 3, 4], &v))]);
    // Output axis i is input axis perm[i]: y[c][a][b] = x[a][b][c].
    assert_eq!(r["y"].shape, vec![4, 2, 3]);
    let y = f32s(&r["y"]);
    for c in 0..4 {
        for a in 0..2 {
            for b in 0..3 {
                assert_eq!(y[c * 6 + a * 3 + b], (100 * a + 10 * b + c) as f32);
            }
        }
    }
    // The first row by hand: y[0][0][..] = x[0][0..3][0] = 0, 10, 20; y[1][1][..] = 101, 111, 121.
    assert_eq!(&y[0..3], &[0., 10., 20.]);
    assert_eq!(&y[9..12], &[101., 111., 121.]);
}

#[test]
fn broadcast_right_aligned() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["3"]);
    let c = input(&mut g, "c", DType::F32, &["2", "1"]);
    let bx = op(
        &mut g,
        Op::Broadcast {
            shape: shape(&["2", "3"]),
        },
        &[x],
    );
    let bc = op(
        &mut g,
        Op::Broadcast {
            shape: shape(&["2", "3"]),
        },
        &[c],
    );
    let s = g.add_const(7.0, DType::F32);
    let bs = op(
        &mut g,
        Op::Broadcast {
            shape: shape(&["2", "2"]),
        },
        &[s],
    );
    out(&mut g, "bx", bx);
    out(&mut g, "bc", bc);
    out(&mut g, "bs", bs);
    let r = run(
        &g,
        vec![
            ("x", f32t(&[3], &[1., 2., 3.])),
            ("c", f32t(&[2, 1], &[10., 20.])),
        ],
    );
    assert_eq!(r["bx"].shape, vec![2, 3]);
    assert_eq!(f32s(&r["bx"]), &[1., 2., 3., 1., 2., 3.]);
    assert_eq!(f32s(&r["bc"]), &[10., 10., 10., 20., 20., 20.]);
    assert_eq!(f32s(&r["bs"]), &[7., 7., 7., 7.]);
}

// ---------------------------------------------------------------------------------------
// Elementwise.

#[test]
fn unary_float_ops() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["4"]);
    let p = input(&mut g, "p", DType::F32, &["3"]);
    let e = input(&mut g, "e", DType::F32, &["3"]);
    let a = input(&mut g, "a", DType::F32, &["3"]);
    let ops = [
        ("neg", UnaryOp::Neg, x),
        ("relu", UnaryOp::Relu, x),
        ("sqrt", UnaryOp::Sqrt, p),
        ("recip", UnaryOp::Recip, p),
        ("log", UnaryOp::Log, p),
        ("exp", UnaryOp::Exp, e),
        ("sin", UnaryOp::Sin, a),
        ("cos", UnaryOp::Cos, a),
        ("tanh", UnaryOp::Tanh, x),
        ("sigmoid", UnaryOp::Sigmoid, x),
        ("erf", UnaryOp::Erf, x),
        ("rsqrt", UnaryOp::Rsqrt, p),
        ("silu", UnaryOp::Silu, x),
    ];
    for (name, u, arg) in ops {
        let id = op(&mut g, Op::Unary(u), &[arg]);
        out(&mut g, name, id);
    }
    let inputs = || {
        vec![
            ("x", f32t(&[4], &[-1.5, 0.5, 1.0, -0.0])),
            ("p", f32t(&[3], &[0.25, 1.0, 4.0])),
            ("e", f32t(&[3], &[0.0, 1.0, -1.0])),
            ("a", f32t(&[3], &[0.0, 1.0, 2.0])),
        ]
    };
    let expected: [(&str, Vec<f64>); 13] = [
        ("neg", vec![1.5, -0.5, -1.0, 0.0]),
        ("relu", vec![0.0, 0.5, 1.0, 0.0]),
        ("sqrt", vec![0.5, 1.0, 2.0]),
        ("recip", vec![4.0, 1.0, 0.25]),
        ("log", vec![-1.3862943611198906, 0.0, 1.3862943611198906]),
        ("exp", vec![1.0, std::f64::consts::E, 0.36787944117144233]),
        ("sin", vec![0.0, 0.8414709848078965, 0.9092974268256817]),
        ("cos", vec![1.0, 0.5403023058681398, -0.4161468365471424]),
        (
            "tanh",
            vec![
                -0.9051482536448664,
                0.46211715726000974,
                0.7615941559557649,
                -0.0,
            ],
        ),
        (
            "sigmoid",
            vec![
                0.18242552380635635,
                0.6224593312018546,
                0.7310585786300049,
                0.5,
            ],
        ),
        (
            "erf",
            vec![
                -0.9661051464753108,
                0.5204998778130465,
                0.8427007929497149,
                -0.0,
            ],
        ),
        ("rsqrt", vec![2.0, 1.0, 0.5]),
        (
            "silu",
            vec![
                -0.2736382857095345,
                0.3112296656009273,
                0.7310585786300049,
                -0.0,
            ],
        ),
    ];
    let r = run(&g, inputs());
    let r64 = run_f64(&g, inputs());
    for (name, want) in &expected {
        assert_close(f32s(&r[*name]), want, 1e-6);
        assert_close64(f64s(&r64[*name]), want, 1e-15);
    }
}

#[test]
fn binary_float_ops() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "2"]);
    let y = input(&mut g, "y", DType::F32, &["2", "2"]);
    for (name, b) in [
        ("add", BinaryOp::Add),
        ("sub", BinaryOp::Sub),
        ("mul", BinaryOp::Mul),
        ("div", BinaryOp::Div),
        ("max", BinaryOp::Max),
    ] {
        let id = op(&mut g, Op::Binary(b), &[x, y]);
        out(&mut g, name, id);
    }
    let r = run(
        &g,
        vec![
            ("x", f32t(&[2, 2], &[1.0, -2.0, 3.0, 8.0])),
            ("y", f32t(&[2, 2], &[4.0, 0.5, -1.0, 8.0])),
        ],
    );
    assert_eq!(f32s(&r["add"]), &[5.0, -1.5, 2.0, 16.0]);
    assert_eq!(f32s(&r["sub"]), &[-3.0, -2.5, 4.0, 0.0]);
    assert_eq!(f32s(&r["mul"]), &[4.0, -1.0, -3.0, 64.0]);
    assert_eq!(f32s(&r["div"]), &[0.25, -4.0, -3.0, 1.0]);
    assert_eq!(f32s(&r["max"]), &[4.0, 0.5, 3.0, 8.0]);
    assert_eq!(r["max"].shape, vec![2, 2]);
}

#[test]
fn max_propagates_nan() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2"]);
    let y = input(&mut g, "y", DType::F32, &["2"]);
    let m = op(&mut g, Op::Binary(BinaryOp::Max), &[x, y]);
    let rm = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Max,
            axis: 0,
        },
        &[x],
    );
    out(&mut g, "m", m);
    out(&mut g, "rm", rm);
    let r = run(
        &g,
        vec![
            ("x", f32t(&[2], &[f32::NAN, 1.0])),
            ("y", f32t(&[2], &[0.0, f32::NAN])),
        ],
    );
    assert!(f32s(&r["m"]).iter().all(|v| v.is_nan()));
    assert!(f32s(&r["rm"])[0].is_nan());
}

#[test]
fn i32_arithmetic() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::I32, &["3"]);
    let y = input(&mut g, "y", DType::I32, &["3"]);
    for (name, b) in [
        ("add", BinaryOp::Add),
        ("sub", BinaryOp::Sub),
        ("mul", BinaryOp::Mul),
        ("max", BinaryOp::Max),
    ] {
        let id = op(&mut g, Op::Binary(b), &[x, y]);
        out(&mut g, name, id);
    }
    let n = op(&mut g, Op::Unary(UnaryOp::Neg), &[x]);
    let r = op(&mut g, Op::Unary(UnaryOp::Relu), &[x]);
    let s = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 0,
        },
        &[x],
    );
    out(&mut g, "neg", n);
    out(&mut g, "relu", r);
    out(&mut g, "sum", s);
    let res = run(
        &g,
        vec![
            ("x", i32t(&[3], &[2, -7, 5])),
            ("y", i32t(&[3], &[3, 4, -5])),
        ],
    );
    assert_eq!(res["add"].as_i32().unwrap(), &[5, -3, 0]);
    assert_eq!(res["sub"].as_i32().unwrap(), &[-1, -11, 10]);
    assert_eq!(res["mul"].as_i32().unwrap(), &[6, -28, -25]);
    assert_eq!(res["max"].as_i32().unwrap(), &[3, 4, 5]);
    assert_eq!(res["neg"].as_i32().unwrap(), &[-2, 7, -5]);
    assert_eq!(res["relu"].as_i32().unwrap(), &[2, 0, 5]);
    assert_eq!(res["sum"].as_i32().unwrap(), &[0]);
    // i32 results stay i32 in the f64 path too.
    assert_eq!(
        run_f64(
            &g,
            vec![
                ("x", i32t(&[3], &[2, -7, 5])),
                ("y", i32t(&[3], &[3, 4, -5]))
            ]
        )["add"]
            .as_i32()
            .unwrap(),
        &[5, -3, 0]
    );
}

#[test]
fn where_selects() {
    let mut g = Graph::new("t");
    let c = input(&mut g, "c", DType::Bool, &["3"]);
    let a = input(&mut g, "a", DType::F32, &["3"]);
    let b = input(&mut g, "b", DType::F32, &["3"]);
    let w = op(&mut g, Op::Where, &[c, a, b]);
    out(&mut g, "w", w);
    let r = run(
        &g,
        vec![
            ("c", boolt(&[3], &[true, false, true])),
            ("a", f32t(&[3], &[1., 2., 3.])),
            ("b", f32t(&[3], &[10., 20., 30.])),
        ],
    );
    assert_eq!(f32s(&r["w"]), &[1., 20., 3.]);
}

#[test]
fn cast_between_dtypes() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["5"]);
    let b = input(&mut g, "b", DType::Bool, &["2"]);
    let i = input(&mut g, "i", DType::I32, &["3"]);
    let casts = [
        ("f_i", DType::I32, x),
        ("f_b", DType::Bool, x),
        ("f_f", DType::F32, x),
        ("b_f", DType::F32, b),
        ("b_i", DType::I32, b),
        ("i_f", DType::F32, i),
        ("i_b", DType::Bool, i),
    ];
    for (name, to, arg) in casts {
        let id = op(&mut g, Op::Cast { to }, &[arg]);
        out(&mut g, name, id);
    }
    let r = run(
        &g,
        vec![
            ("x", f32t(&[5], &[1.7, -1.7, 0.0, 2.5, -0.0])),
            ("b", boolt(&[2], &[true, false])),
            ("i", i32t(&[3], &[-2, 0, 7])),
        ],
    );
    // float -> i32 truncates toward zero.
    assert_eq!(r["f_i"].as_i32().unwrap(), &[1, -1, 0, 2, 0]);
    assert_eq!(
        r["f_b"].as_bool().unwrap(),
        &[true, true, false, true, false]
    );
    assert_eq!(f32s(&r["f_f"]), &[1.7, -1.7, 0.0, 2.5, -0.0]);
    assert_eq!(f32s(&r["b_f"]), &[1.0, 0.0]);
    assert_eq!(r["b_i"].as_i32().unwrap(), &[1, 0]);
    assert_eq!(f32s(&r["i_f"]), &[-2.0, 0.0, 7.0]);
    assert_eq!(r["i_b"].as_bool().unwrap(), &[true, false, true]);
}

// ---------------------------------------------------------------------------------------
// Reductions and matmul.

#[test]
fn reduce_over_each_axis() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "3"]);
    for (name, r, axis) in [
        ("sum0", ReduceOp::Sum, 0),
        ("sum1", ReduceOp::Sum, 1),
        ("max0", ReduceOp::Max, 0),
        ("max1", ReduceOp::Max, 1),
    ] {
        let id = op(&mut g, Op::Reduce { op: r, axis }, &[x]);
        out(&mut g, name, id);
    }
    // [[1, 5, 3], [4, 2, 6]]
    let xs = f32t(&[2, 3], &[1., 5., 3., 4., 2., 6.]);
    let r = run(&g, vec![("x", xs.clone())]);
    assert_eq!(r["sum0"].shape, vec![1, 3]);
    assert_eq!(f32s(&r["sum0"]), &[5., 7., 9.]);
    assert_eq!(r["sum1"].shape, vec![2, 1]);
    assert_eq!(f32s(&r["sum1"]), &[9., 12.]);
    assert_eq!(f32s(&r["max0"]), &[4., 5., 6.]);
    assert_eq!(f32s(&r["max1"]), &[5., 6.]);
    let r64 = run_f64(&g, vec![("x", xs)]);
    assert_eq!(f64s(&r64["sum1"]), &[9., 12.]);

    // The middle axis of a [2, 2, 2] tensor.
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "2", "2"]);
    let s = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 1,
        },
        &[x],
    );
    out(&mut g, "s", s);
    // x[a][b][c] = a*4 + b*2 + c; summing b gives [[2, 4], [10, 12]].
    let r = run(
        &g,
        vec![("x", f32t(&[2, 2, 2], &[0., 1., 2., 3., 4., 5., 6., 7.]))],
    );
    assert_eq!(r["s"].shape, vec![2, 1, 2]);
    assert_eq!(f32s(&r["s"]), &[2., 4., 10., 12.]);
}

#[test]
fn matmul_2x3_by_3x2() {
    let mut g = Graph::new("t");
    let a = input(&mut g, "a", DType::F32, &["2", "3"]);
    let b = input(&mut g, "b", DType::F32, &["3", "2"]);
    let c = op(&mut g, Op::MatMul, &[a, b]);
    out(&mut g, "c", c);
    let inputs = || {
        vec![
            ("a", f32t(&[2, 3], &[1., 2., 3., 4., 5., 6.])),
            ("b", f32t(&[3, 2], &[7., 8., 9., 10., 11., 12.])),
        ]
    };
    // [1*7+2*9+3*11, 1*8+2*10+3*12; 4*7+5*9+6*11, 4*8+5*10+6*12]
    let r = run(&g, inputs());
    assert_eq!(r["c"].shape, vec![2, 2]);
    assert_eq!(f32s(&r["c"]), &[58., 64., 139., 154.]);
    assert_eq!(f64s(&run_f64(&g, inputs())["c"]), &[58., 64., 139., 154.]);
}

#[test]
fn matmul_batched_and_shared_weight() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "1", "2"]);
    let y = input(&mut g, "y", DType::F32, &["2", "2", "1"]);
    let w = input(&mut g, "w", DType::F32, &["2", "2"]);
    let xy = op(&mut g, Op::MatMul, &[x, y]);
    let xw = op(&mut g, Op::MatMul, &[x, w]);
    out(&mut g, "xy", xy);
    out(&mut g, "xw", xw);
    let r = run(
        &g,
        vec![
            ("x", f32t(&[2, 1, 2], &[1., 2., 3., 4.])),
            ("y", f32t(&[2, 2, 1], &[5., 6., 7., 8.])),
            ("w", f32t(&[2, 2], &[1., 0., 1., 1.])),
        ],
    );
    // batch 0: [1 2]·[5 6]^T = 17; batch 1: [3 4]·[7 8]^T = 53.
    assert_eq!(r["xy"].shape, vec![2, 1, 1]);
    assert_eq!(f32s(&r["xy"]), &[17., 53.]);
    // [1 2]·[[1 0],[1 1]] = [3 2]; [3 4]·W = [7 4].
    assert_eq!(r["xw"].shape, vec![2, 1, 2]);
    assert_eq!(f32s(&r["xw"]), &[3., 2., 7., 4.]);
}

#[test]
fn softmax_of_1_2_3_in_both_precisions() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["3"]);
    let m = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Max,
            axis: 0,
        },
        &[x],
    );
    let mb = op(
        &mut g,
        Op::Broadcast {
            shape: shape(&["3"]),
        },
        &[m],
    );
    let d = op(&mut g, Op::Binary(BinaryOp::Sub), &[x, mb]);
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[d]);
    let s = op(
        &mut g,
        Op::Reduce {
            op: ReduceOp::Sum,
            axis: 0,
        },
        &[e],
    );
    let sb = op(
        &mut g,
        Op::Broadcast {
            shape: shape(&["3"]),
        },
        &[s],
    );
    let p = op(&mut g, Op::Binary(BinaryOp::Div), &[e, sb]);
    out(&mut g, "p", p);
    let want = [0.09003057317038046, 0.24472847105479767, 0.6652409557748219];
    let xs = || vec![("x", f32t(&[3], &[1., 2., 3.]))];
    assert_close(f32s(&run(&g, xs())["p"]), &want, 1e-7);
    assert_close64(f64s(&run_f64(&g, xs())["p"]), &want, 1e-15);
    // An f64 input is accepted too.
    let r = run_f64(
        &g,
        vec![("x", Tensor::f64(vec![3], vec![1., 2., 3.]).unwrap())],
    );
    assert_close64(f64s(&r["p"]), &want, 1e-15);
}

// ---------------------------------------------------------------------------------------
// Indexing.

#[test]
fn gather_with_repeated_ids() {
    let mut g = Graph::new("t");
    let table = input(&mut g, "table", DType::F32, &["4", "2"]);
    let ids = input(&mut g, "ids", DType::I32, &["2", "2"]);
    let y = g.add(Op::Gather, &[table, ids], "emb").unwrap();
    out(&mut g, "y", y);
    let r = run(
        &g,
        vec![
            (
                "table",
                f32t(&[4, 2], &[0., 1., 10., 11., 20., 21., 30., 31.]),
            ),
            ("ids", i32t(&[2, 2], &[3, 0, 3, 1])),
        ],
    );
    assert_eq!(r["y"].shape, vec![2, 2, 2]);
    assert_eq!(f32s(&r["y"]), &[30., 31., 0., 1., 30., 31., 10., 11.]);
}

#[test]
fn gather_out_of_range_is_an_error() {
    let mut g = Graph::new("t");
    let table = input(&mut g, "table", DType::F32, &["4", "2"]);
    let ids = input(&mut g, "ids", DType::I32, &["3"]);
    let y = g.add(Op::Gather, &[table, ids], "emb").unwrap();
    out(&mut g, "y", y);
    let table_t = f32t(&[4, 2], &[0.; 8]);
    for bad in [4, -1] {
        let msg = err_text(try_run(
            &g,
            vec![
                ("table", table_t.clone()),
                ("ids", i32t(&[3], &[0, bad, 1])),
            ],
            vec![],
            RunOptions::default(),
        ));
        assert_contains(
            &msg,
            &[
                &format!("{y} gather in scope `emb`"),
                &format!("id {bad}"),
                "0..4",
            ],
        );
    }
}

#[test]
fn scatter_add_accumulates_duplicates() {
    let mut g = Graph::new("t");
    let ids = input(&mut g, "ids", DType::I32, &["3"]);
    let src = input(&mut g, "src", DType::F32, &["3", "2"]);
    let y = op(&mut g, Op::ScatterAdd { rows: Dim::c(3) }, &[ids, src]);
    out(&mut g, "y", y);
    let inputs = |ids: &[i32]| {
        vec![
            ("ids", i32t(&[3], ids)),
            ("src", f32t(&[3, 2], &[1., 2., 3., 4., 5., 6.])),
        ]
    };
    // Row 1 gets [1,2] + [5,6]; row 0 gets [3,4]; row 2 stays zero.
    let r = run(&g, inputs(&[1, 0, 1]));
    assert_eq!(r["y"].shape, vec![3, 2]);
    assert_eq!(f32s(&r["y"]), &[3., 4., 6., 8., 0., 0.]);
    let msg = err_text(try_run(
        &g,
        inputs(&[1, 3, 0]),
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["scatter_add", "id 3", "0..3"]);
}

#[test]
fn one_hot_and_its_range() {
    let mut g = Graph::new("t");
    let ids = input(&mut g, "ids", DType::I32, &["2"]);
    let y = op(&mut g, Op::OneHot { depth: Dim::c(3) }, &[ids]);
    out(&mut g, "y", y);
    let r = run(&g, vec![("ids", i32t(&[2], &[2, 0]))]);
    assert_eq!(r["y"].shape, vec![2, 3]);
    assert_eq!(f32s(&r["y"]), &[0., 0., 1., 1., 0., 0.]);
    assert_eq!(
        f64s(&run_f64(&g, vec![("ids", i32t(&[2], &[2, 0]))])["y"]),
        &[0., 0., 1., 1., 0., 0.]
    );
    let msg = err_text(try_run(
        &g,
        vec![("ids", i32t(&[2], &[3, 0]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["one_hot", "id 3", "0..3"]);
}

#[test]
fn concat_on_axis_0_and_1() {
    let mut g = Graph::new("t");
    let a = input(&mut g, "a", DType::F32, &["2", "2"]);
    let b = input(&mut g, "b", DType::F32, &["1", "2"]);
    let c = input(&mut g, "c", DType::F32, &["2", "1"]);
    let ab = op(&mut g, Op::Concat { axis: 0 }, &[a, b]);
    let ac = op(&mut g, Op::Concat { axis: 1 }, &[a, c]);
    let aca = op(&mut g, Op::Concat { axis: 1 }, &[a, c, a]);
    out(&mut g, "ab", ab);
    out(&mut g, "ac", ac);
    out(&mut g, "aca", aca);
    let r = run(
        &g,
        vec![
            ("a", f32t(&[2, 2], &[1., 2., 3., 4.])),
            ("b", f32t(&[1, 2], &[5., 6.])),
            ("c", f32t(&[2, 1], &[7., 8.])),
        ],
    );
    assert_eq!(r["ab"].shape, vec![3, 2]);
    assert_eq!(f32s(&r["ab"]), &[1., 2., 3., 4., 5., 6.]);
    assert_eq!(r["ac"].shape, vec![2, 3]);
    assert_eq!(f32s(&r["ac"]), &[1., 2., 7., 3., 4., 8.]);
    assert_eq!(f32s(&r["aca"]), &[1., 2., 7., 1., 2., 3., 4., 8., 3., 4.]);

    // A growing cache: [t, 2] ++ [1, 2] -> [t + 1, 2], i32 values.
    let mut g = Graph::new("t");
    let k = input(&mut g, "k", DType::I32, &["t", "2"]);
    let n = input(&mut g, "n", DType::I32, &["1", "2"]);
    let kn = op(&mut g, Op::Concat { axis: 0 }, &[k, n]);
    out(&mut g, "kn", kn);
    let r = run(
        &g,
        vec![
            ("k", i32t(&[2, 2], &[1, 2, 3, 4])),
            ("n", i32t(&[1, 2], &[5, 6])),
        ],
    );
    assert_eq!(r["kn"].shape, vec![3, 2]);
    assert_eq!(r["kn"].as_i32().unwrap(), &[1, 2, 3, 4, 5, 6]);
}

// ---------------------------------------------------------------------------------------
// Masks, arange, dropout.

#[test]
fn causal_mask_with_offset() {
    let mut g = Graph::new("t");
    let m = op(
        &mut g,
        Op::CausalMask {
            q: Dim::c(2),
            k: Dim::c(3),
        },
        &[],
    );
    let sq = op(
        &mut g,
        Op::CausalMask {
            q: Dim::c(3),
            k: Dim::c(3),
        },
        &[],
    );
    out(&mut g, "m", m);
    out(&mut g, "sq", sq);
    let r = run(&g, vec![]);
    // k - q = 1: query 0 sees keys 0..=1, query 1 sees keys 0..=2.
    assert_eq!(r["m"].shape, vec![2, 3]);
    assert_eq!(
        r["m"].as_bool().unwrap(),
        &[true, true, false, true, true, true]
    );
    assert_eq!(
        r["sq"].as_bool().unwrap(),
        &[true, false, false, true, true, false, true, true, true]
    );

    // Symbolic sizes come from an input's shape.
    let mut g = Graph::new("t");
    let _x = input(&mut g, "x", DType::F32, &["t"]);
    let m = op(
        &mut g,
        Op::CausalMask {
            q: Dim::sym("t"),
            k: Dim::sym("t"),
        },
        &[],
    );
    out(&mut g, "m", m);
    let r = run(&g, vec![("x", f32t(&[2], &[0., 0.]))]);
    assert_eq!(r["m"].shape, vec![2, 2]);
    assert_eq!(r["m"].as_bool().unwrap(), &[true, false, true, true]);
}

#[test]
fn pad_mask() {
    let mut g = Graph::new("t");
    let ids = input(&mut g, "ids", DType::I32, &["2", "3"]);
    let m = op(&mut g, Op::PadMask { pad: 0 }, &[ids]);
    out(&mut g, "m", m);
    let r = run(&g, vec![("ids", i32t(&[2, 3], &[5, 7, 0, 0, 1, 0]))]);
    assert_eq!(r["m"].shape, vec![2, 3]);
    assert_eq!(
        r["m"].as_bool().unwrap(),
        &[true, true, false, false, true, false]
    );
}

#[test]
fn arange() {
    let mut g = Graph::new("t");
    let a = op(
        &mut g,
        Op::Arange {
            start: Dim::c(0),
            len: Dim::c(5),
        },
        &[],
    );
    out(&mut g, "a", a);
    let _x = input(&mut g, "x", DType::Bool, &["n"]);
    let b = op(
        &mut g,
        Op::Arange {
            start: Dim::c(0),
            len: Dim::sym("n").add(&Dim::c(1)),
        },
        &[],
    );
    out(&mut g, "b", b);
    // A symbolic start: positions of new tokens after a cache of n.
    let c = op(
        &mut g,
        Op::Arange {
            start: Dim::sym("n"),
            len: Dim::c(2),
        },
        &[],
    );
    out(&mut g, "c", c);
    let r = run(&g, vec![("x", boolt(&[2], &[true, true]))]);
    assert_eq!(r["a"].as_i32().unwrap(), &[0, 1, 2, 3, 4]);
    assert_eq!(r["b"].as_i32().unwrap(), &[0, 1, 2]);
    assert_eq!(r["c"].as_i32().unwrap(), &[2, 3]);
}

#[test]
fn compare_floats_and_ints() {
    use kiln_compiler::ir::CmpOp;
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["4"]);
    let y = input(&mut g, "y", DType::F32, &["4"]);
    let i = input(&mut g, "i", DType::I32, &["4"]);
    let j = input(&mut g, "j", DType::I32, &["4"]);
    for (name, c) in [
        ("eq", CmpOp::Eq),
        ("ne", CmpOp::Ne),
        ("lt", CmpOp::Lt),
        ("le", CmpOp::Le),
        ("gt", CmpOp::Gt),
        ("ge", CmpOp::Ge),
    ] {
        let f = op(&mut g, Op::Compare(c), &[x, y]);
        out(&mut g, &format!("f_{name}"), f);
        let n = op(&mut g, Op::Compare(c), &[i, j]);
        out(&mut g, &format!("i_{name}"), n);
    }
    let r = run(
        &g,
        vec![
            ("x", f32t(&[4], &[1.0, 2.0, 3.0, f32::NAN])),
            ("y", f32t(&[4], &[2.0, 2.0, 1.0, 0.0])),
            ("i", i32t(&[4], &[-1, 5, 7, 0])),
            ("j", i32t(&[4], &[0, 5, 6, 0])),
        ],
    );
    let b = |k: &str| r[k].as_bool().unwrap().to_vec();
    // NaN compares false except with !=.
    assert_eq!(b("f_eq"), [false, true, false, false]);
    assert_eq!(b("f_ne"), [true, false, true, true]);
    assert_eq!(b("f_lt"), [true, false, false, false]);
    assert_eq!(b("f_le"), [true, true, false, false]);
    assert_eq!(b("f_gt"), [false, false, true, false]);
    assert_eq!(b("f_ge"), [false, true, true, false]);
    assert_eq!(b("i_eq"), [false, true, false, true]);
    assert_eq!(b("i_lt"), [true, false, false, false]);
    assert_eq!(b("i_ge"), [false, true, true, true]);
}

#[test]
fn slice_along_each_axis() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2", "3", "2"]);
    let s0 = op(
        &mut g,
        Op::Slice {
            axis: 0,
            start: Dim::c(1),
            len: Dim::c(1),
        },
        &[x],
    );
    let s1 = op(
        &mut g,
        Op::Slice {
            axis: 1,
            start: Dim::c(1),
            len: Dim::c(2),
        },
        &[x],
    );
    let s2 = op(
        &mut g,
        Op::Slice {
            axis: 2,
            start: Dim::c(0),
            len: Dim::c(1),
        },
        &[x],
    );
    out(&mut g, "s0", s0);
    out(&mut g, "s1", s1);
    out(&mut g, "s2", s2);
    let v: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let r = run(&g, vec![("x", f32t(&[2, 3, 2], &v))]);
    // x[b][r][c] = 6b + 2r + c.
    assert_eq!(f32s(&r["s0"]), &[6.0, 7.0, 8.0, 9.0, 10.0, 11.0]);
    assert_eq!(r["s1"].shape, vec![2, 2, 2]);
    assert_eq!(f32s(&r["s1"]), &[2.0, 3.0, 4.0, 5.0, 8.0, 9.0, 10.0, 11.0]);
    assert_eq!(f32s(&r["s2"]), &[0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
    // A slice past the end is caught when the graph is built.
    let bad = g.add(
        Op::Slice {
            axis: 1,
            start: Dim::c(2),
            len: Dim::c(2),
        },
        &[x],
        "",
    );
    assert!(bad.unwrap_err().to_string().contains("outside axis 1"));
    // A symbolic slice out of range is caught when run.
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["n"]);
    let s = op(
        &mut g,
        Op::Slice {
            axis: 0,
            start: Dim::sym("n"),
            len: Dim::c(1),
        },
        &[x],
    );
    out(&mut g, "s", s);
    let e = err_text(try_run(
        &g,
        vec![("x", f32t(&[2], &[1.0, 2.0]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&e, &["slice", "outside axis 0"]);
}

fn dropout_graph(p: f64, n: &str) -> (Graph, NodeId) {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &[n]);
    let d = g
        .add(
            Op::Dropout {
                p: Float::new(p),
                stream: 3,
            },
            &[x],
            "drop",
        )
        .unwrap();
    out(&mut g, "y", d);
    (g, d)
}

#[test]
fn dropout_scales_and_is_deterministic() {
    let (g, _) = dropout_graph(0.25, "1000");
    let x: Vec<f32> = (0..1000).map(|i| 1.0 + i as f32 / 1000.0).collect();
    let go = |seed: u64, step: u32| {
        let opts = RunOptions {
            precision: Precision::F32,
            seed,
            step,
            ..RunOptions::default()
        };
        try_run(&g, vec![("x", f32t(&[1000], &x))], vec![], opts).unwrap()["y"].clone()
    };
    let y = go(11, 4);
    let ys = f32s(&y);
    let scale = (1.0f64 / 0.75) as f32; // 1.3333334
    let threshold = rng::dropout_threshold(0.25);
    let mut kept = 0;
    for (i, (&v, &xi)) in ys.iter().zip(&x).enumerate() {
        // The mask is exactly the documented Philox definition.
        if rng::dropout_keep(11, 4, 3, i as u64, threshold) {
            assert_eq!(v, xi * scale, "element {i}");
            kept += 1;
        } else {
            assert_eq!(v, 0.0, "element {i}");
        }
    }
    // About 750 of 1000 kept (binomial std ~14).
    assert!((680..=820).contains(&kept), "kept {kept}");
    assert_eq!(go(11, 4), y, "same seed and step give the same mask");
    assert_ne!(go(11, 5), y, "another step gives another mask");
    assert_ne!(go(12, 4), y, "another seed gives another mask");

    // The f64 path draws the same mask and scales by 1/(1-p) in f64.
    let opts = RunOptions {
        precision: Precision::F64,
        seed: 11,
        step: 4,
        ..RunOptions::default()
    };
    let y64 = try_run(&g, vec![("x", f32t(&[1000], &x))], vec![], opts).unwrap()["y"].clone();
    for (i, (&v, &xi)) in f64s(&y64).iter().zip(&x).enumerate() {
        let want = if rng::dropout_keep(11, 4, 3, i as u64, threshold) {
            f64::from(xi) / 0.75
        } else {
            0.0
        };
        assert!((v - want).abs() < 1e-12, "element {i}: {v} vs {want}");
    }

    // p = 0 is the identity.
    let (g0, _) = dropout_graph(0.0, "4");
    let r = run(&g0, vec![("x", f32t(&[4], &[1., 2., 3., 4.]))]);
    assert_eq!(f32s(&r["y"]), &[1., 2., 3., 4.]);
}

// ---------------------------------------------------------------------------------------
// Running parts of a graph.

#[test]
fn run_nodes_returns_intermediate_values_and_skips_unneeded_nodes() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2"]);
    let ids = input(&mut g, "ids", DType::I32, &["1"]);
    let table = input(&mut g, "table", DType::F32, &["2", "2"]);
    let e = op(&mut g, Op::Unary(UnaryOp::Exp), &[x]);
    let n = op(&mut g, Op::Unary(UnaryOp::Neg), &[e]);
    // A gather that would fail; it is not needed for `n`.
    let bad = op(&mut g, Op::Gather, &[table, ids]);
    out(&mut g, "n", n);
    out(&mut g, "bad", bad);
    let inputs = map(vec![
        ("x", f32t(&[2], &[0.0, 1.0])),
        ("ids", i32t(&[1], &[9])),
        ("table", f32t(&[2, 2], &[0.; 4])),
    ]);
    let vals = reference::run_nodes(
        &g,
        &inputs,
        &BTreeMap::new(),
        &RunOptions::default(),
        &[e, n, e],
    )
    .unwrap();
    assert_close(f32s(&vals[0]), &[1.0, std::f64::consts::E], 1e-6);
    assert_close(f32s(&vals[1]), &[-1.0, -std::f64::consts::E], 1e-6);
    assert_eq!(vals[2], vals[0]);
    assert!(reference::run(&g, &inputs, &BTreeMap::new(), &RunOptions::default()).is_err());
    let msg = reference::run_nodes(
        &g,
        &inputs,
        &BTreeMap::new(),
        &RunOptions::default(),
        &[NodeId(99)],
    )
    .unwrap_err()
    .to_string();
    assert_contains(&msg, &["%99"]);
}

// ---------------------------------------------------------------------------------------
// Binding errors.

/// `src: i32[batch, src_len]`, `tgt: i32[batch, tgt_len]`, output: a pad mask of each.
fn two_input_graph() -> Graph {
    let mut g = Graph::new("t");
    let s = input(&mut g, "src", DType::I32, &["batch", "src_len"]);
    let t = input(&mut g, "tgt", DType::I32, &["batch", "tgt_len"]);
    let ms = op(&mut g, Op::PadMask { pad: 0 }, &[s]);
    let mt = op(&mut g, Op::PadMask { pad: 0 }, &[t]);
    out(&mut g, "ms", ms);
    out(&mut g, "mt", mt);
    g
}

#[test]
fn missing_input_lists_the_expected_inputs() {
    let g = two_input_graph();
    let msg = err_text(try_run(
        &g,
        vec![("src", i32t(&[1, 2], &[1, 2]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(
        &msg,
        &[
            "missing input `tgt`",
            "`src`: i32[batch, src_len]",
            "`tgt`: i32[batch, tgt_len]",
        ],
    );
}

#[test]
fn wrong_rank_names_the_input() {
    let g = two_input_graph();
    let msg = err_text(try_run(
        &g,
        vec![
            ("src", i32t(&[2], &[1, 2])),
            ("tgt", i32t(&[1, 2], &[1, 2])),
        ],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(
        &msg,
        &["input `src`", "rank 1", "rank 2", "[batch, src_len]"],
    );
}

#[test]
fn dim_conflict_names_both_inputs() {
    let g = two_input_graph();
    let msg = err_text(try_run(
        &g,
        vec![
            ("src", i32t(&[3, 1], &[1, 2, 3])),
            ("tgt", i32t(&[4, 1], &[1, 2, 3, 4])),
        ],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["`batch`", "3", "`src`", "4", "`tgt`"]);
}

#[test]
fn constant_and_composite_dims_are_checked() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["batch", "6"]);
    out(&mut g, "x", x);
    let msg = err_text(try_run(
        &g,
        vec![("x", f32t(&[2, 5], &[0.; 10]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(
        &msg,
        &["input `x`", "[2, 5]", "[batch, 6]", "axis 1 must be 6"],
    );

    let mut g = Graph::new("t");
    let _k = input(&mut g, "k", DType::F32, &["t"]);
    g.add_input(
        "kv",
        TensorType::new(DType::F32, Shape(vec![Dim::sym("t").add(&Dim::c(1))])),
    )
    .unwrap();
    let kv = g.input("kv").unwrap();
    out(&mut g, "kv", kv);
    let ok = try_run(
        &g,
        vec![
            ("k", f32t(&[2], &[0.; 2])),
            ("kv", f32t(&[3], &[1., 2., 3.])),
        ],
        vec![],
        RunOptions::default(),
    )
    .unwrap();
    assert_eq!(f32s(&ok["kv"]), &[1., 2., 3.]);
    let msg = err_text(try_run(
        &g,
        vec![("k", f32t(&[2], &[0.; 2])), ("kv", f32t(&[2], &[1., 2.]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["input `kv`", "t + 1", "= 3"]);
}

#[test]
fn i64_ids_are_accepted_when_they_fit() {
    let g = two_input_graph();
    let r = try_run(
        &g,
        vec![
            ("src", Tensor::i64(vec![1, 3], vec![4, 0, 9]).unwrap()),
            ("tgt", i32t(&[1, 1], &[0])),
        ],
        vec![],
        RunOptions::default(),
    )
    .unwrap();
    assert_eq!(r["ms"].as_bool().unwrap(), &[true, false, true]);
    let msg = err_text(try_run(
        &g,
        vec![
            ("src", Tensor::i64(vec![1, 2], vec![1, 1 << 40]).unwrap()),
            ("tgt", i32t(&[1, 1], &[0])),
        ],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["input `src`", "1099511627776", "i32"]);
}

#[test]
fn wrong_dtype_and_inconsistent_tensors_are_errors() {
    let g = two_input_graph();
    let msg = err_text(try_run(
        &g,
        vec![("src", f32t(&[1, 1], &[1.0])), ("tgt", i32t(&[1, 1], &[0]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["input `src`", "f32", "i32[batch, src_len]"]);
    let broken = Tensor {
        shape: vec![2, 2],
        data: TensorData::I32(vec![1]),
    };
    let msg = err_text(try_run(
        &g,
        vec![("src", broken), ("tgt", i32t(&[1, 1], &[0]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["input `src`", "4 elements", "1 values"]);
}

#[test]
fn parameter_errors_name_the_parameter() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["b", "2"]);
    let w = g
        .add_param(
            "lin.w",
            ty(DType::F32, &["2", "3"]),
            Init::XavierUniform,
            "lin",
        )
        .unwrap();
    let y = g.add(Op::MatMul, &[x, w], "lin").unwrap();
    out(&mut g, "y", y);
    let xs = || vec![("x", f32t(&[1, 2], &[1., 2.]))];
    let msg = err_text(try_run(&g, xs(), vec![], RunOptions::default()));
    assert_contains(&msg, &["parameter `lin.w`", "not provided", "f32[2, 3]"]);
    let msg = err_text(try_run(
        &g,
        xs(),
        vec![("lin.w", f32t(&[3, 2], &[0.; 6]))],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["parameter `lin.w`", "[3, 2]", "f32[2, 3]"]);
    let msg = err_text(try_run(
        &g,
        xs(),
        vec![("lin.w", i32t(&[2, 3], &[0; 6]))],
        RunOptions::default(),
    ));
    assert_contains(&msg, &["parameter `lin.w`", "i32"]);
    let ok = try_run(
        &g,
        xs(),
        vec![("lin.w", f32t(&[2, 3], &[1., 0., 2., 0., 1., 3.]))],
        RunOptions::default(),
    )
    .unwrap();
    // [1 2] · [[1 0 2],[0 1 3]] = [1 2 8]
    assert_eq!(f32s(&ok["y"]), &[1., 2., 8.]);
}

#[test]
fn half_precision_is_reported_not_supported() {
    let mut g = Graph::new("t");
    let x = input(&mut g, "x", DType::F32, &["2"]);
    let h = g.add(Op::Cast { to: DType::BF16 }, &[x], "mp").unwrap();
    out(&mut g, "h", h);
    let msg = err_text(try_run(
        &g,
        vec![("x", f32t(&[2], &[1., 2.]))],
        vec![],
        RunOptions::default(),
    ));
    assert_contains(
        &msg,
        &[&format!("{h} cast in scope `mp`"), "bf16", "not supported"],
    );
}
