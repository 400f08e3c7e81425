use std::collections::BTreeMap;

use super::set::CostSet;

/// A small deterministic generator (the tests need no crate for it).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) as u32
    }
}

fn cost_of(k: u32) -> f64 {
    1.0 + f64::from(k % 7)
}

#[test]
fn unions_hold_exactly_the_members_and_their_summed_cost() {
    let mut rng = Lcg(7);
    let mut sets: Vec<(CostSet, BTreeMap<u32, f64>)> = vec![(CostSet::default(), BTreeMap::new())];
    for step in 0..600 {
        let a = rng.next() as usize % sets.len();
        let (s, m) = if step % 3 == 0 {
            let b = rng.next() as usize % sets.len();
            let mut m = sets[a].1.clone();
            m.extend(sets[b].1.iter().map(|(k, v)| (*k, *v)));
            (sets[a].0.union(&sets[b].0), m)
        } else {
            // Keys near each other and far apart, and the extremes of u32.
            let k = match rng.next() % 4 {
                0 => rng.next() % 64,
                1 => u32::MAX - rng.next() % 4,
                _ => rng.next(),
            };
            let mut m = sets[a].1.clone();
            m.entry(k).or_insert(cost_of(k));
            (sets[a].0.with(k, cost_of(k)), m)
        };
        assert_eq!(
            s.keys(),
            m.keys().copied().collect::<Vec<_>>(),
            "step {step}"
        );
        let want: f64 = m.values().sum();
        assert!(
            (s.sum() - want).abs() < 1e-9,
            "step {step}: {} vs {want}",
            s.sum()
        );
        sets.push((s, m));
    }
}

#[test]
fn a_member_added_twice_is_counted_once() {
    let s = CostSet::default().with(5, 2.0).with(9, 3.0);
    let t = s.with(5, 2.0).union(&CostSet::default().with(9, 3.0));
    assert_eq!(t.keys(), vec![5, 9]);
    assert_eq!(t.sum(), 5.0);
}

#[test]
fn the_sum_depends_on_the_members_not_on_how_the_set_was_built() {
    let keys = [3u32, 1000, 17, 4, 1 << 31, 99, 5];
    let costs = |k: u32| 0.1 + f64::from(k % 13) * 1e-7;
    let mut forward = CostSet::default();
    for &k in &keys {
        forward = forward.with(k, costs(k));
    }
    let mut halves = (CostSet::default(), CostSet::default());
    for (i, &k) in keys.iter().rev().enumerate() {
        if i % 2 == 0 {
            halves.0 = halves.0.with(k, costs(k));
        } else {
            halves.1 = halves.1.with(k, costs(k));
        }
    }
    let joined = halves.1.union(&halves.0);
    assert_eq!(forward.keys(), joined.keys());
    assert_eq!(forward.sum().to_bits(), joined.sum().to_bits());
}
