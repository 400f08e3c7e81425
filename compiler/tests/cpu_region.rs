//! Region kernels and the `embed_pe` kernel against the reference executor.
//!
//! In: region programs ([`Expr`]) built by hand, random inputs (broadcast, permuted,
//! odd-sized), and the `embed_pe` template graphs. Out: pass/fail — every kernel is
//! emitted as CLIF text, JIT-compiled from that text, run over rows split into uneven
//! chunks, and compared with `reference::run` on the graph `Expr::instantiate` (or the
//! template) builds: max|got − ref| ≤ 1e-5·max|ref| + 1e-6 for f32 (NaN where the
//! reference has NaN), exact for i32, bool and every dropout mask.

use std::collections::BTreeMap;

use kiln_compiler::codegen::clif::text;
use kiln_compiler::codegen::jit;
use kiln_compiler::codegen::region::{
    embed_pe, embed_pe_dims, input_dtypes, region, region_dims, region_inner, region_typed,
};
use kiln_compiler::ir::{BinaryOp, CmpOp, Float, UnaryOp};
use kiln_compiler::optimize::lang::Attr;
use kiln_compiler::optimize::regions::{Expr, Inst};
use kiln_compiler::optimize::templates::registry;
use kiln_compiler::reference::{self, RunOptions};
use kiln_compiler::tensor::{Tensor, TensorData};
use kiln_compiler::{DType, Graph, NodeId, Op, Shape, TensorType};

// ---------------------------------------------------------------------------------------
// Helpers.

/// xorshift64*: deterministic test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * ((self.next() >> 40) as f32 / (1u64 << 24) as f32)
    }
    fn int(&mut self, lo: i32, hi: i32) -> i32 {
        let span = (i64::from(hi) - i64::from(lo)) as u64;
        (i64::from(lo) + (self.next() % span) as i64) as i32
    }
}

fn consts(shape: &[usize]) -> Shape {
    Shape::consts(&shape.iter().map(|&d| d as i64).collect::<Vec<_>>())
}

/// How an input is stored and viewed.
#[derive(Clone)]
enum View {
    /// Stored with this shape, broadcast (right-aligned) to the output's.
    Bcast(Vec<usize>),
    /// Stored with this shape, permuted by `perm` to the output's shape.
    Perm(Vec<usize>, Vec<usize>),
}

/// Input value ranges.
#[derive(Clone, Copy)]
enum Range {
    F(f32, f32),
    I(i32, i32),
    B,
}

struct Input {
    dtype: DType,
    view: View,
    range: Range,
}

fn inp(dtype: DType, shape: &[usize], range: Range) -> Input {
    Input {
        dtype,
        view: View::Bcast(shape.to_vec()),
        range,
    }
}

fn f(shape: &[usize]) -> Input {
    inp(DType::F32, shape, Range::F(-3.0, 3.0))
}

fn row_major(shape: &[usize]) -> Vec<isize> {
    let mut s = vec![1isize; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1] as isize;
    }
    s
}

/// Element strides of an input over the output's dims.
fn view_strides(view: &View, out: &[usize]) -> Vec<isize> {
    let r = out.len();
    match view {
        View::Bcast(shape) => {
            let rm = row_major(shape);
            let off = r - shape.len();
            (0..r)
                .map(|k| {
                    if k < off || shape[k - off] == 1 {
                        0
                    } else {
                        rm[k - off]
                    }
                })
                .collect()
        }
        View::Perm(shape, perm) => {
            let rm = row_major(shape);
            (0..r)
                .map(|k| if out[k] == 1 { 0 } else { rm[perm[k]] })
                .collect()
        }
    }
}

fn stored_shape(view: &View) -> &[usize] {
    match view {
        View::Bcast(s) | View::Perm(s, _) => s,
    }
}

/// Random data: the 4-byte buffer and the reference tensor.
fn data(rng: &mut Rng, input: &Input) -> (Vec<u32>, Tensor) {
    let shape = stored_shape(&input.view).to_vec();
    let n: usize = shape.iter().product();
    match input.range {
        Range::F(lo, hi) => {
            let v: Vec<f32> = (0..n).map(|_| rng.uniform(lo, hi)).collect();
            (
                v.iter().map(|x| x.to_bits()).collect(),
                Tensor::f32(shape, v).unwrap(),
            )
        }
        Range::I(lo, hi) => {
            let v: Vec<i32> = (0..n).map(|_| rng.int(lo, hi)).collect();
            (
                v.iter().map(|&x| x as u32).collect(),
                Tensor::i32(shape, v).unwrap(),
            )
        }
        Range::B => {
            let v: Vec<bool> = (0..n).map(|_| rng.next().is_multiple_of(2)).collect();
            (
                v.iter().map(|&x| x as u32).collect(),
                Tensor::bool(shape, v).unwrap(),
            )
        }
    }
}

/// The reference result as 4-byte words (and whether it is f32).
fn words(t: &Tensor) -> Vec<u32> {
    match &t.data {
        TensorData::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
        TensorData::I32(v) => v.iter().map(|&x| x as u32).collect(),
        TensorData::Bool(v) => v.iter().map(|&x| x as u32).collect(),
        other => panic!("unexpected reference dtype {}", other.dtype_name()),
    }
}

/// Compares kernel words with reference words.
fn compare(what: &str, dtype: DType, got: &[u32], want: &[u32], exact: bool) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if dtype != DType::F32 || exact {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(
                g,
                w,
                "{what}: element {i}: got {g:#x} ({}), want {w:#x} ({})",
                f32::from_bits(*g),
                f32::from_bits(*w)
            );
        }
        return;
    }
    let g: Vec<f32> = got.iter().map(|&x| f32::from_bits(x)).collect();
    let w: Vec<f32> = want.iter().map(|&x| f32::from_bits(x)).collect();
    let scale = w
        .iter()
        .filter(|x| x.is_finite())
        .fold(0f32, |m, x| m.max(x.abs()));
    let tol = 1e-5 * scale + 1e-6;
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        if b.is_nan() {
            assert!(a.is_nan(), "{what}: element {i}: got {a}, want NaN");
        } else if b.is_infinite() {
            assert_eq!(a, b, "{what}: element {i}");
        } else {
            assert!(
                (a - b).abs() <= tol,
                "{what}: element {i}: got {a}, want {b} (tolerance {tol})"
            );
        }
    }
}

/// Runs a JIT-compiled kernel over `items` rows in chunks of `chunk` rows.
fn run_kernel(name: &str, src: &str, ptrs: &[*mut u8], dims: &[i64], items: usize, chunk: usize) {
    let m = jit::compile(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let k = m.get(name).expect("kernel");
    let mut lo = 0;
    loop {
        let hi = (lo + chunk).min(items);
        // SAFETY: the buffers are sized for the kernel's shapes.
        unsafe { k(ptrs.as_ptr(), dims.as_ptr(), lo as i64, hi as i64) };
        if hi >= items {
            break;
        }
        lo = hi;
    }
}

/// Builds `expr` over `inputs` (output `out`), runs the kernel and the reference on the
/// same random data, and compares. `typed`: pass the input dtypes (else infer them).
fn check_full(
    what: &str,
    insts: Vec<Inst>,
    out_dtype: DType,
    out: &[usize],
    inputs: &[Input],
    (seed, step): (u64, u32),
    exact: bool,
) {
    let expr = Expr {
        out: TensorType::new(out_dtype, consts(out)),
        inputs: inputs.len(),
        insts,
    };
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (what.len() as u64 * 7919));
    // Reference graph.
    let mut g = Graph::new("region");
    let mut ids: Vec<NodeId> = Vec::new();
    let mut tensors = BTreeMap::new();
    let mut bufs: Vec<Vec<u32>> = Vec::new();
    for (i, input) in inputs.iter().enumerate() {
        let name = format!("in{i}");
        let shape = stored_shape(&input.view);
        let id = g
            .add_input(&name, TensorType::new(input.dtype, consts(shape)))
            .unwrap();
        let id = match &input.view {
            View::Bcast(_) => id,
            View::Perm(_, perm) => g
                .add(Op::Permute { perm: perm.clone() }, &[id], "")
                .unwrap(),
        };
        ids.push(id);
        let (buf, t) = data(&mut rng, input);
        bufs.push(buf);
        tensors.insert(name, t);
    }
    let y = expr.instantiate(&mut g, &ids, "r").unwrap();
    g.add_output("y", y).unwrap();
    let opts = RunOptions {
        seed,
        step,
        ..RunOptions::default()
    };
    let want = reference::run(&g, &tensors, &BTreeMap::new(), &opts).unwrap();
    let want = words(&want[0].1);

    // Kernel.
    let strides: Vec<Vec<isize>> = inputs.iter().map(|i| view_strides(&i.view, out)).collect();
    let inner = region_inner(&strides).expect("innermost strides are 0 or 1");
    let dtypes: Vec<DType> = inputs.iter().map(|i| i.dtype).collect();
    let func = match region(what, &expr, &inner) {
        Ok(f) => {
            assert_eq!(
                input_dtypes(&expr).unwrap(),
                dtypes,
                "{what}: inferred dtypes"
            );
            f
        }
        Err(_) => region_typed(what, &expr, &inner, &dtypes).unwrap(),
    };
    let src = text(&func);
    let (dims, items) = region_dims(&expr, out, &strides, seed, step);
    let numel: usize = out.iter().product();
    let mut got = vec![0xDEAD_BEEFu32; numel];
    let mut ptrs: Vec<*mut u8> = bufs.iter_mut().map(|b| b.as_mut_ptr() as *mut u8).collect();
    ptrs.push(got.as_mut_ptr() as *mut u8);
    for chunk in [items.max(1), 3, 1] {
        got.fill(0xDEAD_BEEF);
        run_kernel(what, &src, &ptrs, &dims, items, chunk);
        compare(
            &format!("{what} (chunks of {chunk})"),
            out_dtype,
            &got,
            &want,
            exact,
        );
    }
}

fn check(what: &str, insts: Vec<Inst>, out_dtype: DType, out: &[usize], inputs: &[Input]) {
    check_full(what, insts, out_dtype, out, inputs, (0, 0), false);
}

fn c(v: f64, d: DType) -> Inst {
    Inst::Const(Float::new(v), d)
}

const UNARY: [UnaryOp; 13] = [
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
];
const BINARY: [BinaryOp; 5] = [
    BinaryOp::Add,
    BinaryOp::Sub,
    BinaryOp::Mul,
    BinaryOp::Div,
    BinaryOp::Max,
];
const CMP: [CmpOp; 6] = [
    CmpOp::Eq,
    CmpOp::Ne,
    CmpOp::Lt,
    CmpOp::Le,
    CmpOp::Gt,
    CmpOp::Ge,
];

// ---------------------------------------------------------------------------------------
// f32 ops.

#[test]
fn every_unary_op_over_odd_shapes() {
    for u in UNARY {
        let range = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => Range::F(0.01, 50.0),
            UnaryOp::Sin | UnaryOp::Cos => Range::F(-20.0, 20.0),
            _ => Range::F(-4.0, 4.0),
        };
        for out in [
            vec![],
            vec![1],
            vec![37],
            vec![5, 1],
            vec![3, 3],
            vec![4, 5],
            vec![2, 17],
            vec![1, 64],
            vec![3, 2, 33],
        ] {
            check(
                &format!("un_{u:?}_{out:?}").replace([' ', ',', '[', ']'], "_"),
                vec![Inst::In(0), Inst::Un(u, 0)],
                DType::F32,
                &out,
                &[inp(DType::F32, &out, range)],
            );
        }
    }
}

#[test]
fn unary_special_values() {
    // relu(NaN) = NaN, relu(-0) = 0, log(0) = -inf, log(-1) = NaN, sqrt(-1) = NaN …
    let xs = [
        f32::NAN,
        -0.0,
        0.0,
        -1.0,
        1.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-3,
        -1e-3,
        100.0,
        -100.0,
    ];
    for u in UNARY {
        let expr = Expr {
            out: TensorType::new(DType::F32, consts(&[xs.len()])),
            inputs: 1,
            insts: vec![Inst::In(0), Inst::Un(u, 0)],
        };
        let name = format!("special_{u:?}");
        let func = region(&name, &expr, &[true]).unwrap();
        let src = text(&func);
        let (dims, items) = region_dims(&expr, &[xs.len()], &[vec![1]], 0, 0);
        let mut x: Vec<f32> = xs.to_vec();
        let mut y = vec![0f32; xs.len()];
        run_kernel(
            &name,
            &src,
            &[x.as_mut_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
            &dims,
            items,
            1,
        );
        for (i, &a) in xs.iter().enumerate() {
            let want = match u {
                UnaryOp::Neg => -a,
                UnaryOp::Exp => a.exp(),
                UnaryOp::Log => a.ln(),
                UnaryOp::Sqrt => a.sqrt(),
                UnaryOp::Recip => 1.0 / a,
                UnaryOp::Relu => {
                    if a.is_nan() || a > 0.0 {
                        a
                    } else {
                        0.0
                    }
                }
                UnaryOp::Sin => a.sin(),
                UnaryOp::Cos => a.cos(),
                UnaryOp::Tanh => a.tanh(),
                UnaryOp::Sigmoid => 1.0 / (1.0 + (-a).exp()),
                UnaryOp::Erf => libm::erff(a),
                UnaryOp::Rsqrt => 1.0 / a.sqrt(),
                UnaryOp::Silu => a / (1.0 + (-a).exp()),
            };
            let g = y[i];
            if want.is_nan() {
                assert!(g.is_nan(), "{u:?}({a}) = {g}, want NaN");
            } else if want.is_infinite() || want == 0.0 {
                assert_eq!(g, want, "{u:?}({a}) = {g}, want {want}");
            } else {
                assert!(
                    (g - want).abs() <= 1e-5 * want.abs() + 1e-6,
                    "{u:?}({a}) = {g}, want {want}"
                );
            }
        }
    }
}

#[test]
fn every_binary_op_with_broadcasts() {
    for b in BINARY {
        let div = b == BinaryOp::Div;
        let rhs = |shape: &[usize]| {
            if div {
                inp(DType::F32, shape, Range::F(0.5, 3.0))
            } else {
                f(shape)
            }
        };
        let prog = vec![Inst::In(0), Inst::In(1), Inst::Bin(b, 0, 1)];
        let name = |s: &str| format!("bin_{b:?}_{s}");
        // Same shape, row broadcast [d] → [n, d], column broadcast [n, 1] → [n, d],
        // scalar, and both operands broadcast.
        check(
            &name("same"),
            prog.clone(),
            DType::F32,
            &[7, 13],
            &[f(&[7, 13]), rhs(&[7, 13])],
        );
        check(
            &name("row"),
            prog.clone(),
            DType::F32,
            &[7, 13],
            &[f(&[7, 13]), rhs(&[13])],
        );
        check(
            &name("col"),
            prog.clone(),
            DType::F32,
            &[7, 13],
            &[f(&[7, 13]), rhs(&[7, 1])],
        );
        check(
            &name("scalar"),
            prog.clone(),
            DType::F32,
            &[6, 5],
            &[f(&[6, 5]), rhs(&[])],
        );
        check(
            &name("scalar_lhs"),
            prog.clone(),
            DType::F32,
            &[2, 3],
            &[f(&[]), rhs(&[2, 3])],
        );
        check(
            &name("outer"),
            prog.clone(),
            DType::F32,
            &[5, 17],
            &[f(&[5, 1]), rhs(&[17])],
        );
        check(
            &name("rank0"),
            prog.clone(),
            DType::F32,
            &[],
            &[f(&[]), rhs(&[])],
        );
        check(
            &name("rank1"),
            prog.clone(),
            DType::F32,
            &[21],
            &[f(&[21]), rhs(&[1])],
        );
        check(
            &name("c1"),
            prog.clone(),
            DType::F32,
            &[9, 1],
            &[f(&[9, 1]), rhs(&[1])],
        );
    }
}

#[test]
fn max_propagates_nan_like_the_reference() {
    let expr = Expr {
        out: TensorType::new(DType::F32, consts(&[8])),
        inputs: 2,
        insts: vec![Inst::In(0), Inst::In(1), Inst::Bin(BinaryOp::Max, 0, 1)],
    };
    let func = region("maxnan", &expr, &[true, true]).unwrap();
    let src = text(&func);
    let (dims, items) = region_dims(&expr, &[8], &[vec![1], vec![1]], 0, 0);
    let mut a = [f32::NAN, 1.0, f32::NAN, -1.0, 2.0, 0.0, -0.0, 3.0];
    let mut b = [1.0, f32::NAN, f32::NAN, -2.0, 5.0, -0.0, 0.0, 3.0];
    let mut y = [0f32; 8];
    run_kernel(
        "maxnan",
        &src,
        &[
            a.as_mut_ptr() as *mut u8,
            b.as_mut_ptr() as *mut u8,
            y.as_mut_ptr() as *mut u8,
        ],
        &dims,
        items,
        1,
    );
    for i in 0..8 {
        let (x, z) = (a[i], b[i]);
        let want = if x.is_nan() {
            x
        } else if z.is_nan() || z > x {
            z
        } else {
            x
        };
        assert_eq!(y[i].is_nan(), want.is_nan(), "max({x}, {z})");
        if !want.is_nan() {
            assert_eq!(y[i].to_bits(), want.to_bits(), "max({x}, {z})");
        }
    }
}

#[test]
fn chains_with_constants_and_row_invariant_parts() {
    // y = relu(x · exp(s) + 0.5) / (1 + sqrt(col²)) − log(2), s a scalar, col [n, 1].
    let insts = vec![
        Inst::In(0),                      // 0 x
        Inst::In(1),                      // 1 s
        Inst::Un(UnaryOp::Exp, 1),        // 2
        Inst::Bin(BinaryOp::Mul, 0, 2),   // 3
        c(0.5, DType::F32),               // 4
        Inst::Bin(BinaryOp::Add, 3, 4),   // 5
        Inst::Un(UnaryOp::Relu, 5),       // 6
        Inst::In(2),                      // 7 col
        Inst::Bin(BinaryOp::Mul, 7, 7),   // 8
        Inst::Un(UnaryOp::Sqrt, 8),       // 9
        c(1.0, DType::F32),               // 10
        Inst::Bin(BinaryOp::Add, 10, 9),  // 11
        Inst::Bin(BinaryOp::Div, 6, 11),  // 12
        c(2.0, DType::F32),               // 13
        Inst::Un(UnaryOp::Log, 13),       // 14
        Inst::Bin(BinaryOp::Sub, 12, 14), // 15
    ];
    for out in [vec![6, 19], vec![2, 3, 5], vec![1, 1], vec![4, 64]] {
        let col: Vec<usize> = out[..out.len() - 1].iter().copied().chain([1]).collect();
        check(
            &format!("chain_{}", out.len() * 100 + out[out.len() - 1]),
            insts.clone(),
            DType::F32,
            &out,
            &[f(&out), f(&[]), f(&col)],
        );
    }
    // A program whose result is row-invariant: y[n, d] = exp(col[n, 1]) · 2.
    check(
        "row_invariant_result",
        vec![
            Inst::In(0),
            Inst::Un(UnaryOp::Exp, 0),
            c(2.0, DType::F32),
            Inst::Bin(BinaryOp::Mul, 1, 2),
        ],
        DType::F32,
        &[5, 11],
        &[f(&[5, 1])],
    );
    // A constant result (no inputs at all).
    check(
        "const_only",
        vec![c(1.5, DType::F32), Inst::Un(UnaryOp::Neg, 0)],
        DType::F32,
        &[3, 7],
        &[],
    );
    // A copy.
    check("copy", vec![Inst::In(0)], DType::F32, &[3, 9], &[f(&[9])]);
}

#[test]
fn attention_mask_broadcast_and_high_ranks() {
    // where(mask[b,1,1,tk], s[b,h,tq,tk] · scale, -1e9): the attention masking pattern.
    let insts = vec![
        Inst::In(0),
        Inst::In(1),
        Inst::In(2),
        Inst::Bin(BinaryOp::Mul, 1, 2),
        c(-1e9, DType::F32),
        Inst::Where(0, 3, 4),
    ];
    for (b, h, tq, tk) in [(2, 3, 5, 7), (1, 2, 3, 16), (3, 1, 1, 1), (2, 2, 2, 9)] {
        check(
            &format!("attn_mask_{b}_{h}_{tq}_{tk}"),
            insts.clone(),
            DType::F32,
            &[b, h, tq, tk],
            &[
                inp(DType::Bool, &[b, 1, 1, tk], Range::B),
                f(&[b, h, tq, tk]),
                f(&[]),
            ],
        );
    }
    // Rank 5, with a bias broadcast along a middle axis.
    check(
        "rank5",
        vec![Inst::In(0), Inst::In(1), Inst::Bin(BinaryOp::Add, 0, 1)],
        DType::F32,
        &[2, 3, 2, 3, 5],
        &[f(&[2, 3, 2, 3, 5]), f(&[3, 1, 1, 5])],
    );
}

#[test]
fn permuted_views() {
    // in0 stored [4, 3, 6], viewed as [3, 4, 6]; in1 stored [5, 2, 3, 7] viewed as
    // [2, 3, 5, 7] (the last axis stays innermost).
    let perm_in = |shape: &[usize], perm: &[usize]| Input {
        dtype: DType::F32,
        view: View::Perm(shape.to_vec(), perm.to_vec()),
        range: Range::F(-2.0, 2.0),
    };
    check(
        "perm3",
        vec![Inst::In(0), Inst::In(1), Inst::Bin(BinaryOp::Mul, 0, 1)],
        DType::F32,
        &[3, 4, 6],
        &[perm_in(&[4, 3, 6], &[1, 0, 2]), f(&[3, 4, 6])],
    );
    check(
        "perm4",
        vec![Inst::In(0), Inst::Un(UnaryOp::Exp, 0)],
        DType::F32,
        &[2, 3, 5, 7],
        &[perm_in(&[5, 2, 3, 7], &[1, 2, 0, 3])],
    );
}

// ---------------------------------------------------------------------------------------
// i32, bool, comparisons, casts.

#[test]
fn comparisons_and_where() {
    for cmp in CMP {
        // f32: where(a cmp b, a, b · 2) with b row-broadcast; values drawn from a small
        // set so that equality happens.
        let small = Range::I(-2, 3);
        let ints = |shape: &[usize]| inp(DType::I32, shape, small);
        check(
            &format!("cmp_f_{cmp:?}"),
            vec![
                Inst::In(0),
                Inst::In(1),
                Inst::Cast(DType::F32, 0),
                Inst::Cast(DType::F32, 1),
                Inst::Cmp(cmp, 2, 3),
                c(2.0, DType::F32),
                Inst::Bin(BinaryOp::Mul, 3, 5),
                Inst::Where(4, 2, 6),
            ],
            DType::F32,
            &[6, 9],
            &[ints(&[6, 9]), ints(&[9])],
        );
        // i32 compare to a bool result.
        check(
            &format!("cmp_i_{cmp:?}"),
            vec![Inst::In(0), Inst::In(1), Inst::Cmp(cmp, 0, 1)],
            DType::Bool,
            &[5, 7],
            &[ints(&[5, 7]), ints(&[5, 1])],
        );
        // f32 compare with a constant, bool result; scalar tail and vectors.
        check(
            &format!("cmp_fc_{cmp:?}"),
            vec![Inst::In(0), c(0.0, DType::F32), Inst::Cmp(cmp, 0, 1)],
            DType::Bool,
            &[3, 13],
            &[f(&[3, 13])],
        );
    }
    // where over i32 and bool values, with a row-invariant condition.
    check(
        "where_i32",
        vec![Inst::In(0), Inst::In(1), Inst::In(2), Inst::Where(0, 1, 2)],
        DType::I32,
        &[4, 11],
        &[
            inp(DType::Bool, &[4, 1], Range::B),
            inp(DType::I32, &[4, 11], Range::I(-100, 100)),
            inp(DType::I32, &[11], Range::I(-100, 100)),
        ],
    );
    check(
        "where_bool",
        vec![Inst::In(0), Inst::In(1), Inst::In(2), Inst::Where(0, 1, 2)],
        DType::Bool,
        &[3, 10],
        &[
            inp(DType::Bool, &[3, 10], Range::B),
            inp(DType::Bool, &[3, 10], Range::B),
            inp(DType::Bool, &[], Range::B),
        ],
    );
}

#[test]
fn i32_arithmetic_wraps_like_the_reference() {
    let big = Range::I(i32::MIN, i32::MAX);
    for b in [BinaryOp::Add, BinaryOp::Sub, BinaryOp::Mul, BinaryOp::Max] {
        check(
            &format!("ibin_{b:?}"),
            vec![Inst::In(0), Inst::In(1), Inst::Bin(b, 0, 1)],
            DType::I32,
            &[5, 9],
            &[inp(DType::I32, &[5, 9], big), inp(DType::I32, &[9], big)],
        );
    }
    for u in [UnaryOp::Neg, UnaryOp::Relu] {
        check(
            &format!("iun_{u:?}"),
            vec![Inst::In(0), Inst::Un(u, 0)],
            DType::I32,
            &[23],
            &[inp(DType::I32, &[23], big)],
        );
    }
    check(
        "i_const",
        vec![
            Inst::In(0),
            c(7.0, DType::I32),
            Inst::Bin(BinaryOp::Mul, 0, 1),
        ],
        DType::I32,
        &[2, 6],
        &[inp(DType::I32, &[2, 6], big)],
    );
}

#[test]
fn every_cast() {
    let all = [DType::F32, DType::I32, DType::Bool];
    for from in all {
        for to in all {
            let range = match from {
                // Covers truncation toward zero, saturation and 0.
                DType::F32 => Range::F(-3e9, 3e9),
                DType::I32 => Range::I(-5, 5),
                _ => Range::B,
            };
            check(
                &format!("cast_{from}_{to}"),
                vec![Inst::In(0), Inst::Cast(to, 0)],
                to,
                &[3, 11],
                &[inp(from, &[3, 11], range)],
            );
            check(
                &format!("cast_small_{from}_{to}"),
                vec![Inst::In(0), Inst::Cast(to, 0)],
                to,
                &[2, 9],
                &[inp(
                    from,
                    &[2, 9],
                    match range {
                        Range::F(..) => Range::F(-2.5, 2.5),
                        r => r,
                    },
                )],
            );
        }
    }
    // NaN → i32 is 0, NaN → bool is true.
    let expr = Expr {
        out: TensorType::new(DType::I32, consts(&[5])),
        inputs: 1,
        insts: vec![Inst::In(0), Inst::Cast(DType::I32, 0)],
    };
    let func = region_typed("nan_cast", &expr, &[true], &[DType::F32]).unwrap();
    let src = text(&func);
    let (dims, items) = region_dims(&expr, &[5], &[vec![1]], 0, 0);
    let mut x = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -1.9, 2.9];
    let mut y = [7i32; 5];
    run_kernel(
        "nan_cast",
        &src,
        &[x.as_mut_ptr() as *mut u8, y.as_mut_ptr() as *mut u8],
        &dims,
        items,
        1,
    );
    assert_eq!(y, [0, i32::MAX, i32::MIN, -1, 2]);
}

#[test]
fn input_dtypes_are_inferred_or_must_be_given() {
    let shape = consts(&[4]);
    let cast = Expr {
        out: TensorType::new(DType::F32, shape.clone()),
        inputs: 1,
        insts: vec![Inst::In(0), Inst::Cast(DType::F32, 0)],
    };
    let err = region("ambiguous", &cast, &[true]).unwrap_err();
    assert!(err.contains("region_typed"), "{err}");
    assert!(region_typed("typed", &cast, &[true], &[DType::I32]).is_ok());
    let masked = Expr {
        out: TensorType::new(DType::F32, shape.clone()),
        inputs: 3,
        insts: vec![Inst::In(0), Inst::In(1), Inst::In(2), Inst::Where(0, 1, 2)],
    };
    assert_eq!(
        input_dtypes(&masked).unwrap(),
        vec![DType::Bool, DType::F32, DType::F32]
    );
    let bad = Expr {
        out: TensorType::new(DType::I32, shape.clone()),
        inputs: 1,
        insts: vec![Inst::In(0), Inst::Un(UnaryOp::Exp, 0)],
    };
    let err = region("bad", &bad, &[true]).unwrap_err();
    assert!(err.contains("not defined"), "{err}");
    let bf = Expr {
        out: TensorType::new(DType::BF16, shape),
        inputs: 1,
        insts: vec![Inst::In(0), Inst::Un(UnaryOp::Neg, 0)],
    };
    assert!(region("bf", &bf, &[true]).is_err());
    assert_eq!(
        region_inner(&[vec![3, 1], vec![0, 0], vec![]]),
        Some(vec![true, false, false])
    );
    assert_eq!(region_inner(&[vec![1, 2]]), None);
}

// ---------------------------------------------------------------------------------------
// Dropout.

#[test]
fn dropout_masks_are_bit_exact() {
    let seeds = [(0u64, 0u32), (42, 7), (0xDEAD_BEEF_0123_4567, 123_456)];
    for (si, &(seed, step)) in seeds.iter().enumerate() {
        for p in [0.1, 0.5, 0.0] {
            for out in [
                vec![37],
                vec![4, 1],
                vec![5, 3],
                vec![7, 5],
                vec![3, 17],
                vec![2, 64],
                vec![2, 3, 6],
                vec![],
            ] {
                check_full(
                    &format!(
                        "dropout_{si}_{}_{}",
                        (p * 10.0) as u32,
                        out.len() * 1000 + out.iter().sum::<usize>()
                    ),
                    vec![Inst::In(0), Inst::Dropout(Float::new(p), 11 + si as u32, 0)],
                    DType::F32,
                    &out,
                    &[f(&out)],
                    (seed, step),
                    true,
                );
            }
        }
    }
    // Dropout inside a chain, of a row-broadcast value, and two dropouts of different
    // streams in one program.
    check_full(
        "dropout_chain",
        vec![
            Inst::In(0),
            Inst::In(1),
            Inst::Bin(BinaryOp::Add, 0, 1),
            Inst::Dropout(Float::new(0.25), 3, 2),
            Inst::Dropout(Float::new(0.3), 4, 1),
            Inst::Bin(BinaryOp::Add, 3, 4),
        ],
        DType::F32,
        &[6, 13],
        &[f(&[6, 13]), f(&[6, 1])],
        (99, 5),
        false,
    );
}

// ---------------------------------------------------------------------------------------
// embed_pe.

fn check_embed(b: usize, t: usize, d: usize, vocab: usize, dropout: Option<(f64, u32)>) {
    let def = registry()
        .iter()
        .find(|def| def.name == "embed_pe" && def.attr_inputs.is_empty() == dropout.is_none())
        .expect("an embed_pe template");
    let (seed, step) = (0x1234_5678_9ABC_DEF0u64, 17u32);
    let mut rng = Rng(0xC0FF_EE00 + (b * 1000 + t * 100 + d) as u64);
    let table: Vec<f32> = (0..vocab * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let ids: Vec<i32> = (0..b * t).map(|_| rng.int(0, vocab as i32)).collect();
    let pe: Vec<f32> = (0..t * d).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let scale = rng.uniform(0.5, 8.0);

    // Reference: the template instantiated on concrete inputs.
    let mut g = Graph::new("embed");
    let mut operands = Vec::new();
    let mut tensors = BTreeMap::new();
    for &i in &def.inputs {
        let name = def.graph.source_name(i).unwrap().to_string();
        let (shape, t_): (Vec<usize>, Tensor) = match name.as_str() {
            "table" => (
                vec![vocab, d],
                Tensor::f32(vec![vocab, d], table.clone()).unwrap(),
            ),
            "ids" => (vec![b, t], Tensor::i32(vec![b, t], ids.clone()).unwrap()),
            "pe" => (vec![t, d], Tensor::f32(vec![t, d], pe.clone()).unwrap()),
            "scale" => (vec![], Tensor::scalar_f32(scale)),
            other => panic!("unexpected template input {other}"),
        };
        let dtype = def.graph.ty(i).dtype;
        operands.push(
            g.add_input(&name, TensorType::new(dtype, consts(&shape)))
                .unwrap(),
        );
        tensors.insert(name, t_);
    }
    let attrs: Vec<Attr> = match dropout {
        Some((p, stream)) => vec![Attr::F(Float::new(p)), Attr::Int(i64::from(stream))],
        None => vec![],
    };
    let outs = def.instantiate(&mut g, &operands, &attrs, "emb").unwrap();
    g.add_output("y", outs[0]).unwrap();
    let opts = RunOptions {
        seed,
        step,
        ..RunOptions::default()
    };
    let want = reference::run(&g, &tensors, &BTreeMap::new(), &opts).unwrap();
    let want = words(&want[0].1);

    let name = if dropout.is_some() {
        "embed_pe_dropout"
    } else {
        "embed_pe"
    };
    let src = text(&embed_pe(name, dropout.is_some()));
    let (dims, items) = embed_pe_dims([b, t, d], dropout, (seed, step));
    let mut table = table;
    let mut ids = ids;
    let mut pe = pe;
    let mut scale = [scale];
    let mut got = vec![0xDEAD_BEEFu32; b * t * d];
    let ptrs = [
        table.as_mut_ptr() as *mut u8,
        ids.as_mut_ptr() as *mut u8,
        pe.as_mut_ptr() as *mut u8,
        scale.as_mut_ptr() as *mut u8,
        got.as_mut_ptr() as *mut u8,
    ];
    for chunk in [items.max(1), 3, 1] {
        run_kernel(name, &src, &ptrs, &dims, items, chunk);
        // Products and sums are exact f32 steps, as in the reference: compare bits.
        compare(
            &format!("embed_pe b={b} t={t} d={d} dropout={dropout:?} chunks of {chunk}"),
            DType::F32,
            &got,
            &want,
            true,
        );
    }
}

#[test]
fn embed_pe_matches_the_template() {
    for (b, t, d, vocab) in [(2, 5, 16, 11), (3, 4, 7, 9), (1, 1, 1, 3), (2, 3, 33, 50)] {
        check_embed(b, t, d, vocab, None);
        check_embed(b, t, d, vocab, Some((0.1, 5)));
        check_embed(b, t, d, vocab, Some((0.5, 1_000_003)));
    }
}

// ---------------------------------------------------------------------------------------
// Determinism.

#[test]
fn clif_text_is_deterministic() {
    let expr = Expr {
        out: TensorType::new(DType::F32, consts(&[3, 4, 5])),
        inputs: 3,
        insts: vec![
            Inst::In(0),
            Inst::In(1),
            Inst::In(2),
            Inst::Un(UnaryOp::Exp, 1),
            Inst::Where(0, 3, 2),
            Inst::Dropout(Float::new(0.1), 2, 4),
        ],
    };
    let a = text(&region("det", &expr, &[false, true, true]).unwrap());
    let b = text(&region("det", &expr, &[false, true, true]).unwrap());
    assert_eq!(a, b);
    assert!(
        a.starts_with("function %det(i64, i64, i64, i64) system_v {"),
        "{a}"
    );
    for dropout in [false, true] {
        assert_eq!(text(&embed_pe("e", dropout)), text(&embed_pe("e", dropout)));
    }
}

// ---------------------------------------------------------------------------------------
// Regions found by the optimizer.

#[test]
fn regions_from_the_optimizer() {
    use kiln_compiler::optimize::kernels::{Def, KernelOp};
    use kiln_compiler::optimize::{optimize, Options};
    // y = where(keep, relu(x · s + b) − 0.5, x · 0.25), z = cast<f32>(ids > 2) + exp(x)
    let mut g = Graph::new("regions");
    let x = g
        .add_input("x", TensorType::new(DType::F32, consts(&[5, 7])))
        .unwrap();
    let b = g
        .add_input("b", TensorType::new(DType::F32, consts(&[7])))
        .unwrap();
    let s = g
        .add_input("s", TensorType::new(DType::F32, consts(&[])))
        .unwrap();
    let keep = g
        .add_input("keep", TensorType::new(DType::Bool, consts(&[5, 1])))
        .unwrap();
    let ids = g
        .add_input("ids", TensorType::new(DType::I32, consts(&[5, 7])))
        .unwrap();
    let full = consts(&[5, 7]);
    let bc = |g: &mut Graph, v: NodeId| {
        g.add(
            Op::Broadcast {
                shape: full.clone(),
            },
            &[v],
            "",
        )
        .unwrap()
    };
    let sb = bc(&mut g, s);
    let xs = g.add(Op::Binary(BinaryOp::Mul), &[x, sb], "").unwrap();
    let bb = bc(&mut g, b);
    let h = g.add(Op::Binary(BinaryOp::Add), &[xs, bb], "").unwrap();
    let r = g.add(Op::Unary(UnaryOp::Relu), &[h], "").unwrap();
    let half = g.add_const(0.5, DType::F32);
    let half = bc(&mut g, half);
    let r = g.add(Op::Binary(BinaryOp::Sub), &[r, half], "").unwrap();
    let q = g.add_const(0.25, DType::F32);
    let q = bc(&mut g, q);
    let xq = g.add(Op::Binary(BinaryOp::Mul), &[x, q], "").unwrap();
    let kb = bc(&mut g, keep);
    let y = g.add(Op::Where, &[kb, r, xq], "").unwrap();
    g.add_output("y", y).unwrap();
    let two = g.add_const(2.0, DType::I32);
    let two = bc(&mut g, two);
    let gt = g.add(Op::Compare(CmpOp::Gt), &[ids, two], "").unwrap();
    let gtf = g.add(Op::Cast { to: DType::F32 }, &[gt], "").unwrap();
    let ex = g.add(Op::Unary(UnaryOp::Exp), &[x], "").unwrap();
    let z = g.add(Op::Binary(BinaryOp::Add), &[gtf, ex], "").unwrap();
    g.add_output("z", z).unwrap();

    let (kg, _) = optimize(&g, &Options::default()).unwrap();
    let mut regions = 0;
    for v in &kg.values {
        let Def::Kernel {
            op: KernelOp::Region(expr),
            inputs,
            ..
        } = &v.def
        else {
            continue;
        };
        regions += 1;
        let ins: Vec<Input> = inputs
            .iter()
            .map(|&i| {
                let ty = &kg.values[i].types[0];
                let shape = ty.shape.as_consts().expect("concrete shapes");
                let range = match ty.dtype {
                    DType::F32 => Range::F(-3.0, 3.0),
                    DType::I32 => Range::I(0, 5),
                    _ => Range::B,
                };
                inp(ty.dtype, &shape, range)
            })
            .collect();
        let out = expr.out.shape.as_consts().expect("concrete shapes");
        check(
            &format!("opt_region_{regions}"),
            expr.insts.clone(),
            expr.out.dtype,
            &out,
            &ins,
        );
    }
    assert!(
        regions >= 2,
        "expected the optimizer to form regions:\n{kg:?}"
    );
}

/// The masks the kernels call for (`kiln_dropout_masks`, [`masks::masks`]) against
/// [`rng::dropout_keep`] at indices no tensor here reaches: aligned and not, and where
/// the low word of the block counter wraps inside a group of blocks (the carry into the
/// high word), for runs of 16 and of 100.
#[test]
fn kernel_masks_match_the_generator_at_any_index() {
    use kiln_compiler::codegen::masks;
    use kiln_compiler::rng;

    let (seed, step, stream, p) = (0x0123_4567_89AB_CDEFu64, 77u32, 5u32, 0.5);
    let threshold = rng::dropout_threshold(p);
    let wrap = (1u64 << 34) - 8; // blocks 2^32 − 2 … 2^32 + 1
    for index in [
        0u64,
        4,
        5,
        6,
        7,
        1000,
        wrap,
        wrap + 1,
        wrap + 4,
        (3u64 << 40) + 12,
        u64::MAX / 8,
    ] {
        for n in [16usize, 100] {
            let mut got = vec![0i32; n];
            masks::masks(seed, step, stream, threshold, index, &mut got);
            for (e, &m) in got.iter().enumerate() {
                let want = rng::dropout_keep(seed, step, stream, index + e as u64, threshold);
                assert_eq!(m, if want { -1 } else { 0 }, "index {index} + {e} of {n}");
            }
        }
    }
}
