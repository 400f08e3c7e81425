//! `kiln init`: a spec's parameters, initialized from a seed, into a safetensors file.

use std::collections::BTreeMap;
use std::path::Path;

use kiln_compiler::init::init_params;
use kiln_compiler::summary::group_digits;
use kiln_compiler::tensor::save_safetensors;
use kiln_dsl::Error;

use crate::outputs::{self, Output};
use crate::{file_error, plain, SpecArgs};

pub fn init(spec: &SpecArgs, seed: u64, output: &Path) -> Result<(), Error> {
    outputs::check("kiln::init", output, &[&spec.spec], Output::File)?;
    let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
    let weights = init_params(&g, seed).map_err(|e| plain("kiln::init", e.to_string(), None))?;
    let mut meta = BTreeMap::new();
    meta.insert("kiln.model".to_string(), g.name.clone());
    meta.insert("kiln.seed".to_string(), seed.to_string());
    save_safetensors(output, &weights, Some(&meta)).map_err(file_error)?;
    outln!(
        "wrote {} parameters in {} tensors of model `{}` to {}",
        group_digits(g.num_parameters()),
        weights.len(),
        g.name,
        output.display()
    );
    Ok(())
}
