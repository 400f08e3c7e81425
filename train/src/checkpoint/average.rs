//! Checkpoint averaging: parameters summed in f64 in the order given, divided once.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::tensor::{Tensor, TensorData};

use super::*;

/// The element-wise mean of the parameters of `paths`: each a checkpoint directory (its
/// `model.safetensors`) or a `.safetensors` file. All must hold the same names with the
/// same shapes. Sums and the division are done in f64 in the order given; the result is
/// f32.
pub fn average(paths: &[&Path]) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    let Some((first, rest)) = paths.split_first() else {
        return Err(CheckpointError::AverageNothing);
    };
    let file_of = |p: &Path| -> Result<PathBuf, CheckpointError> {
        if p.is_dir() {
            require_file(p, MODEL_FILE)
        } else {
            Ok(p.to_path_buf())
        }
    };
    // Each input's floats must be finite: a NaN would make every average it enters NaN,
    // and the average's check could not say which input brought it.
    let finite = |file: &Path, tensors: &BTreeMap<String, Tensor>| {
        kiln_exec::entry::check_finite(&file.display().to_string(), tensors).map_err(|e| {
            CheckpointError::NonFinite {
                message: format!("{}: {}", e.message, e.help),
            }
        })
    };
    let ref_path = file_of(first)?;
    let reference = load_tensors(&ref_path)?;
    finite(&ref_path, &reference)?;
    let mut sums: BTreeMap<String, (Vec<usize>, Vec<f64>)> = BTreeMap::new();
    for (name, t) in &reference {
        sums.insert(name.clone(), (t.shape.clone(), floats(&ref_path, name, t)?));
    }
    for p in rest {
        let path = file_of(p)?;
        let tensors = load_tensors(&path)?;
        finite(&path, &tensors)?;
        let mismatch = |message: String| CheckpointError::AverageMismatch {
            reference: ref_path.clone(),
            odd: path.clone(),
            message,
        };
        let missing: Vec<&str> = reference
            .keys()
            .filter(|k| !tensors.contains_key(*k))
            .map(String::as_str)
            .collect();
        let extra: Vec<&str> = tensors
            .keys()
            .filter(|k| !reference.contains_key(*k))
            .map(String::as_str)
            .collect();
        if !missing.is_empty() || !extra.is_empty() {
            return Err(mismatch(format!(
                "the parameter names differ (missing: {}; extra: {})",
                list_names(&missing),
                list_names(&extra)
            )));
        }
        for (name, t) in &tensors {
            let (shape, acc) = sums.get_mut(name).expect("same names checked above");
            if &t.shape != shape {
                return Err(mismatch(format!(
                    "parameter `{name}` has shape {:?} there but {:?} in the first",
                    t.shape, shape
                )));
            }
            for (a, x) in acc.iter_mut().zip(floats(&path, name, t)?) {
                *a += x;
            }
        }
    }
    let n = paths.len() as f64;
    Ok(sums
        .into_iter()
        .map(|(name, (shape, acc))| {
            let data = acc.into_iter().map(|x| (x / n) as f32).collect();
            (
                name,
                Tensor {
                    shape,
                    data: TensorData::F32(data),
                },
            )
        })
        .collect())
}

pub(super) fn floats(path: &Path, name: &str, t: &Tensor) -> Result<Vec<f64>, CheckpointError> {
    t.to_f64_vec().ok_or_else(|| CheckpointError::AverageDtype {
        path: path.to_path_buf(),
        name: name.to_string(),
        dtype: t.dtype_name(),
    })
}
