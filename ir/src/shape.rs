//! Symbolic dimensions and shapes.
//!
//! In: dimension names declared by a spec (`dims batch, src_len, tgt_len`) and integer
//! constants. Out: [`Dim`], a polynomial with integer coefficients over those names
//! (`batch*src_len`, `t + 1`, `512`), and [`Shape`], a list of dims.
//!
//! A polynomial is kept in a normal form (sorted monomials, no zero coefficients), so two
//! dims are equal exactly when their normal forms are equal. That is all shape inference
//! needs: a reshape of `[batch, src_len, 512]` into `[batch*src_len, 512]` is checked by
//! comparing products, and a key/value cache that grows by one position is `t + 1`.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

/// A monomial: the product of its symbols (sorted, repeated for powers). Empty = 1.
type Monomial = Vec<String>;

/// A symbolic dimension: a polynomial with integer coefficients over dim names.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct Dim {
    /// Sorted by [`monomial_order`], no zero coefficients; shared, because node types
    /// are cloned far more often than dims are computed.
    terms: Arc<[(Monomial, i64)]>,
}

fn monomial_order(a: &Monomial, b: &Monomial) -> std::cmp::Ordering {
    // Higher degree first, then lexicographic; the constant term comes last.
    b.len().cmp(&a.len()).then_with(|| a.cmp(b))
}

impl Dim {
    /// A constant dimension.
    pub fn c(n: i64) -> Dim {
        if n == 0 {
            Dim::default()
        } else {
            Dim {
                terms: Arc::new([(vec![], n)]),
            }
        }
    }

    /// A named symbolic dimension.
    pub fn sym(name: &str) -> Dim {
        Dim {
            terms: Arc::new([(vec![name.to_string()], 1)]),
        }
    }

    fn from_map(map: BTreeMap<Monomial, i64>) -> Dim {
        let mut terms: Vec<(Monomial, i64)> = map.into_iter().filter(|(_, c)| *c != 0).collect();
        terms.sort_by(|a, b| monomial_order(&a.0, &b.0));
        Dim {
            terms: terms.into(),
        }
    }

    /// The value when the dim has no symbols.
    pub fn as_const(&self) -> Option<i64> {
        match &*self.terms {
            [] => Some(0),
            [(m, c)] if m.is_empty() => Some(*c),
            _ => None,
        }
    }

    /// The symbol name when the dim is exactly one symbol (`batch`).
    pub fn as_sym(&self) -> Option<&str> {
        match &*self.terms {
            [(m, 1)] if m.len() == 1 => Some(&m[0]),
            _ => None,
        }
    }

    pub fn is_const(&self) -> bool {
        self.as_const().is_some()
    }

    /// Every symbol the dim mentions, sorted, without repetition.
    pub fn symbols(&self) -> Vec<&str> {
        let mut out: Vec<&str> = self
            .terms
            .iter()
            .flat_map(|(m, _)| m.iter().map(|s| s.as_str()))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    pub fn add(&self, other: &Dim) -> Dim {
        let mut map: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (m, c) in self.terms.iter().chain(other.terms.iter()) {
            *map.entry(m.clone()).or_insert(0) += c;
        }
        Dim::from_map(map)
    }

    pub fn neg(&self) -> Dim {
        Dim {
            terms: self.terms.iter().map(|(m, c)| (m.clone(), -c)).collect(),
        }
    }

    pub fn sub(&self, other: &Dim) -> Dim {
        self.add(&other.neg())
    }

    pub fn mul(&self, other: &Dim) -> Dim {
        let mut map: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (ma, ca) in self.terms.iter() {
            for (mb, cb) in other.terms.iter() {
                let mut m: Monomial = ma.iter().chain(mb.iter()).cloned().collect();
                m.sort();
                *map.entry(m).or_insert(0) += ca * cb;
            }
        }
        Dim::from_map(map)
    }

    /// [`Dim::add`], or `None` where a coefficient overflows `i64`.
    pub fn checked_add(&self, other: &Dim) -> Option<Dim> {
        let mut map: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (m, c) in self.terms.iter().chain(other.terms.iter()) {
            let e = map.entry(m.clone()).or_insert(0);
            *e = e.checked_add(*c)?;
        }
        Some(Dim::from_map(map))
    }

    /// [`Dim::neg`], or `None` where a coefficient is `i64::MIN`.
    pub fn checked_neg(&self) -> Option<Dim> {
        let terms = self
            .terms
            .iter()
            .map(|(m, c)| Some((m.clone(), c.checked_neg()?)))
            .collect::<Option<Vec<_>>>()?;
        Some(Dim {
            terms: terms.into(),
        })
    }

    /// [`Dim::sub`], or `None` where a coefficient overflows.
    pub fn checked_sub(&self, other: &Dim) -> Option<Dim> {
        self.checked_add(&other.checked_neg()?)
    }

    /// [`Dim::mul`], or `None` where a coefficient overflows.
    pub fn checked_mul(&self, other: &Dim) -> Option<Dim> {
        let mut map: BTreeMap<Monomial, i64> = BTreeMap::new();
        for (ma, ca) in self.terms.iter() {
            for (mb, cb) in other.terms.iter() {
                let mut m: Monomial = ma.iter().chain(mb.iter()).cloned().collect();
                m.sort();
                let e = map.entry(m).or_insert(0);
                *e = e.checked_add(ca.checked_mul(*cb)?)?;
            }
        }
        Some(Dim::from_map(map))
    }

    /// The dim with each symbol replaced by a dim from `map` (symbols not in the map stay).
    pub fn subst(&self, map: &BTreeMap<String, Dim>) -> Dim {
        let mut total = Dim::c(0);
        for (m, c) in self.terms.iter() {
            let mut v = Dim::c(*c);
            for s in m {
                v = v.mul(map.get(s).unwrap_or(&Dim::sym(s)));
            }
            total = total.add(&v);
        }
        total
    }

    /// The value of the dim under `bindings` (symbol → size).
    pub fn eval(&self, bindings: &BTreeMap<String, i64>) -> Result<i64, String> {
        let mut total: i64 = 0;
        for (m, c) in self.terms.iter() {
            let mut v = *c;
            for s in m {
                let b = bindings
                    .get(s)
                    .ok_or_else(|| format!("dim `{s}` has no value"))?;
                v = v
                    .checked_mul(*b)
                    .ok_or_else(|| format!("dim `{self}` overflows"))?;
            }
            total = total
                .checked_add(v)
                .ok_or_else(|| format!("dim `{self}` overflows"))?;
        }
        Ok(total)
    }
}

impl From<i64> for Dim {
    fn from(n: i64) -> Dim {
        Dim::c(n)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.terms.is_empty() {
            return write!(f, "0");
        }
        for (i, (m, c)) in self.terms.iter().enumerate() {
            let (sign, mag) = if *c < 0 { ("-", -c) } else { ("+", *c) };
            if i == 0 {
                if sign == "-" {
                    write!(f, "-")?;
                }
            } else {
                write!(f, " {sign} ")?;
            }
            if m.is_empty() {
                write!(f, "{mag}")?;
            } else {
                if mag != 1 {
                    write!(f, "{mag}*")?;
                }
                write!(f, "{}", m.join("*"))?;
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// A tensor shape: one [`Dim`] per axis. Rank 0 is a scalar.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn scalar() -> Shape {
        Shape(vec![])
    }

    pub fn consts(dims: &[i64]) -> Shape {
        Shape(dims.iter().map(|&d| Dim::c(d)).collect())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn dims(&self) -> &[Dim] {
        &self.0
    }

    /// The product of all dims.
    pub fn numel(&self) -> Dim {
        self.0.iter().fold(Dim::c(1), |acc, d| acc.mul(d))
    }

    /// Concrete sizes when no dim has a symbol.
    pub fn as_consts(&self) -> Option<Vec<usize>> {
        self.0
            .iter()
            .map(|d| d.as_const().and_then(|v| usize::try_from(v).ok()))
            .collect()
    }

    /// Concrete sizes under `bindings`; negative sizes are an error.
    pub fn eval(&self, bindings: &BTreeMap<String, i64>) -> Result<Vec<usize>, String> {
        self.0
            .iter()
            .map(|d| {
                let v = d.eval(bindings)?;
                usize::try_from(v)
                    .map_err(|_| format!("dim `{d}` evaluates to {v}, which is negative"))
            })
            .collect()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{d}")?;
        }
        write!(f, "]")
    }
}

impl fmt::Debug for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl From<Vec<Dim>> for Shape {
    fn from(v: Vec<Dim>) -> Shape {
        Shape(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_form_makes_equal_products_equal() {
        let b = Dim::sym("batch");
        let s = Dim::sym("src_len");
        assert_eq!(b.mul(&s), s.mul(&b));
        assert_eq!(b.mul(&s).to_string(), "batch*src_len");
        let t = Dim::sym("t");
        assert_eq!(t.add(&Dim::c(1)).to_string(), "t + 1");
        assert_eq!(t.sub(&Dim::c(1)).to_string(), "t - 1");
        assert_eq!(Dim::c(3).mul(&t).add(&Dim::c(-2)).to_string(), "3*t - 2");
        assert_eq!(t.sub(&t), Dim::c(0));
        assert_eq!(Dim::c(0).to_string(), "0");
    }

    #[test]
    fn eval_and_numel() {
        let shape = Shape(vec![
            Dim::sym("b"),
            Dim::sym("t").add(&Dim::c(1)),
            Dim::c(4),
        ]);
        let mut bind = BTreeMap::new();
        bind.insert("b".to_string(), 3);
        bind.insert("t".to_string(), 5);
        assert_eq!(shape.eval(&bind).unwrap(), vec![3, 6, 4]);
        assert_eq!(shape.numel().to_string(), "4*b*t + 4*b");
        assert_eq!(shape.numel().eval(&bind).unwrap(), 72);
        bind.remove("t");
        assert_eq!(shape.eval(&bind).unwrap_err(), "dim `t` has no value");
        assert_eq!(Shape::consts(&[2, 3]).as_consts(), Some(vec![2, 3]));
        assert_eq!(Shape::scalar().numel(), Dim::c(1));
    }
}
