//! `kiln average`: the mean of checkpoints' weights, into a model directory or a file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kiln_compiler::tensor::{load_safetensors, save_safetensors, Tensor};
use kiln_dsl::Error;
use kiln_train::model;

use crate::outputs::Output;
use crate::{err, plain};

mod choice;
pub use choice::{best_checkpoints, last_checkpoints, Choice, RECORD_FILE};

/// Refuses an average of the same checkpoint twice, and an output that would overwrite an
/// input, a checkpoint or a run directory (`inputs` as given, `dirs` the model directories
/// they name).
fn check_average_paths(inputs: &[PathBuf], dirs: &[PathBuf], output: &Path) -> Result<(), Error> {
    let mut seen: Vec<(PathBuf, &Path)> = Vec::new();
    for (given, dir) in inputs.iter().zip(dirs) {
        let Some(c) = crate::outputs::canonical(dir) else {
            continue;
        };
        if let Some((_, first)) = seen.iter().find(|(s, _)| *s == c) {
            let message = if *first == given.as_path() {
                format!("`{}` is given twice", given.display())
            } else {
                format!(
                    "`{}` and `{}` are the same checkpoint (`{}`)",
                    first.display(),
                    given.display(),
                    dir.display()
                )
            };
            return Err(plain(
                "kiln::average",
                message,
                Some("average distinct checkpoints (each counts once in the mean)".to_string()),
            ));
        }
        seen.push((c, given));
    }
    let all: Vec<&Path> = inputs.iter().chain(dirs).map(|p| p.as_path()).collect();
    let kind = if output.extension().and_then(|e| e.to_str()) == Some("safetensors") {
        Output::File
    } else {
        Output::Model
    };
    crate::outputs::check("kiln::average", output, &all, kind)
}

/// The mean of `inputs`' weights into `output`; a model directory also gets
/// `average.yaml`, what was averaged and how it was chosen (`choice`), which `kiln
/// inspect` prints.
pub fn average(inputs: &[PathBuf], output: &Path, choice: &Choice) -> Result<(), Error> {
    let dirs: Vec<PathBuf> = inputs
        .iter()
        .map(|p| {
            if p.is_dir() {
                model::resolve(p).map_err(err("kiln::average"))
            } else {
                Ok(p.clone())
            }
        })
        .collect::<Result<_, _>>()?;
    check_average_paths(inputs, &dirs, output)?;
    // Checkpoint directories: their graphs and tokenizer checked as `kiln translate`
    // would, and the same for all (one run's checkpoints).
    let mut files: Option<(&Path, model::ModelFiles)> = None;
    for dir in dirs.iter().filter(|d| d.is_dir()) {
        let these = model::read_files(dir).map_err(err("kiln::average"))?;
        let Some((first, reference)) = &files else {
            files = Some((dir, these));
            continue;
        };
        for (name, same) in [
            (
                model::GRAPHS_FILE,
                these.graphs.to_json() == reference.graphs.to_json(),
            ),
            (
                model::TOKENIZER_FILE,
                these.tokenizer.to_json().ok() == reference.tokenizer.to_json().ok(),
            ),
        ] {
            if !same {
                return Err(plain(
                    "kiln::average",
                    format!(
                        "`{}` differs from `{}`: these are checkpoints of different models \
                         or runs ({})",
                        dir.join(name).display(),
                        first.join(name).display(),
                        if name == model::GRAPHS_FILE {
                            "another spec or other spec settings"
                        } else {
                            "another vocabulary: other training data or vocab_size"
                        }
                    ),
                    Some("average checkpoints of one run only".to_string()),
                ));
            }
        }
    }
    let refs: Vec<&Path> = dirs.iter().map(|p| p.as_path()).collect();
    let avg = kiln_train::checkpoint::average(&refs).map_err(err("kiln::average"))?;
    if let Some((first, f)) = &files {
        let weights = first.join(kiln_train::checkpoint::MODEL_FILE);
        kiln_exec::entry::check_weights(&f.graphs.loss, &weights.display().to_string(), &avg)
            .map_err(|e| {
                plain(
                    "kiln::average",
                    e.message,
                    Some(format!(
                        "`{}` does not fit the checkpoint's `{}`: average intact checkpoints",
                        weights.display(),
                        model::GRAPHS_FILE
                    )),
                )
            })?;
    }
    if output.extension().and_then(|e| e.to_str()) == Some("safetensors") {
        let list: Vec<(String, Tensor)> = avg.into_iter().collect();
        save_safetensors(output, &list, None).map_err(err("kiln::average"))?;
    } else {
        let first_is_dir = dirs.first().is_some_and(|d| d.is_dir());
        let Some((_, f)) = files.filter(|_| first_is_dir) else {
            return Err(plain(
                "kiln::average",
                "averaging safetensors files gives weights only; name the output `*.safetensors`".to_string(),
                Some("or average checkpoint directories to get a model directory for `kiln translate`".to_string()),
            ));
        };
        let record = choice.record(&dirs);
        let extra: [(&str, &[u8]); 1] = [(choice::RECORD_FILE, record.as_bytes())];
        model::save_dir(output, &avg, &f.graphs_json, &f.tokenizer_json, &extra)
            .map_err(err("kiln::average"))?;
    }
    let steps: Vec<String> = dirs
        .iter()
        .filter_map(|d| d.file_name()?.to_str())
        .filter_map(kiln_train::checkpoint::parse_dir_name)
        .map(|s| s.to_string())
        .collect();
    say!(
        "averaged {} checkpoint{}{} into {}",
        inputs.len(),
        if inputs.len() == 1 { "" } else { "s" },
        if steps.len() == dirs.len() {
            let word = if steps.len() == 1 { "step" } else { "steps" };
            let how = choice
                .how()
                .map(|h| format!("; the {h}"))
                .unwrap_or_default();
            format!(" ({word} {}{how})", steps.join(", "))
        } else {
            String::new()
        },
        output.display()
    );
    Ok(())
}

/// Weights from a model directory or a safetensors file.
/// The weights of a model directory (loaded and checked against its graphs, as `kiln
/// translate` loads them) or of a plain safetensors file ([`plain_weights`]).
pub(crate) fn weights_of(input: &Path) -> Result<BTreeMap<String, Tensor>, Error> {
    if input.is_dir() {
        return Ok(model::load(input).map_err(err("kiln::model"))?.params);
    }
    plain_weights(input)
}

/// A safetensors file of weights with no model beside it: its tensors must be floats,
/// and finite.
pub(crate) fn plain_weights(file: &Path) -> Result<BTreeMap<String, Tensor>, Error> {
    let w = load_safetensors(file).map_err(err("kiln::file"))?;
    if let Some((name, t)) = w
        .iter()
        .find(|(_, t)| !matches!(t.dtype_name(), "f32" | "f64"))
    {
        return Err(plain(
            "kiln::file",
            format!(
                "tensor `{name}` in `{}` is {}, but weights are floats",
                file.display(),
                t.dtype_name()
            ),
            Some("give a file of model weights (F32)".to_string()),
        ));
    }
    kiln_exec::entry::check_finite(&file.display().to_string(), &w)
        .map_err(crate::runtime_error)?;
    Ok(w)
}
