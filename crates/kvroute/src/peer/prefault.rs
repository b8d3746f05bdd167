//! Fresh buffers made resident by a helper thread while their owner fills them.
//!
//! A snapshot export fills six columns of fresh memory (about 135 MB at 64 ranks x 100,000
//! blocks) front to back on one thread, and the first write to each page of them is a page
//! fault: on this project's machines, in the host's slow phases, those faults were half of the
//! walk (0.64 of 1.37 CPU-seconds profiled), and the walk is the first stage of a booting
//! sibling's time to warm. [`populate_from_back`] asks the kernel, from a second thread, to
//! populate the same ranges from their far end toward the front (`MADV_POPULATE_WRITE`: page
//! tables filled writable without writing a byte), so the filling thread and the helper meet
//! somewhere in the middle and the faults run on two cores instead of one.
//!
//! Why it cannot corrupt anything: populating changes no byte of memory, so the owner may write
//! the ranges meanwhile. A range the owner freed meanwhile (a column reallocated) is at worst
//! populated for the allocator, or refused by the kernel; neither changes a byte, and the helper
//! ignores errors. The caller stops the helper (the `stop` flag) as soon as its filling ends, and
//! a scoped thread makes sure it has stopped before the buffers can go.
//!
//! Hand-rolled because no crate of the field wraps `MADV_POPULATE_WRITE` for memory it does not
//! map itself; it is one `madvise` call per chunk. On other systems, or a kernel before 5.14,
//! nothing is populated and the owner faults its pages in as before.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Bytes populated per call, so the helper notices `stop` soon after the filling ends.
pub const PREFAULT_CHUNK_BYTES: usize = 2 << 20;
/// Bytes of one page; ranges are trimmed inward to page boundaries.
const PAGE_BYTES: usize = 4096;

/// A buffer's whole allocated room: its start address and length in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Room {
    pub start: usize,
    pub bytes: usize,
}

impl Room {
    /// `column`'s allocated capacity (written or not).
    pub fn of<T>(column: &Vec<T>) -> Room {
        Room {
            start: column.as_ptr() as usize,
            bytes: column.capacity() * std::mem::size_of::<T>(),
        }
    }
}

/// What the helper did, for the caller's log line.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefaultReport {
    pub bytes_populated: usize,
    pub calls_refused: usize,
    pub stopped_early: bool,
    pub seconds: f64,
}

/// Populates `rooms` from their far ends toward their starts until done or `stop` is set.
/// Rooms advance in proportion (chunk `k` of each room is its `k`-th slice from the end), so
/// columns filled in step, as an export's are, are met at the same fraction of their length.
pub fn populate_from_back(rooms: &[Room], stop: &AtomicBool) -> PrefaultReport {
    let started = Instant::now();
    let mut report = PrefaultReport::default();
    let pages: Vec<(usize, usize)> = rooms.iter().filter_map(|r| page_span(*r)).collect();
    let longest = pages.iter().map(|&(_, len)| len).max().unwrap_or(0);
    let steps = longest.div_ceil(PREFAULT_CHUNK_BYTES);
    'steps: for k in 0..steps {
        for &(start, len) in &pages {
            if stop.load(Ordering::Relaxed) {
                report.stopped_early = true;
                break 'steps;
            }
            // This room's k-th slice from the end, page-aligned.
            let slice_end = |i: usize| (len as u128 * i as u128 / steps as u128) as usize;
            let (hi, lo) = (len - slice_end(k), len - slice_end(k + 1));
            let (lo, hi) = (lo / PAGE_BYTES * PAGE_BYTES, hi / PAGE_BYTES * PAGE_BYTES);
            if hi <= lo {
                continue;
            }
            if populate(start + lo, hi - lo) {
                report.bytes_populated += hi - lo;
            } else {
                report.calls_refused += 1;
            }
        }
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// `room` trimmed inward to whole pages, as (start, length); `None` when no whole page is in it.
fn page_span(room: Room) -> Option<(usize, usize)> {
    let start = room.start.div_ceil(PAGE_BYTES) * PAGE_BYTES;
    let end = (room.start + room.bytes) / PAGE_BYTES * PAGE_BYTES;
    (end > start).then(|| (start, end - start))
}

#[cfg(target_os = "linux")]
fn populate(start: usize, bytes: usize) -> bool {
    // SAFETY: MADV_POPULATE_WRITE only fills page tables for the range (as a write fault would)
    // and writes no byte; on a range that is not mapped writable the kernel refuses with an
    // error, which is returned as `false`. No Rust reference is created from the address.
    unsafe { libc::madvise(start as *mut libc::c_void, bytes, libc::MADV_POPULATE_WRITE) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn populate(_start: usize, _bytes: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rooms_are_trimmed_inward_to_whole_pages() {
        let room = Room {
            start: PAGE_BYTES + 10,
            bytes: 3 * PAGE_BYTES,
        };
        assert_eq!(page_span(room), Some((2 * PAGE_BYTES, 2 * PAGE_BYTES)));
        let tiny = Room {
            start: PAGE_BYTES + 10,
            bytes: 100,
        };
        assert_eq!(page_span(tiny), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_fresh_column_is_populated_whole_and_its_contents_never_change() {
        let mut column: Vec<u64> = Vec::with_capacity(4 << 20);
        column.extend(0..1000u64);
        let stop = AtomicBool::new(false);
        let report = populate_from_back(&[Room::of(&column)], &stop);
        let whole = page_span(Room::of(&column)).expect("pages").1;
        assert!(!report.stopped_early);
        // A kernel before 5.14 refuses every call; then nothing was populated, and said so.
        let whole_populated = report.bytes_populated == whole && report.calls_refused == 0;
        let all_refused = report.bytes_populated == 0 && report.calls_refused > 0;
        assert!(
            whole_populated || all_refused,
            "{report:?} of {whole} bytes"
        );
        assert!(column.iter().copied().eq(0..1000u64), "written data kept");
        column.extend(1000..(4u64 << 20));
        assert_eq!(column[(4 << 20) - 1], (4 << 20) - 1);
    }

    #[test]
    fn a_set_stop_flag_ends_the_helper_before_its_first_call() {
        let column: Vec<u8> = Vec::with_capacity(8 << 20);
        let stop = AtomicBool::new(true);
        let report = populate_from_back(&[Room::of(&column)], &stop);
        assert!(report.stopped_early);
        assert_eq!(report.bytes_populated, 0);
    }
}
