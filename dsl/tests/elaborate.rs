//! Elaboration semantics: naming, sharing, repeat, overrides, patterns, control flow and
//! the errors the DSL promises — each on a small spec written inline.

use kiln_dsl::{compile_str, Mode, Options};
use kiln_ir::ir::{Init, Op};
use kiln_ir::Graph;

fn compile(text: &str) -> Graph {
    compile_with(text, &[], Mode::Eval)
}

fn compile_with(text: &str, sets: &[&str], mode: Mode) -> Graph {
    let opts = Options {
        overrides: sets.iter().map(|s| s.to_string()).collect(),
        mode,
        model: None,
    };
    compile_str("test.kiln", text, &opts).unwrap_or_else(|e| panic!("{}", e.render(false)))
}

fn error(text: &str, sets: &[&str]) -> String {
    let opts = Options {
        overrides: sets.iter().map(|s| s.to_string()).collect(),
        ..Options::default()
    };
    match compile_str("test.kiln", text, &opts) {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.render(false),
    }
}

fn param_names(g: &Graph) -> Vec<String> {
    g.params
        .iter()
        .map(|&p| g.source_name(p).unwrap().to_string())
        .collect()
}

#[test]
fn applying_an_instance_twice_shares_its_weights() {
    let g = compile(
        "model m(d: int = 4) {\n\
           dims b\n\
           input x: f32[b, d]\n\
           input y: f32[b, d]\n\
           proj = linear(d_in = d, d_out = d)\n\
           output a = proj(x)\n\
           output c = proj(y)\n\
         }",
    );
    assert_eq!(param_names(&g), ["proj.w", "proj.b"]);
    assert_eq!(g.num_parameters(), 20);
}

#[test]
fn inline_calls_get_their_layer_name_or_a_numbered_one() {
    let g = compile(
        "layer two(d: int)(x: [..., d]) {\n\
           a = linear(x, d_in = d, d_out = d)\n\
           linear(a, d_in = d, d_out = d, bias = false)\n\
         }\n\
         layer one(d: int)(x: [..., d]) {\n\
           linear(x, d_in = d, d_out = 2)\n\
         }\n\
         model m(d: int = 3) {\n\
           dims b\n\
           input x: f32[b, d]\n\
           t = two(d = d)\n\
           output y = one(t(x), d = d)\n\
         }",
    );
    assert_eq!(
        param_names(&g),
        [
            "t.linear_0.w",
            "t.linear_0.b",
            "t.linear_1.w",
            "one.linear.w",
            "one.linear.b"
        ]
    );
}

#[test]
fn reapplying_an_instance_reuses_its_inline_instances() {
    let g = compile(
        "layer block(d: int)(x: [..., d]) {\n\
           relu(linear(x, d_in = d, d_out = d))\n\
         }\n\
         model m(d: int = 3) {\n\
           dims b\n\
           input x: f32[b, d]\n\
           blk = block(d = d)\n\
           output y = blk(blk(x))\n\
         }",
    );
    assert_eq!(param_names(&g), ["blk.linear.w", "blk.linear.b"]);
}

#[test]
fn repeat_makes_independent_numbered_copies_threaded_in_order() {
    let g = compile(
        "layer block(d: int)(x: [..., d], scale) {\n\
           linear(x, d_in = d, d_out = d) * scale\n\
         }\n\
         model m(d: int = 2, n: int = 3) {\n\
           dims b\n\
           input x: f32[b, d]\n\
           input s: f32[b, d]\n\
           stack = repeat(n, block(d = d))\n\
           output y = stack(x, s)\n\
         }",
    );
    assert_eq!(
        param_names(&g),
        [
            "stack.0.linear.w",
            "stack.0.linear.b",
            "stack.1.linear.w",
            "stack.1.linear.b",
            "stack.2.linear.w",
            "stack.2.linear.b"
        ]
    );
    // The output depends on the last copy, which consumes the second's output.
    let y = g.output("y").unwrap();
    assert!(g.node(y).scope.starts_with("stack.2"));
    // repeat(0, ...) is the identity.
    let g0 = compile_with(
        "layer block(d: int)(x: [..., d]) { linear(x, d_in = d, d_out = d) }\n\
         model m(d: int = 2, n: int = 3) {\n\
           dims b\n\
           input x: f32[b, d]\n\
           stack = repeat(n, block(d = d))\n\
           output y = stack(x)\n\
         }",
        &["n=0"],
        Mode::Eval,
    );
    assert_eq!(g0.params.len(), 0);
    assert_eq!(g0.output("y"), g0.input("x"));
}

#[test]
fn defaults_see_earlier_parameters_and_overrides_apply_in_order() {
    let spec = "model base(d: int = 8, h: int = 2, d_k: int = d / h, p: float = 0.1) {\n\
                  dims b\n\
                  input x: f32[b, d]\n\
                  w = linear(d_in = d, d_out = h * d_k)\n\
                  output y = w(x)\n\
                }\n\
                model derived = base(h = 4) {\n\
                  output z = y * 2.0\n\
                }";
    let opts = |sets: &[&str]| Options {
        overrides: sets.iter().map(|s| s.to_string()).collect(),
        model: Some("derived".to_string()),
        ..Options::default()
    };
    let g = compile_str("t.kiln", spec, &opts(&[])).unwrap();
    assert_eq!(g.ty(g.output("y").unwrap()).to_string(), "f32[b, 8]");
    assert!(
        g.output("z").is_some(),
        "the alias's extension block adds an output"
    );
    // The command line beats the alias: d = 12 with the alias's h = 4 gives d_k = 3.
    let g = compile_str("t.kiln", spec, &opts(&["d=12"])).unwrap();
    assert_eq!(g.ty(g.output("y").unwrap()).to_string(), "f32[b, 12]");
    assert_eq!(g.ty(g.param("w.w").unwrap()).to_string(), "f32[12, 12]");
    let err = compile_str("t.kiln", spec, &opts(&["d=10"]))
        .unwrap_err()
        .render(false);
    assert!(
        err.contains("`d` (10) is not divisible by `h` (4)"),
        "{err}"
    );
    assert!(err.contains("divisors of 10 near 4 are 2 and 5"), "{err}");
}

#[test]
fn set_values_are_typed() {
    let spec = "model m(d: int = 8, p: float = 0.1, flag: bool = false, name: str = \"x\") {\n\
                  dims b\n\
                  input x: f32[b, d]\n\
                  check p < 1.0\n\
                  output y = x * p\n\
                }";
    compile_with(
        spec,
        &["p=0", "flag=true", "name=abc", "d=1_024"],
        Mode::Eval,
    );
    assert!(error(spec, &["flag=yes"]).contains("`flag` is a bool"));
    assert!(error(spec, &["p=lots"]).contains("`p` is a float"));
    assert!(error(spec, &["d=8", "d=9"]).contains("`d` is set twice"));
    assert!(error(spec, &["p=2"]).contains("check failed"));
}

#[test]
fn patterns_bind_and_check_dims() {
    let spec = "layer pair()(a: f32[n, k], b: f32[k, m]) { a @ b }\n\
                model m() {\n\
                  dims r\n\
                  input x: f32[r, 3]\n\
                  input w: f32[3, 5]\n\
                  input v: f32[4, 5]\n\
                  output y = pair(x, w)\n\
                  output z = pair(x, v)\n\
                }";
    let err = error(spec, &[]);
    assert!(
        err.contains("argument `b` of `pair` must be `f32[k, m]`, got f32[4, 5]"),
        "{err}"
    );
    assert!(err.contains("axis 0 must be k = 3, but it is 4"), "{err}");
    // `...` matches any number of leading axes.
    let g = compile(
        "layer last(d: int)(x: [..., d]) { x * 2.0 }\n\
         model m() {\n\
           dims b, t\n\
           input x: f32[b, t, 4]\n\
           input y: f32[4]\n\
           output a = last(x, d = 4)\n\
           output c = last(y, d = 4)\n\
         }",
    );
    assert_eq!(g.outputs.len(), 2);
}

#[test]
fn if_expressions_return_and_optional_tensors() {
    let spec = "layer pick(big: bool)(x, extra = none) {\n\
                  if extra != none {\n\
                    return x + extra\n\
                  }\n\
                  if big { x * 10.0 } else { x }\n\
                }\n\
                model m(big: bool = false) {\n\
                  dims b\n\
                  input x: f32[b, 2]\n\
                  input e: f32[b, 2]\n\
                  output with_extra = pick(x, extra = e, big = big)\n\
                  output plain = pick(x, big = big)\n\
                }";
    let g = compile(spec);
    assert_eq!(g.node(g.output("with_extra").unwrap()).op.name(), "add");
    assert_eq!(g.output("plain"), g.input("x"));
    let g = compile_with(spec, &["big=true"], Mode::Eval);
    assert_eq!(g.node(g.output("plain").unwrap()).op.name(), "mul");
}

#[test]
fn prim_reaches_the_primitive_behind_a_prelude_layer() {
    let spec = "model m() {\n\
                  dims b\n\
                  input x: f32[b, 4]\n\
                  output y = prim.dropout(x, p = 0.5)\n\
                  output z = dropout(x, p = 0.5)\n\
                }";
    let g = compile_with(spec, &[], Mode::Train);
    let drops = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Dropout { .. }))
        .count();
    assert_eq!(drops, 2);
    let g = compile_with(spec, &[], Mode::Eval);
    assert_eq!(g.output("y"), g.input("x"));
}

#[test]
fn initializers_follow_the_spec() {
    let g = compile(
        "layer l()(x) {\n\
           param a: f32[3, 4]\n\
           param b: f32[4]\n\
           param c: f32[4] init 0.5\n\
           param e: f32[2, 4] init normal(std = 0.02)\n\
           param u: f32[2, 4] init uniform(a = 0.1)\n\
           x @ a + b + c + sum(e, axis = 0) * 0.0 + sum(u, axis = 0) * 0.0\n\
         }\n\
         model m() {\n\
           dims n\n\
           input x: f32[n, 3]\n\
           output y = l(x)\n\
         }",
    );
    let init = |name: &str| match &g.node(g.param(name).unwrap()).op {
        Op::Param { init, .. } => *init,
        _ => unreachable!(),
    };
    assert_eq!(init("l.a"), Init::XavierUniform);
    assert_eq!(init("l.b"), Init::Zeros);
    assert!(matches!(init("l.c"), Init::Constant(v) if v.get() == 0.5));
    assert!(matches!(init("l.e"), Init::Normal { std } if std.get() == 0.02));
    assert!(matches!(init("l.u"), Init::Uniform { a } if a.get() == 0.1));
}

#[test]
fn symbolic_dims_flow_through_reshape_and_concat() {
    let g = compile(
        "model m() {\n\
           dims b, t\n\
           input x: f32[b, t, 6]\n\
           flat = reshape(x, [b * t, 6])\n\
           back = reshape(flat, [b, t, 2, 3])\n\
           output y = concat([x, x], axis = 1)\n\
           output z = back\n\
           check dim(y, 1) == 2 * t and rank(back) == 4 and dim(flat, 0) == t * b\n\
         }",
    );
    assert_eq!(g.ty(g.output("y").unwrap()).to_string(), "f32[b, 2*t, 6]");
    assert_eq!(g.ty(g.output("z").unwrap()).to_string(), "f32[b, t, 2, 3]");
}

#[test]
fn errors_name_the_problem() {
    let m = |body: &str| {
        format!("model m(d: int = 4) {{\n  dims b, t\n  input x: f32[b, t, d]\n{body}\n}}")
    };
    let cases: &[(&str, &str)] = &[
        (
            "  output y = reshape(x, [b, 5])",
            "cannot reshape [b, t, 4] into [b, 5]",
        ),
        ("  output y = x @ x", "inner dims 4 and t differ"),
        (
            "  output y = softmax(x, axis = 3)",
            "axis 3 is out of range for a tensor with 3 axes",
        ),
        (
            "  output y = where(x, x, x)",
            "argument `cond` of `where` must be a bool tensor",
        ),
        ("  output y = x ** 3", "tensor ** 3 is not supported"),
        (
            "  output y = x + true",
            "expected a tensor or a number, got a bool",
        ),
        ("  z = 1 / 0\n  output y = x", "division by zero"),
        (
            "  output y = sqrt(-1.0) * x",
            "sqrt needs a non-negative number",
        ),
        ("  output y = cast(x, f8)", "unknown name `f8`"),
        ("  output y = x.weight", "`.weight` needs a layer instance"),
        ("  output y = 3", "output `y` must be a tensor, got an int"),
        (
            "  output y = x\n  output y = x",
            "output `y` is defined twice",
        ),
        (
            "  output y = repeat(2, x)",
            "`repeat` needs a layer with its hyper-parameters bound",
        ),
        (
            "  output y = linear(x, d_in = d, d_out = 2)(x)",
            "is a tensor, which cannot be called",
        ),
        (
            "  l = linear(d_in = d, d_out = 2)\n  output y = l(x, d_out = 3)",
            "`d_out` is fixed when `l` is created",
        ),
        ("  dims t\n  output y = x", "`t` is already defined"),
        (
            "  output y = mean(x, axis = 1)",
            "`mean` over a symbolic size (t) is not supported",
        ),
        (
            "  output y = concat([], axis = 0)",
            "`concat` needs at least one tensor",
        ),
    ];
    for (body, want) in cases {
        let err = error(&m(body), &[]);
        assert!(
            err.contains(want),
            "for {body:?} expected {want:?} in:\n{err}"
        );
    }
}

#[test]
fn errors_inside_the_prelude_point_at_the_user_call() {
    let err = error(
        "model m() {\n  dims b, t\n  input x: f32[b, t, 6]\n  output y = attention(x, x, d_model = 6, h = 4)\n}",
        &[],
    );
    // The user's line is the primary location; the prelude line is a note.
    assert!(
        err.contains("`d_model` (6) is not divisible by `h` (4)"),
        "{err}"
    );
    assert!(err.contains("test.kiln:4:"), "{err}");
    assert!(err.contains("inside prelude layer `attention`"), "{err}");
}

#[test]
fn prelude_defines_the_standard_layers() {
    let layers = kiln_dsl::prelude_layers().unwrap();
    for name in [
        "linear",
        "ffn",
        "attention",
        "layer_norm",
        "residual_norm",
        "dropout",
        "embedding",
        "sinusoidal",
        "learned",
        "tied_projection",
        "label_smoothed_xent",
        "softmax",
        "log_softmax",
    ] {
        assert!(
            layers.iter().any(|l| l == name),
            "the prelude lacks `{name}`"
        );
    }
}

/// `kv_cache(…, transposed = true)`: in decode mode the cache is stored with the cached
/// axis last, and the value returned has `x`'s layout; elsewhere it is `x` itself.
#[test]
fn a_transposed_cache_is_stored_with_its_axis_last() {
    let spec = "model m(d: int = 4) {\n\
                  dims b, t\n\
                  input x: f32[b, t, d]\n\
                  param w: f32[d, d]\n\
                  output k = kv_cache(x @ w, axis = 1, name = \"k\", transposed = true)\n\
                }";
    let g = compile_with(spec, &[], Mode::Decode);
    let cache = g.input("cache.k").expect("the cache input");
    assert_eq!(g.ty(cache).to_string(), "f32[b, 4, past]");
    let grown = g.output("cache.k").expect("the cache output");
    assert_eq!(g.ty(grown).to_string(), "f32[b, 4, past + t]");
    let k = g.output("k").expect("the layer's value");
    assert_eq!(g.ty(k).to_string(), "f32[b, past + t, 4]");
    // Not decoding: `x @ w` itself, with no permutes around it.
    let g = compile_with(spec, &[], Mode::Eval);
    let k = g.output("k").expect("the layer's value");
    assert!(matches!(g.node(k).op, Op::MatMul));
    let bad = spec.replace("transposed = true", "transposed = 2");
    let err = error(&bad, &[]);
    assert!(err.contains("transposed"), "{err}");
}
