//! Operators on tensors: broadcasting, elementwise operators, powers and matrix products
//! as IR nodes.

use kiln_ir::infer::broadcast_shapes;
use kiln_ir::ir::{BinaryOp, CmpOp, DType, NodeId, Op, UnaryOp};
use kiln_ir::shape::Shape;

use crate::diagnostics::Diag;
use crate::source::Span;
use crate::values::Value;

use super::*;

impl<'p> Elab<'p> {
    /// Broadcasts `id` to `shape` (no node when it already has it).
    pub(crate) fn broadcast(
        &mut self,
        frame: &Frame,
        id: NodeId,
        shape: &Shape,
        span: Span,
    ) -> R<NodeId> {
        if &self.graph.ty(id).shape == shape {
            return Ok(id);
        }
        self.node(
            frame,
            Op::Broadcast {
                shape: shape.clone(),
            },
            &[id],
            span,
        )
    }

    /// A tensor from a value: tensors as they are, numbers as scalar constants of `dtype`.
    pub(crate) fn as_tensor(&mut self, v: &Value, dtype: DType, span: Span) -> R<NodeId> {
        match v {
            Value::Tensor(t) => Ok(*t),
            Value::Int(x) => Ok(self.graph.add_const(*x as f64, dtype)),
            Value::Float(x) if dtype.is_float() => Ok(self.graph.add_const(*x, dtype)),
            Value::Float(x) => Err(Diag::new(
                "kiln::type",
                format!("cannot use the float {x} with an {dtype} tensor"),
            )
            .at(span, "a float")
            .help("cast the tensor first: `cast(x, f32)`")),
            Value::Bool(b) if dtype == DType::Bool => Ok(self
                .graph
                .add_const(if *b { 1.0 } else { 0.0 }, DType::Bool)),
            other => Err(Diag::new(
                "kiln::type",
                format!("expected a tensor or a number, got {}", other.kind()),
            )
            .at(span, format!("this is {}", other.kind()))),
        }
    }

    /// A two-operand elementwise op (arithmetic or comparison) with numpy broadcasting;
    /// each operand comes with its place in the source.
    pub(crate) fn elementwise(
        &mut self,
        frame: &Frame,
        op: Op,
        (va, sa): (&Value, Span),
        (vb, sb): (&Value, Span),
        span: Span,
        verb: &str,
    ) -> R<NodeId> {
        let dtype = match (va, vb) {
            (Value::Tensor(t), _) | (_, Value::Tensor(t)) => self.graph.ty(*t).dtype,
            _ => DType::F32,
        };
        let ta = self.as_tensor(va, dtype, sa)?;
        let tb = self.as_tensor(vb, dtype, sb)?;
        let (ya, yb) = (self.ty(ta), self.ty(tb));
        if ya.dtype != yb.dtype {
            return Err(Diag::new(
                "kiln::type",
                format!("cannot {verb} {} and {} tensors", ya.dtype, yb.dtype),
            )
            .at(sa, format!("this is {ya}"))
            .label(sb, format!("{yb}"))
            .help(format!("convert one of them with `cast(x, {})`", ya.dtype)));
        }
        let Some(shape) = broadcast_shapes(&ya.shape, &yb.shape) else {
            return Err(Diag::new("kiln::shape", format!("shape mismatch: cannot {verb} {} and {}", ya, yb))
                .at(sa, format!("this is {ya}"))
                .label(sb, format!("this is {yb}"))
                .help("shapes broadcast when, aligned from the right, each pair of dims is equal or one of them is 1"));
        };
        let ba = self.broadcast(frame, ta, &shape, sa)?;
        let bb = self.broadcast(frame, tb, &shape, sb)?;
        self.node(frame, op, &[ba, bb], span)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn tensor_binary(
        &mut self,
        frame: &mut Frame,
        op: BinOp,
        va: Value,
        sa: Span,
        vb: Value,
        sb: Span,
        span: Span,
    ) -> R<Value> {
        let (bop, verb) = match op {
            BinOp::Add => (BinaryOp::Add, "add"),
            BinOp::Sub => (BinaryOp::Sub, "subtract"),
            BinOp::Mul => (BinaryOp::Mul, "multiply"),
            BinOp::Div => (BinaryOp::Div, "divide"),
            BinOp::MatMul => {
                return self
                    .matmul(frame, &va, sa, &vb, sb, span)
                    .map(Value::Tensor)
            }
            BinOp::Pow => return self.tensor_pow(frame, &va, sa, &vb, sb, span),
            BinOp::Cmp(c)
                if c.is_equality() && (matches!(va, Value::None) || matches!(vb, Value::None)) =>
            {
                return Ok(Value::Bool(c == CmpOp::Ne));
            }
            BinOp::Cmp(c) => {
                let (a, b) = ((&va, sa), (&vb, sb));
                let t = self.elementwise(frame, Op::Compare(c), a, b, span, "compare")?;
                return Ok(Value::Tensor(t));
            }
            _ => {
                return Err(Diag::new(
                    "kiln::type",
                    format!("`{}` is not defined on tensors", op.symbol()),
                )
                .at(span, "")
                .help("tensors support + - * / @, comparisons, and ** with a number"))
            }
        };
        let (a, b) = ((&va, sa), (&vb, sb));
        let t = self.elementwise(frame, Op::Binary(bop), a, b, span, verb)?;
        Ok(Value::Tensor(t))
    }

    pub(super) fn tensor_pow(
        &mut self,
        frame: &mut Frame,
        va: &Value,
        sa: Span,
        vb: &Value,
        sb: Span,
        span: Span,
    ) -> R<Value> {
        let (Value::Tensor(x), Some(p)) = (va, vb.as_f64()) else {
            return Err(
                Diag::new("kiln::type", "`**` on tensors needs a number exponent")
                    .at(sb, format!("this is {}", vb.kind())),
            );
        };
        let x = *x;
        let id = if p == 1.0 {
            x
        } else if p == 2.0 {
            self.node(frame, Op::Binary(BinaryOp::Mul), &[x, x], span)?
        } else if p == 0.5 {
            self.node(frame, Op::Unary(UnaryOp::Sqrt), &[x], span)?
        } else if p == -1.0 {
            self.node(frame, Op::Unary(UnaryOp::Recip), &[x], span)?
        } else if p == -0.5 {
            let s = self.node(frame, Op::Unary(UnaryOp::Sqrt), &[x], span)?;
            self.node(frame, Op::Unary(UnaryOp::Recip), &[s], span)?
        } else {
            return Err(Diag::new("kiln::type", format!("tensor ** {p} is not supported"))
                .at(sb, "this exponent")
                .label(sa, "tensor")
                .help("exponents 2, 1, 0.5, -0.5 and -1 are supported; write others with exp and log"));
        };
        Ok(Value::Tensor(id))
    }

    /// `a @ b`: batched matrix product; batch dims broadcast, a `[k, n]` right side is shared.
    pub(crate) fn matmul(
        &mut self,
        frame: &Frame,
        va: &Value,
        sa: Span,
        vb: &Value,
        sb: Span,
        span: Span,
    ) -> R<NodeId> {
        let (Value::Tensor(a), Value::Tensor(b)) = (va, vb) else {
            let (bad, s) = if matches!(va, Value::Tensor(_)) {
                (vb, sb)
            } else {
                (va, sa)
            };
            return Err(Diag::new(
                "kiln::type",
                format!("`@` multiplies tensors, not {}", bad.kind()),
            )
            .at(s, format!("this is {}", bad.kind()))
            .help("scale with `*` instead"));
        };
        let (ya, yb) = (self.ty(*a), self.ty(*b));
        let (ra, rb) = (ya.shape.rank(), yb.shape.rank());
        if ra < 2 || rb < 2 {
            let (t, s) = if ra < 2 { (&ya, sa) } else { (&yb, sb) };
            return Err(Diag::new(
                "kiln::shape",
                format!("`@` needs operands with at least two axes, got {t}"),
            )
            .at(s, format!("this is {t}"))
            .help("reshape it to a matrix, e.g. `reshape(x, [1, n])`"));
        }
        let k1 = &ya.shape.dims()[ra - 1];
        let k2 = &yb.shape.dims()[rb - 2];
        if k1 != k2 {
            return Err(Diag::new(
                "kiln::shape",
                format!("shape mismatch: cannot multiply {} by {}: inner dims {k1} and {k2} differ", ya, yb),
            )
            .at(sa, format!("this is {ya}"))
            .label(sb, format!("this is {yb}"))
            .help("the last axis of the left operand must equal the second-to-last axis of the right one"));
        }
        if rb == 2 {
            return self.node(frame, Op::MatMul, &[*a, *b], span);
        }
        let batch_a = Shape(ya.shape.dims()[..ra - 2].to_vec());
        let batch_b = Shape(yb.shape.dims()[..rb - 2].to_vec());
        let Some(batch) = broadcast_shapes(&batch_a, &batch_b) else {
            return Err(Diag::new(
                "kiln::shape",
                format!(
                    "shape mismatch: cannot multiply {} by {}: batch dims {} and {} differ",
                    ya, yb, batch_a, batch_b
                ),
            )
            .at(sa, format!("this is {ya}"))
            .label(sb, format!("this is {yb}")));
        };
        let mut full_a = batch.0.clone();
        full_a.extend(ya.shape.dims()[ra - 2..].iter().cloned());
        let mut full_b = batch.0.clone();
        full_b.extend(yb.shape.dims()[rb - 2..].iter().cloned());
        let ba = self.broadcast(frame, *a, &Shape(full_a), sa)?;
        let bb = self.broadcast(frame, *b, &Shape(full_b), sb)?;
        self.node(frame, Op::MatMul, &[ba, bb], span)
    }
}
