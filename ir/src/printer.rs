//! The deterministic text form of a graph (`kiln graph SPEC`).
//!
//! In: a [`Graph`]. Out: one line per node, `%id = op operands attrs : type  # scope`,
//! then the outputs. Node order, number formatting and attribute order are fixed, so the
//! same graph always prints to the same bytes — snapshot tests depend on it.

use std::fmt::Write;

use crate::ir::{Graph, Node, Op};

/// The attribute text of an op (empty when it has none).
pub fn op_attrs(op: &Op) -> String {
    match op {
        Op::Input { name } => name.clone(),
        Op::Param { name, init } => format!("{name} init={init}"),
        Op::Const { value, dtype } => match dtype {
            crate::ir::DType::I32 => format!("{}", value.get() as i64),
            crate::ir::DType::Bool => format!("{}", value.get() != 0.0),
            _ => value.to_string(),
        },
        Op::Reshape { shape } | Op::Broadcast { shape } => format!("to={shape}"),
        Op::Permute { perm } => format!(
            "perm=[{}]",
            perm.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Op::Cast { to } => format!("to={to}"),
        Op::Reduce { axis, .. } => format!("axis={axis}"),
        Op::ScatterAdd { rows } => format!("rows={rows}"),
        Op::Dropout { p, stream } => format!("p={p} stream={stream}"),
        Op::CausalMask { q, k } => format!("q={q} k={k}"),
        Op::PadMask { pad } => format!("pad={pad}"),
        Op::Arange { start, len } if start.as_const() == Some(0) => format!("len={len}"),
        Op::Arange { start, len } => format!("start={start} len={len}"),
        Op::Slice { axis, start, len } => format!("axis={axis} start={start} len={len}"),
        Op::OneHot { depth } => format!("depth={depth}"),
        Op::Concat { axis } => format!("axis={axis}"),
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::MatMul | Op::Gather => {
            String::new()
        }
    }
}

/// One node's line, without the trailing newline.
pub fn node_line(id: usize, node: &Node) -> String {
    let mut line = format!("%{id} = {}", node.op.name());
    if !node.inputs.is_empty() {
        let ops: Vec<String> = node.inputs.iter().map(|i| i.to_string()).collect();
        write!(line, " {}", ops.join(", ")).unwrap();
    }
    let attrs = op_attrs(&node.op);
    if !attrs.is_empty() {
        write!(line, " {attrs}").unwrap();
    }
    write!(line, " : {}", node.ty).unwrap();
    if !node.scope.is_empty() {
        write!(line, "  # {}", node.scope).unwrap();
    }
    line
}

/// The whole graph as text.
pub fn print_graph(g: &Graph) -> String {
    let mut out = String::new();
    writeln!(out, "graph {}", g.name).unwrap();
    if !g.dims.is_empty() {
        writeln!(out, "dims {}", g.dims.join(", ")).unwrap();
    }
    for (i, node) in g.nodes.iter().enumerate() {
        writeln!(out, "{}", node_line(i, node)).unwrap();
    }
    for o in &g.outputs {
        let kind = if Some(&o.name) == g.objective.as_ref() {
            "objective"
        } else {
            "output"
        };
        writeln!(out, "{kind} {} = {}", o.name, o.node).unwrap();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{BinaryOp, DType, Init, Op, TensorType};
    use crate::shape::{Dim, Shape};

    #[test]
    fn prints_a_small_graph() {
        let mut g = Graph::new("tiny");
        g.add_dim("b");
        let x = g
            .add_input(
                "x",
                TensorType::new(DType::F32, Shape(vec![Dim::sym("b"), Dim::c(4)])),
            )
            .unwrap();
        let w = g
            .add_param(
                "lin.w",
                TensorType::new(DType::F32, Shape::consts(&[4, 3])),
                Init::XavierUniform,
                "lin",
            )
            .unwrap();
        let y = g.add(Op::MatMul, &[x, w], "lin").unwrap();
        let half = g.add_const(0.5, DType::F32);
        let hb = g
            .add(
                Op::Broadcast {
                    shape: g.ty(y).shape.clone(),
                },
                &[half],
                "",
            )
            .unwrap();
        let z = g.add(Op::Binary(BinaryOp::Mul), &[y, hb], "").unwrap();
        // A repeated op is the same node.
        assert_eq!(g.add(Op::Binary(BinaryOp::Mul), &[y, hb], "").unwrap(), z);
        g.add_output("z", z).unwrap();
        assert_eq!(
            print_graph(&g),
            "graph tiny\n\
             dims b\n\
             %0 = input x : f32[b, 4]\n\
             %1 = param lin.w init=xavier_uniform : f32[4, 3]  # lin\n\
             %2 = matmul %0, %1 : f32[b, 3]  # lin\n\
             %3 = const 0.5 : f32[]\n\
             %4 = broadcast %3 to=[b, 3] : f32[b, 3]\n\
             %5 = mul %2, %4 : f32[b, 3]\n\
             output z = %5\n"
        );
        g.verify().unwrap();
    }
}
