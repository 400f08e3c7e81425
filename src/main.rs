//! The `kiln` command line: parses arguments and calls the crates. No algorithms here.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kiln_compiler::printer::print_graph;
use kiln_compiler::summary::Summary;
use kiln_dsl::{Error, Mode, Options};

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: a declarative model compiler")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Clone)]
struct SpecArgs {
    /// The model spec (a `.kiln` file).
    spec: PathBuf,
    /// Override a model parameter: `--set d_model=256` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// Which model of the file, when it defines several.
    #[arg(long)]
    model: Option<String>,
    /// Elaborate the training graph (with dropout) instead of the inference graph.
    #[arg(long)]
    train: bool,
}

impl SpecArgs {
    fn options(&self) -> Options {
        Options {
            overrides: self.set.clone(),
            mode: if self.train { Mode::Train } else { Mode::Eval },
            model: self.model.clone(),
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Check a spec: parameters, dims, inputs, outputs, node count.
    Check {
        #[command(flatten)]
        spec: SpecArgs,
        /// Print JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Print the IR graph of a spec in its deterministic text form.
    Graph {
        #[command(flatten)]
        spec: SpecArgs,
    },
    /// Run the main job on an embedded default.
    Demo,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            eprint!("{}", e.render(color));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    match cli.command {
        Command::Check { spec, json } => {
            let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
            let s = Summary::of(&g);
            if json {
                println!("{}", serde_json::to_string_pretty(&s).expect("summary serializes"));
            } else {
                print!("{}", s.to_text());
            }
            Ok(())
        }
        Command::Graph { spec } => {
            let g = kiln_dsl::compile_file(&spec.spec, &spec.options())?;
            print!("{}", print_graph(&g));
            Ok(())
        }
        Command::Demo => {
            println!("kiln demo: not yet available");
            Ok(())
        }
    }
}
