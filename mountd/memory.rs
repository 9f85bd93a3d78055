//! What a keeper's and a server's process costs in memory: the allocator's settings, and
//! what a process gives back once its start is over. Every container has a keeper and a
//! server of its own, so what each process keeps is paid once per container
//! (`benches/node.rs`, docs/performance.md).
//!
//! Assumptions: glibc's allocator (elsewhere these do nothing); pages are 4 KiB or larger;
//! [`give_back_start_memory`] and [`give_back_unused_stack`] are called on the main thread,
//! whose stack is the `[stack]` mapping.

/// The allocator's settings, made before any thread starts (an operator's own, in
/// `MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_` or `GLIBC_TUNABLES`, are left as they are):
///
/// - One malloc arena for the whole process. glibc gives each thread that allocates an arena of
///   its own (up to 8 per CPU), and each of a keeper's and a server's threads kept its own: about
///   270 KiB of every container's 1,990 KiB of PSS (`benches/node.rs` with `MALLOC_ARENA_MAX=1`:
///   1,717 KiB). Their allocations are few and small (a reply, a reload's plan), so the one lock
///   costs nothing measurable (`benches/devfs.rs`).
/// - A fixed threshold for blocks mapped on their own ([`MMAP_THRESHOLD`], glibc's starting
///   value). glibc's otherwise rises to the size of the largest mapped block freed (a 16 MiB
///   FUSE buffer, freed at a handover): from then on large blocks came from the heap, and the
///   heap's top, which a high threshold also keeps from being trimmed, stayed dirty.
#[cfg(target_env = "gnu")]
pub fn malloc_settings() {
    let set = |var: &str| std::env::var_os(var).is_some();
    if set("GLIBC_TUNABLES") {
        return;
    }
    if !set("MALLOC_ARENA_MAX") {
        // SAFETY: mallopt only changes a malloc setting; no other thread runs yet.
        unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    }
    if !set("MALLOC_MMAP_THRESHOLD_") {
        // SAFETY: as above.
        unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) };
    }
}

#[cfg(not(target_env = "gnu"))]
pub fn malloc_settings() {}

/// See [`malloc_settings`].
const MMAP_THRESHOLD: i32 = 128 * 1024;

/// The same settings for the node daemon's zygote and spares, as glibc tunables in their
/// environment (`None` where the operator made settings of their own, which they inherit as
/// they are), with two that only a tunable can make:
///
/// - No per-thread cache of freed blocks. A thread's cache keeps up to 7 blocks of each small
///   size out of the heap's free lists, so [`give_back_start_memory`] cannot give their pages
///   back: 92 KiB of every container's 587 (`benches/node.rs`, 2026-12-04). Their processes
///   allocate a few blocks a request; the cache's speed is not what a FUSE round trip waits for.
/// - No cache of the stacks of threads that ended (glibc keeps up to 40 MiB of them, touched
///   pages and all, for the next thread): a stack is unmapped once its thread is joined. A
///   keeper's `watch` thread, ended once it has found the container and never joined, left
///   8 KiB in every keeper (`/proc/PID/maps`, 2026-12-04, fifth session).
///
/// Every process forked from the zygote, and every server a keeper spawns, inherits the
/// environment and so the settings.
pub fn glibc_tunables() -> Option<String> {
    let operator = ["GLIBC_TUNABLES", "MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_"];
    if cfg!(not(target_env = "gnu")) || operator.iter().any(|var| std::env::var_os(var).is_some()) {
        return None;
    }
    Some(format!(
        "glibc.malloc.arena_max=1:glibc.malloc.mmap_threshold={MMAP_THRESHOLD}:glibc.malloc.tcache_count=0:glibc.pthread.stack_cache_size=0"
    ))
}

/// Gives the heap's free pages back to the kernel. A keeper's and a server's start (the
/// command line parsed, the inputs loaded, the threads started) leaves freed blocks all over a
/// heap each of them has copied from the process it was forked from; the pages stay theirs,
/// dirty, until given back: 84 KiB of every container's 782 (`benches/node.rs`, 2026-12-04).
/// A server also calls it after each reload it publishes: a reload of large inputs grew one
/// from 24 to 48 MiB, kept after a reload of small ones (found from outside).
#[cfg(target_env = "gnu")]
pub fn give_back_freed_heap() {
    // SAFETY: malloc_trim only returns free memory; it takes the arena's lock like any malloc.
    unsafe { libc::malloc_trim(0) };
}

#[cfg(not(target_env = "gnu"))]
pub fn give_back_freed_heap() {}

/// Gives back what a keeper's start left behind, once it serves (after it has said ready and
/// told its server to proceed, and again after each takeover): the heap's free pages ([`give_back_freed_heap`]) and the
/// main thread's stack below where it now runs ([`give_back_unused_stack`]). Off the start's
/// path; each takes some microseconds.
pub fn give_back_start_memory() {
    give_back_unused_stack();
    give_back_freed_heap();
}

/// How far below this function's frame the stack is kept: the frames of the one call live
/// while the pages go (`madvise`'s, a few words; `/proc/self/maps` is read, and its frames
/// gone, before) and the 128 bytes under the stack pointer that x86-64's ABI lets a function
/// use, many times over. 16 KiB kept 12 KiB that the main loops, once serving, do not reach
/// again (`benches/node.rs`: 28 -> 12 KiB of `[stack]` in each keeper and server, PSS per
/// container 361 -> 330 KiB).
const STACK_KEPT_BELOW: usize = 4 * 1024;

/// Gives back the main thread's stack pages below where it runs now, as folly's
/// `MemoryIdler::unmapUnusedStack` does for a thread that goes idle: the start's deepest calls
/// (clap's parser, the inputs' loading) wrote 40 to 60 KiB of it, which the main loop, much
/// shallower, never uses again, and which a process forked from the zygote had copied from it.
/// Below the stack pointer nothing is live; a later deep call gets zeroed pages again, as the
/// first did. A stack that cannot be found in `/proc/self/maps` is left as it is.
/// A server's main thread calls it alone, before it answers the kernel, its lifecycle giving
/// the heap's pages back once it serves, on the signal thread.
#[inline(never)]
pub fn give_back_unused_stack() {
    if nix::unistd::gettid() != nix::unistd::getpid() {
        return;
    }
    let here = 0u8;
    let sp = std::hint::black_box(&here) as *const u8 as usize;
    let Some(lowest) = main_stack_start() else { return };
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE).ok().flatten().unwrap_or(4096) as usize;
    let below = sp.saturating_sub(STACK_KEPT_BELOW) & !(page - 1);
    if below <= lowest {
        return;
    }
    // SAFETY: [lowest, below) is this thread's own stack, at least STACK_KEPT_BELOW under the
    // frame now running: no live data is there, and the mapping stays (its pages read as zero
    // until written again).
    unsafe { libc::madvise(lowest as *mut libc::c_void, below - lowest, libc::MADV_DONTNEED) };
}

/// The lowest address of the main thread's stack mapping (`[stack]` in `/proc/self/maps`).
fn main_stack_start() -> Option<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let line = maps.lines().find(|l| l.ends_with(" [stack]"))?;
    let (start, _) = line.split_once('-')?;
    usize::from_str_radix(start, 16).ok()
}
