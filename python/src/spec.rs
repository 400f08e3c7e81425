//! `kiln.check` and `kiln.compile`: the compiler on a spec, its diagnostics raised as
//! `KilnError` with their place.

use std::path::PathBuf;

use kiln::build::{compile_artifact, compile_artifact_from_model, model_entries, Build};
use kiln_compiler::optimize::Target;
use kiln_compiler::options::{CompileOptions, Precision};
use kiln_compiler::summary::Summary;
use kiln_dsl::{Mode, Options};
use pyo3::prelude::*;

use crate::{kiln_error, plain_error};

/// The spec's summary as `kiln check --json` prints it: parameters, dims, inputs,
/// outputs and node count. `overrides` are `--set` values (`["d_model=256"]`).
#[pyfunction]
#[pyo3(signature = (spec, overrides=Vec::new(), model=None, mode="eval"))]
pub(crate) fn check(
    py: Python<'_>,
    spec: PathBuf,
    overrides: Vec<String>,
    model: Option<String>,
    mode: &str,
) -> PyResult<String> {
    let mode = match mode {
        "eval" => Mode::Eval,
        "train" => Mode::Train,
        "decode" => Mode::Decode,
        other => {
            return Err(plain_error(
                "kiln::check",
                format!("mode `{other}` is not eval, train or decode"),
            ))
        }
    };
    let opts = Options {
        overrides,
        mode,
        model,
    };
    let g = py
        .detach(|| kiln_dsl::compile_file(&spec, &opts))
        .map_err(kiln_error)?;
    Ok(serde_json::to_string(&Summary::of(&g)).expect("a summary serializes"))
}

/// Compiles `spec` into the artifact directory `out`, as `kiln compile SPEC -o OUT`:
/// `entries` (default: every one the model has), `target` `cpu` or `cuda`, `precision`
/// (`f32`, and for `cuda` `tf32`, `bf16`, `mixed`; `int8` for decoding entries),
/// weights from `seed`, `validate` against the reference executor first.
#[pyfunction]
#[pyo3(signature = (spec, out, overrides=Vec::new(), entries=None, target="cpu",
                    precision="f32", seed=0, validate=false, model=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn compile(
    py: Python<'_>,
    spec: PathBuf,
    out: PathBuf,
    overrides: Vec<String>,
    entries: Option<Vec<String>>,
    target: &str,
    precision: &str,
    seed: u64,
    validate: bool,
    model: Option<String>,
) -> PyResult<()> {
    let options = options(target, precision, &out)?;
    py.detach(|| {
        let entries = match entries {
            Some(e) => e,
            None => model_entries(&spec, &overrides, &model)?,
        };
        let build = Build {
            entries: &entries,
            output: Some(&out),
            check: validate,
            options: &options,
        };
        compile_artifact((&spec, &overrides, &model), seed, &build)
    })
    .map_err(kiln_error)
}

/// The compile options `target` and `precision` name, checked, for an artifact at `out`
/// (which must not exist).
fn options(target: &str, precision: &str, out: &std::path::Path) -> PyResult<CompileOptions> {
    let bad = |why: String| plain_error("kiln::compile", why);
    let target = Target::parse(target)
        .ok_or_else(|| bad(format!("target `{target}` is not cpu or cuda")))?;
    let precision = Precision::parse(precision)
        .ok_or_else(|| bad(format!("precision `{precision}` is not a precision")))?;
    let options = CompileOptions {
        target,
        cuda_arch: (target == Target::Cuda)
            .then(|| kiln_compiler::codegen::cuda::DEFAULT_ARCH.to_string()),
        precision,
        ..CompileOptions::default()
    };
    options.check().map_err(bad)?;
    if out.exists() {
        return Err(bad(format!(
            "`{}` exists: kiln never writes over an artifact; choose a new directory",
            out.display()
        )));
    }
    Ok(options)
}

/// Compiles a trained model (a checkpoint, a run or `kiln average`'s output) with its
/// weights and tokenizer into the artifact directory `out`, as `kiln compile --from-model
/// MODEL -o OUT` (by default the decoding entries; `precision="int8"` for int8 products).
#[pyfunction]
#[pyo3(signature = (model, out, entries=None, target="cpu", precision="f32", validate=false))]
pub(crate) fn compile_model(
    py: Python<'_>,
    model: PathBuf,
    out: PathBuf,
    entries: Option<Vec<String>>,
    target: &str,
    precision: &str,
    validate: bool,
) -> PyResult<()> {
    let options = options(target, precision, &out)?;
    let entries = entries.unwrap_or_default();
    let build = Build {
        entries: &entries,
        output: Some(&out),
        check: validate,
        options: &options,
    };
    py.detach(|| compile_artifact_from_model(&model, &build))
        .map_err(kiln_error)
}
