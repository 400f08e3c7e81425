//! Hyper-parameters taken from the input's shape (#61): the card's `attention(h=8,d_k=64)`
//! and `linear(d_out = 2048)` elaborate with the parameter shapes their inputs determine;
//! explicit values still work and are checked; a second width is a located error.

use kiln_dsl::{compile_str, Options};
use kiln_ir::Graph;

fn compile(text: &str) -> Result<Graph, String> {
    compile_str("test.kiln", text, &Options::default()).map_err(|e| e.render(false))
}

fn shape(g: &Graph, name: &str) -> String {
    let p = g
        .param(name)
        .unwrap_or_else(|| panic!("no parameter {name}"));
    g.ty(p).to_string()
}

const HEAD: &str = "model m(vocab: int = 100) {\n  dims batch, len\n  input ids: i32[batch, len]\n  x = embedding(ids, vocab = vocab, d = 512)\n";

fn spec(body: &str) -> String {
    format!("{HEAD}{body}\n}}")
}

#[test]
fn the_cards_attention_takes_d_model_from_its_input() {
    let g = compile(&spec(
        "  attn = attention(h=8,d_k=64)\n  output y = attn(x, x)",
    ))
    .unwrap();
    assert_eq!(shape(&g, "attn.w_q"), "f32[512, 512]");
    assert_eq!(shape(&g, "attn.w_o"), "f32[512, 512]");
    assert_eq!(
        g.ty(g.output("y").unwrap()).to_string(),
        "f32[batch, len, 512]"
    );
    // d_k's default, d_model / h, follows the inferred d_model.
    let g = compile(&spec("  output y = attention(x, x, h = 4)")).unwrap();
    assert_eq!(shape(&g, "attention.w_q"), "f32[512, 512]");
    let g = compile(&spec("  output y = attention(x, x, h = 4, d_k = 32)")).unwrap();
    assert_eq!(shape(&g, "attention.w_k"), "f32[512, 128]");
    assert_eq!(shape(&g, "attention.w_o"), "f32[128, 512]");
}

#[test]
fn linear_ffn_and_norms_take_their_widths_from_their_inputs() {
    let g = compile(&spec(
        "  h = linear(x, d_out = 2048)\n  n = layer_norm(h)\n  output y = residual_norm(x, ffn(x, d_ff = 64))",
    ))
    .unwrap();
    assert_eq!(shape(&g, "linear.w"), "f32[512, 2048]");
    assert_eq!(shape(&g, "layer_norm.gamma"), "f32[2048]");
    assert_eq!(shape(&g, "ffn.linear1.w"), "f32[512, 64]");
    assert_eq!(shape(&g, "ffn.linear2.w"), "f32[64, 512]");
    assert_eq!(shape(&g, "residual_norm.gamma"), "f32[512]");
}

#[test]
fn each_repeated_copy_takes_its_own_input_width() {
    let g = compile(&spec(
        "  narrow = linear(x, d_out = 8)\n  stack = repeat(2, linear(d_out = 8))\n  output y = stack(narrow)",
    ))
    .unwrap();
    assert_eq!(shape(&g, "stack.0.w"), "f32[8, 8]");
    assert_eq!(shape(&g, "stack.1.w"), "f32[8, 8]");
    let g = compile(&spec(
        "  stack = repeat(2, linear(d_out = 8))\n  output y = stack(x)",
    ))
    .unwrap();
    assert_eq!(shape(&g, "stack.0.w"), "f32[512, 8]");
    assert_eq!(shape(&g, "stack.1.w"), "f32[8, 8]");
}

#[test]
fn a_shared_instance_keeps_its_first_width() {
    let g = compile(&spec(
        "  proj = linear(d_out = 512)\n  a = proj(x)\n  output y = proj(a)\n  check proj.d_in == 512, \"d_in taken from x\"",
    ))
    .unwrap();
    assert_eq!(shape(&g, "proj.w"), "f32[512, 512]");
    let e = compile(&spec(
        "  proj = linear(d_out = 64)\n  a = proj(x)\n  output y = proj(linear(x, d_out = 32))",
    ))
    .unwrap_err();
    assert!(e.contains("axis 2 must be d_in = 512, but it is 32"), "{e}");
    assert!(
        e.contains("`d_in` = 512 of `proj` came from its first application"),
        "{e}"
    );
}

#[test]
fn explicit_values_are_still_taken_and_checked() {
    let g = compile(&spec("  output y = attention(x, x, d_model = 512, h = 8)")).unwrap();
    assert_eq!(shape(&g, "attention.w_v"), "f32[512, 512]");
    let e = compile(&spec("  output y = attention(x, x, d_model = 256, h = 8)")).unwrap_err();
    assert!(
        e.contains("axis 2 must be d_model = 256, but it is 512"),
        "{e}"
    );
    // A hyper-parameter no pattern names is still required.
    let e = compile(&spec("  output y = attention(x, x)")).unwrap_err();
    assert!(e.contains("missing argument `h` of `attention`"), "{e}");
}
