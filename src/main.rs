//! The `kiln` command line: parses arguments and calls the crates. No algorithms here.

use std::io::{IsTerminal, Write as _};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use kiln_dsl::Error;

/// `println!` for a command's output (a graph, a summary, a report): a reader that went
/// away (`kiln graph … | head`) ends the command quietly, as `grep` would end, instead of a
/// panic; any other write error is an error exit.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

/// `print!` with [`outln!`]'s handling of a closed standard output.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout().lock(), $($arg)*) {
            $crate::stdout_failed(e)
        }
    }};
}

/// Ends the process after a failed write to standard output: quietly (status 0) when the
/// reader closed the pipe, else with the error (status 1).
fn stdout_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(0);
    }
    let _ = writeln!(
        std::io::stderr(),
        "kiln: cannot write to standard output: {e}"
    );
    std::process::exit(1);
}

/// `println!` that does not panic when standard output is closed (`kiln train … | head`):
/// for reports that are not a command's product (a finished run is not undone by a
/// reader that went away).
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// `eprintln!` that does not panic when standard error is closed (see `say!`).
macro_rules! tell {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

mod args;
mod cmd;
mod compile_flags;
mod errors;
mod input;
mod outputs;
mod serve;

pub(crate) use args::{set_threads, DecodeRunArgs, GemmArgs, SearchArgs, SpecArgs};
pub(crate) use errors::{err, file_error, plain, runtime_error};

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: a declarative model compiler")]
struct Cli {
    /// Skip the check that a large allocation fits in the memory the system leaves this
    /// process (before 256 MiB or more, kiln compares with the available memory and swap,
    /// the cgroup's limit and `ulimit -v`).
    #[arg(long, global = true)]
    no_memory_check: bool,
    /// Where the CUDA executor keeps the PTX NVRTC compiled, between processes (`off`:
    /// nowhere). Default: `$XDG_CACHE_HOME/kiln/ptx`, else `$HOME/.cache/kiln/ptx`.
    #[arg(long, global = true, value_name = "DIR")]
    ptx_cache: Option<String>,
    #[command(subcommand)]
    command: Command,
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
    /// Optimize an entry point and explain it: rules fired, e-graph sizes and stop
    /// reasons per phase, kernels per kind before and after, bytes moved, time spent.
    Explain {
        #[command(flatten)]
        args: cmd::explain::OptArgs,
        /// Also print the kernel graph and each fusion.
        #[arg(long)]
        kernels: bool,
        #[command(flatten)]
        fusions: compile_flags::FusionFlags,
    },
    /// Compile a spec into an artifact directory (`-o DIR`: kernel graphs, memory plans,
    /// CLIF code, weights) that runs without the spec — every entry point, or those of
    /// `--entries` — or, with `--entry` (or without `-o`), one entry point into its kernel
    /// graph (fused kernels, deterministic text). With
    /// `--config` the artifact is what `kiln train` needs (tokenizer included); with
    /// `--from-model` it is a trained model ready for `kiln translate`.
    Compile(cmd::compile::CompileArgs),
    /// Write a spec's generated kernels (launch order, kernel graph, CLIF, CUDA C) as
    /// files to commit (`-o DIR`), compare with them (`--check DIR`: a unified diff and
    /// exit status 1 when anything changed), or rewrite them (`--bless DIR`).
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Describe a compiled artifact (format, model, kernels, code size, memory plan and
    /// arena bytes at given dims) or a model directory (a checkpoint, a run's newest
    /// checkpoint or `kiln average`'s output: model, parameters, vocabulary, training
    /// state, the run's last logged losses), after checking it.
    Inspect {
        /// The artifact directory (`kiln compile --entries … -o DIR`), or a checkpoint,
        /// run or averaged model directory.
        dir: PathBuf,
        /// Batch size for the arena sizes.
        #[arg(long, default_value_t = 32)]
        batch: i64,
        /// Source length for the arena sizes.
        #[arg(long = "src-len", default_value_t = 25)]
        src_len: i64,
        /// Target length for the arena sizes.
        #[arg(long = "tgt-len", default_value_t = 25)]
        tgt_len: i64,
        /// Cached positions (decode_step) for the arena sizes.
        #[arg(long, default_value_t = 0)]
        past: i64,
        /// Also print each memory plan (slots and their buffers).
        #[arg(long)]
        plan: bool,
        /// Compile a `--target cuda` artifact's CUDA C with NVRTC here (it needs no GPU,
        /// only libnvrtc) and print the assembler's registers, shared memory and spills;
        /// fails if NVRTC rejects it.
        #[arg(long)]
        nvrtc: bool,
    },
    /// Time an entry point (median ms/step, tokens/s, peak RSS).
    Bench {
        #[command(flatten)]
        args: cmd::bench::BenchArgs,
    },
    /// Initialize a spec's parameters (seeded, deterministic) into a safetensors file.
    Init {
        #[command(flatten)]
        spec: SpecArgs,
        /// The seed; the same spec and seed give the same bits.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Where to write the weights.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Run an entry point of a spec (reference executor by default), or of a compiled
    /// artifact directory given in place of the spec (its generated kernels by default,
    /// its own weights unless `--weights`).
    Run(cmd::run::RunArgs),
    /// Corpus BLEU with sacreBLEU's semantics and defaults (13a tokens, `exp` smoothing).
    Bleu(cmd::bleu::BleuArgs),
    /// Encode a configuration's training corpus once into a binarized corpus (token ids
    /// and an index, as fairseq's `.bin`/`.idx`) that `kiln train` reads mapped from disk
    /// when `data.binarized` names it: corpora of any size, in memory that does not grow
    /// with them
    Preprocess(cmd::preprocess::PreprocessArgs),
    /// Train a model with the paper's recipe (a YAML configuration).
    Train(cmd::train::TrainArgs),
    /// Translate lines of text (standard input, or --input) with a trained model.
    Translate {
        /// A checkpoint directory, a run directory (its newest checkpoint), the output of
        /// `kiln average`, or a compiled artifact (`kiln compile --from-model`).
        #[arg(long, visible_alias = "model")]
        checkpoint: PathBuf,
        /// Read sentences from this file instead of standard input.
        #[arg(long)]
        input: Option<PathBuf>,
        #[command(flatten)]
        search: SearchArgs,
        /// Print each sentence's N best hypotheses (N ≤ beam), best first, in the Moses
        /// n-best format that Marian writes: `LINE ||| TEXT ||| log_prob= LP ||| SCORE`,
        /// LINE counting input lines from 0, LP the sum of the token log-probabilities
        /// (`<eos>` included) and SCORE that divided by the length penalty.
        #[arg(long, value_name = "N",
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        nbest: Option<usize>,
        #[command(flatten)]
        run: DecodeRunArgs,
    },
    /// Serve a trained model over HTTP: `POST /translate {"text": [...], "beam": 4}`
    /// answers JSON; `GET /health`, `GET /model`. Concurrent requests are batched
    /// together; SIGTERM lets the requests in flight finish.
    Serve(cmd::serve::ServeArgs),
    /// Score reference translations with a trained model (teacher forcing, as fairseq's
    /// --score-reference and marian-scorer): each pair's log-probability, one per line,
    /// and the corpus cross-entropy and perplexity.
    Score {
        /// A checkpoint directory, a run directory (its newest checkpoint), the output of
        /// `kiln average`, or a compiled artifact (`kiln compile --from-model`).
        #[arg(long, visible_alias = "model")]
        checkpoint: PathBuf,
        /// Source sentences, one per line.
        #[arg(long)]
        src: PathBuf,
        /// Their translations, one per line, as many lines as --src.
        #[arg(long = "ref")]
        reference: PathBuf,
        /// Print each log-probability divided by the translation's length in tokens
        /// (`<eos>` included) instead of the sum.
        #[arg(long)]
        normalize: bool,
        #[command(flatten)]
        run: DecodeRunArgs,
    },
    /// Average the weights of checkpoints (the paper averages the last 5 or 20).
    Average {
        /// Checkpoint directories or safetensors weight files; with `--last`, one run
        /// directory.
        #[arg(required = true)]
        inputs: Vec<PathBuf>,
        /// Average the run's last N checkpoints (fairseq's --num-update-checkpoints).
        #[arg(long, value_name = "N",
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        last: Option<usize>,
        /// Average the run's N checkpoints with the best validation, by the run's
        /// `valid.metric` (BLEU when it computed it, else the loss).
        #[arg(long, value_name = "N", conflicts_with = "last",
              value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
        best: Option<usize>,
        /// A directory (a model directory for `kiln translate`) or a `.safetensors` file.
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Write a model's weights under another framework's names.
    Export {
        #[arg(long, default_value = "torch")]
        format: String,
        /// A model/checkpoint directory or a safetensors weights file.
        input: PathBuf,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Read weights written under another framework's names.
    Import {
        #[arg(long, default_value = "torch")]
        format: String,
        input: PathBuf,
        #[arg(short = 'o', long = "output")]
        output: PathBuf,
    },
    /// Run the main job on an embedded default: generate a task, train, translate, score.
    Demo {
        /// Training time in seconds.
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
        seconds: u64,
        /// Train for exactly this many steps instead (deterministic; overrides --seconds).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
        steps: Option<u64>,
        /// Where to write the generated data and the run (default: a temporary folder).
        #[arg(long)]
        dir: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let color = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
            // Not `eprint!`: a closed standard error must not turn the failure into a panic.
            let _ = write!(std::io::stderr(), "{}", e.render(color));
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<(), Error> {
    kiln_compiler::memory::set_enabled(!cli.no_memory_check);
    read_environment(cli.ptx_cache.as_deref());
    dispatch(cli.command)
}

/// The environment is read here, at the command line's edge: the user's directories, and
/// the tests' switch for the emulated CUDA device (with the C++ compiler it uses).
fn read_environment(ptx_cache: Option<&str>) {
    let var = |k: &str| std::env::var(k).ok();
    use kiln_exec::cuda::emulate;
    emulate::configure(
        var(emulate::EMULATE_ENV).as_deref(),
        var(emulate::REFUSE_BIAS_GRAD_ENV).is_some(),
        var("CXX"),
    );
    kiln_exec::cuda::ptx_cache::set_dir(kiln_exec::cuda::ptx_cache::dir_from(
        ptx_cache,
        var("XDG_CACHE_HOME").as_deref(),
        var("HOME").as_deref(),
    ));
}

/// Each command to the function that does it.
fn dispatch(command: Command) -> Result<(), Error> {
    match command {
        Command::Check { spec, json } => cmd::check::check(&spec, json),
        Command::Explain {
            args,
            kernels,
            fusions,
        } => cmd::explain::explain(&args, kernels, &fusions),
        Command::Compile(a) => cmd::compile::compile(a),
        Command::Snapshot(a) => cmd::snapshot::snapshot(a),
        Command::Serve(a) => cmd::serve::serve(a),
        Command::Inspect {
            dir,
            batch,
            src_len,
            tgt_len,
            past,
            plan,
            nvrtc,
        } => cmd::inspect::inspect(
            &dir,
            &[
                ("batch", batch),
                ("src_len", src_len),
                ("tgt_len", tgt_len),
                ("past", past),
            ],
            plan,
            nvrtc,
        ),
        Command::Bench { args } => cmd::bench::bench(&args),
        Command::Graph { spec } => cmd::graph::graph(&spec),
        Command::Init { spec, seed, output } => cmd::init::init(&spec, seed, &output),
        Command::Run(a) => cmd::run::run(a),
        Command::Bleu(a) => cmd::bleu::bleu(a),
        Command::Preprocess(a) => cmd::preprocess::preprocess(a),
        Command::Train(a) => cmd::train::train(a),
        Command::Translate {
            checkpoint,
            input,
            search,
            nbest,
            run,
        } => {
            run.apply()?;
            cmd::translate::translate(cmd::translate::TranslateArgs {
                checkpoint,
                input,
                search,
                nbest,
                batching: run.batching(),
                executor: run.executor,
                workers: run.workers,
            })
        }
        Command::Score {
            checkpoint,
            src,
            reference,
            normalize,
            run,
        } => {
            run.apply()?;
            cmd::score::score(cmd::score::ScoreArgs {
                checkpoint,
                src,
                reference,
                normalize,
                batching: run.batching(),
                executor: run.executor,
                workers: run.workers,
            })
        }
        Command::Average {
            inputs,
            last,
            best,
            output,
        } => {
            let (inputs, choice) = match (last, best) {
                (Some(n), _) => cmd::average::last_checkpoints(&inputs, n)?,
                (_, Some(n)) => cmd::average::best_checkpoints(&inputs, n)?,
                _ => (inputs, cmd::average::Choice::Given),
            };
            cmd::average::average(&inputs, &output, &choice)
        }
        Command::Export {
            format,
            input,
            output,
        } => cmd::export::export(&format, &input, &output),
        Command::Import {
            format,
            input,
            output,
        } => cmd::export::import(&format, &input, &output),
        Command::Demo {
            seconds,
            steps,
            dir,
        } => cmd::demo::demo(cmd::demo::DemoArgs {
            seconds,
            steps,
            dir,
        }),
    }
}
