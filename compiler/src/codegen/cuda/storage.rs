//! Mixed precision: the element type every float buffer of a program is stored in.
//!
//! In: a [`KernelGraph`] and the activations' element type (`Elem::Bf16` for a mixed
//! precision program). Out: [`Storage`] — per value of the kernel graph, one [`Elem`] per
//! output. Arithmetic stays `float` in every kernel: a bf16 buffer is widened when read
//! and rounded when written, so the choice below is only where values are kept.
//!
//! # The rule
//!
//! A buffer is a kernel's output, a parameter, a constant or an entry input; a view
//! (reshape, permute, broadcast) is its source's buffer, and output `i` of a
//! multi-output kernel is a buffer of its own. Integer and bool buffers are 4-byte words
//! whatever the mode, listed as `Elem::F32`. A float buffer is
//!
//! 1. **as its kernels require** — the fused templates' generated code reads and writes
//!    activations in the program's element type and everything else in `float`
//!    ([`operand_class`], [`output_class`]):
//!    - activations: the operands `x`, `y`, `q`, `k`, `v`, `g`, `logits` of the row and
//!      attention kernels, and their outputs (`xent_ls`'s logits gradient included);
//!    - `float`: parameters they read (`gamma`, `beta`, biases, the embedding table),
//!      scalar operands, `xent_ls`'s loss and `add_layer_norm_bwd`'s `dgamma`/`dbeta`;
//!    - every operand and result of `adam_update` (f32 master weights, moments and the
//!      gradients Adam reads);
//!    - every float operand and result of a kernel that runs on the host (the CPU
//!      fallback reads 4-byte words);
//! 2. otherwise **`float` for parameters and constants**, and for any other buffer
//!    **the activation type when it is an activation**: its shape has a symbolic dim
//!    (`batch`, `src_len`, …) and it depends on an entry input, the batch's data. The
//!    rest stays `float`: weight and bias gradients, statistics, scalars, and what is
//!    computed from the dims alone — positions and the sinusoids' angles, which bf16
//!    would round (it holds integers exactly only up to 256).
//!
//! Regions, `embed_pe`, `sum_rows`, reductions, `concat`, `scatter_add`, GEMMs and
//! copies take any element type per operand, so they impose nothing
//! (`scatter_add_into` only on its rows: its base and result are a weight gradient, in
//! `float`). Two requirements
//! on one buffer (a parameter read as an activation, a value one kernel reads as bf16
//! and another as `float`) are an error naming both kernels.
//!
//! Entry inputs and outputs follow the same rule: a float entry input, such as a decoding
//! step's key/value cache or the encoder's output, is an activation kept in bf16, and
//! the executor converts at the boundary.
//!
//! With `Elem::F32` every buffer is `float`: an f32 program is unchanged.

use std::collections::BTreeMap;

use crate::codegen::cuda::text::Elem;
use crate::ir::{DType, Op};
use crate::optimize::kernels::{Def, KernelGraph, KernelOp};
use crate::optimize::templates::registry;
use crate::plan::MemoryPlan;

/// The element type of each value's buffers: `storage[v][i]` for output `i` of value `v`
/// (one entry for a value with one type).
pub type Storage = Vec<Vec<Elem>>;

/// What a kernel wants of one float buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// The program's activation type.
    Act,
    /// `float`.
    Full,
    /// Anything (the kernel is generated per element type).
    Free,
}

/// What template `template`'s operand named `input` (in its template graph) needs.
pub fn operand_class(template: &str, input: &str) -> Class {
    match (template, input) {
        ("adam_update", _) => Class::Full,
        ("linear" | "linear_relu", "x" | "w")
        | ("sum_rows", _)
        | ("embed_pe", "pe")
        | ("scatter_add_into", "src") => Class::Free,
        (_, "x" | "y" | "q" | "k" | "v" | "g" | "g_carry" | "logits") => Class::Act,
        _ => Class::Full,
    }
}

/// What template `template`'s output `i` needs.
pub fn output_class(template: &str, i: usize) -> Class {
    match (template, i) {
        ("adam_update", _) => Class::Full,
        ("sum_rows" | "embed_pe", _) => Class::Free,
        ("add_layer_norm_bwd", 1..) | ("xent_ls", 0) | ("scatter_add_into", _) => Class::Full,
        _ => Class::Act,
    }
}

/// Whether a primitive kernel has CUDA code; the others run on the host
/// ([`super::Library::Host`]).
pub fn on_device(kg: &KernelGraph, op: &Op, inputs: &[usize]) -> bool {
    let dtype = |k: usize| inputs.get(k).map(|&x| kg.values[x].types[0].dtype);
    match op {
        Op::Reduce { .. } => dtype(0) == Some(DType::F32),
        Op::ScatterAdd { .. } => {
            inputs.len() == 2 && dtype(0) == Some(DType::I32) && dtype(1) == Some(DType::F32)
        }
        Op::MatMul
        | Op::CausalMask { .. }
        | Op::PadMask { .. }
        | Op::Arange { .. }
        | Op::Concat { .. } => true,
        _ => false,
    }
}

/// The buffer value `v` lives in: `(owner, output)`, through views and projections.
pub fn buffer(kg: &KernelGraph, mut v: usize) -> (usize, usize) {
    loop {
        match &kg.values[v].def {
            Def::View(_, src) => v = *src,
            Def::Proj(k, i) => return (*k, usize::from(*i)),
            _ => return (v, 0),
        }
    }
}

/// The storage of every buffer of `kg` with activations in `act` (see the module
/// documentation), or the conflict that prevents it.
pub fn plan(kg: &KernelGraph, act: Elem) -> Result<Storage, String> {
    if act == Elem::F32 {
        return Ok(kg
            .values
            .iter()
            .map(|v| vec![Elem::F32; v.types.len()])
            .collect());
    }
    let float = |b: (usize, usize)| {
        kg.values[b.0]
            .types
            .get(b.1)
            .is_some_and(|t| t.dtype == DType::F32)
    };
    // Requirements: buffer -> (element type, who asked).
    let mut req: BTreeMap<(usize, usize), (Elem, String)> = BTreeMap::new();
    let mut require = |b: (usize, usize), e: Elem, who: String| -> Result<(), String> {
        if !float(b) {
            return Ok(());
        }
        match req.get(&b) {
            Some((had, by)) if *had != e => Err(format!(
                "value %{} is needed as {} by {by} and as {} by {who}: a mixed-precision \
                 program keeps each buffer in one type",
                b.0,
                name(*had),
                name(e)
            )),
            Some(_) => Ok(()),
            None => {
                req.insert(b, (e, who));
                Ok(())
            }
        }
    };
    for (v, value) in kg.values.iter().enumerate() {
        if matches!(value.def, Def::Param(_) | Def::Const(..)) {
            let what = match &value.def {
                Def::Param(p) => format!("parameter `{p}` (f32 master weights)"),
                _ => "a constant".to_string(),
            };
            require((v, 0), Elem::F32, what)?;
        }
    }
    let class_elem = |c: Class| match c {
        Class::Act => Some(act),
        Class::Full => Some(Elem::F32),
        Class::Free => None,
    };
    for (v, op, inputs) in kg.kernels() {
        let who = format!("kernel %{v} ({})", op.kind());
        match op {
            KernelOp::Template { id, .. } => {
                let def = &registry()[*id as usize];
                for (k, &x) in inputs.iter().enumerate() {
                    let input = def
                        .inputs
                        .get(k)
                        .map(|&n| match &def.graph.node(n).op {
                            Op::Input { name } => name.as_str(),
                            _ => "",
                        })
                        .unwrap_or("");
                    if let Some(e) = class_elem(operand_class(&def.name, input)) {
                        require(buffer(kg, x), e, format!("{who}, operand `{input}`"))?;
                    }
                }
                for i in 0..kg.values[v].types.len() {
                    if let Some(e) = class_elem(output_class(&def.name, i)) {
                        require((v, i), e, format!("{who}, output {i}"))?;
                    }
                }
            }
            KernelOp::Prim(p) if !on_device(kg, p, inputs) => {
                let who = format!("{who}, which runs on the host");
                for &x in inputs {
                    require(buffer(kg, x), Elem::F32, who.clone())?;
                }
                for i in 0..kg.values[v].types.len() {
                    require((v, i), Elem::F32, who.clone())?;
                }
            }
            _ => {}
        }
    }
    // Whether a value depends on an entry input (the batch's data); positions and
    // sinusoids computed from the dims alone do not.
    let mut data = vec![false; kg.values.len()];
    for (v, value) in kg.values.iter().enumerate() {
        data[v] = match &value.def {
            Def::Input(_) => true,
            Def::Param(_) | Def::Const(..) => false,
            Def::View(_, src) => data[*src],
            Def::Proj(k, _) => data[*k],
            Def::Kernel { inputs, .. } => inputs.iter().any(|&x| data[x]),
        };
    }
    let mut out: Storage = Vec::with_capacity(kg.values.len());
    for v in 0..kg.values.len() {
        let owned = |b: (usize, usize)| -> Elem {
            if !float(b) {
                return Elem::F32;
            }
            if let Some((e, _)) = req.get(&b) {
                return *e;
            }
            let symbolic = kg.values[b.0].types[b.1]
                .shape
                .dims()
                .iter()
                .any(|d| !d.is_const());
            if symbolic && data[b.0] {
                act
            } else {
                Elem::F32
            }
        };
        let n = kg.values[v].types.len();
        let elems = if matches!(kg.values[v].def, Def::Kernel { .. }) && n > 1 {
            (0..n).map(|i| owned((v, i))).collect()
        } else {
            vec![owned(buffer(kg, v))]
        };
        out.push(elems);
    }
    Ok(out)
}

/// The element type of value `v` (output 0; views and projections resolved).
pub fn of(storage: &Storage, kg: &KernelGraph, v: usize) -> Elem {
    let (owner, i) = buffer(kg, v);
    storage
        .get(owner)
        .and_then(|s| s.get(i))
        .copied()
        .unwrap_or(Elem::F32)
}

/// The memory plan of a program stored as `storage` says: kernel results in their
/// element type's bytes (a bf16 activation takes half the slot an f32 one does). With
/// an f32 storage (or an empty one) it is [`MemoryPlan::build`]'s plan.
pub fn memory_plan(kg: &KernelGraph, storage: &Storage) -> MemoryPlan {
    MemoryPlan::build_with(kg, &|v, k| {
        storage
            .get(v)
            .and_then(|s| s.get(k))
            .map_or(Elem::F32.bytes(), |e| e.bytes())
    })
}

fn name(e: Elem) -> &'static str {
    match e {
        Elem::F32 => "f32",
        Elem::Bf16 => "bf16",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::TensorType;
    use crate::optimize::extract::Target;
    use crate::optimize::kernels::Value;
    use crate::shape::{Dim, Shape};

    fn value(def: Def, dtype: DType, dims: Vec<Dim>) -> Value {
        Value {
            def,
            types: vec![TensorType::new(dtype, Shape(dims))],
            scope: String::new(),
        }
    }

    fn graph(values: Vec<Value>) -> KernelGraph {
        KernelGraph {
            name: "t".into(),
            target: Target::Cuda,
            dims: vec!["batch".into()],
            values,
            outputs: Vec::new(),
            objective: None,
            stages: Vec::new(),
            hparams: Vec::new(),
        }
    }

    fn template(name: &str, variant: &str) -> u16 {
        registry()
            .iter()
            .position(|t| t.name == name && t.variant == variant)
            .expect("a registered template") as u16
    }

    fn kernel(index: usize, op: KernelOp, inputs: Vec<usize>) -> Def {
        Def::Kernel { index, op, inputs }
    }

    /// `x: f32[batch, 4]` (an input), `w: f32[4, 4]` (a parameter), `t = transpose(w)`
    /// (a view), `y = softmax(x)`, `z = y · t`, and a weight gradient `y · z` (its shape
    /// has no symbolic dim).
    #[test]
    fn activations_go_bf16_and_parameters_stay_f32() {
        let (b, c4) = (Dim::sym("batch"), Dim::c(4));
        let softmax = KernelOp::Template {
            id: template("softmax", "rank=2"),
            attrs: Vec::new(),
        };
        let kg = graph(vec![
            value(
                Def::Input("x".into()),
                DType::F32,
                vec![b.clone(), c4.clone()],
            ),
            value(
                Def::Param("w".into()),
                DType::F32,
                vec![c4.clone(), c4.clone()],
            ),
            value(
                Def::View(Op::Permute { perm: vec![1, 0] }, 1),
                DType::F32,
                vec![c4.clone(), c4.clone()],
            ),
            value(
                kernel(0, softmax.clone(), vec![0]),
                DType::F32,
                vec![b.clone(), c4.clone()],
            ),
            value(
                kernel(1, KernelOp::Prim(Op::MatMul), vec![3, 2]),
                DType::F32,
                vec![b.clone(), c4.clone()],
            ),
            value(
                kernel(2, KernelOp::Prim(Op::MatMul), vec![3, 4]),
                DType::F32,
                vec![c4.clone(), c4.clone()],
            ),
        ]);
        let f32_plan = plan(&kg, Elem::F32).unwrap();
        assert!(f32_plan.iter().flatten().all(|&e| e == Elem::F32));
        let p = plan(&kg, Elem::Bf16).unwrap();
        let got: Vec<Elem> = p.iter().map(|e| e[0]).collect();
        use Elem::{Bf16, F32};
        assert_eq!(got, vec![Bf16, F32, F32, Bf16, Bf16, F32]);
        assert_eq!(of(&p, &kg, 2), F32, "a view is its source's buffer");

        // A parameter read as an activation is a conflict, named.
        let mut bad = kg.clone();
        bad.values.push(value(
            kernel(3, softmax, vec![1]),
            DType::F32,
            vec![c4.clone(), c4.clone()],
        ));
        let e = plan(&bad, Elem::Bf16).unwrap_err();
        assert!(
            e.contains("value %1")
                && e.contains("parameter `w`")
                && e.contains("kernel %6 (softmax), operand `x`"),
            "{e}"
        );
    }
}
