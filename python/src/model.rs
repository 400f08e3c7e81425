//! `kiln.Model`: the entry points of a compiled artifact run on tensors, with the
//! artifact's weights (or others). Tensors cross as (name, bytes, dtype, shape); the
//! Python side makes them NumPy arrays.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use kiln_compiler::ir::Op;
use kiln_compiler::reference::RunOptions;
use kiln_compiler::tensor::{Feeds, Tensor, TensorData};
use kiln_exec::artifact::Artifact;
use kiln_exec::executor::Exec;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::{kiln_error, plain_error};

/// A tensor as it crosses: name, little-endian bytes, dtype (`float32`, `float64`,
/// `int32`, `int64`, `bool`) and shape.
type Wire = (String, Vec<u8>, String, Vec<usize>);

/// A tensor as it goes back: its bytes already Python's.
type WireOut<'py> = (String, Bound<'py, PyBytes>, &'static str, Vec<usize>);

#[pyclass(frozen, module = "kiln._kiln")]
pub(crate) struct Model {
    artifact: Artifact,
    weights: Feeds,
}

fn err(code: &'static str) -> impl Fn(String) -> PyErr {
    move |m| plain_error(code, m)
}

/// `bytes` as a tensor of `dtype` and `shape`.
fn tensor((name, bytes, dtype, shape): Wire) -> PyResult<(String, Tensor)> {
    let width = match dtype.as_str() {
        "float32" | "int32" => 4,
        "float64" | "int64" => 8,
        "bool" => 1,
        other => {
            return Err(plain_error(
                "kiln::run",
                format!("input `{name}` is {other}: give float32, float64, int32, int64 or bool"),
            ))
        }
    };
    let words = bytes.chunks_exact(width);
    let data = match dtype.as_str() {
        "float32" => TensorData::F32(
            words
                .map(|w| f32::from_le_bytes(w.try_into().unwrap()))
                .collect(),
        ),
        "float64" => TensorData::F64(
            words
                .map(|w| f64::from_le_bytes(w.try_into().unwrap()))
                .collect(),
        ),
        "int32" => TensorData::I32(
            words
                .map(|w| i32::from_le_bytes(w.try_into().unwrap()))
                .collect(),
        ),
        "int64" => TensorData::I64(
            words
                .map(|w| i64::from_le_bytes(w.try_into().unwrap()))
                .collect(),
        ),
        _ => TensorData::Bool(bytes.iter().map(|&b| b != 0).collect()),
    };
    let t = Tensor::new(shape, data)
        .map_err(|e| plain_error("kiln::run", format!("input `{name}`: {e}")))?;
    Ok((name, t))
}

/// `t` as it crosses back.
fn wire<'py>(py: Python<'py>, name: String, t: &Tensor) -> WireOut<'py> {
    let (bytes, dtype): (Vec<u8>, &str) = match &t.data {
        TensorData::F32(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "float32"),
        TensorData::F64(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "float64"),
        TensorData::I32(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "int32"),
        TensorData::I64(v) => (v.iter().flat_map(|x| x.to_le_bytes()).collect(), "int64"),
        TensorData::Bool(v) => (v.iter().map(|&b| u8::from(b)).collect(), "bool"),
    };
    (name, PyBytes::new(py, &bytes), dtype, t.shape.clone())
}

#[pymethods]
impl Model {
    /// Loads the artifact directory `path` (`kiln compile … -o DIR`), its files checked.
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Model> {
        py.detach(|| {
            let artifact = Artifact::load(&path).map_err(|e| e.to_string())?;
            let weights = artifact.weights().map_err(|e| e.to_string())?;
            Ok::<_, String>(Model { artifact, weights })
        })
        .map_err(err("kiln::artifact"))
    }

    /// The artifact's entry points.
    #[getter]
    fn entries(&self) -> Vec<String> {
        self.artifact
            .entries()
            .iter()
            .map(|e| e.manifest.name.clone())
            .collect()
    }

    /// The inputs `entry` takes: name, dtype (`f32`, `i32`, …) and shape (dims by name or
    /// size).
    fn inputs(&self, entry: &str) -> PyResult<Vec<(String, String, Vec<String>)>> {
        let e = self
            .artifact
            .entry(entry)
            .map_err(|e| plain_error("kiln::artifact", e.to_string()))?;
        let g = &e.manifest.graph;
        Ok(g.inputs
            .iter()
            .map(|&i| {
                let ty = g.ty(i);
                let shape = ty.shape.dims().iter().map(|d| d.to_string()).collect();
                let name = g.source_name(i).unwrap_or_default().to_string();
                (name, ty.dtype.to_string(), shape)
            })
            .collect())
    }

    /// Runs `entry` on `inputs` with the artifact's weights (or `weights`, by name):
    /// its outputs in the graph's order.
    #[pyo3(signature = (entry, inputs, weights=None, seed=0, step=0))]
    fn run<'py>(
        &self,
        py: Python<'py>,
        entry: &str,
        inputs: Vec<Wire>,
        weights: Option<Vec<Wire>>,
        seed: u64,
        step: u32,
    ) -> PyResult<Vec<WireOut<'py>>> {
        let feeds: Feeds = inputs.into_iter().map(tensor).collect::<PyResult<_>>()?;
        let given: Option<Feeds> = weights
            .map(|w| w.into_iter().map(tensor).collect::<PyResult<_>>())
            .transpose()?;
        let outs = py
            .detach(|| -> Result<Vec<(String, Tensor)>, kiln_dsl::Error> {
                let plain = |code, m: String| kiln_dsl::Error::plain(code, m, None);
                let e = self
                    .artifact
                    .entry(entry)
                    .map_err(|e| plain("kiln::artifact", e.to_string()))?;
                let g = &e.manifest.graph;
                kiln_exec::check_inputs(g, "inputs", &feeds)
                    .map_err(|e| kiln_dsl::Error::plain("kiln::run", e.message, Some(e.help)))?;
                let mine: BTreeSet<&str> = g
                    .params
                    .iter()
                    .filter_map(|&p| match &g.node(p).op {
                        Op::Param { name, .. } => Some(name.as_str()),
                        _ => None,
                    })
                    .collect();
                let all = given.as_ref().unwrap_or(&self.weights);
                let params: BTreeMap<String, Tensor> = all
                    .iter()
                    .filter(|(k, _)| mine.contains(k.as_str()))
                    .map(|(k, t)| (k.clone(), t.clone()))
                    .collect();
                kiln_exec::check_weights(g, "weights", &params)
                    .map_err(|e| kiln_dsl::Error::plain("kiln::run", e.message, Some(e.help)))?;
                let exec = self
                    .artifact
                    .executor(entry)
                    .map_err(|e| plain("kiln::artifact", e.to_string()))?;
                let opts = RunOptions {
                    seed,
                    step,
                    ..RunOptions::default()
                };
                exec.run(&feeds, &params, &opts)
                    .map_err(|e| plain("kiln::run", e.to_string()))
            })
            .map_err(kiln_error)?;
        Ok(outs.into_iter().map(|(n, t)| wire(py, n, &t)).collect())
    }
}
