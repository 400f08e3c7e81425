//! Dynamic batching: the requests that arrive close together are translated as one batch.
//!
//! In: jobs (one request's encoded sentences, its search and a reply channel) from the
//! HTTP handlers. Out: each job's hypotheses on its reply channel. One thread takes the
//! first waiting job, then gathers more until their source tokens reach
//! `max_batch_tokens` or `max_wait` has passed since the first, and translates the jobs
//! that ask for the same search together (in arrival order). A sentence's translation
//! does not depend on its batch (`kiln_decode::translate`), so the answers are those of
//! `kiln translate`, however the requests were batched.

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln::translator::Translator;
use kiln_decode::search::{DecodeOptions, Hypothesis};
use kiln_decode::translate::{translate_nbest_ids, Schedule};
use tokio::sync::oneshot;

/// What a job's reply carries: each sentence's hypotheses, or why the batch failed.
pub(crate) type Reply = Result<Vec<Vec<Hypothesis>>, String>;

/// One request's sentences to translate.
pub(crate) struct Job {
    /// The sentences' source ids (none empty).
    pub ids: Vec<Vec<i32>>,
    pub opts: DecodeOptions,
    pub nbest: usize,
    pub reply: oneshot::Sender<Reply>,
}

impl Job {
    fn tokens(&self) -> usize {
        self.ids.iter().map(Vec::len).sum()
    }

    /// Jobs with the same key are translated together: the same search.
    fn key(&self) -> String {
        format!("{:?} {}", self.opts, self.nbest)
    }
}

/// How jobs are gathered into batches, and how a batch is run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gather {
    /// Stop gathering once the jobs hold this many source tokens.
    pub max_batch_tokens: usize,
    /// Stop gathering this long after the first job.
    pub max_wait: Duration,
    /// How a gathered batch is cut and run (`kiln translate`'s `--batch`, workers).
    pub schedule: Schedule,
}

/// Runs until every sender of `jobs` is gone (the server has shut down and its handlers
/// finished), answering each job.
pub(crate) fn run(translator: Arc<Translator>, jobs: Receiver<Job>, gather: Gather) {
    while let Ok(first) = jobs.recv() {
        let deadline = Instant::now() + gather.max_wait;
        let mut tokens = first.tokens();
        let mut batch = vec![first];
        while tokens < gather.max_batch_tokens {
            let left = deadline.saturating_duration_since(Instant::now());
            match jobs.recv_timeout(left) {
                Ok(job) => {
                    tokens += job.tokens();
                    batch.push(job);
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => break,
            }
        }
        let mut groups: BTreeMap<String, Vec<Job>> = BTreeMap::new();
        let mut order = Vec::new();
        for job in batch {
            let key = job.key();
            if !groups.contains_key(&key) {
                order.push(key.clone());
            }
            groups.entry(key).or_default().push(job);
        }
        for key in order {
            if let Some(group) = groups.remove(&key) {
                translate_group(&translator, group, gather.schedule);
            }
        }
    }
}

/// Translates the jobs of `group` (one search) as one batch and answers each.
fn translate_group(translator: &Translator, group: Vec<Job>, mut schedule: Schedule) {
    let ids: Vec<Vec<i32>> = group.iter().flat_map(|j| j.ids.iter().cloned()).collect();
    // A gathered batch is cut so that every worker gets a share of it: 32 sentences
    // from 32 clients would otherwise be one batch of 32 on one worker while the others
    // wait. The translations do not depend on the cut.
    let share = ids.len().div_ceil(schedule.workers.max(1)).max(1);
    schedule.batching.sentences = schedule.batching.sentences.min(share);
    let (opts, nbest) = (&group[0].opts, group[0].nbest);
    // A panic in the search is one failed batch, answered as such, not a dead server.
    let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
        translate_nbest_ids(
            translator.step_models(),
            &ids,
            opts,
            nbest,
            schedule,
            &mut |_| {},
        )
    }));
    let hyps = match result {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return answer_all(group, &e.to_string()),
        Err(_) => return answer_all(group, "internal error: the search panicked"),
    };
    let mut hyps = hyps.into_iter();
    for job in group {
        let mine: Vec<Vec<Hypothesis>> = hyps.by_ref().take(job.ids.len()).collect();
        // A client that went away no longer waits for its answer.
        let _ = job.reply.send(Ok(mine));
    }
}

fn answer_all(group: Vec<Job>, why: &str) {
    for job in group {
        let _ = job.reply.send(Err(why.to_string()));
    }
}
