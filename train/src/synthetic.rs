//! A generated translation-like task for the demo and the end-to-end tests.
//!
//! In: a seed and a number of pairs. Out: sentence pairs over two vocabularies of 100
//! "words" each. The target is the source *reversed*, with every source word replaced by
//! its translation under a fixed (seeded) permutation: a task that needs both a lexicon
//! and reordering — attention — to solve, yet small enough to learn on two cores in about
//! a minute. Everything is deterministic in the seed.

/// Words per language.
pub const WORDS: usize = 100;

/// A small deterministic generator (xorshift64*), so the data never depends on a crate's
/// RNG algorithm.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// The task: its lexicon and sentence lengths.
#[derive(Clone, Debug)]
pub struct Task {
    /// `lexicon[i]` is the target word for source word `i`.
    pub lexicon: Vec<usize>,
    pub min_len: usize,
    pub max_len: usize,
}

impl Task {
    /// The lexicon is a permutation drawn from `seed`.
    pub fn new(seed: u64, min_len: usize, max_len: usize) -> Task {
        let mut rng = Rng::new(seed ^ 0x5eed);
        let mut lexicon: Vec<usize> = (0..WORDS).collect();
        for i in (1..WORDS).rev() {
            let j = rng.below(i + 1);
            lexicon.swap(i, j);
        }
        Task {
            lexicon,
            min_len: min_len.max(1),
            max_len: max_len.max(min_len.max(1)),
        }
    }

    /// The reference translation of a source sentence (words `s<i>`).
    pub fn translate(&self, src: &str) -> Option<String> {
        let mut out = Vec::new();
        for w in src.split_whitespace().rev() {
            let i: usize = w.strip_prefix('s')?.parse().ok()?;
            out.push(format!("t{}", self.lexicon.get(i)?));
        }
        Some(out.join(" "))
    }

    /// `n` pairs drawn from `seed` (different seeds give disjoint-looking sets).
    pub fn pairs(&self, seed: u64, n: usize) -> Vec<(String, String)> {
        let mut rng = Rng::new(seed);
        (0..n)
            .map(|_| {
                let len = self.min_len + rng.below(self.max_len - self.min_len + 1);
                let words: Vec<usize> = (0..len).map(|_| rng.below(WORDS)).collect();
                let src = words
                    .iter()
                    .map(|w| format!("s{w}"))
                    .collect::<Vec<_>>()
                    .join(" ");
                let tgt = words
                    .iter()
                    .rev()
                    .map(|&w| format!("t{}", self.lexicon[w]))
                    .collect::<Vec<_>>()
                    .join(" ");
                (src, tgt)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_follow_the_rule_and_are_deterministic() {
        let t = Task::new(7, 3, 8);
        let a = t.pairs(1, 50);
        assert_eq!(a, t.pairs(1, 50));
        assert_ne!(a, t.pairs(2, 50));
        for (s, g) in &a {
            assert_eq!(t.translate(s).as_deref(), Some(g.as_str()));
            let n = s.split(' ').count();
            assert!((3..=8).contains(&n));
            assert_eq!(n, g.split(' ').count());
        }
        // The lexicon is a permutation.
        let mut l = t.lexicon.clone();
        l.sort();
        assert_eq!(l, (0..WORDS).collect::<Vec<_>>());
        assert_eq!(t.translate("s1 x2"), None);
    }
}
