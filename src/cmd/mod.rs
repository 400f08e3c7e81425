//! One file per command of `kiln`: each turns its arguments into calls of the crates.

pub mod average;
pub mod bench;
pub mod bleu;
pub mod check;
pub mod compile;
pub mod demo;
pub mod explain;
pub mod export;
pub mod graph;
pub mod init;
pub mod inspect;
pub mod preprocess;
pub mod run;
pub mod score;
pub mod serve;
pub mod snapshot;
pub mod train;
pub mod translate;
