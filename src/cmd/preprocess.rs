//! `kiln preprocess`: a configuration's training corpus encoded once into a binarized
//! corpus (`kiln_train::data::binarized`), which `kiln train` reads mapped from disk when
//! `data.binarized` names it.

use std::path::PathBuf;

use kiln_dsl::Error;
use kiln_train::config::Config;
use kiln_train::data::binarized;
use kiln_train::tokenizer::prepare_tokenizer;

use crate::{err, plain};

// `kiln preprocess`'s arguments (their help is `kiln preprocess --help`).
#[derive(clap::Args)]
pub struct PreprocessArgs {
    /// The run's configuration: its training files, `data.max_len`, and its tokenizer
    /// (the run directory's, or trained there now as `kiln train` would).
    #[arg(long)]
    pub config: PathBuf,
    /// The directory to write (default: the configuration's `data.binarized`).
    #[arg(short = 'o', long = "output")]
    pub output: Option<PathBuf>,
    /// Worker threads encoding the text (default: one per core).
    #[arg(long)]
    pub threads: Option<usize>,
}

pub fn preprocess(a: PreprocessArgs) -> Result<(), Error> {
    crate::set_threads(a.threads)?;
    let cfg = Config::load(&a.config).map_err(|e| {
        plain(
            "kiln::config",
            e.to_string(),
            Some("see models/configs/base.yaml for every key and its default".to_string()),
        )
    })?;
    let Some(dir) = a.output.clone().or_else(|| cfg.data.binarized.clone()) else {
        return Err(plain(
            "kiln::preprocess",
            "no output directory: the configuration has no `data.binarized`".to_string(),
            Some(
                "give `-o DIR`, or set `data.binarized: DIR` in the configuration (then \
                 `kiln train` reads the corpus from there)"
                    .to_string(),
            ),
        ));
    };
    let (tok, note) = prepare_tokenizer(&cfg).map_err(err("kiln::preprocess"))?;
    tell!("{note}");
    let started = std::time::Instant::now();
    let json = tok.to_json().map_err(err("kiln::preprocess"))?;
    let meta = binarized::binarize(
        (&cfg.data.train_src, &cfg.data.train_tgt),
        &tok,
        &binarized::digest(&json),
        cfg.data.max_len,
        &dir,
    )
    .map_err(err("kiln::preprocess"))?;
    let secs = started.elapsed().as_secs_f64();
    tell!(
        "encoded {} lines into {} pairs ({} skipped as empty, {} longer than {} tokens) in \
         {secs:.1} s, {:.0} lines/s on {} threads: {}",
        meta.lines,
        meta.pairs,
        meta.skipped_empty,
        meta.dropped_too_long,
        meta.max_len,
        meta.lines as f64 / secs.max(1e-9),
        rayon::current_num_threads(),
        dir.display()
    );
    Ok(())
}
