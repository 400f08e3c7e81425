//! The CLIF math library (`exp`, `log`, `sin`, `cos`, the activations) against Rust's `f32` functions, in
//! vector lanes and in the scalar tail, through the JIT from text.

use kiln_compiler::codegen::clif::{build_kernel, text};
use kiln_compiler::codegen::{jit, math};

/// A kernel `y[i] = f(x[i])` over items [begin, end).
fn unary_kernel(
    name: &str,
    f: fn(
        &mut kiln_compiler::codegen::clif::Kb,
        cranelift_codegen::ir::Value,
    ) -> cranelift_codegen::ir::Value,
) -> String {
    let func = build_kernel(name, |kb| {
        let x = kb.ptr(0);
        let y = kb.ptr(1);
        let (lo, hi) = (kb.begin, kb.end);
        kb.map_elems(lo, hi, |kb, i, ty| {
            let v = kb.load(ty, x, i);
            let r = f(kb, v);
            kb.store(r, y, i);
        });
    });
    text(&func)
}

fn run(name: &str, src: &str, xs: &[f32]) -> Vec<f32> {
    let m = jit::compile(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    let f = m.get(name).expect("function");
    let mut out = vec![0f32; xs.len()];
    let ptrs = [xs.as_ptr() as *mut u8, out.as_mut_ptr() as *mut u8];
    unsafe { f(ptrs.as_ptr(), [0i64].as_ptr(), 0, xs.len() as i64) };
    out
}

fn check(
    name: &str,
    f: fn(
        &mut kiln_compiler::codegen::clif::Kb,
        cranelift_codegen::ir::Value,
    ) -> cranelift_codegen::ir::Value,
    reference: impl Fn(f32) -> f32,
    xs: &[f32],
    rel: f32,
    abs: f32,
) {
    let src = unary_kernel(name, f);
    let got = run(name, &src, xs);
    for (x, g) in xs.iter().zip(&got) {
        let want = reference(*x);
        if want.is_nan() {
            assert!(g.is_nan(), "{name}({x}) = {g}, want NaN");
            continue;
        }
        if want.is_infinite() {
            assert_eq!(*g, want, "{name}({x})");
            continue;
        }
        let err = (g - want).abs();
        assert!(
            err <= rel * want.abs() + abs,
            "{name}({x}) = {g}, want {want} (error {err})"
        );
    }
}

fn grid(lo: f32, hi: f32, n: usize) -> Vec<f32> {
    // An odd count so the last elements run in the scalar tail.
    (0..n)
        .map(|i| lo + (hi - lo) * i as f32 / (n - 1) as f32)
        .collect()
}

#[test]
fn exp_matches_std() {
    let mut xs = grid(-87.0, 88.0, 10_007);
    xs.extend([0.0, -0.0, 1e-8, -1e-8, -1e9, 1e9, f32::NAN, -100.0, 100.0]);
    // Results below f32::MIN_POSITIVE flush to 0 (no subnormal outputs).
    check("exp", math::exp, f32::exp, &xs, 4e-7, 1.2e-38);
}

/// The softmax form: the same bits as `exp` wherever the argument does not pass 88.72 (every
/// `x − max x` does), `−inf`, NaN and the flush to 0 below −87.34 included; and one
/// comparison and two selects shorter.
#[test]
fn exp_nonpositive_is_exp_below_its_overflow() {
    let mut xs = grid(-90.0, 0.0, 20_011);
    xs.extend(grid(0.0, 88.72, 1_001));
    xs.extend([
        -0.0,
        -1e-30,
        -87.33654,
        -87.3366,
        -1e9,
        f32::NEG_INFINITY,
        f32::NAN,
        -1e-8,
    ]);
    let whole = run("e", &unary_kernel("e", math::exp), &xs);
    let short = run("e", &unary_kernel("e", math::exp_nonpositive), &xs);
    for ((x, w), s) in xs.iter().zip(&whole).zip(&short) {
        assert_eq!(w.to_bits(), s.to_bits(), "exp({x}): {w} and {s}");
    }
    assert_eq!(short[xs.len() - 3], 0.0, "exp(−inf)");
    assert!(short[xs.len() - 2].is_nan(), "exp(NaN)");
    let count = |f| unary_kernel("e", f).matches("fcmp").count();
    // Two comparisons an `exp` and one a short one, in each copy of the loop body (the
    // unrolled vectors, the vector tail, the scalar tail).
    assert_eq!((count(math::exp), count(math::exp_nonpositive)), (12, 6));
    // Past 88.72 the full form gives +inf (the short one is not for such arguments).
    assert_eq!(
        run("e", &unary_kernel("e", math::exp), &[100.0]),
        [f32::INFINITY]
    );
}

#[test]
fn log_matches_std() {
    let mut xs = grid(1e-30, 10.0, 5_003);
    xs.extend(grid(10.0, 1e30, 5_003));
    xs.extend([
        0.0,
        -1.0,
        1.0,
        f32::INFINITY,
        f32::NAN,
        f32::MIN_POSITIVE,
        0.5,
        2.0,
    ]);
    check("log", math::log, f32::ln, &xs, 4e-7, 1e-7);
}

#[test]
fn sin_cos_match_std() {
    let xs = grid(-600.0, 600.0, 100_001);
    check(
        "sin",
        |kb, x| math::sincos(kb, x, false),
        f32::sin,
        &xs,
        0.0,
        2e-6,
    );
    check(
        "cos",
        |kb, x| math::sincos(kb, x, true),
        f32::cos,
        &xs,
        0.0,
        2e-6,
    );
}

/// The activations (#61) against f64 references: the relative error a few ulp, with the
/// signs, the limits and NaN.
#[test]
fn activations_match_f64_references() {
    let mut xs = grid(-12.0, 12.0, 20_001);
    xs.extend(grid(-1.2, 1.2, 4_001));
    xs.extend([
        0.0,
        -0.0,
        1e-8,
        -1e-8,
        1e-30,
        -100.0,
        100.0,
        1e9,
        -1e9,
        f32::NAN,
    ]);
    xs.extend([f32::INFINITY, f32::NEG_INFINITY]);
    let f64_of = |f: fn(f64) -> f64| move |x: f32| f(x as f64) as f32;
    check("tanh", math::tanh, f64_of(f64::tanh), &xs, 5e-7, 1e-37);
    check("erf", math::erf, f64_of(libm::erf), &xs, 3e-7, 2e-7);
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    check("sigmoid", math::sigmoid, f64_of(sig), &xs, 6e-7, 1e-37);
    check(
        "silu",
        math::silu,
        f64_of(|x| x / (1.0 + (-x).exp())),
        &xs,
        6e-7,
        1e-37,
    );
    // Odd functions keep the sign; the limits are exact.
    let src = unary_kernel("tanh", math::tanh);
    let got = run("tanh", &src, &[-1e-8, 30.0, -30.0, f32::INFINITY]);
    assert_eq!(got, [-1e-8, 1.0, -1.0, 1.0]);
    let src = unary_kernel("erf", math::erf);
    let got = run("erf", &src, &[-1e-8, 5.0, -5.0, f32::NEG_INFINITY]);
    assert!((got[0] + 1.128_379_2e-8).abs() < 1e-15, "{}", got[0]);
    assert_eq!(&got[1..], [1.0, -1.0, -1.0]);
}

#[test]
fn text_is_deterministic_and_rejects_bad_input() {
    let a = unary_kernel("exp", math::exp);
    let b = unary_kernel("exp", math::exp);
    assert_eq!(a, b);
    assert!(
        a.starts_with("function %exp(i64, i64, i64, i64) system_v {"),
        "{a}"
    );
    let err = jit::compile("function %bad(i64) system_v {\nblock0(v0: i64):\n    return\n}\n")
        .unwrap_err();
    assert!(err.contains("every kernel takes"), "{err}");
    let err = jit::compile("function %x(").unwrap_err();
    assert!(err.contains("does not parse"), "{err}");
}
