//! How fast this host hands a process memory it has not touched before, against memory the
//! process touched and freed a moment ago: the floor under every stage of a bootstrap that fills
//! fresh memory (the producer's export, the consumer's decode, the graft's index).
//!
//! Why it is measured apart: on a virtual machine whose guest returns free memory to the host
//! (free page reporting, ballooning), the first write to each page of fresh memory costs a fault
//! in the host as well as in the guest, and that cost, not the code, can bound a graft of
//! gigabytes. On such a host the first round is several times slower than the second; on a host
//! without it the two are alike.
//!
//! Each round allocates `KVROUTE_TOUCH_GB` GiB (default 2) from the system allocator, writes one
//! byte per 4 KiB page, and frees it; the second round usually gets back the pages the first
//! freed. Run it in a fresh process, before other large allocations, for the first round to
//! measure memory new to the process:
//! `CARGO_PROFILE_BENCH_DEBUG=0 cargo bench -p kvroute --bench first_touch`.

use std::time::Instant;

/// Bytes between two writes: one per page of the smallest page size.
const PAGE_BYTES: usize = 4096;
/// Largest allocation the bench makes, so a typo cannot ask for all of memory.
const TOUCH_GB_MAX: usize = 16;

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let gib = std::env::var("KVROUTE_TOUCH_GB")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(2)
        .clamp(1, TOUCH_GB_MAX);
    let bytes = gib << 30;
    for round in ["fresh (first touch)", "just freed (second touch)"] {
        // A zeroed allocation this large is mapped, not written: its pages are first touched by
        // the loop below. (This bench keeps the system allocator, which maps it from the OS.)
        let mut memory = vec![0u8; bytes];
        let started = Instant::now();
        for offset in (0..bytes).step_by(PAGE_BYTES) {
            memory[offset] = 1;
        }
        let seconds = started.elapsed().as_secs_f64();
        // The writes must happen: the memory is read as far as the compiler knows.
        std::hint::black_box(&memory);
        drop(memory);
        println!(
            "{round}: {gib} GiB written one byte per page in {seconds:.2} s = {:.2} GB/s",
            bytes as f64 / seconds / 1e9
        );
    }
}
