//! Fixed-size log-linear latency histogram.
//!
//! A load run can record millions of samples; keeping them all would make memory grow with the
//! run length, so latencies go into buckets whose width is a fixed fraction of their value
//! (`SUB_BUCKETS` per power of two, i.e. under 1.6% relative error), in memory that does not depend
//! on the number of samples. Values are nanoseconds; anything above `TRACKED_MAX_NS` is clamped
//! into the last bucket and still counted (the exact maximum is kept separately).

/// Buckets per power of two above `EXACT_BELOW_NS`: a bucket is at most `1 / SUB_BUCKETS` of
/// its values wide (under 1.6% relative error).
pub const SUB_BUCKETS: usize = 64;
/// Values below this are counted exactly, one bucket each.
const EXACT_BELOW_NS: u64 = 2 * SUB_BUCKETS as u64;
/// Largest value resolved by buckets (~68.7 s); larger values land in the last bucket.
pub const TRACKED_MAX_NS: u64 = (1 << 36) - 1;
const BUCKETS: usize = bucket_of(TRACKED_MAX_NS) + 1;

/// Latency histogram in nanoseconds.
#[derive(Clone)]
pub struct Histogram {
    counts: Box<[u64]>,
    total: u64,
    max_ns: u64,
    sum_ns: u128,
}

impl Default for Histogram {
    fn default() -> Self {
        Self::new()
    }
}

const fn bucket_of(v: u64) -> usize {
    let v = if v > TRACKED_MAX_NS {
        TRACKED_MAX_NS
    } else {
        v
    };
    if v < EXACT_BELOW_NS {
        return v as usize;
    }
    // Shift so the top bits `top` fall in [SUB_BUCKETS, 2 * SUB_BUCKETS); every shift level then
    // holds SUB_BUCKETS buckets, each 2^shift wide, laid out after the exact ones in value order.
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB_BUCKETS.trailing_zeros();
    let top = (v >> shift) as usize;
    SUB_BUCKETS * shift as usize + top
}

/// Highest value that falls into bucket `b` (reported for quantiles, so they never understate).
fn bucket_high(b: usize) -> u64 {
    if (b as u64) < EXACT_BELOW_NS {
        return b as u64;
    }
    let shift = b / SUB_BUCKETS - 1;
    let top = (b - SUB_BUCKETS * shift) as u64;
    ((top + 1) << shift) - 1
}

impl Histogram {
    pub fn new() -> Histogram {
        Histogram {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            total: 0,
            max_ns: 0,
            sum_ns: 0,
        }
    }

    pub fn record(&mut self, ns: u64) {
        self.counts[bucket_of(ns)] += 1;
        self.total += 1;
        self.max_ns = self.max_ns.max(ns);
        self.sum_ns += ns as u128;
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += *b;
        }
        self.total += other.total;
        self.max_ns = self.max_ns.max(other.max_ns);
        self.sum_ns += other.sum_ns;
    }

    pub fn count(&self) -> u64 {
        self.total
    }

    pub fn max_ns(&self) -> u64 {
        self.max_ns
    }

    pub fn mean_ns(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.sum_ns as f64 / self.total as f64
        }
    }

    /// The value at quantile `q` (0..=1): the upper edge of the bucket holding the
    /// `ceil(q * count)`-th sample, capped at the exact maximum. 0 when empty.
    pub fn quantile_ns(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0u64;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return bucket_high(b).min(self.max_ns);
            }
        }
        self.max_ns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_one_bucket_of_the_exact_value() {
        let mut h = Histogram::new();
        // 1..=100_000 us in ns: the exact p50 is 50_000 us, p99 99_000 us.
        for us in 1..=100_000u64 {
            h.record(us * 1_000);
        }
        for (q, exact) in [
            (0.5, 50_000_000u64),
            (0.99, 99_000_000),
            (0.999, 99_900_000),
        ] {
            let got = h.quantile_ns(q);
            let err = (got as f64 - exact as f64).abs() / exact as f64;
            assert!(
                err <= 1.0 / SUB_BUCKETS as f64,
                "q={q}: got {got}, exact {exact}, err {err}"
            );
            assert!(
                got >= exact,
                "quantiles must not understate: q={q} got {got}"
            );
        }
        assert_eq!(h.quantile_ns(1.0), 100_000_000);
        assert_eq!(h.count(), 100_000);
    }

    #[test]
    fn small_values_are_exact_and_huge_values_are_clamped_but_counted() {
        let mut h = Histogram::new();
        h.record(3);
        h.record(u64::MAX / 2);
        assert_eq!(h.quantile_ns(0.5), 3);
        assert_eq!(h.count(), 2);
        assert_eq!(h.max_ns(), u64::MAX / 2);
        assert!(h.quantile_ns(1.0) >= TRACKED_MAX_NS / 2);
    }

    #[test]
    fn every_bucket_upper_edge_maps_back_to_its_bucket() {
        for b in 0..BUCKETS {
            let hi = bucket_high(b);
            if hi > TRACKED_MAX_NS {
                break;
            }
            assert_eq!(bucket_of(hi), b, "bucket {b} edge {hi}");
            if hi < TRACKED_MAX_NS {
                assert_eq!(bucket_of(hi + 1), b + 1, "value after bucket {b}'s edge");
            }
        }
    }

    #[test]
    fn quantiles_never_decrease_as_q_grows() {
        let mut h = Histogram::new();
        // A spread of magnitudes, as a latency distribution with a long tail has.
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..50_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            h.record(100 + x % (1 << (10 + x % 20)));
        }
        let mut last = 0;
        for i in 0..=1_000 {
            let q = h.quantile_ns(i as f64 / 1_000.0);
            assert!(q >= last, "quantile {} = {q} below the previous {last}", i);
            last = q;
        }
    }

    #[test]
    fn merged_histograms_report_the_union() {
        let mut a = Histogram::new();
        let mut b = Histogram::new();
        for v in 0..100 {
            a.record(v);
            b.record(1_000 + v);
        }
        a.merge(&b);
        assert_eq!(a.count(), 200);
        assert_eq!(a.max_ns(), 1_099);
        assert!(a.quantile_ns(0.5) < 100);
        assert!(a.quantile_ns(0.51) >= 1_000);
    }
}
