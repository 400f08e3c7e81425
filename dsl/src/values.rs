//! The values the elaborator computes with.
//!
//! In: nothing (plain data). Out: [`Value`] — numbers, booleans, strings, symbolic dims,
//! lists, tensors (graph nodes), element types, initializers, and the three forms a layer
//! takes: a reference to a definition, a [`Partial`] (hyper-parameters bound, no weights
//! yet) and an [`Instance`] (a named owner of parameters; applying it twice shares them).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::rc::Rc;

use kiln_ir::ir::{DType, Init, NodeId};
use kiln_ir::shape::Dim;

use crate::ast::LayerDef;
use crate::source::Span;

#[derive(Clone)]
pub enum Value {
    None,
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(Rc<str>),
    /// A dim with symbols (`batch`, `t + 1`); constant dims are `Int`.
    Dim(Dim),
    List(Rc<Vec<Value>>),
    Tensor(NodeId),
    DType(DType),
    Init(Init),
    /// A layer or builtin referred to by name, not yet called.
    Layer(Rc<str>),
    Partial(Rc<Partial>),
    Instance(Rc<Instance>),
}

impl Value {
    /// The kind of value, for messages ("an int", "a tensor").
    pub fn kind(&self) -> &'static str {
        match self {
            Value::None => "none",
            Value::Int(_) => "an int",
            Value::Float(_) => "a float",
            Value::Bool(_) => "a bool",
            Value::Str(_) => "a string",
            Value::Dim(_) => "a dim",
            Value::List(_) => "a list",
            Value::Tensor(_) => "a tensor",
            Value::DType(_) => "an element type",
            Value::Init(_) => "an initializer",
            Value::Layer(_) => "a layer",
            Value::Partial(_) => "a layer (not yet instantiated)",
            Value::Instance(_) => "a layer instance",
        }
    }

    /// A dim view of an int or dim value.
    pub fn as_dim(&self) -> Option<Dim> {
        match self {
            Value::Int(v) => Some(Dim::c(*v)),
            Value::Dim(d) => Some(d.clone()),
            _ => None,
        }
    }

    /// An int or a dim value from a dim (constants become ints).
    pub fn from_dim(d: Dim) -> Value {
        match d.as_const() {
            Some(v) => Value::Int(v),
            None => Value::Dim(d),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(v) => Some(*v as f64),
            Value::Float(v) => Some(*v),
            _ => None,
        }
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::None => write!(f, "none"),
            Value::Int(v) => write!(f, "{v}"),
            Value::Float(v) => kiln_ir::ir::fmt_f64(*v, f),
            Value::Bool(v) => write!(f, "{v}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Dim(d) => write!(f, "{d}"),
            Value::List(items) => {
                write!(f, "[")?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        write!(f, ", ")?;
                    }
                    write!(f, "{v}")?;
                }
                write!(f, "]")
            }
            Value::Tensor(id) => write!(f, "tensor {id}"),
            Value::DType(d) => write!(f, "{d}"),
            Value::Init(i) => write!(f, "{i}"),
            Value::Layer(n) => write!(f, "layer `{n}`"),
            Value::Partial(p) => write!(f, "layer `{}`", p.layer.name.name),
            Value::Instance(i) => write!(f, "instance `{}` of `{}`", i.display_name(), i.kind),
        }
    }
}

/// A layer with its hyper-parameters bound but no parameters created yet. Assigning it
/// to a name (`self_attn = attention(h = 8, d_model = 512)`) makes an [`Instance`].
pub struct Partial {
    pub layer: Rc<LayerDef>,
    pub hyper: Vec<(String, Value)>,
    /// Hyper-parameters left to the first application (`attention(h = 8)` takes
    /// `d_model` from its input), in declaration order: see [`Instance::deferred`].
    pub deferred: Vec<String>,
    /// `repeat(n, partial)`: `n` independent copies applied in sequence.
    pub repeat: Option<usize>,
}

/// A named owner of parameters. Its parameters are called `<name>.<param>`; applying it
/// again reuses them (weight sharing).
pub struct Instance {
    /// The dotted prefix of its parameters (`encoder.layers.0.self_attn`); `""` for the
    /// model itself.
    pub name: String,
    /// The layer (or model) it instantiates.
    pub kind: String,
    pub layer: Option<Rc<LayerDef>>,
    pub hyper: Vec<(String, Value)>,
    /// Hyper-parameters neither given nor defaulted when the instance was made: those a
    /// tensor argument's pattern names (`d_in` of `linear(d_out = 64)` applied to
    /// `x: [..., d_in]`), and those whose defaults use them. Its first application binds
    /// them ([`InstanceState::inferred`]).
    pub deferred: Vec<String>,
    /// For `repeat`: the copies, applied in order.
    pub stack: Option<Vec<Rc<Instance>>>,
    pub state: RefCell<InstanceState>,
}

#[derive(Default)]
pub struct InstanceState {
    pub params: BTreeMap<String, NodeId>,
    pub children: BTreeMap<String, Rc<Instance>>,
    /// Instances made by calls without a name, keyed by call site.
    pub anon: BTreeMap<u32, Rc<Instance>>,
    pub applied: bool,
    /// The deferred hyper-parameters' values, set by the first application.
    pub inferred: Option<Inferred>,
}

/// What an instance's first application bound of its deferred hyper-parameters.
#[derive(Clone)]
pub struct Inferred {
    pub values: Vec<(String, Value)>,
    /// That application, for the note on a later one that does not fit.
    pub at: Span,
}

impl Instance {
    pub fn display_name(&self) -> &str {
        if self.name.is_empty() {
            "<model>"
        } else {
            &self.name
        }
    }

    /// The dotted name of a child called `child`.
    pub fn child_name(&self, child: &str) -> String {
        if self.name.is_empty() {
            child.to_string()
        } else {
            format!("{}.{}", self.name, child)
        }
    }

    /// A hyper-parameter's value: bound when the instance was made, or by its first
    /// application.
    pub fn hyper(&self, name: &str) -> Option<Value> {
        if let Some((_, v)) = self.hyper.iter().find(|(n, _)| n == name) {
            return Some(v.clone());
        }
        let state = self.state.borrow();
        let inferred = state.inferred.as_ref()?;
        inferred
            .values
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
}
