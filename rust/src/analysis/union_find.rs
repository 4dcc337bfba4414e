//! Disjoint sets over `0..n`: the grouping behind the id graphs and the loop groups.

/// A partition of `0..n`; each set is represented by its smallest member.
#[derive(Clone, Debug)]
pub struct UnionFind {
    parent: Vec<u32>,
}

impl UnionFind {
    /// `n` singleton sets.
    pub fn new(n: usize) -> Self {
        Self { parent: (0..n as u32).collect() }
    }

    /// Representative of `x`'s set.
    pub fn find(&self, x: usize) -> usize {
        let mut x = x as u32;
        while self.parent[x as usize] != x {
            x = self.parent[x as usize];
        }
        x as usize
    }

    /// Join the sets of `a` and `b`; false when they were one set already.
    pub fn union(&mut self, a: usize, b: usize) -> bool {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra == rb {
            return false;
        }
        let (lo, hi) = if ra < rb { (ra, rb) } else { (rb, ra) };
        // The joined members point at the root directly, so chains of unions stay shallow.
        for x in [hi, a, b] {
            self.parent[x] = lo as u32;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::UnionFind;

    #[test]
    fn joins_sets_under_their_smallest_member() {
        let mut u = UnionFind::new(6);
        assert!(u.union(4, 2) && u.union(2, 5) && !u.union(5, 4));
        assert_eq!((u.find(4), u.find(5), u.find(2)), (2, 2, 2));
        assert!(u.union(5, 0));
        assert_eq!(u.find(4), 0);
        assert_eq!((u.find(1), u.find(3)), (1, 3));
    }
}
