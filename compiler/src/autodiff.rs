//! Reverse-mode automatic differentiation as a graph-to-graph pass.
//!
//! In: a [`Graph`], a float node `loss` and the float nodes to differentiate it with
//! respect to. Out: a copy of the graph with new nodes appended that compute
//! d(loss)/d(x) for each of those nodes ([`gradients`]); and, for a model graph
//! elaborated in training mode, its `train_step` entry point: the objective plus the
//! gradient of every parameter ([`train_step`]).
//!
//! # How
//!
//! The nodes the loss depends on are walked in reverse topological order (descending
//! ids: operands always come before their users). The gradient of the loss is seeded
//! with a scalar constant `1` (for a non-scalar `loss`, a broadcast `1`: the gradient of
//! the sum of its elements). Each node passes its accumulated gradient to its operands by
//! the rule of its op (below); several contributions to one node are summed with `add`,
//! in the order the walk produces them, so the result is deterministic.
//!
//! Gradients only flow into *active* nodes: floating-point nodes that are, or depend on,
//! one of the nodes differentiated against. Branches that do not lead there, `i32` and
//! `bool` values, masks and constants get no gradient nodes at all. A node differentiated
//! against that the loss does not depend on gets zeros (a broadcast `0`).
//!
//! Every new node is added with [`Graph::add`], so its type is inferred and checked, and it
//! is hash-consed: a gradient node that already exists (often a broadcast constant, or
//! `broadcast(max)` in a softmax) is reused, keeping its original scope.
//!
//! # Scopes
//!
//! A node created while differentiating a node of scope `s` gets the scope `grad/s`
//! (`grad/encoder.layers.0.ffn`), or `grad` when `s` is empty. Zeros for unreachable
//! nodes get `grad`.
//!
//! # Rules (g is the gradient of the node's result y)
//!
//! - `reshape`: reshape back. `permute`: the inverse permutation. `broadcast`: `sum` over
//!   every expanded axis (prepended axes and size-1 axes that grew), then a reshape to the
//!   operand's shape when axes were prepended.
//! - `sum`: broadcast g back. `reduce_max`: g goes to the positions equal to the maximum
//!   (`eq` against the broadcast max), split evenly among ties (like `torch.amax`).
//! - `neg`: −g; `exp`: g·y; `log`: g/x; `sqrt`: g/(y + y); `recip`: −(g·(y·y));
//!   `relu`: `where(y > 0, g, 0)` (zero at 0, as in PyTorch; y > 0 exactly where x > 0,
//!   and reading y lets a fused forward keep only its output); `sin`: g·cos x;
//!   `cos`: −(g·sin x).
//! - `add`: g, g; `sub`: g, −g; `mul`: g·b, g·a; `div`: g/b and −((g/b)·y) (= −g·a/b²);
//!   `max`: g to the larger operand, split evenly on ties (like `torch.maximum`).
//! - `where(c, a, b)`: `where(c, g, 0)` and `where(c, 0, g)`; no gradient for `c`.
//! - `cast` between float types: cast back (g itself when the types agree). Casts to or
//!   from `i32`/`bool` pass no gradient, nor do `eq`…`ge`, `pad_mask`, `causal_mask`,
//!   `arange` and `one_hot` (their results are not float, or their operands are not).
//! - `matmul`: `g @ bᵀ` and `aᵀ @ g` (ᵀ = a `permute` of the last two axes). When the
//!   right operand is a matrix `[k, n]` shared by a batch `a[..., m, k]`, its gradient is
//!   `reshape(a, [N, k])ᵀ @ reshape(g, [N, n])`, N the (symbolic) product of a's leading
//!   dims.
//! - `gather(table, ids)`: `scatter_add{rows = V}(ids, g)` for the table;
//!   `scatter_add(ids, src)`: `gather(g, ids)` for the source.
//! - `dropout`: the same dropout (same `p`, same `stream`) applied to g. The mask is keyed
//!   by (seed, step, stream, element index), so the backward pass drops exactly the
//!   elements the forward pass dropped, and scales the others by the same `1/(1-p)`.
//! - `concat`: a `slice` of g for each part. `slice`: `concat` of zeros, g and zeros along
//!   the axis; a piece whose size is the constant 0 is left out.

use std::collections::BTreeMap;

use crate::ir::{BinaryOp, CmpOp, DType, Graph, IrError, NodeId, Op, ReduceOp, UnaryOp};
use crate::shape::{Dim, Shape};

mod unary;
use unary::unary_grad;

/// The scope of the gradient nodes made for a node of scope `scope`.
pub fn grad_scope(scope: &str) -> String {
    if scope.is_empty() {
        "grad".to_string()
    } else {
        format!("grad/{scope}")
    }
}

/// Appends to a copy of `graph` the nodes computing d(loss)/d(x) for each x in `wrt`
/// (float nodes), returning the new graph and the gradient node of each.
///
/// The gradient of x has x's type. A non-scalar `loss` is differentiated as the sum of
/// its elements. An x the loss does not depend on gets zeros.
pub fn gradients(
    graph: &Graph,
    loss: NodeId,
    wrt: &[NodeId],
) -> Result<(Graph, Vec<NodeId>), IrError> {
    gradients_seeded(graph, loss, None, wrt)
}

/// Like [`gradients`], but the gradient of `out` is the node `seed` (a node of `graph`
/// with `out`'s type) instead of ones: the vector-Jacobian product with `seed`. The
/// optimizer derives the backward templates of fused kernels this way.
pub fn gradients_seeded(
    graph: &Graph,
    loss: NodeId,
    seed: Option<NodeId>,
    wrt: &[NodeId],
) -> Result<(Graph, Vec<NodeId>), IrError> {
    gradients_carried(graph, loss, seed, wrt, &[])
}

/// Like [`gradients_seeded`], where each `(x, g)` of `carried` is a gradient that node `x`
/// receives from a use after the whole graph: the first contribution to `x`, as the walk
/// over a larger graph that used `x` again later would sum it. A fused block's backward
/// template derived this way matches the block inside a larger graph, with that later
/// use's gradient added in (a pre-LN block's residual path past its layer norm).
pub fn gradients_carried(
    graph: &Graph,
    loss: NodeId,
    seed: Option<NodeId>,
    wrt: &[NodeId],
    carried: &[(NodeId, NodeId)],
) -> Result<(Graph, Vec<NodeId>), IrError> {
    graph.verify()?;
    let n = graph.len();
    let in_range = |id: NodeId, what: &str| {
        if id.index() < n {
            Ok(())
        } else {
            Err(IrError::Malformed(format!(
                "{what} {id} does not exist (the graph has {n} nodes)"
            )))
        }
    };
    in_range(loss, "the loss")?;
    if !graph.ty(loss).dtype.is_float() {
        return Err(IrError::Type(format!(
            "cannot differentiate {loss}: the loss must be floating point, not {}",
            graph.ty(loss)
        )));
    }
    let mut is_wrt = vec![false; n];
    for &x in wrt {
        in_range(x, "the node to differentiate against")?;
        if !graph.ty(x).dtype.is_float() {
            return Err(IrError::Type(format!(
                "cannot differentiate with respect to {x} ({} {}): only floating-point \
                 nodes have gradients",
                graph.node(x).op.name(),
                graph.ty(x)
            )));
        }
        is_wrt[x.index()] = true;
    }

    // Active: float, and one of `wrt` or depends on one.
    let mut active = vec![false; n];
    for (i, node) in graph.nodes.iter().enumerate() {
        active[i] = node.ty.dtype.is_float()
            && (is_wrt[i] || node.inputs.iter().any(|x| active[x.index()]));
    }
    // Live: the loss depends on it.
    let mut live = vec![false; n];
    let mut stack = vec![loss];
    while let Some(id) = stack.pop() {
        if !std::mem::replace(&mut live[id.index()], true) {
            stack.extend(graph.node(id).inputs.iter().copied());
        }
    }

    let mut out = graph.clone();
    let mut grads: Vec<Option<NodeId>> = vec![None; n];
    let mut finals: Vec<Option<NodeId>> = vec![None; n];
    if active[loss.index()] {
        let mut b = Builder {
            g: &mut out,
            scope: grad_scope(&graph.node(loss).scope),
        };
        let ty = graph.ty(loss);
        grads[loss.index()] = Some(match seed {
            Some(s) => {
                in_range(s, "the seed")?;
                if graph.ty(s) != ty {
                    return Err(IrError::Type(format!(
                        "the seed {s} is {} but the differentiated node is {ty}",
                        graph.ty(s)
                    )));
                }
                s
            }
            None => b.fill(1.0, ty.dtype, &ty.shape)?,
        });
    }
    for &(x, g) in carried {
        in_range(x, "a node with a carried gradient")?;
        in_range(g, "a carried gradient")?;
        if graph.ty(g) != graph.ty(x) || x == loss || grads[x.index()].is_some() {
            return Err(IrError::Type(format!(
                "the gradient {g} carried into {x} must have its type and come first"
            )));
        }
        grads[x.index()] = Some(g);
    }
    for i in (0..=loss.index()).rev() {
        if !(live[i] && active[i]) {
            continue;
        }
        let Some(g) = grads[i] else { continue };
        if is_wrt[i] {
            finals[i] = Some(g);
        }
        let id = NodeId(i as u32);
        let mut b = Builder {
            g: &mut out,
            scope: grad_scope(&graph.node(id).scope),
        };
        for (x, gx) in backward(&mut b, graph, id, g, &active)? {
            let acc = match grads[x.index()] {
                None => gx,
                Some(prev) => b.add(Op::Binary(BinaryOp::Add), &[prev, gx])?,
            };
            grads[x.index()] = Some(acc);
        }
    }

    let mut result = Vec::with_capacity(wrt.len());
    for &x in wrt {
        let gx = match finals[x.index()] {
            Some(gx) => gx,
            None => {
                let ty = graph.ty(x);
                let mut b = Builder {
                    g: &mut out,
                    scope: grad_scope(""),
                };
                b.fill(0.0, ty.dtype, &ty.shape)?
            }
        };
        result.push(gx);
    }
    Ok((out, result))
}

/// The `train_step` entry point of a model graph elaborated in training mode: its
/// objective (a float scalar) plus the gradient of every parameter the objective uses.
/// Outputs: the objective under its own name, then `grad.<param name>` for every
/// parameter in `graph.params` order (zeros for a parameter the objective does not use).
/// Dims/inputs/params are those of the pruned objective graph; `objective` stays set.
pub fn train_step(model: &Graph) -> Result<Graph, IrError> {
    train_step_with(model, TrainStepOptions::default())
}

/// The name of the scalar input that seeds a loss-scaled `train_step`'s backward pass.
pub const LOSS_SCALE: &str = "loss_scale";

/// How [`train_step_with`] builds the entry point.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TrainStepOptions {
    /// Seed the backward pass with the scalar input [`LOSS_SCALE`] (of the objective's
    /// type) instead of one, so every `grad.*` output is `loss_scale` times the
    /// gradient: the graph half of dynamic loss scaling. The objective output itself is
    /// not scaled. With a power of two as the scale (and no overflow or underflow) every
    /// backward value is that power times the unscaled value, bit for bit.
    pub loss_scale: bool,
}

/// [`train_step`] with options: see [`TrainStepOptions`]. With `loss_scale`, a model
/// that already has an input named [`LOSS_SCALE`] is an error.
pub fn train_step_with(model: &Graph, options: TrainStepOptions) -> Result<Graph, IrError> {
    model.verify()?;
    let objective = model.objective.clone().ok_or_else(|| {
        IrError::Malformed(format!(
            "model `{}` declares no objective, so it has no `train_step` entry",
            model.name
        ))
    })?;
    let pruned = model.prune(std::slice::from_ref(&objective))?;
    let loss = pruned.output(&objective).ok_or_else(|| {
        IrError::Malformed(format!("the objective `{objective}` is not an output"))
    })?;
    let loss_ty = pruned.ty(loss);
    if !loss_ty.dtype.is_float() || loss_ty.shape.rank() != 0 {
        return Err(IrError::Type(format!(
            "the objective `{objective}` must be a floating-point scalar, not {loss_ty}"
        )));
    }
    let (mut g, grads) = if options.loss_scale {
        let mut seeded = pruned.clone();
        let seed = seeded.add_input(LOSS_SCALE, loss_ty.clone()).map_err(|e| {
            IrError::Malformed(format!(
                "a loss-scaled train_step adds the input `{LOSS_SCALE}`: {e}; rename the \
                 model's input of that name"
            ))
        })?;
        let params = seeded.params.clone();
        gradients_seeded(&seeded, loss, Some(seed), &params)?
    } else {
        gradients(&pruned, loss, &pruned.params)?
    };
    let by_param: BTreeMap<NodeId, NodeId> = pruned.params.iter().copied().zip(grads).collect();

    let mut names = vec![objective.clone()];
    for &p in &model.params {
        let node = model
            .nodes
            .get(p.index())
            .ok_or_else(|| IrError::Malformed(format!("parameter {p} does not exist")))?;
        let Op::Param { name, .. } = &node.op else {
            return Err(IrError::Malformed(format!(
                "{p} is listed as a parameter but is a {} node",
                node.op.name()
            )));
        };
        let grad = match pruned.param(name) {
            Some(q) => by_param.get(&q).copied().ok_or_else(|| {
                IrError::Malformed(format!("parameter `{name}` is not in the parameter list"))
            })?,
            None => {
                let mut b = Builder {
                    g: &mut g,
                    scope: grad_scope(&node.scope),
                };
                b.fill(0.0, node.ty.dtype, &node.ty.shape)?
            }
        };
        let out_name = format!("grad.{name}");
        g.add_output(&out_name, grad)?;
        names.push(out_name);
    }
    let step = g.prune(&names)?;
    step.verify()?;
    Ok(step)
}

/// Adds gradient nodes under one scope.
struct Builder<'a> {
    g: &'a mut Graph,
    scope: String,
}

impl Builder<'_> {
    fn add(&mut self, op: Op, inputs: &[NodeId]) -> Result<NodeId, IrError> {
        self.g.add(op, inputs, &self.scope)
    }

    fn shape(&self, id: NodeId) -> Shape {
        self.g.ty(id).shape.clone()
    }

    fn dtype(&self, id: NodeId) -> DType {
        self.g.ty(id).dtype
    }

    /// A tensor of `shape` filled with `value`: a scalar constant, broadcast if needed.
    fn fill(&mut self, value: f64, dtype: DType, shape: &Shape) -> Result<NodeId, IrError> {
        let c = self.add(
            Op::Const {
                value: crate::ir::Float::new(value),
                dtype,
            },
            &[],
        )?;
        if shape.rank() == 0 {
            Ok(c)
        } else {
            self.add(
                Op::Broadcast {
                    shape: shape.clone(),
                },
                &[c],
            )
        }
    }

    /// Zeros of the type of `like`.
    fn zeros_like(&mut self, like: NodeId) -> Result<NodeId, IrError> {
        self.fill_like(0.0, like)
    }

    /// `value` in the type of `like`.
    fn fill_like(&mut self, value: f64, like: NodeId) -> Result<NodeId, IrError> {
        let (dtype, shape) = (self.dtype(like), self.shape(like));
        self.fill(value, dtype, &shape)
    }

    /// `value - x`.
    fn minus(&mut self, value: f64, x: NodeId) -> Result<NodeId, IrError> {
        let v = self.fill_like(value, x)?;
        self.binary(BinaryOp::Sub, v, x)
    }

    /// `a · b · c`.
    fn mul3(&mut self, a: NodeId, b: NodeId, c: NodeId) -> Result<NodeId, IrError> {
        let ab = self.binary(BinaryOp::Mul, a, b)?;
        self.binary(BinaryOp::Mul, ab, c)
    }

    fn unary(&mut self, u: UnaryOp, x: NodeId) -> Result<NodeId, IrError> {
        self.add(Op::Unary(u), &[x])
    }

    fn binary(&mut self, op: BinaryOp, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.add(Op::Binary(op), &[a, b])
    }

    fn compare(&mut self, op: CmpOp, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.add(Op::Compare(op), &[a, b])
    }

    fn select(&mut self, c: NodeId, a: NodeId, b: NodeId) -> Result<NodeId, IrError> {
        self.add(Op::Where, &[c, a, b])
    }

    fn reshape(&mut self, x: NodeId, shape: Shape) -> Result<NodeId, IrError> {
        self.add(Op::Reshape { shape }, &[x])
    }

    fn broadcast(&mut self, x: NodeId, shape: Shape) -> Result<NodeId, IrError> {
        self.add(Op::Broadcast { shape }, &[x])
    }

    /// Swaps the last two axes.
    fn transpose(&mut self, x: NodeId) -> Result<NodeId, IrError> {
        let rank = self.shape(x).rank();
        if rank < 2 {
            return Err(IrError::Type(format!(
                "cannot transpose {x}: it has {rank} axes"
            )));
        }
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(rank - 2, rank - 1);
        self.add(Op::Permute { perm }, &[x])
    }

    /// The gradient of `broadcast(x, to)` for x of shape `from`: sums over the expanded
    /// axes, then drops the prepended ones.
    fn unbroadcast(&mut self, g: NodeId, from: &Shape, to: &Shape) -> Result<NodeId, IrError> {
        let off = to.rank().checked_sub(from.rank()).ok_or_else(|| {
            IrError::Type(format!("cannot broadcast {from} to {to}: it has more axes"))
        })?;
        let mut cur = g;
        for axis in 0..to.rank() {
            let expanded = axis < off || from.dims()[axis - off] != to.dims()[axis];
            if expanded {
                cur = self.add(
                    Op::Reduce {
                        op: ReduceOp::Sum,
                        axis,
                    },
                    &[cur],
                )?;
            }
        }
        if off > 0 {
            cur = self.reshape(cur, from.clone())?;
        }
        Ok(cur)
    }
}

/// The gradient of a reduction of `x` (with result `id`) along `axis`: `g` broadcast
/// back, for a max shared among the elements that reach it.
fn reduce_grad(
    b: &mut Builder,
    op: ReduceOp,
    axis: usize,
    (x, id): (NodeId, NodeId),
    g: NodeId,
    dtype: DType,
    xs: Shape,
) -> Result<NodeId, IrError> {
    Ok(match op {
        ReduceOp::Sum => b.broadcast(g, xs)?,
        ReduceOp::Max => {
            let yb = b.broadcast(id, xs.clone())?;
            let hit = b.compare(CmpOp::Eq, x, yb)?;
            let hitf = b.add(Op::Cast { to: dtype }, &[hit])?;
            let count = b.add(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axis,
                },
                &[hitf],
            )?;
            let share = b.binary(BinaryOp::Div, g, count)?;
            let share = b.broadcast(share, xs)?;
            b.binary(BinaryOp::Mul, hitf, share)?
        }
    })
}

/// The contributions of binary `op` (result `id`, operands `x`, `y`) to its active
/// operands' gradients, given the result's gradient `g`.
fn binary_grads(
    b: &mut Builder,
    op: BinaryOp,
    (x, y): (NodeId, NodeId),
    id: NodeId,
    g: NodeId,
    act: &dyn Fn(usize) -> bool,
    out: &mut Vec<(NodeId, NodeId)>,
) -> Result<(), IrError> {
    match op {
        BinaryOp::Add => {
            if act(0) {
                out.push((x, g));
            }
            if act(1) {
                out.push((y, g));
            }
        }
        BinaryOp::Sub => {
            if act(0) {
                out.push((x, g));
            }
            if act(1) {
                out.push((y, b.unary(UnaryOp::Neg, g)?));
            }
        }
        BinaryOp::Mul => {
            if act(0) {
                out.push((x, b.binary(BinaryOp::Mul, g, y)?));
            }
            if act(1) {
                out.push((y, b.binary(BinaryOp::Mul, g, x)?));
            }
        }
        BinaryOp::Div => {
            let g_over_y = b.binary(BinaryOp::Div, g, y)?;
            if act(0) {
                out.push((x, g_over_y));
            }
            if act(1) {
                let t = b.binary(BinaryOp::Mul, g_over_y, id)?;
                out.push((y, b.unary(UnaryOp::Neg, t)?));
            }
        }
        BinaryOp::Max => {
            let zeros = b.zeros_like(g)?;
            let half = b.fill(0.5, b.dtype(g), &b.shape(g))?;
            let half_g = b.binary(BinaryOp::Mul, g, half)?;
            let tie = b.compare(CmpOp::Eq, x, y)?;
            let on_tie = b.select(tie, half_g, zeros)?;
            if act(0) {
                let wins = b.compare(CmpOp::Gt, x, y)?;
                out.push((x, b.select(wins, g, on_tie)?));
            }
            if act(1) {
                let wins = b.compare(CmpOp::Lt, x, y)?;
                out.push((y, b.select(wins, g, on_tie)?));
            }
        }
    }
    Ok(())
}

/// The contributions of a product `x · w` to its active operands' gradients.
fn matmul_grads(
    b: &mut Builder,
    graph: &Graph,
    (x, w): (NodeId, NodeId),
    g: NodeId,
    act: &dyn Fn(usize) -> bool,
    out: &mut Vec<(NodeId, NodeId)>,
) -> Result<(), IrError> {
    let (xs, ws) = (graph.ty(x).shape.clone(), graph.ty(w).shape.clone());
    if act(0) {
        let wt = b.transpose(w)?;
        out.push((x, b.add(Op::MatMul, &[g, wt])?));
    }
    if act(1) {
        let gw = if ws.rank() == 2 && xs.rank() > 2 {
            // A matrix shared by the batch: fold every leading dim into the rows.
            let r = xs.rank();
            let rows = xs.dims()[..r - 1]
                .iter()
                .fold(Dim::c(1), |acc, d| acc.mul(d));
            let k = xs.dims()[r - 1].clone();
            let nn = ws.dims()[1].clone();
            let x2 = b.reshape(x, Shape(vec![rows.clone(), k]))?;
            let g2 = b.reshape(g, Shape(vec![rows, nn]))?;
            let x2t = b.transpose(x2)?;
            b.add(Op::MatMul, &[x2t, g2])?
        } else {
            let xt = b.transpose(x)?;
            b.add(Op::MatMul, &[xt, g])?
        };
        out.push((w, gw));
    }
    Ok(())
}

/// The gradient of a slice of `x`: `g` between zeros where the slice left `x` out.
fn slice_grad(
    b: &mut Builder,
    graph: &Graph,
    x: NodeId,
    g: NodeId,
    axis: usize,
    start: &Dim,
    len: &Dim,
) -> Result<NodeId, IrError> {
    let xs = graph.ty(x).shape.clone();
    let full = xs.dims()[axis].clone();
    let after = full.sub(start).sub(len);
    let dtype = graph.ty(x).dtype;
    let mut parts = Vec::with_capacity(3);
    for (size, is_g) in [(start.clone(), false), (len.clone(), true), (after, false)] {
        if is_g {
            parts.push(g);
        } else if size.as_const() != Some(0) {
            let mut dims = xs.0.clone();
            dims[axis] = size;
            parts.push(b.fill(0.0, dtype, &Shape(dims))?);
        }
    }
    Ok(if parts.len() == 1 {
        g
    } else {
        b.add(Op::Concat { axis }, &parts)?
    })
}

/// The contributions of node `id`, whose gradient is `g`, to the gradients of its active
/// operands: `(operand, gradient)` pairs, in operand order.
fn backward(
    b: &mut Builder,
    graph: &Graph,
    id: NodeId,
    g: NodeId,
    active: &[bool],
) -> Result<Vec<(NodeId, NodeId)>, IrError> {
    let node = graph.node(id);
    let ins = &node.inputs;
    let act = |k: usize| ins.get(k).is_some_and(|x| active[x.index()]);
    let shape_of = |x: NodeId| graph.ty(x).shape.clone();
    let mut out: Vec<(NodeId, NodeId)> = Vec::new();
    match &node.op {
        // Sources and ops whose operands can carry no gradient.
        Op::Input { .. }
        | Op::Param { .. }
        | Op::Const { .. }
        | Op::Compare(_)
        | Op::PadMask { .. }
        | Op::CausalMask { .. }
        | Op::Arange { .. }
        | Op::OneHot { .. } => {}

        Op::Reshape { .. } => {
            if act(0) {
                let x = ins[0];
                out.push((x, b.reshape(g, shape_of(x))?));
            }
        }
        Op::Permute { perm } => {
            if act(0) {
                let mut inv = vec![0; perm.len()];
                for (i, &p) in perm.iter().enumerate() {
                    inv[p] = i;
                }
                out.push((ins[0], b.add(Op::Permute { perm: inv }, &[g])?));
            }
        }
        Op::Broadcast { shape } => {
            if act(0) {
                let x = ins[0];
                out.push((x, b.unbroadcast(g, &shape_of(x), shape)?));
            }
        }
        Op::Reduce { op, axis } => {
            if act(0) {
                let x = ins[0];
                let xs = shape_of(x);
                let gx = reduce_grad(b, *op, *axis, (x, id), g, node.ty.dtype, xs)?;
                out.push((x, gx));
            }
        }
        Op::Unary(u) => {
            if act(0) {
                let x = ins[0];
                let gx = unary_grad(b, *u, x, id, g)?;
                out.push((x, gx));
            }
        }
        Op::Binary(op) => {
            binary_grads(b, *op, (ins[0], ins[1]), id, g, &act, &mut out)?;
        }
        Op::Where => {
            let (c, x, y) = (ins[0], ins[1], ins[2]);
            let zeros = b.zeros_like(g)?;
            if act(1) {
                out.push((x, b.select(c, g, zeros)?));
            }
            if act(2) {
                out.push((y, b.select(c, zeros, g)?));
            }
        }
        Op::Cast { .. } => {
            if act(0) {
                let x = ins[0];
                let from = graph.ty(x).dtype;
                let gx = if from == node.ty.dtype {
                    g
                } else {
                    b.add(Op::Cast { to: from }, &[g])?
                };
                out.push((x, gx));
            }
        }
        Op::MatMul => matmul_grads(b, graph, (ins[0], ins[1]), g, &act, &mut out)?,
        Op::Gather => {
            if act(0) {
                let (table, ids) = (ins[0], ins[1]);
                let rows =
                    shape_of(table).dims().first().cloned().ok_or_else(|| {
                        IrError::Type(format!("gather {id} reads a scalar table"))
                    })?;
                out.push((table, b.add(Op::ScatterAdd { rows }, &[ids, g])?));
            }
        }
        Op::ScatterAdd { .. } => {
            if act(1) {
                let (ids, src) = (ins[0], ins[1]);
                out.push((src, b.add(Op::Gather, &[g, ids])?));
            }
        }
        Op::Dropout { p, stream } => {
            if act(0) {
                let op = Op::Dropout {
                    p: *p,
                    stream: *stream,
                };
                out.push((ins[0], b.add(op, &[g])?));
            }
        }
        Op::Concat { axis } => {
            let mut start = Dim::c(0);
            for (k, &x) in ins.iter().enumerate() {
                let len = shape_of(x).dims()[*axis].clone();
                if act(k) {
                    let op = Op::Slice {
                        axis: *axis,
                        start: start.clone(),
                        len: len.clone(),
                    };
                    out.push((x, b.add(op, &[g])?));
                }
                start = start.add(&len);
            }
        }
        Op::Slice { axis, start, len } => {
            if act(0) {
                let x = ins[0];
                out.push((x, slice_grad(b, graph, x, g, *axis, start, len)?));
            }
        }
    }
    Ok(out)
}
