//! `kiln export` and `kiln import`: weights under another framework's names.

use std::path::Path;

use kiln_compiler::tensor::{save_safetensors, Tensor};
use kiln_dsl::Error;

use crate::cmd::average::{plain_weights, weights_of};
use crate::outputs::Output;
use crate::{err, plain};

pub fn export(format: &str, input: &Path, output: &Path) -> Result<(), Error> {
    check_format(format)?;
    crate::outputs::check("kiln::export", output, &[input], Output::File)?;
    let w = weights_of(input)?;
    let t = kiln_train::interop::to_torch(&w).map_err(err("kiln::export"))?;
    let list: Vec<(String, Tensor)> = t.into_iter().collect();
    save_safetensors(output, &list, None).map_err(err("kiln::export"))?;
    say!(
        "wrote {} tensors in nn.Transformer naming to {}",
        list.len(),
        output.display()
    );
    Ok(())
}

pub fn import(format: &str, input: &Path, output: &Path) -> Result<(), Error> {
    check_format(format)?;
    crate::outputs::check("kiln::import", output, &[input], Output::File)?;
    let w = plain_weights(input)?;
    let k = kiln_train::interop::from_torch(&w).map_err(err("kiln::import"))?;
    let list: Vec<(String, Tensor)> = k.into_iter().collect();
    save_safetensors(output, &list, None).map_err(err("kiln::import"))?;
    say!(
        "wrote {} tensors in kiln naming to {}",
        list.len(),
        output.display()
    );
    Ok(())
}

fn check_format(format: &str) -> Result<(), Error> {
    if format == "torch" {
        Ok(())
    } else {
        Err(plain(
            "kiln::interop",
            format!("unknown weight format `{format}`"),
            Some("the supported format is `torch` (PyTorch nn.Transformer names)".to_string()),
        ))
    }
}
