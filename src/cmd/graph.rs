//! `kiln graph`: a spec's IR graph in its deterministic text form.

use kiln_compiler::printer::print_graph;
use kiln_dsl::Error;

use crate::SpecArgs;

pub fn graph(spec: &SpecArgs) -> Result<(), Error> {
    let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
    out!("{}", print_graph(&g));
    Ok(())
}
