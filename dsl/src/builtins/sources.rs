//! Builtins: tensors made from dims and inputs: masks, ranges, one-hots, dropout and the decoder's cache.

use super::*;

pub(super) fn call(e: &mut Elab, frame: &mut Frame, name: &str, a: &Args, span: Span) -> R<Value> {
    let node =
        |e: &mut Elab, op: Op, ins: &[NodeId]| e.node(frame, op, ins, span).map(Value::Tensor);
    match name {
        "dropout" => {
            let (x, _) = a.tensor("x")?;
            let p = a.number("p")?;
            if !(0.0..1.0).contains(&p) {
                return Err(Diag::new(
                    "kiln::range",
                    format!("dropout probability must be in [0, 1), got {p}"),
                )
                .at(a.req("p").1, "out of range")
                .help("0 disables dropout; the paper uses 0.1 (base) and 0.3 (big)"));
            }
            if e.mode != Mode::Train || p == 0.0 {
                return Ok(Value::Tensor(x));
            }
            let stream = e.next_stream;
            e.next_stream += 1;
            node(
                e,
                Op::Dropout {
                    p: Float::new(p),
                    stream,
                },
                &[x],
            )
        }
        "causal_mask" => {
            let q = a.dim("q")?;
            let k = a.dim("k")?;
            node(e, Op::CausalMask { q, k }, &[])
        }
        "padding_mask" => {
            let (i, _) = a.tensor("ids")?;
            let pad = if a.get("pad").is_some() {
                a.int("pad")?
            } else {
                0
            };
            node(e, Op::PadMask { pad }, &[i])
        }
        "arange" => {
            let len = a.size("n", 0)?;
            let start = if a.get("start").is_some() {
                a.dim("start")?
            } else {
                Dim::c(0)
            };
            node(e, Op::Arange { start, len }, &[])
        }
        "one_hot" => {
            let (i, _) = a.tensor("ids")?;
            let depth = a.size("depth", 1)?;
            node(e, Op::OneHot { depth }, &[i])
        }
        "kv_cache" => {
            let (x, _) = a.tensor("x")?;
            let ty = e.ty(x);
            let axis = a.axis("axis", ty.shape.rank())?.expect("required");
            let cname = match a.req("name") {
                (Value::Str(n), _) => n.to_string(),
                _ => return Err(a.wrong("name", "a string naming the cache, such as \"k\"")),
            };
            let transposed = match a.get("transposed") {
                None | Some((Value::Bool(false), _)) => false,
                Some((Value::Bool(true), _)) => true,
                Some(_) => return Err(a.wrong("transposed", "`true` or `false`")),
            };
            if e.mode != Mode::Decode {
                return Ok(Value::Tensor(x));
            }
            // Stored with `axis` and the last axis swapped (`transposed`): the cache then
            // grows along its last axis, and the value returned is the same view of it as
            // of `x`.
            let last = ty.shape.rank() - 1;
            let swap: Option<Vec<usize>> = (transposed && axis != last).then(|| {
                let mut perm: Vec<usize> = (0..=last).collect();
                perm.swap(axis, last);
                perm
            });
            let (x, ty, axis) = match &swap {
                Some(perm) => {
                    let xt = e.node(frame, Op::Permute { perm: perm.clone() }, &[x], span)?;
                    (xt, e.ty(xt).clone(), last)
                }
                None => (x, ty, axis),
            };
            let full = if frame.inst.name.is_empty() {
                format!("{}{cname}", kiln_ir::ir::CACHE_PREFIX)
            } else {
                format!("{}{}.{cname}", kiln_ir::ir::CACHE_PREFIX, frame.inst.name)
            };
            e.graph.add_dim(PAST);
            let mut dims = ty.shape.0.clone();
            dims[axis] = Dim::sym(PAST);
            let past = e
                .graph
                .add_input(&full, kiln_ir::ir::TensorType::new(ty.dtype, Shape(dims)))
                .map_err(|err| {
                    Diag::new(
                        "kiln::duplicate",
                        format!("{err}; one layer instance can hold one cache per name"),
                    )
                    .at(span, "second cache of this name")
                })?;
            let all = e.node(frame, Op::Concat { axis }, &[past, x], span)?;
            e.graph
                .add_output(&full, all)
                .map_err(|err| Diag::new("kiln::duplicate", err.to_string()).at(span, ""))?;
            Ok(Value::Tensor(match swap {
                Some(perm) => e.node(frame, Op::Permute { perm }, &[all], span)?,
                None => all,
            }))
        }
        "past_len" => {
            if e.mode == Mode::Decode {
                e.graph.add_dim(PAST);
                Ok(Value::Dim(Dim::sym(PAST)))
            } else {
                Ok(Value::Int(0))
            }
        }
        _ => unreachable!("builtin `{name}` is not sources"),
    }
}
