//! The gradients of the elementwise unary ops (the rules of [`super`]'s list).

use super::Builder;
use crate::ir::{BinaryOp, CmpOp, IrError, NodeId, UnaryOp};

/// The gradient of unary `u` at `x` (with result `id`), given the result's gradient `g`.
pub(super) fn unary_grad(
    b: &mut Builder,
    u: UnaryOp,
    x: NodeId,
    id: NodeId,
    g: NodeId,
) -> Result<NodeId, IrError> {
    Ok(match u {
        UnaryOp::Neg => b.unary(UnaryOp::Neg, g)?,
        UnaryOp::Exp => b.binary(BinaryOp::Mul, g, id)?,
        UnaryOp::Log => b.binary(BinaryOp::Div, g, x)?,
        UnaryOp::Sqrt => {
            let two_y = b.binary(BinaryOp::Add, id, id)?;
            b.binary(BinaryOp::Div, g, two_y)?
        }
        UnaryOp::Recip => {
            let yy = b.binary(BinaryOp::Mul, id, id)?;
            let gyy = b.binary(BinaryOp::Mul, g, yy)?;
            b.unary(UnaryOp::Neg, gyy)?
        }
        UnaryOp::Relu => {
            // y > 0 exactly where x > 0: reading the output (as PyTorch's
            // threshold_backward does) lets the forward keep only y.
            let zeros = b.zeros_like(x)?;
            let pos = b.compare(CmpOp::Gt, id, zeros)?;
            b.select(pos, g, zeros)?
        }
        UnaryOp::Sin => {
            let c = b.unary(UnaryOp::Cos, x)?;
            b.binary(BinaryOp::Mul, g, c)?
        }
        UnaryOp::Cos => {
            let s = b.unary(UnaryOp::Sin, x)?;
            let gs = b.binary(BinaryOp::Mul, g, s)?;
            b.unary(UnaryOp::Neg, gs)?
        }
        // The result's own value where the derivative is a function of it, so that the
        // forward keeps only y.
        UnaryOp::Tanh => {
            let yy = b.binary(BinaryOp::Mul, id, id)?;
            let d = b.minus(1.0, yy)?;
            b.binary(BinaryOp::Mul, g, d)?
        }
        UnaryOp::Sigmoid => {
            let d = b.minus(1.0, id)?;
            b.mul3(g, id, d)?
        }
        UnaryOp::Erf => {
            let xx = b.binary(BinaryOp::Mul, x, x)?;
            let nxx = b.unary(UnaryOp::Neg, xx)?;
            let e = b.unary(UnaryOp::Exp, nxx)?;
            let c = b.fill_like(std::f64::consts::FRAC_2_SQRT_PI, x)?;
            b.mul3(g, c, e)?
        }
        UnaryOp::Rsqrt => {
            // d/dx x^(-1/2) = -x^(-3/2) / 2 = -y³ / 2.
            let yy = b.binary(BinaryOp::Mul, id, id)?;
            let half = b.fill_like(-0.5, x)?;
            let y3 = b.binary(BinaryOp::Mul, yy, id)?;
            b.mul3(g, half, y3)?
        }
        UnaryOp::Silu => {
            // (x·σ(x))' = σ(x) · (1 + x · (1 − σ(x))).
            let s = b.unary(UnaryOp::Sigmoid, x)?;
            let one_minus = b.minus(1.0, s)?;
            let xs = b.binary(BinaryOp::Mul, x, one_minus)?;
            let one = b.fill_like(1.0, x)?;
            let f = b.binary(BinaryOp::Add, one, xs)?;
            b.mul3(g, s, f)?
        }
    })
}
