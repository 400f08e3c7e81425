//! Elementwise regions and `embed_pe` as CUDA C.
//!
//! In: a region's scalar program ([`Expr`]), its inputs' dtypes and innermost-stride
//! flags (as the CPU backend computes them); or `embed_pe`'s dropout flag. Out: one
//! [`CudaFunction`] each.
//!
//! # Region kernels ([`region`])
//!
//! Buffers: the inputs in order (`const float*` / `const int*`; bools are `int` 0/1),
//! then the output; in a mixed-precision program ([`region_as`]) a float buffer may be
//! `kiln_bf16`, widened on load and rounded on store. `dims`: exactly [`crate::codegen::region::region_dims`]'s array —
//! `C`, the `L` leading output dims, each input's `L` element strides over them, then
//! `seed` and `step` when the program has a dropout. Items: **elements**, `R·C` (the CPU
//! kernel's items are rows); four consecutive elements per thread ([`Work::Quads`]):
//! the first one's row and column are the group's only divisions (the others step the
//! column and carry into the leading indices), and each dropout draws one Philox block
//! for the four. Element `i` is row `i / C`, column `i % C`; input `k` is read at
//! `Σ_l j_l·s_k,l (+ c if its innermost stride is 1)`.
//!
//! Semantics are the reference executor's, as in the CPU kernel: NaN-propagating `max`
//! and `relu`, wrapping `i32` arithmetic, saturating `f32 → i32` casts (NaN → 0),
//! number → bool is `x != 0`, bool → number is 0/1, `recip` is `1/x`, dropout keeps
//! element `i` as [`crate::rng::dropout_keep`] does and scales by `1/(1−p)` computed in
//! f64 and rounded to f32. `exp`, `log`, `sin`, `cos` are CUDA's `expf`, `logf`, `sinf`,
//! `cosf` (not the CPU's polynomials).
//!
//! # `embed_pe` ([`embed_pe`])
//!
//! `out[b, t, :] = table[ids[b, t], :] · scale + pe[t, :]` (a product, then a sum), then
//! optionally dropout keyed by the flat output index. Buffers `[table, ids, pe, scale,
//! out]` and `dims` as [`crate::codegen::region::embed_pe_dims`] (`[d, t]`, with dropout
//! `[d, t, seed, step, stream, threshold, keep-scale bits]`). Items: elements `b·t·d`,
//! four per thread as in the regions.
//! Ids must be in range (the caller checks them, as on the CPU).

use crate::codegen::cuda::text::{f32_lit, i32_lit, Elem, W};
use crate::codegen::cuda::{param, signature, CudaFunction, Param, Work, FOR_QUADS};
use crate::ir::{BinaryOp, CmpOp, DType, UnaryOp};
use crate::optimize::regions::{Expr, Inst};
use crate::rng;

/// The dtype of every step, given the inputs' dtypes; an `Err` for what neither the
/// reference nor the CPU kernels define.
fn step_types(expr: &Expr, in_dtypes: &[DType]) -> Result<Vec<DType>, String> {
    let mut t: Vec<DType> = Vec::with_capacity(expr.insts.len());
    for (k, inst) in expr.insts.iter().enumerate() {
        let at = |a: usize| -> Result<DType, String> {
            t.get(a)
                .copied()
                .ok_or_else(|| format!("step {k} reads step {a}, which is not before it"))
        };
        let d = match *inst {
            Inst::In(i) => *in_dtypes
                .get(i)
                .ok_or_else(|| format!("step {k} reads input {i} of {}", in_dtypes.len()))?,
            Inst::Const(_, d) | Inst::Cast(d, _) => d,
            Inst::Un(u, a) => {
                let d = at(a)?;
                match (u, d) {
                    (_, DType::F32) | (UnaryOp::Neg | UnaryOp::Relu, DType::I32) => d,
                    _ => return Err(format!("region step {k}: {u:?} of {d} is not defined")),
                }
            }
            Inst::Bin(b, a, c) => {
                let (d, e) = (at(a)?, at(c)?);
                if d != e {
                    return Err(format!("region step {k}: {b:?} of {d} and {e}"));
                }
                match (b, d) {
                    (_, DType::F32) => d,
                    (b, DType::I32) if b != BinaryOp::Div => d,
                    _ => return Err(format!("region step {k}: {b:?} of {d} is not defined")),
                }
            }
            Inst::Cmp(c, a, b) => {
                let (d, e) = (at(a)?, at(b)?);
                if d != e || d == DType::Bool {
                    return Err(format!("region step {k}: {c:?} of {d} and {e}"));
                }
                DType::Bool
            }
            Inst::Where(c, a, b) => {
                let (dc, d, e) = (at(c)?, at(a)?, at(b)?);
                if dc != DType::Bool || d != e {
                    return Err(format!("region step {k}: where({dc}, {d}, {e})"));
                }
                d
            }
            Inst::Dropout(_, _, a) => {
                if at(a)? != DType::F32 {
                    return Err(format!("region step {k}: dropout of non-f32"));
                }
                DType::F32
            }
        };
        if !matches!(d, DType::F32 | DType::I32 | DType::Bool) {
            return Err(format!(
                "{d} values are not supported by CUDA region kernels"
            ));
        }
        t.push(d);
    }
    if t.last() != Some(&expr.out.dtype) {
        return Err(format!(
            "the region's last step is not its output type {}",
            expr.out.dtype
        ));
    }
    Ok(t)
}

/// The C type of a value of dtype `d` in registers (bools are `int` 0/1).
fn reg(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        _ => "int",
    }
}

fn unary(u: UnaryOp, d: DType, x: &str) -> String {
    if d == DType::I32 {
        return match u {
            UnaryOp::Neg => format!("kiln_wrap_sub(0, {x})"),
            _ => format!("({x} > 0 ? {x} : 0)"),
        };
    }
    match u {
        UnaryOp::Neg => format!("-{x}"),
        UnaryOp::Exp => format!("expf({x})"),
        UnaryOp::Log => format!("logf({x})"),
        UnaryOp::Sqrt => format!("sqrtf({x})"),
        UnaryOp::Recip => format!("1.0f / {x}"),
        UnaryOp::Relu => format!("kiln_relu({x})"),
        UnaryOp::Sin => format!("sinf({x})"),
        UnaryOp::Cos => format!("cosf({x})"),
        UnaryOp::Tanh => format!("tanhf({x})"),
        UnaryOp::Sigmoid => format!("1.0f / (1.0f + expf(-{x}))"),
        UnaryOp::Erf => format!("erff({x})"),
        UnaryOp::Rsqrt => format!("1.0f / sqrtf({x})"),
        UnaryOp::Silu => format!("{x} / (1.0f + expf(-{x}))"),
    }
}

fn binary(b: BinaryOp, d: DType, x: &str, y: &str) -> String {
    if d == DType::I32 {
        return match b {
            BinaryOp::Add => format!("kiln_wrap_add({x}, {y})"),
            BinaryOp::Sub => format!("kiln_wrap_sub({x}, {y})"),
            BinaryOp::Mul => format!("kiln_wrap_mul({x}, {y})"),
            _ => format!("({x} > {y} ? {x} : {y})"),
        };
    }
    match b {
        BinaryOp::Add => format!("{x} + {y}"),
        BinaryOp::Sub => format!("{x} - {y}"),
        BinaryOp::Mul => format!("{x} * {y}"),
        BinaryOp::Div => format!("{x} / {y}"),
        BinaryOp::Max => format!("kiln_max_bin({x}, {y})"),
    }
}

fn compare(c: CmpOp, x: &str, y: &str) -> String {
    format!("({x} {} {y}) ? 1 : 0", c.symbol())
}

fn cast(from: DType, to: DType, x: &str) -> String {
    match (from, to) {
        (a, b) if a == b => x.to_string(),
        (DType::F32, DType::I32) => format!("kiln_f2i({x})"),
        (DType::F32, _) => format!("({x} != 0.0f) ? 1 : 0"),
        (DType::I32, DType::F32) => format!("(float){x}"),
        (DType::I32, _) => format!("({x} != 0) ? 1 : 0"),
        (_, DType::I32) => x.to_string(),
        _ => format!("{x} ? 1.0f : 0.0f"),
    }
}

fn constant(d: DType, v: f64) -> String {
    match d {
        DType::F32 => f32_lit(v as f32),
        DType::I32 => i32_lit(v as i32),
        _ => (if v != 0.0 { "1" } else { "0" }).to_string(),
    }
}

/// `const T vk = …;` for every step of `expr`, input `i` read as `input(i)`.
fn steps(w: &mut W, expr: &Expr, types: &[DType], input: impl Fn(usize) -> String) {
    for (k, inst) in expr.insts.iter().enumerate() {
        let v = |a: usize| format!("v{a}");
        let rhs = match *inst {
            Inst::In(i) => input(i),
            Inst::Const(c, d) => constant(d, c.get()),
            Inst::Un(u, a) => unary(u, types[a], &v(a)),
            Inst::Bin(b, a, c) => binary(b, types[a], &v(a), &v(c)),
            Inst::Cmp(c, a, b) => compare(c, &v(a), &v(b)),
            Inst::Where(c, a, b) => format!("v{c} ? v{a} : v{b}"),
            Inst::Cast(d, a) => cast(types[a], d, &v(a)),
            Inst::Dropout(p, _, a) => {
                let p = p.get();
                let threshold = rng::dropout_threshold(p);
                let scale = (1.0 / (1.0 - p)) as f32;
                format!(
                    "kiln_keep_word(kiln_word_of(dw{k}, (unsigned)u), {threshold}u) ? v{a} * {} : 0.0f",
                    f32_lit(scale)
                )
            }
        };
        w.l(format!("const {} v{k} = {rhs};", reg(types[k])));
    }
}

/// `o{i}`, input `i`'s element offset: its strides times the leading indices `j0`, …
/// (each cast by `cast`), plus the column `c` if it reads along the row.
fn offset(lead: usize, i: usize, inner: bool, cast: &str) -> String {
    let mut terms: Vec<String> = (0..lead)
        .map(|k| format!("{cast}j{k} * dims.d[{}]", 1 + lead + i * lead + k))
        .collect();
    if inner {
        terms.push("c".into());
    }
    if terms.is_empty() {
        terms.push("0".into());
    }
    format!("const long long o{i} = {};", terms.join(" + "))
}

/// `vec`: whether every group of four elements lies in one row (`C` a multiple of 4),
/// every input read along the row starts each group on a vector boundary (its strides
/// multiples of 4, its pointer aligned to four elements), the output is aligned too, and
/// the row and leading indices fit in 32 bits. The same for every thread of a launch.
fn vector_condition(
    w: &mut W,
    lead: usize,
    n_in: usize,
    used: &[bool],
    inner: &[bool],
    stored: &[Elem],
    out: Elem,
) {
    let mut terms = vec!["items <= 2147483647LL".to_string()];
    if lead > 0 {
        terms.push("(C & 3) == 0".into());
    }
    let aligned =
        |p: &str, e: Elem| format!("((unsigned long long){p} & {}u) == 0", 4 * e.bytes() - 1);
    for i in (0..n_in).filter(|&i| used[i] && inner[i]) {
        for k in 0..lead {
            terms.push(format!("(dims.d[{}] & 3) == 0", 1 + lead + i * lead + k));
        }
        terms.push(aligned(&format!("in{i}"), stored[i]));
    }
    terms.push(aligned("out", out));
    w.l(format!("const bool vec = {};", terms.join(" && ")));
}

/// The region kernel for `expr` with inputs of `in_dtypes`, innermost strides 1
/// (`inner[k]`) or 0, every float buffer `float`.
pub fn region(
    name: &str,
    expr: &Expr,
    inner: &[bool],
    in_dtypes: &[DType],
) -> Result<CudaFunction, String> {
    let elems = vec![Elem::F32; in_dtypes.len()];
    region_as(name, expr, inner, in_dtypes, &elems, Elem::F32)
}

/// [`region`] with f32 inputs stored as `in_elems` and an f32 output as `out_elem`
/// (read widened, written rounded; the arithmetic is `float` either way). Integer and
/// bool buffers take `Elem::F32`.
pub fn region_as(
    name: &str,
    expr: &Expr,
    inner: &[bool],
    in_dtypes: &[DType],
    in_elems: &[Elem],
    out_elem: Elem,
) -> Result<CudaFunction, String> {
    let n_in = expr.inputs;
    if inner.len() != n_in || in_dtypes.len() != n_in || in_elems.len() != n_in {
        return Err(format!(
            "region `{name}`: {} inner flags, {} dtypes and {} element types for {n_in} inputs",
            inner.len(),
            in_dtypes.len(),
            in_elems.len()
        ));
    }
    let stored = |d: DType, e: Elem| -> Result<Elem, String> {
        if e != Elem::F32 && d != DType::F32 {
            return Err(format!("region `{name}`: a {d} buffer stored as {e:?}"));
        }
        Ok(e)
    };
    for (&d, &e) in in_dtypes.iter().zip(in_elems) {
        stored(d, e)?;
    }
    stored(expr.out.dtype, out_elem)?;
    let rank = expr.out.shape.rank();
    if rank > 5 {
        return Err(format!(
            "region `{name}`: rank {rank} outputs are not supported"
        ));
    }
    let types = step_types(expr, in_dtypes)?;
    let lead = rank.saturating_sub(1);
    let n = expr.insts.len();
    let used: Vec<bool> = (0..n_in)
        .map(|i| {
            expr.insts
                .iter()
                .any(|s| matches!(s, Inst::In(k) if *k == i))
        })
        .collect();

    let buf = |d: DType, e: Elem| if d == DType::F32 { e.c_type() } else { reg(d) };
    let mut params: Vec<Param> = (0..n_in)
        .map(|i| {
            param(
                &format!("in{i}"),
                &format!("const {}*", buf(in_dtypes[i], in_elems[i])),
            )
        })
        .collect();
    params.push(param("out", &format!("{}*", buf(types[n - 1], out_elem))));
    let mut w = W::new();
    signature(&mut w, name, &params);
    if lead > 0 {
        w.l("const long long C = dims.d[0];");
    }
    let dropout_base = 1 + lead + n_in * lead;
    if expr.insts.iter().any(|s| matches!(s, Inst::Dropout(..))) {
        w.l(format!(
            "const unsigned long long seed = (unsigned long long)dims.d[{dropout_base}];"
        ));
        w.l(format!(
            "const unsigned step = (unsigned)dims.d[{}];",
            dropout_base + 1
        ));
    }
    // The column, unless no input reads along it (every one broadcast over it).
    let column = (0..n_in).any(|i| used[i] && inner[i]);
    // (Integer and bool buffers are checked above to be `Elem::F32`: 4-byte words.)
    vector_condition(&mut w, lead, n_in, &used, inner, in_elems, out_elem);
    let loops = Loops {
        expr,
        types: &types,
        inner,
        in_dtypes,
        in_elems,
        out_elem,
        used,
        lead,
        column,
    };
    w.open(FOR_QUADS);
    w.l("const long long i0 = g << 2;");
    // One Philox block per dropout step: the words of the group's four elements.
    for (k, inst) in expr.insts.iter().enumerate() {
        if let Inst::Dropout(_, stream, _) = *inst {
            w.l(format!(
                "const kiln_words4 dw{k} = kiln_dropout_block(seed, step, {stream}u, (unsigned long long)g);"
            ));
        }
    }
    loops.vector_group(&mut w);
    loops.scalar_group(&mut w);
    w.close();
    w.close();
    let items = "elements R·C of the output, four per thread";
    Ok(CudaFunction::new(name, params, Work::Quads, items, w))
}

/// What the element loops of a region kernel are written from.
struct Loops<'a> {
    expr: &'a Expr,
    /// Each step's value type.
    types: &'a [DType],
    inner: &'a [bool],
    in_dtypes: &'a [DType],
    in_elems: &'a [Elem],
    out_elem: Elem,
    /// Whether the program reads input `i`.
    used: Vec<bool>,
    /// The output's leading axes (its rank − 1).
    lead: usize,
    /// Whether an input reads along the column.
    column: bool,
}

impl Loops<'_> {
    /// Input `i`'s value from its stored element `at`.
    fn read(&self, i: usize, at: &str) -> String {
        match self.in_dtypes[i] {
            DType::Bool => format!("({at} != 0) ? 1 : 0"),
            DType::F32 => self.in_elems[i].load(at),
            _ => at.to_string(),
        }
    }

    /// Element `u` of input `i`'s vector `x{i}` (a word, or half of one in bf16).
    fn read_lane(&self, i: usize) -> String {
        let x = format!("x{i}");
        match self.in_dtypes[i] {
            DType::Bool => format!("({x}.w[u] != 0) ? 1 : 0"),
            DType::F32 => self.in_elems[i].quad_lane(&x, "u"),
            _ => format!("(int){x}.w[u]"),
        }
    }

    /// A whole group of four in one row, every operand aligned: vector loads and one
    /// store.
    fn vector_group(&self, w: &mut W) {
        let n = self.expr.insts.len();
        w.open("if (vec && i0 + 3 < items)");
        if self.lead > 0 && self.used.iter().any(|&u| u) {
            w.l("const unsigned row = (unsigned)i0 / (unsigned)C;");
            if self.column {
                w.l("const unsigned c = (unsigned)i0 - row * (unsigned)C;");
            }
            w.l("unsigned rest = row;");
            for k in (1..self.lead).rev() {
                w.l(format!(
                    "const unsigned q{k} = rest / (unsigned)dims.d[{}];",
                    1 + k
                ));
                w.l(format!(
                    "const unsigned j{k} = rest - q{k} * (unsigned)dims.d[{}];",
                    1 + k
                ));
                w.l(format!("rest = q{k};"));
            }
            w.l("const unsigned j0 = rest;");
        } else if self.lead == 0 && self.column {
            w.l("const long long c = i0;");
        }
        for i in (0..self.expr.inputs).filter(|&i| self.used[i]) {
            w.l(offset(self.lead, i, self.inner[i], "(long long)"));
            if self.inner[i] {
                let v = self.in_elems[i].quad();
                w.l(format!("const {v} x{i} = *(const {v}*)(in{i} + o{i});"));
            } else {
                w.l(format!(
                    "const {} b{i} = {};",
                    reg(self.in_dtypes[i]),
                    self.read(i, &format!("in{i}[o{i}]"))
                ));
            }
        }
        let out_vec = self.out_elem.quad();
        w.l(format!("{out_vec} st = {{}};"));
        w.l("KILN_UNROLL");
        w.open("for (int u = 0; u < 4; ++u)");
        steps(w, self.expr, self.types, |i| {
            if self.inner[i] {
                self.read_lane(i)
            } else {
                format!("b{i}")
            }
        });
        let last = format!("v{}", n - 1);
        let word = match (self.types[n - 1], self.out_elem) {
            (DType::F32, Elem::F32) => format!("(unsigned)__float_as_int({last})"),
            (DType::F32, Elem::Bf16) => format!("(unsigned)kiln_f32_to_bf16({last})"),
            _ => format!("(unsigned){last}"),
        };
        match self.out_elem {
            Elem::F32 => w.l(format!("st.w[u] = {word};")),
            Elem::Bf16 => w.l(format!("st.w[u >> 1] |= {word} << (16 * (u & 1));")),
        }
        w.close();
        w.l(format!("*({out_vec}*)(out + i0) = st;"));
        w.l("continue;");
        w.close();
    }

    /// Any other group: element by element, the row and column carried from the first.
    fn scalar_group(&self, w: &mut W) {
        let n = self.expr.insts.len();
        // Rows are tracked through the column all the same when there are leading axes.
        let track_c = self.column || self.lead > 0;
        // The first element's row and column (the only divisions of the group).
        if self.lead > 0 {
            w.l("const long long row = i0 / C;");
            w.l("long long c = i0 - row * C;");
            w.l("long long rest = row;");
            for k in (1..self.lead).rev() {
                w.l(format!("const long long q{k} = rest / dims.d[{}];", 1 + k));
                w.l(format!("long long j{k} = rest - q{k} * dims.d[{}];", 1 + k));
                w.l(format!("rest = q{k};"));
            }
            w.l("long long j0 = rest;");
        } else if track_c {
            w.l("long long c = i0;");
        }
        w.open("for (int u = 0; u < 4; ++u)");
        w.l("const long long i = i0 + u;");
        w.l("if (i >= items) break;");
        if track_c {
            // The next element: the column, then the leading indices, carried.
            w.open("if (u > 0)");
            if self.lead > 0 {
                w.open("if (++c == C)");
                w.l("c = 0;");
                for k in (1..self.lead).rev() {
                    w.open(format!("if (++j{k} == dims.d[{}])", 1 + k));
                    w.l(format!("j{k} = 0;"));
                }
                w.l("++j0;");
                for _ in 1..self.lead {
                    w.close();
                }
                w.close();
            } else {
                w.l("++c;");
            }
            w.close();
        }
        for i in (0..self.expr.inputs).filter(|&i| self.used[i]) {
            w.l(offset(self.lead, i, self.inner[i], ""));
        }
        steps(w, self.expr, self.types, |i| {
            self.read(i, &format!("in{i}[o{i}]"))
        });
        let last = format!("v{}", n - 1);
        let value = if self.types[n - 1] == DType::F32 {
            self.out_elem.store(&last)
        } else {
            last
        };
        w.l(format!("out[i] = {value};"));
        w.close();
    }
}

/// The `embed_pe` kernel (see the module documentation).
pub fn embed_pe(name: &str, dropout: bool) -> CudaFunction {
    embed_pe_as(name, dropout, Elem::F32, Elem::F32)
}

/// [`embed_pe`] with `pe` stored as `pe` and the output as `out` (the table is `float`).
pub fn embed_pe_as(name: &str, dropout: bool, pe: Elem, out: Elem) -> CudaFunction {
    let params = vec![
        param("table", "const float*"),
        param("ids", "const int*"),
        param("pe", &pe.ptr(true)),
        param("scale", "const float*"),
        param("out", &out.ptr(false)),
    ];
    let mut w = W::new();
    signature(&mut w, name, &params);
    w.l("const long long d = dims.d[0];");
    w.l("const long long t = dims.d[1];");
    w.l("const float s = scale[0];");
    if dropout {
        w.l("const unsigned long long seed = (unsigned long long)dims.d[2];");
        w.l("const unsigned step = (unsigned)dims.d[3];");
        w.l("const unsigned stream = (unsigned)dims.d[4];");
        w.l("const unsigned threshold = (unsigned)dims.d[5];");
        w.l("const float keep_scale = __int_as_float((int)dims.d[6]);");
    }
    w.open(FOR_QUADS);
    w.l("const long long i0 = g << 2;");
    if dropout {
        w.l(
            "const kiln_words4 dw = kiln_dropout_block(seed, step, stream, (unsigned long long)g);",
        );
    }
    w.l("long long row = i0 / d;");
    w.l("long long c = i0 - row * d;");
    w.l("long long pos = row % t;");
    w.open("for (int u = 0; u < 4; ++u)");
    w.l("const long long i = i0 + u;");
    w.l("if (i >= items) break;");
    w.open("if (u > 0 && ++c == d)");
    w.l("c = 0;");
    w.l("++row;");
    w.l("if (++pos == t) pos = 0;");
    w.close();
    w.l("const long long id = ids[row];");
    w.l("const float x = table[id * d + c] * s;");
    w.l(format!("float y = x + {};", pe.load("pe[pos * d + c]")));
    if dropout {
        w.l(
            "y = kiln_keep_word(kiln_word_of(dw, (unsigned)u), threshold) ? y * keep_scale : 0.0f;",
        );
    }
    w.l(format!("out[i] = {};", out.store("y")));
    w.close();
    w.close();
    w.close();
    CudaFunction {
        name: name.to_string(),
        params,
        work: Work::Quads,
        items_rule: "elements b·t·d of the output, four per thread".into(),
        text: w.finish(),
    }
}
