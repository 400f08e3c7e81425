//! After the greedy choice: switch a needed e-class to a cheaper e-node whose children
//! are all needed anyway (and do not need the class), or to one as cheap when that
//! frees something, until nothing changes.
//!
//! Why: the greedy choice cannot see that a multi-output kernel chosen for one output
//! is already paid for when it weighs another (an attention backward chosen for dq and
//! dk still looks expensive from dv), or that a loss-scaled cross-entropy's loss can be
//! taken from the seeded kernel the gradient needs rather than from an unseeded one.
//!
//! Consumers (later classes) go first, and what is needed is kept exact after every
//! switch, so a value a switch frees is not then used to justify another. "Needed" is
//! a count of needing parents per class (a switch adjusts only what it frees), and a
//! topological rank of the chosen graph answers most cycle checks without a search.

use super::Indexed;

pub(super) struct Improve<'g, 'a> {
    g: &'g Indexed<'a>,
    chosen: Vec<Option<usize>>,
    /// How many needed classes' chosen e-nodes have this class as a child, plus one for
    /// a root: a class is needed while this is positive.
    refs: Vec<usize>,
    /// Every needed class ranks above the children of its chosen e-node.
    rank: Vec<usize>,
    roots: Vec<usize>,
}

impl<'g, 'a> Improve<'g, 'a> {
    /// `order`: the classes, children before parents (the order they were settled in).
    pub fn new(
        g: &'g Indexed<'a>,
        chosen: Vec<Option<usize>>,
        order: &[usize],
        roots: &[usize],
    ) -> Result<Improve<'g, 'a>, String> {
        let n = g.len();
        let mut rank = vec![0; n];
        for (r, &c) in order.iter().enumerate() {
            rank[c] = r;
        }
        let mut fix = Improve {
            g,
            chosen,
            refs: vec![0; n],
            rank,
            roots: roots.to_vec(),
        };
        for &r in roots {
            if fix.chosen[r].is_none() {
                return Err(format!(
                    "e-class {} has no extractable e-node ({:?})",
                    g.ids[r], g.eg[g.ids[r]].data
                ));
            }
            fix.need(r);
        }
        Ok(fix)
    }

    fn kids(&self, c: usize) -> &'g [usize] {
        let g: &'g Indexed<'a> = self.g;
        &g.kids[c][self.chosen[c].expect("needed classes are chosen")]
    }

    /// One more reference to `c`; a class that becomes needed references its children.
    fn need(&mut self, c: usize) {
        let mut stack = vec![c];
        while let Some(c) = stack.pop() {
            self.refs[c] += 1;
            if self.refs[c] == 1 {
                stack.extend_from_slice(self.kids(c));
            }
        }
    }

    /// One reference fewer to `c`; returns the summed own cost of what that frees.
    fn release(&mut self, c: usize) -> f64 {
        let mut freed = 0.0;
        let mut stack = vec![c];
        while let Some(c) = stack.pop() {
            self.refs[c] -= 1;
            if self.refs[c] == 0 {
                freed += self.g.costs[c][self.chosen[c].expect("needed classes are chosen")];
                stack.extend_from_slice(self.kids(c));
            }
        }
        freed
    }

    /// Whether `c` is reachable from `from` through chosen e-nodes. Only classes ranked
    /// above `c` can reach it.
    fn reaches(&self, from: &[usize], c: usize) -> bool {
        let mut seen = std::collections::HashSet::new();
        let mut stack: Vec<usize> = from
            .iter()
            .copied()
            .filter(|&k| self.rank[k] > self.rank[c] || k == c)
            .collect();
        while let Some(k) = stack.pop() {
            if k == c {
                return true;
            }
            if seen.insert(k) {
                stack.extend(
                    self.kids(k)
                        .iter()
                        .copied()
                        .filter(|&x| self.rank[x] > self.rank[c] || x == c),
                );
            }
        }
        false
    }

    /// Switches `c` to e-node `ni` (whose children are all needed) and keeps the switch
    /// when it is cheaper or frees something; returns whether it was kept.
    fn try_switch(&mut self, c: usize, ni: usize, cheaper: bool) -> bool {
        let cur = self.chosen[c].expect("needed classes are chosen");
        let (old, new) = (&self.g.kids[c][cur], &self.g.kids[c][ni]);
        // The new children first, so nothing they need is freed on the way.
        for &k in new {
            self.refs[k] += 1;
        }
        self.chosen[c] = Some(ni);
        let freed: f64 = old.iter().map(|&k| self.release(k)).sum();
        if cheaper || freed > 1e-15 {
            if new.iter().any(|&k| self.rank[k] > self.rank[c]) {
                self.rerank();
            }
            return true;
        }
        // As cheap and freeing nothing: keep the greedy choice.
        self.chosen[c] = Some(cur);
        for &k in old {
            self.need(k);
        }
        for &k in new {
            self.refs[k] -= 1;
        }
        false
    }

    /// Ranks the needed classes afresh: children first, by depth-first post-order.
    fn rerank(&mut self) {
        let mut done = vec![false; self.g.len()];
        let mut next = 0;
        for &r in &self.roots.clone() {
            let mut stack = vec![(r, false)];
            while let Some((c, expanded)) = stack.pop() {
                if expanded {
                    self.rank[c] = next;
                    next += 1;
                    continue;
                }
                if std::mem::replace(&mut done[c], true) {
                    continue;
                }
                stack.push((c, true));
                stack.extend(self.kids(c).iter().map(|&k| (k, false)));
            }
        }
    }

    pub fn run(&mut self) {
        let g = self.g;
        for _round in 0..50 {
            let mut changed = false;
            for c in (0..g.len()).rev() {
                if self.refs[c] == 0 {
                    continue;
                }
                let cur = self.chosen[c].expect("needed classes are chosen");
                for ni in 0..g.costs[c].len() {
                    let cost = g.costs[c][ni];
                    if ni == cur || cost > g.costs[c][cur] + 1e-15 {
                        continue;
                    }
                    let ks = &g.kids[c][ni];
                    if ks.iter().any(|&k| self.refs[k] == 0 || k == c) || self.reaches(ks, c) {
                        continue;
                    }
                    if self.try_switch(c, ni, cost < g.costs[c][cur] - 1e-15) {
                        changed = true;
                        break;
                    }
                }
            }
            if !changed {
                break;
            }
        }
    }

    /// The choices, and which classes the roots need.
    pub fn into_choice(self) -> (Vec<Option<usize>>, Vec<bool>) {
        let needed = self.refs.iter().map(|&r| r > 0).collect();
        (self.chosen, needed)
    }
}
