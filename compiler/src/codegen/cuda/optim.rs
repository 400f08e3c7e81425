//! The optimizer step on the device: what training needs so that parameters, gradients
//! and Adam's moments stay in GPU memory between steps.
//!
//! In: nothing but the element count of each call. Out: [`code`] — a CUDA unit of its own
//! (the prelude and three functions), compiled by NVRTC next to an entry's module with
//! the same [`super::nvrtc_options`]:
//!
//! | function            | buffers                          | does, per element `i < n`            |
//! |---------------------|----------------------------------|--------------------------------------|
//! | [`GRAD_ASSIGN`]     | `[g, w, acc, bad]`               | `acc[i] = w·g[i]`                    |
//! | [`GRAD_ACCUMULATE`] | `[g, w, acc, bad]`               | `acc[i] = acc[i] + w·g[i]`           |
//! | [`ADAM_STEP`]       | `[p, acc, m, v, k]`              | Adam on `g = acc[i]·scale`, in place |
//!
//! and the same three over many tensors in one launch ([`GRAD_ASSIGN_MANY`],
//! [`GRAD_ACCUMULATE_MANY`], [`ADAM_STEP_MANY`]): a table of each tensor's pointers and
//! length replaces the per-tensor buffers (a base step's 253 parameters were 253 launches
//! of each, mostly launch overhead), the arithmetic per element is the same.
//!
//! dims `[n]`, items `n` (one thread per element, `Work::Threads`). `w` is one `float`
//! (a micro-batch's target tokens), `bad` one `unsigned` set to 1 when some `g[i]` is not
//! finite (it is never cleared here), `k` the [`ADAM_CONSTANTS`] in that order.
//!
//! These are the trainer's host loops (`kiln_train::trainer`'s gradient accumulation,
//! its `1/tokens` scaling and `kiln_train::optim::Adam::step`) element for element in
//! the same op order, so with `--fmad=false` a step on the device gives the host's bits:
//! `w·g` then the sum; `acc·scale` rounded to `f32` before Adam uses it.

use crate::codegen::cuda::misc::adam_math;
use crate::codegen::cuda::text::{prelude, W};
use crate::codegen::cuda::{param, signature, CudaCode, CudaFunction, Param, Work, FOR_THREADS};

/// `acc = w·g` (the first micro-batch of a step).
pub const GRAD_ASSIGN: &str = "kiln_grad_assign";
/// `acc += w·g` (the later micro-batches).
pub const GRAD_ACCUMULATE: &str = "kiln_grad_accumulate";
/// One Adam update from the accumulated gradient.
pub const ADAM_STEP: &str = "kiln_adam_step";
/// [`GRAD_ASSIGN`] over a table of tensors.
pub const GRAD_ASSIGN_MANY: &str = "kiln_grad_assign_many";
/// [`GRAD_ACCUMULATE`] over a table of tensors.
pub const GRAD_ACCUMULATE_MANY: &str = "kiln_grad_accumulate_many";
/// [`ADAM_STEP`] over a table of tensors.
pub const ADAM_STEP_MANY: &str = "kiln_adam_step_many";

/// 64-bit entries a tensor takes in the table of [`grad_accumulate_many`]: the gradient,
/// the accumulator, the tensor's `bad` word (pointers) and the length.
pub const GRAD_ENTRY: usize = 4;
/// 64-bit entries a tensor takes in the table of [`adam_step_many`]: `p`, `acc`, `m`,
/// `v` (pointers) and the length.
pub const ADAM_ENTRY: usize = 5;

/// The threads a `_many` launch should ask for (its `items`): enough for the largest
/// tensor, at most 2^20 (4,096 blocks; each thread strides over the rest).
pub fn many_items(largest: usize) -> usize {
    largest.clamp(1, 1 << 20)
}

/// A table as the `_many` kernels read it: each 64-bit entry as two `unsigned` words, low
/// word first (so the table needs only 4-byte alignment).
pub fn table_words(entries: &[u64]) -> Vec<u32> {
    entries
        .iter()
        .flat_map(|&e| [e as u32, (e >> 32) as u32])
        .collect()
}

/// C: entry `j` of the current tensor's row `e` of a table, as a 64-bit value.
fn entry(j: usize) -> String {
    format!(
        "(((unsigned long long)e[{}] << 32) | (unsigned long long)e[{}])",
        2 * j + 1,
        2 * j
    )
}

/// Opens the loop over a table's `dims.d[0]` tensors (`e` the row of `width` entries)
/// and, inside it, the grid-stride loop over the tensor's `n` elements.
fn open_many(w: &mut W, width: usize, ptrs: &[(&str, &str)]) {
    w.l("const long long count = dims.d[0];");
    w.open("for (long long t = 0; t < count; ++t)");
    w.l(format!("const unsigned* e = tab + {} * t;", 2 * width));
    for (j, (c_type, name)) in ptrs.iter().enumerate() {
        w.l(format!("{c_type} {name} = ({c_type}){};", entry(j)));
    }
    w.l(format!(
        "const long long n = (long long){};",
        entry(ptrs.len())
    ));
    w.open("for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)");
}

/// The values of [`ADAM_STEP`]'s `k` buffer, in order: `beta1`, `beta2`, `1 − beta1`,
/// `1 − beta2`, `eps`, `lr / (1 − beta1^t)`, `1 / sqrt(1 − beta2^t)` (each as the host
/// optimizer rounds it to `f32`) and the gradient's scale (`1 / tokens`).
pub const ADAM_CONSTANTS: [&str; 8] = [
    "b1",
    "b2",
    "c1",
    "c2",
    "eps",
    "step_size",
    "inv_sqrt_bc2",
    "scale",
];

fn function(name: &str, params: Vec<Param>, w: W) -> CudaFunction {
    CudaFunction::new(name, params, Work::Threads, "elements n", w)
}

/// The gradient's element `i` into its accumulator (`acc`, weight `k_w`), flagging `bad`.
fn grad_element(w: &mut W, first: bool) {
    w.l("const float gi = g[i];");
    w.l("// Not finite: all exponent bits set (inf or NaN). Every writer stores 1.");
    w.l("if ((__float_as_int(gi) & 0x7f800000) == 0x7f800000) bad[0] = 1u;");
    if first {
        w.l("acc[i] = k_w * gi;");
    } else {
        w.l("acc[i] = acc[i] + k_w * gi;");
    }
}

/// Adam's update of element `i` of `p`, `m`, `v` from `acc[i]·k_scale`.
fn adam_element(w: &mut W) {
    w.l("const float gi = acc[i] * k_scale;");
    w.l("const float pi = p[i];");
    w.l("const float mi = m[i];");
    w.l("const float vi = v[i];");
    adam_math(w);
    w.l("p[i] = p2;");
    w.l("m[i] = m2;");
    w.l("v[i] = v2;");
}

/// [`GRAD_ASSIGN`] (`first`) or [`GRAD_ACCUMULATE`].
pub fn grad_accumulate(first: bool) -> CudaFunction {
    let name = if first { GRAD_ASSIGN } else { GRAD_ACCUMULATE };
    let params = vec![
        param("g", "const float*"),
        param("w", "const float*"),
        param("acc", "float*"),
        param("bad", "unsigned*"),
    ];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const float k_w = w[0];");
    w.open(FOR_THREADS);
    grad_element(&mut w, first);
    w.close();
    w.close();
    function(name, params, w)
}

/// [`GRAD_ASSIGN_MANY`] (`first`) or [`GRAD_ACCUMULATE_MANY`]: buffers `[tab, w]`, `tab`
/// [`GRAD_ENTRY`] entries a tensor ([`table_words`]), dims `[tensors]`, items
/// [`many_items`].
pub fn grad_accumulate_many(first: bool) -> CudaFunction {
    let name = if first {
        GRAD_ASSIGN_MANY
    } else {
        GRAD_ACCUMULATE_MANY
    };
    let params = vec![param("tab", "const unsigned*"), param("w", "const float*")];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const float k_w = w[0];");
    open_many(
        &mut w,
        GRAD_ENTRY,
        &[
            ("const float*", "g"),
            ("float*", "acc"),
            ("unsigned*", "bad"),
        ],
    );
    grad_element(&mut w, first);
    w.close();
    w.close();
    w.close();
    CudaFunction {
        items_rule: "threads many_items(largest tensor)".to_string(),
        ..function(name, params, w)
    }
}

/// [`ADAM_STEP_MANY`]: buffers `[tab, k]`, `tab` [`ADAM_ENTRY`] entries a tensor, dims
/// `[tensors]`, items [`many_items`].
pub fn adam_step_many() -> CudaFunction {
    let params = vec![param("tab", "const unsigned*"), param("k", "const float*")];
    let mut w = W::new();
    signature(&mut w, ADAM_STEP_MANY, &params);
    for (j, c) in ADAM_CONSTANTS.iter().enumerate() {
        w.l(format!("const float k_{c} = k[{j}];"));
    }
    open_many(
        &mut w,
        ADAM_ENTRY,
        &[
            ("float*", "p"),
            ("const float*", "acc"),
            ("float*", "m"),
            ("float*", "v"),
        ],
    );
    adam_element(&mut w);
    w.close();
    w.close();
    w.close();
    CudaFunction {
        items_rule: "threads many_items(largest tensor)".to_string(),
        ..function(ADAM_STEP_MANY, params, w)
    }
}

/// [`ADAM_STEP`]: `g = acc·scale`, then Adam's update of `p`, `m`, `v` in place.
pub fn adam_step() -> CudaFunction {
    let params = vec![
        param("p", "float*"),
        param("acc", "const float*"),
        param("m", "float*"),
        param("v", "float*"),
        param("k", "const float*"),
    ];
    let mut w = W::new();
    signature(&mut w, ADAM_STEP, &params);
    for (j, c) in ADAM_CONSTANTS.iter().enumerate() {
        w.l(format!("const float k_{c} = k[{j}];"));
    }
    w.open(FOR_THREADS);
    adam_element(&mut w);
    w.close();
    w.close();
    function(ADAM_STEP, params, w)
}

/// The optimizer's unit: the prelude, [`GRAD_ASSIGN`], [`GRAD_ACCUMULATE`], [`ADAM_STEP`]
/// and their `_many` forms (no kernel launches of a graph). Deterministic text.
pub fn code() -> CudaCode {
    CudaCode {
        prelude: prelude(),
        functions: vec![
            grad_accumulate(true),
            grad_accumulate(false),
            adam_step(),
            grad_accumulate_many(true),
            grad_accumulate_many(false),
            adam_step_many(),
        ],
        kernels: Vec::new(),
        storage: Vec::new(),
    }
}
