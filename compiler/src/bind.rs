//! Binding a graph's inputs and parameters to host tensors, shared by every executor.
//!
//! In: a [`Graph`] and the caller's input and parameter [`Tensor`]s (by name). Out: a
//! [`Binder`] holding the value of every symbolic dim, which hands out each source's
//! elements ([`Source`], borrowed wherever the dtype already fits) and each node's
//! concrete shape — or an [`ExecError`] whose text is the same whichever executor asked.
//!
//! The rules (the reference executor's, see [`crate::reference`]):
//!
//! - Every graph input must be given; other names are ignored. An `i32` input takes `I32`
//!   or `I64` tensors (every `I64` value must fit in i32); a float input takes `F32` or
//!   `F64`; a `bool` input takes `Bool`.
//! - Ranks must match. An axis whose dim is a single symbol binds it; two inputs that
//!   disagree on it are an [`ExecError::DimConflict`] naming both. Constant dims must match
//!   exactly; composite dims (`t + 1`) are evaluated once every symbol is bound.
//! - A parameter is looked up when a node needs it: it must be given, consistent, a float
//!   tensor (`F32` or `F64`) and have exactly the graph's shape.
//! - A node's shape is its symbolic shape evaluated under the bound dims.

use std::borrow::Cow;
use std::collections::BTreeMap;

use crate::ir::{DType, Graph, IrError, NodeId, TensorType};
use crate::reference::ExecError;
use crate::tensor::{shape_numel, Tensor, TensorData};

/// `[2, 3]`: how shapes appear in messages.
pub fn fmt_dims(dims: &[usize]) -> String {
    format!("{dims:?}")
}

/// An id as an index into `0..len`, or an error naming it. `what` says where the range
/// comes from (`the table has 4 rows`); `position` is the id's flat position.
pub fn check_id(
    id: i32,
    len: usize,
    position: usize,
    what: impl std::fmt::Display,
) -> Result<usize, String> {
    match usize::try_from(id) {
        Ok(r) if r < len => Ok(r),
        _ => Err(format!(
            "id {id} (at flat position {position}) is out of range: valid ids are 0..{len} \
             ({what})"
        )),
    }
}

/// The ids (`i32` as words) an embedding table of `vocab` rows is read at: each must be a
/// row. The generated kernels do not check them.
pub fn check_embedding_ids(ids: &[u32], vocab: usize) -> Result<(), String> {
    for (i, &w) in ids.iter().enumerate() {
        check_id(
            w as i32,
            vocab,
            i,
            format_args!("the embedding table has {vocab} rows"),
        )?;
    }
    Ok(())
}

/// The targets of a cross-entropy over `v` classes (`i32` ids as words): every one but
/// `pad` must be in `0..v`, as `one_hot` requires of them in the definition. The
/// generated kernels read an out-of-range target as no class at all, so without this
/// check such a target would give a wrong loss without a word.
pub fn check_targets(targets: &[u32], v: usize, pad: i64) -> Result<(), String> {
    for (i, &w) in targets.iter().enumerate() {
        let t = w as i32;
        if i64::from(t) != pad {
            check_id(
                t,
                v,
                i,
                format_args!("the target of a loss over {v} classes"),
            )?;
        }
    }
    Ok(())
}

/// The elements of a bound input or parameter, borrowed from the caller's tensor unless a
/// conversion was needed (`I64` ids become `i32`).
#[derive(Clone, Debug)]
pub enum Source<'t> {
    F32(&'t [f32]),
    F64(&'t [f64]),
    I32(Cow<'t, [i32]>),
    Bool(&'t [bool]),
}

/// The caller's tensors checked against a graph, with every symbolic dim bound.
pub struct Binder<'g, 't> {
    graph: &'g Graph,
    inputs: &'t BTreeMap<String, Tensor>,
    /// Inputs the executor already holds (on a device): their shapes and dtypes only.
    resident: &'t BTreeMap<String, (Vec<usize>, DType)>,
    params: &'t BTreeMap<String, Tensor>,
    /// `the reference executor`: who to name when a dtype is not supported.
    executor: &'static str,
    /// Symbolic dim → size, from the input shapes.
    pub dims: BTreeMap<String, i64>,
}

impl<'g, 't> Binder<'g, 't> {
    /// Checks every input's presence, dtype and rank, and binds the symbolic dims.
    /// `executor` names the caller in messages about unsupported dtypes
    /// (`the reference executor`).
    pub fn new(
        graph: &'g Graph,
        inputs: &'t BTreeMap<String, Tensor>,
        params: &'t BTreeMap<String, Tensor>,
        executor: &'static str,
    ) -> Result<Self, ExecError> {
        static NONE: BTreeMap<String, (Vec<usize>, DType)> = BTreeMap::new();
        Binder::with_resident(graph, inputs, &NONE, params, executor)
    }

    /// [`Binder::new`] where some inputs are not host tensors but values an executor
    /// already holds (a decoder's state on a device), given by shape and dtype: they bind
    /// dims like the others (in place of a host tensor of the same name, if there is
    /// one); [`Binder::input`] does not hand them out.
    pub fn with_resident(
        graph: &'g Graph,
        inputs: &'t BTreeMap<String, Tensor>,
        resident: &'t BTreeMap<String, (Vec<usize>, DType)>,
        params: &'t BTreeMap<String, Tensor>,
        executor: &'static str,
    ) -> Result<Self, ExecError> {
        let mut b = Binder {
            graph,
            inputs,
            resident,
            params,
            executor,
            dims: BTreeMap::new(),
        };
        b.bind_dims()?;
        Ok(b)
    }

    pub fn graph(&self) -> &'g Graph {
        self.graph
    }

    /// `%12 gather in scope `emb``.
    pub fn label(&self, id: NodeId) -> String {
        let node = self.graph.node(id);
        let mut s = format!("{id} {}", node.op.name());
        if let Some(name) = self.graph.source_name(id) {
            s.push_str(&format!(" `{name}`"));
        }
        if !node.scope.is_empty() {
            s.push_str(&format!(" in scope `{}`", node.scope));
        }
        s
    }

    /// An error at node `id`, labelled as [`Binder::label`] does.
    pub fn node_err(&self, id: NodeId, message: String) -> ExecError {
        ExecError::Node {
            node: self.label(id),
            message,
        }
    }

    /// The graph's inputs as `` `src`: i32[batch, src_len], … ``.
    pub fn expected_inputs(&self) -> String {
        let list: Vec<String> = self
            .graph
            .inputs
            .iter()
            .map(|&i| {
                format!(
                    "`{}`: {}",
                    self.graph.source_name(i).unwrap_or("?"),
                    self.graph.ty(i)
                )
            })
            .collect();
        list.join(", ")
    }

    fn input_name(&self, id: NodeId) -> Result<&'g str, ExecError> {
        self.graph.source_name(id).ok_or_else(|| {
            ExecError::Graph(IrError::Malformed(format!(
                "{id} is listed as an input but is a {} node",
                self.graph.node(id).op.name()
            )))
        })
    }

    fn bind_dims(&mut self) -> Result<(), ExecError> {
        let graph = self.graph;
        // symbol -> (input, axis, size) that bound it first.
        let mut origin: BTreeMap<String, (String, usize, usize)> = BTreeMap::new();
        for &id in &graph.inputs {
            if id.index() >= graph.len() {
                return Err(ExecError::Graph(IrError::Malformed(format!(
                    "input {id} does not exist"
                ))));
            }
            let name = self.input_name(id)?;
            let ty = graph.ty(id);
            let err = |message: String| ExecError::Input {
                name: name.to_string(),
                message,
            };
            // A resident entry wins over a host tensor of the same name: an executor that
            // reads a tensor in its own way (rows gathered) gives its shape as read.
            let shape: &[usize] = match (self.inputs.get(name), self.resident.get(name)) {
                (Some(t), None) => {
                    self.check_source_tensor(ty, t).map_err(err)?;
                    &t.shape
                }
                (_, Some((shape, dtype))) => {
                    if *dtype != ty.dtype {
                        return Err(err(format!(
                            "is held as {dtype}, but the graph declares {ty}"
                        )));
                    }
                    shape
                }
                (None, None) => {
                    return Err(ExecError::MissingInput {
                        name: name.to_string(),
                        expected: self.expected_inputs(),
                    })
                }
            };
            let dims = ty.shape.dims();
            if shape.len() != dims.len() {
                return Err(err(format!(
                    "has rank {} (shape {}), but the graph declares rank {}: {}",
                    shape.len(),
                    fmt_dims(shape),
                    dims.len(),
                    ty.shape
                )));
            }
            for (axis, (d, &got)) in dims.iter().zip(shape).enumerate() {
                if let Some(c) = d.as_const() {
                    if i64::try_from(got) != Ok(c) {
                        return Err(err(format!(
                            "has shape {}, expected {}: axis {axis} must be {c}",
                            fmt_dims(shape),
                            ty.shape
                        )));
                    }
                } else if let Some(sym) = d.as_sym() {
                    match origin.get(sym) {
                        Some((first, first_axis, first_value)) if *first_value != got => {
                            return Err(ExecError::DimConflict {
                                dim: sym.to_string(),
                                first: first.clone(),
                                first_axis: *first_axis,
                                first_value: *first_value,
                                second: name.to_string(),
                                second_axis: axis,
                                second_value: got,
                            });
                        }
                        Some(_) => {}
                        None => {
                            let v = i64::try_from(got).map_err(|_| {
                                err(format!("axis {axis} has size {got}, which is too large"))
                            })?;
                            origin.insert(sym.to_string(), (name.to_string(), axis, got));
                            self.dims.insert(sym.to_string(), v);
                        }
                    }
                }
            }
        }
        // Composite dims, now that every plain symbol is bound.
        for &id in &graph.inputs {
            let name = self.input_name(id)?;
            let ty = graph.ty(id);
            let shape: &[usize] = match (self.inputs.get(name), self.resident.get(name)) {
                (Some(t), _) => &t.shape,
                (None, Some((shape, _))) => shape,
                (None, None) => continue,
            };
            for (axis, (d, &got)) in ty.shape.dims().iter().zip(shape).enumerate() {
                if d.is_const() || d.as_sym().is_some() {
                    continue;
                }
                let want = d.eval(&self.dims).map_err(|e| ExecError::Input {
                    name: name.to_string(),
                    message: format!(
                        "has axis {axis} of size `{d}`, which cannot be evaluated ({e}); some \
                         input must have an axis that is exactly that dim"
                    ),
                })?;
                if i64::try_from(got) != Ok(want) {
                    return Err(ExecError::Input {
                        name: name.to_string(),
                        message: format!(
                            "has shape {}, expected {}: axis {axis} is `{d}` = {want}",
                            fmt_dims(shape),
                            ty.shape
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// The concrete shape of node `id` under the bound dims. Half-precision nodes, dims
    /// that cannot be evaluated and element counts that overflow are errors at the node.
    pub fn node_shape(&self, id: NodeId) -> Result<Vec<usize>, ExecError> {
        let node = self.graph.node(id);
        if matches!(node.ty.dtype, DType::BF16 | DType::F16) {
            return Err(self.node_err(
                id,
                format!(
                    "{} values are not supported by {}; run it in f32 (or f64)",
                    node.ty.dtype, self.executor
                ),
            ));
        }
        let shape = node.ty.shape.eval(&self.dims).map_err(|e| {
            self.node_err(
                id,
                format!(
                    "cannot size the result {}: {e}; every dim must be fixed by the shape of \
                     some input",
                    node.ty.shape
                ),
            )
        })?;
        if shape_numel(&shape).is_none() {
            return Err(self.node_err(
                id,
                format!("the result {} has too many elements", fmt_dims(&shape)),
            ));
        }
        Ok(shape)
    }

    /// The elements of input node `id` (named `name`).
    pub fn input(&self, id: NodeId, name: &str) -> Result<Source<'t>, ExecError> {
        let t = self
            .inputs
            .get(name)
            .ok_or_else(|| ExecError::MissingInput {
                name: name.to_string(),
                expected: self.expected_inputs(),
            })?;
        self.source(self.graph.ty(id), t)
            .map_err(|message| ExecError::Input {
                name: name.to_string(),
                message,
            })
    }

    /// The elements of parameter node `id` (named `name`), whose concrete shape is
    /// `shape`.
    pub fn param(&self, id: NodeId, name: &str, shape: &[usize]) -> Result<Source<'t>, ExecError> {
        let ty = self.graph.ty(id);
        let err = |message: String| ExecError::Param {
            name: name.to_string(),
            message,
        };
        let t = self.params.get(name).ok_or_else(|| {
            let scope = &self.graph.node(id).scope;
            let place = if scope.is_empty() {
                String::new()
            } else {
                format!(" in scope `{scope}`")
            };
            err(format!(
                "is not provided; the graph needs it as {ty}{place} (initialize the \
                 parameters or load a checkpoint of this model)"
            ))
        })?;
        if !t.is_consistent() {
            return Err(err(format!(
                "has shape {} ({} elements) but holds {} values",
                fmt_dims(&t.shape),
                t.numel(),
                t.data.len()
            )));
        }
        if !matches!(t.data, TensorData::F32(_) | TensorData::F64(_)) {
            return Err(err(format!(
                "is {}, but parameters must be f32 (or f64) tensors; the graph needs {ty}",
                t.dtype_name()
            )));
        }
        if t.shape != shape {
            return Err(err(format!(
                "has shape {}, but the graph needs {ty}; the tensors do not belong to this \
                 model (or its config changed)",
                fmt_dims(&t.shape)
            )));
        }
        self.source(ty, t).map_err(err)
    }

    /// Checks that a source tensor is consistent and has a dtype the declared type
    /// accepts.
    fn check_source_tensor(&self, ty: &TensorType, t: &Tensor) -> Result<(), String> {
        if !t.is_consistent() {
            return Err(format!(
                "has shape {} ({} elements) but holds {} values",
                fmt_dims(&t.shape),
                t.numel(),
                t.data.len()
            ));
        }
        let ok = match ty.dtype {
            DType::F32 => matches!(t.data, TensorData::F32(_) | TensorData::F64(_)),
            DType::I32 => matches!(t.data, TensorData::I32(_) | TensorData::I64(_)),
            DType::Bool => matches!(t.data, TensorData::Bool(_)),
            DType::BF16 | DType::F16 => {
                return Err(format!(
                    "is declared {}, which {} does not support",
                    ty.dtype, self.executor
                ))
            }
        };
        if !ok {
            let accepts = match ty.dtype {
                DType::F32 => "f32 or f64",
                DType::I32 => "i32 or i64",
                _ => "bool",
            };
            return Err(format!(
                "is {}, but the graph declares {ty}; pass it as {accepts}",
                t.dtype_name()
            ));
        }
        Ok(())
    }

    /// A checked source tensor's elements.
    fn source(&self, ty: &TensorType, t: &'t Tensor) -> Result<Source<'t>, String> {
        self.check_source_tensor(ty, t)?;
        Ok(match &t.data {
            TensorData::F32(v) => Source::F32(v),
            TensorData::F64(v) => Source::F64(v),
            TensorData::I32(v) => Source::I32(Cow::Borrowed(v)),
            TensorData::I64(v) => {
                let mut out = Vec::with_capacity(v.len());
                for (p, &x) in v.iter().enumerate() {
                    let x = i32::try_from(x).map_err(|_| {
                        format!(
                            "has the value {x} at flat position {p}, which does not fit in \
                             i32 (the graph declares {ty})"
                        )
                    })?;
                    out.push(x);
                }
                Source::I32(Cow::Owned(out))
            }
            TensorData::Bool(v) => Source::Bool(v),
        })
    }
}

/// Which nodes computing `requested` needs, and for each needed node the index of the
/// last needed node that reads it (its own index when nothing reads it). Every requested
/// id must exist.
pub fn liveness(graph: &Graph, requested: &[NodeId]) -> (Vec<bool>, Vec<usize>) {
    let n = graph.len();
    let mut live = vec![false; n];
    let mut stack: Vec<NodeId> = requested.to_vec();
    while let Some(id) = stack.pop() {
        if !std::mem::replace(&mut live[id.index()], true) {
            stack.extend(graph.node(id).inputs.iter().copied());
        }
    }
    let mut last_use: Vec<usize> = (0..n).collect();
    for (i, node) in graph.nodes.iter().enumerate() {
        if live[i] {
            for inp in &node.inputs {
                last_use[inp.index()] = last_use[inp.index()].max(i);
            }
        }
    }
    (live, last_use)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{Dim, Shape};

    /// Inputs `ids: i32[b, t]` and `cache: f32[b, h, t, 2]` (a decoder's state).
    fn graph() -> Graph {
        let mut g = Graph::new("resident");
        let ids = TensorType::new(DType::I32, Shape::from(vec![Dim::sym("b"), Dim::sym("t")]));
        let cache = TensorType::new(
            DType::F32,
            Shape::from(vec![
                Dim::sym("b"),
                Dim::from(3),
                Dim::sym("t"),
                Dim::from(2),
            ]),
        );
        let i = g.add_input("ids", ids).unwrap();
        let c = g.add_input("cache", cache).unwrap();
        g.add_output("ids", i).unwrap();
        g.add_output("cache", c).unwrap();
        g
    }

    #[test]
    fn resident_inputs_bind_dims_by_shape() {
        let g = graph();
        let mut inputs = BTreeMap::new();
        inputs.insert(
            "ids".to_string(),
            Tensor::i32(vec![4, 5], vec![0; 20]).unwrap(),
        );
        let params = BTreeMap::new();
        let mut resident = BTreeMap::new();
        resident.insert("cache".to_string(), (vec![4, 3, 5, 2], DType::F32));
        let b = Binder::with_resident(&g, &inputs, &resident, &params, "test").unwrap();
        assert_eq!(b.dims["b"], 4);
        assert_eq!(b.dims["t"], 5);
        // Not handed out as a host source.
        let id = g.input("cache").unwrap();
        assert!(matches!(
            b.input(id, "cache"),
            Err(ExecError::MissingInput { .. })
        ));
        // Checked like host tensors: conflicting dims, constant axes, dtype, presence.
        resident.insert("cache".to_string(), (vec![6, 3, 5, 2], DType::F32));
        let e = Binder::with_resident(&g, &inputs, &resident, &params, "test").err();
        assert!(matches!(e, Some(ExecError::DimConflict { .. })), "{e:?}");
        resident.insert("cache".to_string(), (vec![4, 2, 5, 2], DType::F32));
        let e = Binder::with_resident(&g, &inputs, &resident, &params, "test").err();
        assert!(e.unwrap().to_string().contains("axis 1 must be 3"));
        resident.insert("cache".to_string(), (vec![4, 3, 5, 2], DType::I32));
        let e = Binder::with_resident(&g, &inputs, &resident, &params, "test").err();
        assert!(e.unwrap().to_string().contains("is held as i32"));
        let e = Binder::new(&g, &inputs, &params, "test").err();
        assert!(matches!(e, Some(ExecError::MissingInput { .. })), "{e:?}");
    }
}
