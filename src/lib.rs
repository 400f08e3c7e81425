//! kiln as a library: a trained model loaded for translating ([`translator`]), and helpers
//! for users' own tests.
//!
//! The command-line tool is `src/main.rs`; this library exposes what applications (the
//! server, the Python package) and a user's test suite need, such as snapshotting the
//! generated kernels of a spec in one line:
//!
//! ```no_run
//! // tests/kernels.rs of your project (with insta as a dev-dependency)
//! # macro_rules! assert_snapshot { ($e:expr) => { let _ = $e; } }
//! assert_snapshot!(kiln::snapshot::kernels("models/my_model.kiln", &["vocab=100"], "forward").unwrap());
//! ```

pub mod build;
pub mod translator;

/// The DSL mode that elaborates a graph of `kind` (what an entry point is cut from).
pub fn dsl_mode(kind: kiln_exec::GraphKind) -> kiln_dsl::Mode {
    match kind {
        kiln_exec::GraphKind::Eval => kiln_dsl::Mode::Eval,
        kiln_exec::GraphKind::Train => kiln_dsl::Mode::Train,
        kiln_exec::GraphKind::Decode => kiln_dsl::Mode::Decode,
    }
}

pub mod snapshot {
    //! Deterministic text of a spec's generated CPU kernels, for snapshot tests.

    use std::fmt::Write as _;
    use std::path::Path;

    use kiln_compiler::pipeline::EntryProgram;
    use kiln_dsl::Options;
    use kiln_exec::{compiled_entry_graph_with, GraphKind};

    /// The CPU code of entry point `entry` of `spec` (with `--set` style overrides): one
    /// line per kernel in launch order (its kind and the functions it runs), the fusions
    /// of the launch plan, then every CLIF function. The same spec and overrides give the same text, byte for byte.
    pub fn kernels(spec: impl AsRef<Path>, set: &[&str], entry: &str) -> Result<String, String> {
        let spec = spec.as_ref();
        let elaborate = |kind: GraphKind| {
            let opts = Options {
                overrides: set.iter().map(|s| s.to_string()).collect(),
                mode: crate::dsl_mode(kind),
                model: None,
            };
            kiln_dsl::compile_file(spec, &opts)
                .map_err(|e| format!("{} does not compile: {e:?}", spec.display()))
        };
        let g = compiled_entry_graph_with(entry, elaborate, |e| e.message)?;
        let p = kiln_compiler::pipeline::compile_entry(&g, &Default::default(), None)
            .map_err(|e| e.to_string())?;
        let mut s = launch_text(&p, &g.name, entry);
        s.push('\n');
        s.push_str(&p.cpu.text());
        Ok(s)
    }

    /// The kernels of program `p` (entry `entry` of graph `name`) in launch order, one line
    /// each (its value, kind and the functions it runs), then the launch plan's fusions.
    pub fn launch_text(p: &EntryProgram, name: &str, entry: &str) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "# kernels of {name} entry={entry}");
        for l in &p.launch.launches {
            let fns: Vec<String> = l
                .functions
                .iter()
                .filter(|(r, _)| r.as_str() != "inner" && r.as_str() != "copy")
                .map(|(r, f)| format!("{r}={f}"))
                .collect();
            let _ = writeln!(s, "%{} {} {}", l.value, l.kind.name(), fns.join(" "));
        }
        s.push_str(&p.launch.fusions_text(true));
        s
    }
}
