//! The launch plan of an entry point: what runs, in order — the contract between the
//! compiler and the executors.
//!
//! Per kernel, in launch order: its kind ([`KernelKind`]), its value and operands in the
//! kernel graph, the CLIF functions it calls by role, the buffers it reads and writes
//! (slots of the memory plan, or an input, parameter or constant), and the fusions
//! decided after extraction ([`crate::fuse`]): its product group and its bias-gradient
//! partner. The artifact's manifest carries it; `kiln explain` and `kiln inspect` print
//! it; the CPU executor replays it (and its product groups where its products run in 16
//! bits), the CUDA executor takes its bias-gradient pairs. A plan is a function of the
//! kernel graph, the CPU code, the memory plan and the options, so a loader can rebuild
//! it and refuse a manifest whose plan differs.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::codegen::program::CpuCode;
use crate::fuse::{self, ProductGroup, Role};
use crate::optimize::kernels::{Def, KernelGraph, KernelOp};
use crate::optimize::kind::TemplateKind;
use crate::optimize::templates::registry;
use crate::options::CompileOptions;
use crate::plan::MemoryPlan;

/// What a kernel is. Every backend matches [`TemplateKind`] exhaustively; a primitive
/// kernel's op is the kernel graph's.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum KernelKind {
    /// A fused template.
    Template(TemplateKind),
    /// An elementwise region.
    Region,
    /// One primitive, by its IR name (`matmul`, `gather`, …).
    Prim(String),
}

impl KernelKind {
    pub fn of(op: &KernelOp) -> KernelKind {
        match op {
            KernelOp::Prim(p) => KernelKind::Prim(p.name().to_string()),
            KernelOp::Template { id, .. } => KernelKind::Template(registry()[*id as usize].kind),
            KernelOp::Region(_) => KernelKind::Region,
        }
    }

    /// The name in kernel graphs and reports (`linear`, `region`, `matmul`).
    pub fn name(&self) -> &str {
        match self {
            KernelKind::Template(k) => k.name(),
            KernelKind::Region => "region",
            KernelKind::Prim(p) => p,
        }
    }
}

/// One operand or result of a launch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Access {
    /// The plan buffer (index into [`MemoryPlan::buffers`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buffer: Option<usize>,
    /// The buffer's arena slot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slot: Option<usize>,
    /// A source not in the arena: `input NAME`, `param NAME` or `const V`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Launch {
    /// The kernel's value number in the kernel graph.
    pub value: usize,
    pub kind: KernelKind,
    /// Its operands' values.
    pub inputs: Vec<usize>,
    /// The CLIF functions it calls, by role (`main`, `bias`, `softmax`, …).
    pub functions: BTreeMap<String, String>,
    pub reads: Vec<Access>,
    pub writes: Vec<Access>,
    /// For a bias gradient and its layer's weight-gradient product: the other's launch
    /// index ([`fuse::bias_grad_pairs`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias_grad: Option<usize>,
}

/// Every launch of an entry point, in order, and its product groups.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchPlan {
    pub launches: Vec<Launch>,
    /// [`fuse::product_groups`], in launch order.
    pub groups: Vec<ProductGroup>,
}

impl LaunchPlan {
    /// The plan of `kg` with its CPU code `code` and memory plan `plan`; the fusions the
    /// options allow.
    pub fn build(
        kg: &KernelGraph,
        code: &CpuCode,
        plan: &MemoryPlan,
        opts: &CompileOptions,
    ) -> Result<LaunchPlan, String> {
        let kernels = kg.kernels();
        if code.kernels.len() != kernels.len() {
            return Err(format!(
                "the code lists {} kernels, the kernel graph has {}",
                code.kernels.len(),
                kernels.len()
            ));
        }
        let described: Vec<fuse::Described<'_>> = kernels
            .iter()
            .map(|&(v, op, inputs)| (v, inputs, Role::of(kg, op, inputs)))
            .collect();
        let pairs = if opts.bias_grad_fusion {
            fuse::bias_grad_pairs(kg, &described)
        } else {
            vec![None; kernels.len()]
        };
        let groups = if opts.product_groups {
            fuse::product_groups(&described)
        } else {
            Vec::new()
        };
        let launches = kernels
            .iter()
            .zip(&code.kernels)
            .zip(pairs)
            .map(|((&(v, op, inputs), roles), bias_grad)| Launch {
                value: v,
                kind: KernelKind::of(op),
                inputs: inputs.to_vec(),
                functions: roles.clone(),
                reads: inputs.iter().map(|&x| access(kg, plan, x)).collect(),
                writes: (0..kg.values[v].types.len())
                    .map(|k| slot_access(plan, plan.buffer_of(v, k)))
                    .collect(),
                bias_grad,
            })
            .collect();
        Ok(LaunchPlan { launches, groups })
    }

    /// The group launch `s` starts, if it starts one.
    pub fn group_at(&self, s: usize) -> Option<&ProductGroup> {
        self.groups.iter().find(|g| g.first == s)
    }

    /// How many fusions, and with `detail` each on a line of its own (what `kiln explain`
    /// prints).
    pub fn fusions_text(&self, detail: bool) -> String {
        let mut s = String::new();
        let grouped: usize = self.groups.iter().map(|g| g.len).sum();
        let pairs = self
            .launches
            .iter()
            .filter(|l| l.bias_grad.is_some())
            .count()
            / 2;
        let _ = writeln!(
            s,
            "fusions: {} product groups ({grouped} launches), {pairs} bias gradients paired \
             with their weight gradient's product",
            self.groups.len()
        );
        if !detail {
            return s;
        }
        for g in &self.groups {
            let members: Vec<String> = (g.first..g.first + g.len)
                .map(|i| format!("%{}", self.launches[i].value))
                .collect();
            let kind = self.launches[g.first].kind.name();
            let _ = writeln!(
                s,
                "  group of {} {kind} reading %{}: {}",
                g.len,
                g.operand,
                members.join(" ")
            );
        }
        for l in &self.launches {
            let Some(p) = l.bias_grad else { continue };
            if l.kind == KernelKind::Template(TemplateKind::SumRows) {
                let _ = writeln!(
                    s,
                    "  bias gradient %{} summed by the product %{}",
                    l.value, self.launches[p].value
                );
            }
        }
        s
    }
}

fn slot_access(plan: &MemoryPlan, b: Option<usize>) -> Access {
    Access {
        buffer: b,
        slot: b.map(|b| plan.buffers[b].slot),
        source: None,
    }
}

/// Where value `v` is read from: its buffer (through views) or its source.
fn access(kg: &KernelGraph, plan: &MemoryPlan, mut v: usize) -> Access {
    let source = |s: String| Access {
        buffer: None,
        slot: None,
        source: Some(s),
    };
    loop {
        match &kg.values[v].def {
            Def::View(_, x) => v = *x,
            Def::Proj(t, k) => return slot_access(plan, plan.buffer_of(*t, *k as usize)),
            Def::Kernel { .. } => return slot_access(plan, plan.buffer_of(v, 0)),
            Def::Input(n) => return source(format!("input {n}")),
            Def::Param(n) => return source(format!("param {n}")),
            Def::Const(x, d) => return source(format!("const {x}:{d}")),
        }
    }
}
