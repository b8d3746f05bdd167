//! How long the sweep's threads ran and how long they waited for a core, per round, from the
//! Linux scheduler's own per-thread accounting (`/proc/self/task/<tid>/schedstat`: nanoseconds
//! on a CPU, nanoseconds runnable but waiting on a run queue, time slices).
//!
//! Why the replica sweep reads it: the sweep runs its replicas, the simulated engines and the
//! client as threads of one process on this machine's cores. Four replicas on hosts of their own
//! would each have idle cores; here a request's hops (client, replica, engine, back) each wait
//! their turn behind the other replicas' threads, and that wait lands in the time to first
//! token as if it were the routing's. The scheduler counts it exactly, so the sweep prints it per
//! request beside the latencies instead of leaving it to be inferred from slowed runs.
//!
//! Shaped as two snapshots and a difference, because the sweep's threads come and go with each
//! round's fleet and replicas: a thread born during the round counts whole, one present before
//! counts its increase, and one that ended before the second snapshot is not seen (the figure
//! is then a lower bound; the round's threads live until after the second snapshot, so in the
//! sweep only the runtimes' short-lived blocking threads can be missed). Where procfs is not
//! there (not Linux), [`snapshot`] returns `None` and the sweep prints nothing.

use std::collections::HashMap;

/// Most threads one snapshot reads: the sweep runs a few dozen; anything past this is left out
/// rather than grown into.
pub const THREADS_READ_MAX: usize = 4_096;

/// Prefix of the name the router gives its data-plane threads (`kvroute::data_plane`).
const DATA_PLANE_THREAD_PREFIX: &str = "kvroute-data-";

/// Which of the sweep's threads a figure belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ThreadGroup {
    /// The replicas' data-plane threads: the proxy path of every request.
    ReplicaDataPlanes,
    /// Everything else: the demo's runtime (simulated engines, the client, the replicas' pumps
    /// and control tasks), helper threads.
    Rest,
}

impl ThreadGroup {
    fn of(thread_name: &str) -> ThreadGroup {
        if thread_name.starts_with(DATA_PLANE_THREAD_PREFIX) {
            ThreadGroup::ReplicaDataPlanes
        } else {
            ThreadGroup::Rest
        }
    }
}

/// One thread's cumulative scheduler times, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadTimes {
    pub on_cpu_ns: u64,
    pub runqueue_wait_ns: u64,
}

/// Parses a `schedstat` line: `<on-cpu ns> <run-queue wait ns> <time slices>`. `None` for
/// anything else.
pub fn parse_schedstat(line: &str) -> Option<ThreadTimes> {
    let mut fields = line.split_ascii_whitespace();
    let on_cpu_ns = fields.next()?.parse().ok()?;
    let runqueue_wait_ns = fields.next()?.parse().ok()?;
    fields.next()?.parse::<u64>().ok()?;
    Some(ThreadTimes {
        on_cpu_ns,
        runqueue_wait_ns,
    })
}

/// Every readable thread of this process at one instant, by thread id.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    threads: HashMap<u32, (ThreadGroup, ThreadTimes)>,
}

impl Snapshot {
    /// A snapshot from (tid, thread name, times) triples, at most [`THREADS_READ_MAX`].
    pub fn from_threads<'a>(
        threads: impl IntoIterator<Item = (u32, &'a str, ThreadTimes)>,
    ) -> Snapshot {
        Snapshot {
            threads: threads
                .into_iter()
                .take(THREADS_READ_MAX)
                .map(|(tid, name, times)| (tid, (ThreadGroup::of(name), times)))
                .collect(),
        }
    }
}

/// Reads this process's threads from procfs; `None` where it cannot (not Linux, no procfs). A
/// thread that ends while it is read is skipped.
pub fn snapshot() -> Option<Snapshot> {
    let dir = std::fs::read_dir("/proc/self/task").ok()?;
    let mut threads: Vec<(u32, String, ThreadTimes)> = Vec::new();
    for entry in dir.flatten().take(THREADS_READ_MAX) {
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let path = entry.path();
        let (Ok(stat), Ok(name)) = (
            std::fs::read_to_string(path.join("schedstat")),
            std::fs::read_to_string(path.join("comm")),
        ) else {
            continue;
        };
        if let Some(times) = parse_schedstat(&stat) {
            threads.push((tid, name.trim_end().to_string(), times));
        }
    }
    Some(Snapshot::from_threads(
        threads
            .iter()
            .map(|(tid, name, t)| (*tid, name.as_str(), *t)),
    ))
}

/// Time a group of threads spent between two snapshots, in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Spent {
    pub on_cpu_ns: u64,
    pub runqueue_wait_ns: u64,
}

/// What each group of threads spent between `before` and `after`. A thread only in `after`
/// counts whole; one whose times went backwards is a reused thread id and also counts whole.
pub fn spent_between(before: &Snapshot, after: &Snapshot) -> HashMap<ThreadGroup, Spent> {
    let mut spent: HashMap<ThreadGroup, Spent> = HashMap::new();
    for (tid, (group, now)) in &after.threads {
        let was = match before.threads.get(tid) {
            Some((_, was))
                if was.on_cpu_ns <= now.on_cpu_ns
                    && was.runqueue_wait_ns <= now.runqueue_wait_ns =>
            {
                *was
            }
            _ => ThreadTimes::default(),
        };
        let entry = spent.entry(*group).or_default();
        entry.on_cpu_ns += now.on_cpu_ns - was.on_cpu_ns;
        entry.runqueue_wait_ns += now.runqueue_wait_ns - was.runqueue_wait_ns;
    }
    spent
}

#[cfg(test)]
mod tests {
    use super::*;

    fn times(on_cpu_ns: u64, runqueue_wait_ns: u64) -> ThreadTimes {
        ThreadTimes {
            on_cpu_ns,
            runqueue_wait_ns,
        }
    }

    #[test]
    fn a_schedstat_line_gives_cpu_and_wait_and_anything_else_is_refused() {
        assert_eq!(
            parse_schedstat("123456 7890 42\n"),
            Some(times(123_456, 7_890))
        );
        assert_eq!(parse_schedstat("123456 7890"), None, "a field missing");
        assert_eq!(parse_schedstat("12x 7890 42"), None, "not a number");
        assert_eq!(parse_schedstat(""), None);
    }

    #[test]
    fn data_plane_threads_are_told_apart_by_their_name() {
        assert_eq!(
            ThreadGroup::of("kvroute-data-3"),
            ThreadGroup::ReplicaDataPlanes
        );
        assert_eq!(ThreadGroup::of("tokio-rt-worker"), ThreadGroup::Rest);
        assert_eq!(ThreadGroup::of("kvroute-prefault"), ThreadGroup::Rest);
    }

    #[test]
    fn a_thread_counts_its_increase_a_new_one_counts_whole_and_a_gone_one_nothing() {
        let before = Snapshot::from_threads([
            (1, "kvroute-data-1", times(1_000, 100)),
            (2, "tokio-rt-worker", times(5_000, 500)),
            (3, "tokio-rt-worker", times(9_000, 900)),
        ]);
        let after = Snapshot::from_threads([
            (1, "kvroute-data-1", times(1_600, 130)),
            (2, "tokio-rt-worker", times(5_200, 540)),
            (4, "kvroute-data-2", times(300, 20)),
        ]);
        let spent = spent_between(&before, &after);
        assert_eq!(
            spent[&ThreadGroup::ReplicaDataPlanes],
            Spent {
                on_cpu_ns: 600 + 300,
                runqueue_wait_ns: 30 + 20
            }
        );
        assert_eq!(
            spent[&ThreadGroup::Rest],
            Spent {
                on_cpu_ns: 200,
                runqueue_wait_ns: 40
            },
            "thread 3 ended between the snapshots and is not counted"
        );
    }

    #[test]
    fn a_reused_thread_id_whose_times_went_backwards_counts_whole() {
        let before = Snapshot::from_threads([(7, "tokio-rt-worker", times(9_000, 900))]);
        let after = Snapshot::from_threads([(7, "kvroute-data-1", times(400, 50))]);
        let spent = spent_between(&before, &after);
        assert_eq!(
            spent[&ThreadGroup::ReplicaDataPlanes],
            Spent {
                on_cpu_ns: 400,
                runqueue_wait_ns: 50
            }
        );
    }

    #[test]
    fn this_process_can_be_read_where_procfs_exists() {
        let Some(first) = snapshot() else {
            // No procfs (not Linux): the sweep prints no thread times there.
            assert!(!std::path::Path::new("/proc/self/task").exists());
            return;
        };
        // Burn a little CPU on this thread so the second snapshot must be ahead of the first.
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(i);
        }
        std::hint::black_box(x);
        let second = snapshot().expect("procfs read once already");
        let rest = spent_between(&first, &second)
            .get(&ThreadGroup::Rest)
            .copied()
            .unwrap_or_default();
        assert!(
            rest.on_cpu_ns > 0,
            "awaited CPU time on this test's thread between two snapshots, saw {rest:?}"
        );
    }
}
