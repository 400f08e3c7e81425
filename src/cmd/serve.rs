//! `kiln serve`: a trained model answering translation requests over HTTP (the server
//! itself is `crate::serve`).

use std::path::PathBuf;
use std::time::Duration;

use kiln::translator::Translator;
use kiln_decode::translate::{decode_workers, Schedule};
use kiln_dsl::Error;
use serde_json::json;

use crate::args::{DecodeRunArgs, SearchArgs};
use crate::cmd::translate::executor_label;
use crate::serve::api::Limits;
use crate::serve::batcher::Gather;
use crate::serve::{serve as run_server, Settings};

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A checkpoint directory, a run directory (its newest checkpoint), the output of
    /// `kiln average`, or a compiled artifact (`kiln compile --from-model`).
    #[arg(long)]
    pub model: PathBuf,
    /// The address to listen on (`0.0.0.0` for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port to listen on (0: a free one; the address is printed on standard error).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// The search a request gets for the fields it leaves out.
    #[command(flatten)]
    pub search: SearchArgs,
    /// Gather requests into one batch until their sentences hold this many source tokens…
    #[arg(long, default_value_t = 2048,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_batch_tokens: usize,
    /// …or this many milliseconds have passed since the first.
    #[arg(long, default_value_t = 10,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(0..=60_000))]
    pub max_wait_ms: u64,
    /// Sentences one request may hold.
    #[arg(long, default_value_t = 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_sentences: usize,
    /// Characters one sentence may hold.
    #[arg(long, default_value_t = 10_000,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_chars: usize,
    /// Bytes one request's body may hold.
    #[arg(long, default_value_t = 4 << 20,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_body_bytes: usize,
    /// Close a connection that has not sent a request's headers within this long.
    #[arg(long, default_value_t = 30_000,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub header_timeout_ms: u64,
    /// Answer 408 to a request whose body has not arrived within this long.
    #[arg(long, default_value_t = 60_000,
          value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..))]
    pub body_timeout_ms: u64,
    /// Requests that may wait for the translator; more are answered 503.
    #[arg(long, default_value_t = 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub queue: usize,
    #[command(flatten)]
    pub run: DecodeRunArgs,
}

/// `kiln serve`: loads the model, then serves until SIGTERM or Ctrl-C.
pub fn serve(a: ServeArgs) -> Result<(), Error> {
    a.run.apply()?;
    // The defaults must make a valid search on their own, as `kiln translate`'s flags do.
    let defaults = a.search.decode_options(None)?;
    let m = Translator::load(&a.model, a.run.executor)?;
    let workers = a.run.workers.unwrap_or_else(|| decode_workers(&*m.step));
    let limits = Limits {
        sentences: a.max_sentences,
        chars: a.max_chars,
        body_bytes: a.max_body_bytes,
    };
    let model = json!({
        "model": a.model.display().to_string(),
        "format": if m.from_artifact { "artifact" } else { "model directory" },
        "executor": executor_label(a.run.executor),
        "compile_options": m.options,
        "vocabulary": m.tokenizer.vocab_size(),
        "output_width": m.vocab,
        "parameters": m.params.values().map(|t| t.numel()).sum::<usize>(),
        "defaults": {
            "beam": defaults.beam,
            "greedy": defaults.greedy,
            "alpha": a.search.alpha,
            "length_penalty": a.search.length_penalty,
            "early_stop": a.search.early_stop,
            "max_len_a": defaults.max_len_a,
            "max_len_b": defaults.max_len_b,
            "allow_unk": defaults.allow_unk,
        },
        "limits": {
            "max_sentences": limits.sentences,
            "max_chars": limits.chars,
            "max_body_bytes": limits.body_bytes,
            "header_timeout_ms": a.header_timeout_ms,
            "body_timeout_ms": a.body_timeout_ms,
        },
        "batching": {
            "max_batch_tokens": a.max_batch_tokens,
            "max_wait_ms": a.max_wait_ms,
            "batch": a.run.batch,
            "max_tokens": a.run.max_tokens,
            "workers": workers,
        },
    });
    let settings = Settings {
        host: a.host,
        port: a.port,
        defaults: a.search,
        limits,
        gather: Gather {
            max_batch_tokens: a.max_batch_tokens,
            max_wait: Duration::from_millis(a.max_wait_ms),
            schedule: Schedule {
                batching: a.run.batching(),
                workers,
            },
        },
        queue: a.queue,
        model,
        header_timeout: Duration::from_millis(a.header_timeout_ms),
        body_timeout: Duration::from_millis(a.body_timeout_ms),
    };
    run_server(m, settings)
}
