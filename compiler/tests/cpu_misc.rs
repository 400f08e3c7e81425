//! The misc CPU kernels (`adam_update`, `sum_rows`, `reduce`, `fill_rows`, `relu`,
//! `bias_relu`, `copy_strided`), JIT-compiled from their CLIF text and compared with the
//! reference executor (on the template graphs where a template exists) or a plain loop.

use std::collections::BTreeMap;

use cranelift_codegen::ir::Function;
use kiln_compiler::codegen::clif::{text, Reduce};
use kiln_compiler::codegen::jit;
use kiln_compiler::codegen::misc::{self, ReduceLayout};
use kiln_compiler::ir::{BinaryOp, DType, Graph, Op, ReduceOp, TensorType, UnaryOp};
use kiln_compiler::optimize::templates::{registry, TemplateDef};
use kiln_compiler::reference::{run, RunOptions};
use kiln_compiler::rng::uniform01;
use kiln_compiler::shape::Shape;
use kiln_compiler::tensor::Tensor;

/// Deterministic values in (lo, hi).
fn values(stream: u64, n: usize, lo: f64, hi: f64) -> Vec<f32> {
    (0..n)
        .map(|i| (lo + (hi - lo) * uniform01(11, stream, i as u64)) as f32)
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// A kernel JIT-compiled from its CLIF text (the text checked to be deterministic).
struct Kernel {
    module: jit::JitModule,
    name: String,
}

impl Kernel {
    fn new(name: &str, build: impl Fn() -> Function) -> Kernel {
        let a = text(&build());
        let b = text(&build());
        assert_eq!(a, b, "the text of {name} is deterministic");
        assert!(
            a.starts_with(&format!("function %{name}(i64, i64, i64, i64) system_v {{")),
            "{a}"
        );
        let module = jit::compile(&a).unwrap_or_else(|e| panic!("{e}\n{a}"));
        Kernel {
            module,
            name: name.to_string(),
        }
    }

    /// Calls the kernel over `[0, items)` split into chunks of at least `grain` items
    /// (buffers are raw pointers, so outputs may alias inputs).
    fn launch(&self, ptrs: &[*mut u8], dims: &[i64], items: usize, grain: usize) {
        let f = self.module.get(&self.name).expect("function");
        unsafe { jit::launch(f, ptrs, dims, items, grain) };
    }
}

fn ptr(v: &[f32]) -> *mut u8 {
    v.as_ptr() as *mut u8
}

fn mptr(v: &mut [f32]) -> *mut u8 {
    v.as_mut_ptr() as *mut u8
}

fn template(name: &str, variant: &str) -> &'static TemplateDef {
    registry()
        .iter()
        .find(|t| t.name == name && t.variant == variant)
        .unwrap_or_else(|| panic!("no template {name} {variant}"))
}

fn input_names(def: &TemplateDef) -> Vec<String> {
    def.inputs
        .iter()
        .map(|&i| def.graph.source_name(i).unwrap().to_string())
        .collect()
}

/// The template's outputs from the reference executor (the template graph has no graph
/// outputs; its kernel outputs are requested as nodes).
fn reference_outputs(def: &TemplateDef, inputs: &BTreeMap<String, Tensor>) -> Vec<Vec<f32>> {
    let got = kiln_compiler::reference::run_nodes(
        &def.graph,
        inputs,
        &BTreeMap::new(),
        &RunOptions::default(),
        &def.outputs,
    )
    .unwrap();
    got.into_iter()
        .map(|t| t.as_f32().unwrap().to_vec())
        .collect()
}

// ---------------------------------------------------------------------------------------
// adam_update

#[test]
fn adam_update_is_bit_identical_to_the_reference() {
    let kernel = Kernel::new("adam", || misc::adam_update("adam"));
    let shapes: &[&[usize]] = &[
        &[],
        &[1],
        &[3],
        &[5],
        &[17],
        &[1024],
        &[2049],
        &[1, 17],
        &[3, 5],
        &[1000, 513],
    ];
    let (b1, b2, eps) = (0.9f64, 0.98f64, 1e-9f64);
    let (lr, t) = (1e-3f64, 3);
    let scalars: [(&str, f32); 7] = [
        ("b1", b1 as f32),
        ("b2", b2 as f32),
        ("c1", (1.0 - b1) as f32),
        ("c2", (1.0 - b2) as f32),
        ("eps", eps as f32),
        ("step_size", (lr / (1.0 - b1.powi(t))) as f32),
        ("inv_sqrt_bc2", (1.0 / (1.0 - b2.powi(t)).sqrt()) as f32),
    ];
    for (k, shape) in shapes.iter().enumerate() {
        let def = template("adam_update", &format!("rank={}", shape.len()));
        let n: usize = shape.iter().product();
        let s = 4 * k as u64;
        let p = values(s, n, -0.01, 0.01);
        let g = values(s + 1, n, -0.5, 0.5);
        let m = values(s + 2, n, -0.01, 0.01);
        let v = values(s + 3, n, 0.0, 1e-4);
        let mut inputs = BTreeMap::new();
        for (name, x) in [("p", &p), ("g", &g), ("m", &m), ("v", &v)] {
            inputs.insert(
                name.to_string(),
                Tensor::f32(shape.to_vec(), x.clone()).unwrap(),
            );
        }
        for (name, x) in scalars {
            inputs.insert(name.to_string(), Tensor::scalar_f32(x));
        }
        assert_eq!(
            input_names(def),
            [
                "p",
                "g",
                "m",
                "v",
                "b1",
                "b2",
                "c1",
                "c2",
                "eps",
                "step_size",
                "inv_sqrt_bc2"
            ]
        );
        let want = reference_outputs(def, &inputs);
        let sc: Vec<[f32; 1]> = scalars.iter().map(|&(_, x)| [x]).collect();
        let (dims, items) = misc::adam_update_dims(n);

        // Out of place, in one call and split into single items.
        for grain in [items.max(1), 1] {
            let (mut p2, mut m2, mut v2) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
            let mut ptrs = vec![ptr(&p), ptr(&g), ptr(&m), ptr(&v)];
            ptrs.extend(sc.iter().map(|x| ptr(x)));
            ptrs.extend([mptr(&mut p2), mptr(&mut m2), mptr(&mut v2)]);
            kernel.launch(&ptrs, &dims, items, grain);
            for (name, got, want) in [
                ("p", &p2, &want[0]),
                ("m", &m2, &want[1]),
                ("v", &v2, &want[2]),
            ] {
                assert_eq!(bits(got), bits(want), "{name} of shape {shape:?}");
            }
        }
        // In place: the outputs are the p, m, v buffers.
        let (mut pi, mut mi, mut vi) = (p.clone(), m.clone(), v.clone());
        let mut ptrs = vec![mptr(&mut pi), ptr(&g), mptr(&mut mi), mptr(&mut vi)];
        ptrs.extend(sc.iter().map(|x| ptr(x)));
        ptrs.extend([ptrs[0], ptrs[2], ptrs[3]]);
        kernel.launch(&ptrs, &dims, items, 1);
        assert_eq!(bits(&pi), bits(&want[0]), "in-place p of {shape:?}");
        assert_eq!(bits(&mi), bits(&want[1]), "in-place m of {shape:?}");
        assert_eq!(bits(&vi), bits(&want[2]), "in-place v of {shape:?}");
        if n > 0 {
            assert_ne!(bits(&pi), bits(&p), "the update moved p");
        }
    }
}

// ---------------------------------------------------------------------------------------
// sum_rows

#[test]
fn sum_rows_is_bit_identical_to_the_template() {
    let shapes: &[&[usize]] = &[
        &[1, 1],
        &[1, 17],
        &[5, 1],
        &[3, 5],
        &[7, 3],
        &[2, 33],
        &[1000, 513],
        &[2, 3, 17],
        &[4, 1, 5],
        &[2, 2, 3, 5],
        &[3, 4, 5, 19],
    ];
    let kernels: Vec<Kernel> = (1..=3)
        .map(|lead| {
            let name = format!("sum_rows_{lead}");
            Kernel::new(&name, || misc::sum_rows(&name, lead))
        })
        .collect();
    for (k, shape) in shapes.iter().enumerate() {
        let def = template("sum_rows", &format!("rank={}", shape.len()));
        assert_eq!(input_names(def), ["x"]);
        let numel: usize = shape.iter().product();
        let n = *shape.last().unwrap();
        // Mixed magnitudes make the rounding order visible.
        let mut x = values(100 + k as u64, numel, -1.0, 1.0);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 7 == 3 {
                *v *= 1e4;
            }
        }
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "x".to_string(),
            Tensor::f32(shape.to_vec(), x.clone()).unwrap(),
        );
        let want = reference_outputs(def, &inputs).remove(0);
        let kernel = &kernels[shape.len() - 2];
        let (dims, items) = misc::sum_rows_dims(shape);
        for grain in [items, 1] {
            let mut y = vec![f32::NAN; n];
            kernel.launch(&[ptr(&x), mptr(&mut y)], &dims, items, grain);
            assert_eq!(bits(&y), bits(&want), "sum_rows of {shape:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// reduce

/// `reduce_{op}(x, axis)` by the reference executor.
fn reference_reduce(op: ReduceOp, shape: &[usize], axis: usize, x: &[f32]) -> Vec<f32> {
    let mut g = Graph::new("reduce");
    let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    let xi = g
        .add_input("x", TensorType::new(DType::F32, Shape::consts(&dims)))
        .unwrap();
    let y = g.add(Op::Reduce { op, axis }, &[xi], "").unwrap();
    g.add_output("y", y).unwrap();
    let mut inputs = BTreeMap::new();
    inputs.insert(
        "x".to_string(),
        Tensor::f32(shape.to_vec(), x.to_vec()).unwrap(),
    );
    let out = run(&g, &inputs, &BTreeMap::new(), &RunOptions::default()).unwrap();
    out[0].1.as_f32().unwrap().to_vec()
}

/// Max elementwise |got − want| ≤ 1e-5·max|want| + 1e-6.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(0f32, |a, &b| a.max(b.abs()));
    let err = got
        .iter()
        .zip(want)
        .fold(0f32, |a, (&g, &w)| a.max((g - w).abs()));
    assert!(
        err <= 1e-5 * scale + 1e-6,
        "{what}: max error {err} (scale {scale})"
    );
}

#[test]
fn reduce_matches_the_reference() {
    let mut kernels = BTreeMap::new();
    for (op, opn) in [(Reduce::Sum, "sum"), (Reduce::Max, "max")] {
        for (layout, ln) in [
            (ReduceLayout::Rows, "rows"),
            (ReduceLayout::Across, "across"),
        ] {
            let name = format!("reduce_{opn}_{ln}");
            kernels.insert(
                (opn, ln),
                Kernel::new(&name, || misc::reduce(&name, op, layout)),
            );
        }
    }
    let cases: &[(&[usize], usize)] = &[
        (&[1], 0),
        (&[17], 0),
        (&[1, 5], 1),
        (&[7, 13], 1),
        (&[7, 13], 0),
        (&[3, 5, 17], 1),
        (&[3, 5, 17], 2),
        (&[3, 5, 17], 0),
        (&[2, 3, 1], 1),
        (&[4, 64], 1),
        (&[1000, 513], 1),
        (&[1000, 513], 0),
        (&[6, 0, 3], 1),
        (&[6, 0], 1),
    ];
    for (k, &(shape, axis)) in cases.iter().enumerate() {
        let numel: usize = shape.iter().product();
        let outer: usize = shape[..axis].iter().product();
        let len = shape[axis];
        let inner: usize = shape[axis + 1..].iter().product();
        let mut x = values(200 + k as u64, numel, -3.0, 3.0);
        for (i, v) in x.iter_mut().enumerate() {
            if i % 5 == 1 {
                *v *= 1e3;
            }
        }
        let layouts: &[(ReduceLayout, &str)] = if inner == 1 {
            &[
                (ReduceLayout::Rows, "rows"),
                (ReduceLayout::Across, "across"),
            ]
        } else {
            &[(ReduceLayout::Across, "across")]
        };
        assert_eq!(misc::reduce_layout(inner), layouts[0].0);
        for (op, opn) in [(ReduceOp::Sum, "sum"), (ReduceOp::Max, "max")] {
            let want = reference_reduce(op, shape, axis, &x);
            for &(layout, ln) in layouts {
                let (dims, items) = misc::reduce_dims(layout, outer, len, inner);
                for grain in [items, 1] {
                    let mut y = vec![f32::NAN; outer * inner];
                    kernels[&(opn, ln)].launch(&[ptr(&x), mptr(&mut y)], &dims, items, grain);
                    let what = format!("{opn} {ln} of {shape:?} over axis {axis}");
                    if op == ReduceOp::Max || layout == ReduceLayout::Across {
                        // Max always, and the sequential sum of the Across layout: exact.
                        assert_eq!(bits(&y), bits(&want), "{what}");
                    } else {
                        assert_close(&y, &want, &what);
                    }
                }
            }
        }
    }
}

#[test]
fn reduce_max_keeps_the_references_nan_and_zero_choices() {
    let nan_a = f32::from_bits(0x7fc0_0001);
    let nan_b = f32::from_bits(0xffc0_0002);
    // Rows of 37 elements (vector blocks, a vector, a scalar tail), each with a pattern.
    let len = 37;
    let mut rows: Vec<Vec<f32>> = Vec::new();
    let base: Vec<f32> = values(300, len, -5.0, -1.0);
    let with = |edits: &[(usize, f32)]| {
        let mut r = base.clone();
        for &(i, v) in edits {
            r[i] = v;
        }
        r
    };
    rows.push(with(&[(3, -0.0), (20, 0.0)])); // -0.0 first: -0.0
    rows.push(with(&[(3, 0.0), (20, -0.0)])); // 0.0 first: 0.0
    rows.push(with(&[(36, -0.0), (17, 0.0)])); // 0.0 first (index 17)
    rows.push(with(&[(35, -0.0)])); // in the scalar tail
    rows.push(with(&[(10, nan_a), (2, nan_b)])); // the first NaN: nan_b
    rows.push(with(&[(30, nan_a), (36, nan_b), (1, 7.0)])); // nan_a
    rows.push(with(&[(5, f32::INFINITY), (6, nan_a)]));
    rows.push(with(&[(8, f32::INFINITY), (9, f32::NEG_INFINITY)]));
    rows.push(vec![f32::NEG_INFINITY; len]);
    rows.push(vec![-0.0; len]);
    rows.push(base.clone());
    let outer = rows.len();
    let x: Vec<f32> = rows.concat();
    let kr = Kernel::new("max_rows", || {
        misc::reduce("max_rows", Reduce::Max, ReduceLayout::Rows)
    });
    let ka = Kernel::new("max_across", || {
        misc::reduce("max_across", Reduce::Max, ReduceLayout::Across)
    });
    // Along the rows.
    let want = reference_reduce(ReduceOp::Max, &[outer, len], 1, &x);
    assert_eq!(want[0].to_bits(), (-0.0f32).to_bits());
    assert_eq!(want[4].to_bits(), nan_b.to_bits());
    let (dims, items) = misc::reduce_dims(ReduceLayout::Rows, outer, len, 1);
    let mut y = vec![0f32; outer];
    kr.launch(&[ptr(&x), mptr(&mut y)], &dims, items, 1);
    assert_eq!(bits(&y), bits(&want));
    // Across rows: the transpose, reduced over axis 0.
    let xt: Vec<f32> = (0..len)
        .flat_map(|i| rows.iter().map(move |r| r[i]))
        .collect();
    let want_t = reference_reduce(ReduceOp::Max, &[len, outer], 0, &xt);
    assert_eq!(bits(&want_t), bits(&want));
    let (dims, items) = misc::reduce_dims(ReduceLayout::Across, 1, len, outer);
    let mut y = vec![0f32; outer];
    ka.launch(&[ptr(&xt), mptr(&mut y)], &dims, items, 1);
    assert_eq!(bits(&y), bits(&want));
}

// ---------------------------------------------------------------------------------------
// fill_rows, relu, bias_relu

/// Values with ±0, NaN and ±inf sprinkled in.
fn special_values(stream: u64, n: usize) -> Vec<f32> {
    let mut x = values(stream, n, -2.0, 2.0);
    let specials = [
        0.0,
        -0.0,
        f32::NAN,
        f32::from_bits(0xffc0_1234),
        f32::INFINITY,
        f32::NEG_INFINITY,
        -1e-40,
        1e-40,
    ];
    for (i, v) in x.iter_mut().enumerate() {
        if i % 3 == 0 {
            *v = specials[(i / 3) % specials.len()];
        }
    }
    x
}

#[test]
fn relu_is_bit_identical_to_the_reference() {
    let kernel = Kernel::new("relu", || misc::relu("relu"));
    for (k, n) in [0usize, 1, 3, 5, 17, 1023, 1025, 5000]
        .into_iter()
        .enumerate()
    {
        let x = special_values(400 + k as u64, n);
        let mut g = Graph::new("relu");
        let xi = g
            .add_input("x", TensorType::new(DType::F32, Shape::consts(&[n as i64])))
            .unwrap();
        let y = g.add(Op::Unary(UnaryOp::Relu), &[xi], "").unwrap();
        g.add_output("y", y).unwrap();
        let mut inputs = BTreeMap::new();
        inputs.insert("x".to_string(), Tensor::f32(vec![n], x.clone()).unwrap());
        let want = run(&g, &inputs, &BTreeMap::new(), &RunOptions::default()).unwrap();
        let want = want[0].1.as_f32().unwrap();
        let (dims, items) = misc::relu_dims(n);
        let mut y = x.clone();
        kernel.launch(&[mptr(&mut y)], &dims, items, 1);
        assert_eq!(bits(&y), bits(want), "relu of {n}");
    }
}

/// `[rows, n]` buffer `y` with `b` broadcast over rows, added (`add`), optionally relu'd,
/// by the reference.
fn reference_bias(rows: usize, n: usize, b: &[f32], y: Option<&[f32]>, relu: bool) -> Vec<f32> {
    let mut g = Graph::new("bias");
    let bi = g
        .add_input("b", TensorType::new(DType::F32, Shape::consts(&[n as i64])))
        .unwrap();
    let shape = Shape::consts(&[rows as i64, n as i64]);
    let mut out = g
        .add(
            Op::Broadcast {
                shape: shape.clone(),
            },
            &[bi],
            "",
        )
        .unwrap();
    let mut inputs = BTreeMap::new();
    inputs.insert("b".to_string(), Tensor::f32(vec![n], b.to_vec()).unwrap());
    if let Some(y) = y {
        let yi = g
            .add_input("y", TensorType::new(DType::F32, shape))
            .unwrap();
        out = g.add(Op::Binary(BinaryOp::Add), &[yi, out], "").unwrap();
        inputs.insert(
            "y".to_string(),
            Tensor::f32(vec![rows, n], y.to_vec()).unwrap(),
        );
    }
    if relu {
        out = g.add(Op::Unary(UnaryOp::Relu), &[out], "").unwrap();
    }
    g.add_output("out", out).unwrap();
    let got = run(&g, &inputs, &BTreeMap::new(), &RunOptions::default()).unwrap();
    got[0].1.as_f32().unwrap().to_vec()
}

#[test]
fn fill_rows_and_bias_relu_are_bit_identical_to_the_reference() {
    let fill = Kernel::new("fill_rows", || misc::fill_rows("fill_rows"));
    let bias_relu = Kernel::new("bias_relu", || misc::bias_relu("bias_relu"));
    for (k, (rows, n)) in [
        (1, 1),
        (1, 17),
        (3, 5),
        (4, 3),
        (7, 1),
        (33, 70),
        (1000, 513),
    ]
    .into_iter()
    .enumerate()
    {
        let b = special_values(500 + k as u64, n);
        let (dims, items) = misc::rows_dims(rows, n);
        // fill_rows
        let want = reference_bias(rows, n, &b, None, false);
        let mut dst = vec![f32::NAN; rows * n];
        fill.launch(&[ptr(&b), mptr(&mut dst)], &dims, items, 1);
        assert_eq!(bits(&dst), bits(&want), "fill_rows {rows}x{n}");
        // bias_relu, in place
        let y = special_values(600 + k as u64, rows * n);
        let want = reference_bias(rows, n, &b, Some(&y), true);
        let mut got = y.clone();
        bias_relu.launch(&[ptr(&b), mptr(&mut got)], &dims, items, 1);
        assert_eq!(bits(&got), bits(&want), "bias_relu {rows}x{n}");
    }
}

// ---------------------------------------------------------------------------------------
// copy_strided

/// `out[idx] = src[origin + Σ idx_k·strides_k]` by plain loops.
fn copy_loop(src: &[u32], origin: usize, shape: &[usize], strides: &[i64]) -> Vec<u32> {
    let n: usize = shape.iter().product();
    let mut out = Vec::with_capacity(n);
    for flat in 0..n {
        let mut rest = flat;
        let mut off = origin as i64;
        for k in (0..shape.len()).rev() {
            off += (rest % shape[k]) as i64 * strides[k];
            rest /= shape[k];
        }
        out.push(src[off as usize]);
    }
    out
}

#[test]
fn copy_strided_matches_a_loop() {
    let unit = Kernel::new("copy_unit", || misc::copy_strided("copy_unit", true));
    let gather = Kernel::new("copy_gather", || misc::copy_strided("copy_gather", false));
    // (shape, strides)
    let cases: Vec<(Vec<usize>, Vec<i64>)> = vec![
        (vec![], vec![]),
        (vec![17], vec![1]),
        (vec![17], vec![-1]),
        (vec![5], vec![0]),
        (vec![3, 5], vec![5, 1]),
        (vec![3, 5], vec![1, 3]),
        (vec![4, 6], vec![-6, 1]),
        (vec![2, 3, 17], vec![0, 17, 1]),
        (vec![2, 3, 17], vec![51, -17, 1]),
        (vec![2, 3, 4, 5], vec![60, 1, 15, 3]),
        (vec![2, 2, 3, 4, 9], vec![216, 108, 36, 9, 1]),
        (vec![2, 2, 3, 4, 9], vec![1, 2, 4, -12, 48]),
        (vec![3, 0, 4], vec![4, 4, 1]),
        (vec![1, 1000, 513], vec![0, 513, 1]),
    ];
    let pool: Vec<u32> = (0..2_000_000u32)
        .map(|i| i.wrapping_mul(2_654_435_761))
        .collect();
    for (shape, strides) in &cases {
        // The origin: far enough from the start that every negative stride stays inside.
        let neg: i64 = shape
            .iter()
            .zip(strides)
            .map(|(&d, &t)| {
                if t < 0 {
                    -(t * (d as i64 - 1).max(0))
                } else {
                    0
                }
            })
            .sum();
        let origin = neg as usize + 7;
        let want = copy_loop(&pool, origin, shape, strides);
        let (dims, items) = misc::copy_strided_dims(shape, strides);
        let mut kernels = vec![("gather", &gather)];
        if strides.last().is_none_or(|&t| t == 1) {
            kernels.push(("unit", &unit));
        }
        for (kn, kernel) in kernels {
            for grain in [items.max(1), 1] {
                let mut out = vec![0xdead_beefu32; want.len()];
                let src = unsafe { pool.as_ptr().add(origin) } as *mut u8;
                kernel.launch(&[src, out.as_mut_ptr() as *mut u8], &dims, items, grain);
                assert_eq!(out, want, "{kn} copy of {shape:?} strides {strides:?}");
            }
        }
    }
}
