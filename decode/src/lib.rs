//! kiln-decode: from a model's entry points to translations.
//!
//! Modules:
//! - [`search`] — greedy and beam search with a key/value cache, on any executor;
//! - [`translate`] — batches of sentences through beam search on several workers, in
//!   input order, and teacher-forced scoring;
//! - [`bleu`] — corpus BLEU with sacreBLEU's semantics.

pub mod bleu;
pub mod search;
pub mod translate;
