//! `kiln check`: a spec's parameters, dims, inputs, outputs and node count.

use kiln_compiler::summary::Summary;
use kiln_dsl::Error;

use crate::SpecArgs;

pub fn check(spec: &SpecArgs, json: bool) -> Result<(), Error> {
    let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
    let s = Summary::of(&g);
    if json {
        outln!(
            "{}",
            serde_json::to_string_pretty(&s).expect("summary serializes")
        );
    } else {
        out!("{}", s.to_text());
    }
    Ok(())
}
