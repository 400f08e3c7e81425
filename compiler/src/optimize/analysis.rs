//! The e-graph analysis: the type (dtype + symbolic shape) and constant value of every
//! e-class.
//!
//! In: e-nodes as they are added. Out: an [`Info`] per e-class. `make` infers types with
//! the IR's own shape inference ([`crate::infer::infer_type`]) for primitives, from the
//! template for fused kernels and from the expression for regions. `merge` asserts that
//! two merged e-classes agree: a rewrite that equates tensors of different types is a
//! compiler bug, recorded in [`Types::errors`] (and reported by the optimizer as such),
//! never a panic.

use egg::{Analysis, DidMerge, EGraph, Id};

use crate::infer::infer_type;
use crate::ir::{Float, Op, TensorType};
use crate::optimize::lang::{attr_of, node_op, Attr, KNode, Kind};
use crate::optimize::templates;

/// The e-graph the optimizer works on.
pub type EG = EGraph<KNode, Types>;

/// What an e-class holds.
#[derive(Clone, Debug, PartialEq)]
pub enum Info {
    /// An attribute leaf.
    Attr,
    /// A tensor; `konst` is its value when every element is the same known constant.
    Tensor {
        ty: TensorType,
        konst: Option<Float>,
    },
    /// The outputs of a multi-output kernel.
    Tuple(Vec<TensorType>),
    /// A node whose type could not be inferred (a compiler bug; the message says why).
    Invalid(String),
}

impl Info {
    pub fn ty(&self) -> Option<&TensorType> {
        match self {
            Info::Tensor { ty, .. } => Some(ty),
            _ => None,
        }
    }

    pub fn konst(&self) -> Option<f64> {
        match self {
            Info::Tensor { konst, .. } => konst.map(|k| k.get()),
            _ => None,
        }
    }
}

/// The analysis; collects merge disagreements.
#[derive(Default)]
pub struct Types {
    pub errors: Vec<String>,
}

fn tensor_types(eg: &EG, ids: &[Id]) -> Result<Vec<TensorType>, String> {
    ids.iter()
        .map(|&i| match &eg[i].data {
            Info::Tensor { ty, .. } => Ok(ty.clone()),
            other => Err(format!("operand {i} is not a tensor ({other:?})")),
        })
        .collect()
}

fn make_info(eg: &EG, enode: &KNode) -> Result<Info, String> {
    let KNode::Op(kind, children) = enode else {
        return Ok(Info::Attr);
    };
    match *kind {
        Kind::Input | Kind::Param => match (attr_of(eg, children[1]), attr_of(eg, children[2])) {
            (Some(Attr::DType(d)), Some(Attr::Shape(s))) => Ok(Info::Tensor {
                ty: TensorType::new(*d, s.clone()),
                konst: None,
            }),
            _ => Err("a source without dtype and shape".to_string()),
        },
        Kind::Proj(i) => match &eg[children[0]].data {
            Info::Tuple(tys) => tys
                .get(i as usize)
                .map(|ty| Info::Tensor {
                    ty: ty.clone(),
                    konst: None,
                })
                .ok_or_else(|| format!("proj{i} of a {}-tuple", tys.len())),
            other => Err(format!("proj{i} of a non-tuple ({other:?})")),
        },
        Kind::Region => {
            let Some(Attr::Expr(e)) = attr_of(eg, *children.last().expect("regions have an expr"))
            else {
                return Err("a region without an expression".to_string());
            };
            Ok(Info::Tensor {
                ty: e.out.clone(),
                konst: None,
            })
        }
        Kind::Kernel(t) => {
            let def = &templates::registry()[t as usize];
            let n = def.inputs.len();
            let tys = tensor_types(eg, &children[..n])?;
            let outs = def.output_types(&tys)?;
            if def.outputs.len() == 1 {
                Ok(Info::Tensor {
                    ty: outs[0].clone(),
                    konst: None,
                })
            } else {
                Ok(Info::Tuple(outs))
            }
        }
        _ => {
            let (op, operands) = node_op(eg, enode)?;
            let tys = tensor_types(eg, &operands)?;
            let refs: Vec<&TensorType> = tys.iter().collect();
            let ty = infer_type(&op, &refs).map_err(|e| e.to_string())?;
            let konst = match &op {
                Op::Const { value, .. } => Some(*value),
                Op::Broadcast { .. } | Op::Reshape { .. } => match &eg[operands[0]].data {
                    Info::Tensor { konst, .. } => *konst,
                    _ => None,
                },
                _ => None,
            };
            Ok(Info::Tensor { ty, konst })
        }
    }
}

impl Analysis<KNode> for Types {
    type Data = Info;

    fn make(eg: &mut EG, enode: &KNode, _id: Id) -> Info {
        make_info(eg, enode).unwrap_or_else(Info::Invalid)
    }

    fn merge(&mut self, a: &mut Info, b: Info) -> DidMerge {
        match (&mut *a, &b) {
            (Info::Tensor { ty: ta, konst: ka }, Info::Tensor { ty: tb, konst: kb })
                if ta == tb =>
            {
                if ka.is_none() && kb.is_some() {
                    *ka = *kb;
                    DidMerge(true, false)
                } else {
                    DidMerge(false, ka != kb)
                }
            }
            (x, y) if *x == *y => DidMerge(false, false),
            (x, y) => {
                self.errors
                    .push(format!("two equal e-classes disagree: {x:?} and {y:?}"));
                DidMerge(false, true)
            }
        }
    }
}
