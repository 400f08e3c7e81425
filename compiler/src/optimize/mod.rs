//! The optimizer: rewrites an IR graph with an e-graph (egg) into fused kernels.
//!
//! In: a verified [`Graph`] (an entry point: forward, `train_step`, `encode`,
//! `decode_step`, the Adam update) and [`Options`] (target, limits). Out: a
//! [`KernelGraph`] and a [`Report`] of what happened.
//!
//! Pipeline, one file per step:
//! 1. [`lang`] — the graph becomes an e-graph ([`analysis`] types every e-class);
//! 2. [`canon`] — canonicalization phase;
//! 3. [`templates`] — template phase: the fused kernels the prelude's layers and their
//!    autodiff-made backwards are recognized as, each of a [`kind::TemplateKind`];
//! 4. [`regions`] — elementwise-region phase;
//! 5. [`extract`] — DAG-aware extraction by a per-target cost model ([`cost`]);
//! 6. [`kernels`] — the kernel graph, and its expansion back to primitives;
//! 7. [`validate`] — the program against the source graph on random inputs.
//!
//! Each phase is its own egg `Runner` with iteration, node and time limits; its stop
//! reason is recorded, and one that hit the node or time limit is reported (the e-graph
//! is still sound — every rewrite adds equalities only — but the result may miss fusions).

pub mod analysis;
pub mod canon;
pub mod cost;
pub mod extract;
pub mod kernels;
pub mod kind;
pub mod lang;
pub mod native;
pub mod regions;
pub mod templates;
pub mod validate;

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use egg::{Id, Rewrite, Runner, SimpleScheduler, StopReason};

use crate::ir::Graph;
use analysis::{Types, EG};
pub use extract::{CostModel, Target};
pub use kernels::KernelGraph;
use lang::KNode;

/// Limits and target of one optimization.
#[derive(Clone, Debug)]
pub struct Options {
    pub target: Target,
    /// Per phase.
    pub iter_limit: usize,
    pub node_limit: usize,
    pub time_limit: Duration,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            target: Target::Cpu,
            iter_limit: 10,
            node_limit: 1_000_000,
            time_limit: Duration::from_secs(30),
        }
    }
}

/// One phase's account.
#[derive(Clone, Debug)]
pub struct PhaseReport {
    pub name: &'static str,
    pub iterations: usize,
    pub nodes: usize,
    pub classes: usize,
    /// `saturated`, `iteration limit 10`, `node limit …`, `time limit …`.
    pub stop: String,
    /// Whether the stop reason means the phase may have missed rewrites.
    pub truncated: bool,
    /// Applications per rule, summed over iterations.
    pub fired: BTreeMap<String, usize>,
    pub seconds: f64,
}

/// What the optimizer did.
#[derive(Clone, Debug)]
pub struct Report {
    pub source_nodes: usize,
    pub phases: Vec<PhaseReport>,
    pub kernels_before: BTreeMap<String, usize>,
    pub kernels_after: BTreeMap<String, usize>,
    pub bytes_before: f64,
    pub bytes_after: f64,
    /// Cost-model estimates of one run, seconds.
    pub cost_before: f64,
    pub cost_after: f64,
    pub extract_seconds: f64,
    pub total_seconds: f64,
}

/// Why optimization failed: always a compiler bug (the input graph was verified).
#[derive(Debug, thiserror::Error)]
pub enum OptError {
    #[error("the input graph is malformed: {0}")]
    Graph(#[from] crate::ir::IrError),
    #[error("optimizer bug: {0} (please report it with the spec that triggered it)")]
    Bug(String),
}

fn stop_text(s: &Option<StopReason>) -> (String, bool) {
    match s {
        Some(StopReason::Saturated) => ("saturated".to_string(), false),
        Some(StopReason::IterationLimit(n)) => (format!("iteration limit {n}"), true),
        Some(StopReason::NodeLimit(n)) => (format!("node limit {n}"), true),
        Some(StopReason::TimeLimit(t)) => (format!("time limit {t}s"), true),
        Some(StopReason::Other(o)) => (o.clone(), true),
        None => ("not run".to_string(), true),
    }
}

fn run_phase(
    name: &'static str,
    eg: EG,
    rules: &[Rewrite<KNode, Types>],
    opts: &Options,
    iters: usize,
) -> (EG, PhaseReport) {
    let t0 = Instant::now();
    let runner: Runner<KNode, Types> = Runner::default()
        .with_scheduler(SimpleScheduler)
        .with_iter_limit(iters.min(opts.iter_limit))
        .with_node_limit(opts.node_limit)
        .with_time_limit(opts.time_limit)
        .with_egraph(eg)
        .run(rules);
    let mut fired: BTreeMap<String, usize> = BTreeMap::new();
    for it in &runner.iterations {
        for (r, n) in &it.applied {
            *fired.entry(r.to_string()).or_insert(0) += n;
        }
    }
    let (stop, truncated) = stop_text(&runner.stop_reason);
    let eg = runner.egraph;
    let report = PhaseReport {
        name,
        iterations: runner.iterations.len(),
        nodes: eg.total_number_of_nodes(),
        classes: eg.number_of_classes(),
        stop,
        truncated,
        fired,
        seconds: t0.elapsed().as_secs_f64(),
    };
    (eg, report)
}

/// How many nodes and outputs of `g` use each e-class.
fn consumers(g: &Graph, eg: &EG, class: &[Id]) -> HashMap<Id, usize> {
    let mut m: HashMap<Id, usize> = HashMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        let mut seen: Vec<Id> = Vec::new();
        for x in &node.inputs {
            let c = eg.find(class[x.index()]);
            if !seen.contains(&c) && c != eg.find(class[i]) {
                seen.push(c);
                *m.entry(c).or_insert(0) += 1;
            }
        }
    }
    for o in &g.outputs {
        *m.entry(eg.find(class[o.node.index()])).or_insert(0) += 1;
    }
    m
}

fn extract_program(
    g: &Graph,
    eg: &EG,
    class: &[Id],
    model: &CostModel,
    target: Target,
) -> Result<(KernelGraph, f64), OptError> {
    let roots: Vec<(String, Id)> = g
        .outputs
        .iter()
        .map(|o| (o.name.clone(), class[o.node.index()]))
        .collect();
    let ids: Vec<Id> = roots.iter().map(|r| r.1).collect();
    let choice = extract::extract(eg, &ids, model).map_err(OptError::Bug)?;
    let scopes = kernels::class_scopes(g, eg, class);
    let kg =
        KernelGraph::build(g, eg, &choice.node, &roots, &scopes, target).map_err(OptError::Bug)?;
    Ok((kg, choice.cost))
}

/// Optimizes `g` into a kernel graph.
pub fn optimize(g: &Graph, opts: &Options) -> Result<(KernelGraph, Report), OptError> {
    let t0 = Instant::now();
    g.verify()?;
    let model = CostModel::new(opts.target, &g.dims);
    let (eg, class) = lang::to_egraph(g);
    let (before, cost_before) = extract_program(g, &eg, &class, &model, opts.target)?;
    let uses = consumers(g, &eg, &class);

    let mut phases = Vec::new();
    let (eg, r) = run_phase("canonicalize", eg, &canon::rules(), opts, opts.iter_limit);
    phases.push(r);
    let (eg, r) = run_phase("templates", eg, &templates::rules(), opts, 4);
    phases.push(r);
    let uses: HashMap<Id, usize> = {
        let mut m = HashMap::new();
        for (c, n) in uses {
            *m.entry(eg.find(c)).or_insert(0) += n;
        }
        m
    };
    let (eg, r) = run_phase("regions", eg, &regions::rules(uses), opts, 2);
    phases.push(r);
    if !eg.analysis.errors.is_empty() {
        return Err(OptError::Bug(eg.analysis.errors.join("; ")));
    }
    let t1 = Instant::now();
    let (after, cost_after) = extract_program(g, &eg, &class, &model, opts.target)?;
    let after = crate::schedule::reorder(after);
    let extract_seconds = t1.elapsed().as_secs_f64();
    let report = Report {
        source_nodes: g.len(),
        phases,
        kernels_before: before.counts(),
        kernels_after: after.counts(),
        bytes_before: before.bytes_moved(&model),
        bytes_after: after.bytes_moved(&model),
        cost_before,
        cost_after,
        extract_seconds,
        total_seconds: t0.elapsed().as_secs_f64(),
    };
    Ok((after, report))
}

impl Report {
    /// What `kiln explain` prints.
    pub fn text(&self, with_timing: bool) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(s, "source graph: {} nodes", self.source_nodes);
        for p in &self.phases {
            let _ = write!(
                s,
                "phase {:<13} {} iterations, e-graph {} nodes / {} classes, stop: {}",
                p.name, p.iterations, p.nodes, p.classes, p.stop
            );
            if with_timing {
                let _ = write!(s, ", {:.3} s", p.seconds);
            }
            s.push('\n');
            if p.truncated {
                let _ = writeln!(
                    s,
                    "  warning: the phase stopped early; some fusions may be missing"
                );
            }
            for (rule, n) in &p.fired {
                if *n > 0 {
                    let _ = writeln!(s, "  {rule:<40} fired {n}");
                }
            }
        }
        let total = |m: &BTreeMap<String, usize>| m.values().sum::<usize>();
        let _ = writeln!(
            s,
            "kernels: {} before, {} after",
            total(&self.kernels_before),
            total(&self.kernels_after)
        );
        let mut kinds: Vec<&String> = self
            .kernels_before
            .keys()
            .chain(self.kernels_after.keys())
            .collect();
        kinds.sort();
        kinds.dedup();
        for k in kinds {
            let _ = writeln!(
                s,
                "  {:<22} {:>6} -> {:>6}",
                k,
                self.kernels_before.get(k).copied().unwrap_or(0),
                self.kernels_after.get(k).copied().unwrap_or(0)
            );
        }
        let _ = writeln!(
            s,
            "bytes moved (every dim = {}): {:.1} MB -> {:.1} MB",
            extract::ESTIMATE_DIM,
            self.bytes_before / 1e6,
            self.bytes_after / 1e6
        );
        let _ = writeln!(
            s,
            "estimated time (cost model): {:.3} ms -> {:.3} ms",
            self.cost_before * 1e3,
            self.cost_after * 1e3
        );
        if with_timing {
            let _ = writeln!(
                s,
                "optimizer time: {:.3} s (extraction {:.3} s)",
                self.total_seconds, self.extract_seconds
            );
        }
        s
    }
}
