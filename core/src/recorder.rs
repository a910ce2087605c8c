//! The flight recorder: the last N operations of every communicator that shares it, with
//! their state, for a dump when something hangs.

use crate::dtype::DType;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Where an operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpState {
    /// Enqueued, not yet seen complete.
    Pending,
    /// Completed.
    Completed,
    /// Failed with this text.
    Failed(String),
    /// Dropped before completion was observed.
    Dropped,
}

/// One recorded operation.
#[derive(Debug, Clone)]
pub struct OpRecord {
    /// Group name.
    pub group: Arc<str>,
    /// Rank in the group.
    pub rank: usize,
    /// Sequence number in the group.
    pub seq: u64,
    /// Operation name.
    pub op: &'static str,
    /// Element type, when the op has one.
    pub dtype: Option<DType>,
    /// Elements of the largest buffer involved.
    pub count: usize,
    /// Bytes moved by this rank (the size of its largest buffer).
    pub bytes: usize,
    /// Peer rank for point-to-point ops (or root for rooted collectives).
    pub peer: Option<usize>,
    /// When it was enqueued.
    pub started: Instant,
    /// How long until its completion was observed, to the coarse clock's tick (1-4 ms on
    /// Linux, more while a loaded machine delays ticks): never more than the true time,
    /// and zero for operations shorter than a tick.
    pub elapsed: Option<Duration>,
    /// State.
    pub state: OpState,
}

/// A bounded ring of [`OpRecord`]s.
///
/// A push and a finish run on every operation, so neither takes a lock: a push claims the
/// next ticket with one atomic add and writes its slot, a finish writes its slot's outcome
/// with one compare-and-swap. Readers (dumps, errors) copy a slot between two reads of its
/// tag and keep the copy only when the tag did not change.
#[derive(Debug)]
pub struct FlightRecorder {
    capacity: usize,
    /// What record times count from.
    base: Instant,
    /// `base` on the coarse clock's scale (nanoseconds of `CLOCK_MONOTONIC`).
    #[cfg(target_os = "linux")]
    base_ns: u64,
    slots: Box<[Slot]>,
    /// Records ever pushed: the ring holds tickets `pushed - capacity .. pushed` (fewer
    /// until it fills).
    pushed: AtomicU64,
    /// Group and operation names, and failure texts: taken when a communicator is made, a
    /// new operation name is first seen, or an operation fails.
    names: Mutex<Names>,
    /// Failure texts held in `names`: a push reads the tag of the slot it overwrites (to
    /// drop that record's text) only while there are any. The slot's line is cold by then
    /// (a whole ring of pushes ago), and the read was the recorder's one miss a call that
    /// waited: with real NCCL launches, most of a push's time.
    failed: AtomicU64,
    /// Operation names already seen, by index (a lookup without the lock).
    ops: [OnceLock<&'static str>; MAX_OPS],
}

/// The most records a recorder keeps (64 MiB of slots): a larger capacity is refused at
/// connect (`CommConfig::check`) and cut to this where a recorder is made directly.
pub const MAX_RECORDS: usize = 1 << 20;

/// Every live flight recorder of the process.
static LIVE: Mutex<Vec<std::sync::Weak<FlightRecorder>>> = Mutex::new(Vec::new());

/// Operation names a recorder tells apart (any more are shown as `?`).
const MAX_OPS: usize = 32;

#[derive(Debug, Default)]
struct Names {
    /// Group names, each once (a name used again takes its old index).
    groups: Vec<Arc<str>>,
    /// The text of each failed record, by ticket (pruned as the ring moves on).
    failures: std::collections::HashMap<u64, String>,
}

/// One record: a cache line of words. `tag` is `ticket << 8 | state` (`EMPTY` before the
/// first push), written last by a push (`WRITING` meanwhile) and moved from `PENDING` by
/// the one finish that wins it.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Slot {
    tag: AtomicU64,
    seq: AtomicU64,
    /// From the recorder's base to the start, in nanoseconds.
    started_ns: AtomicU64,
    /// Until completion was observed, in nanoseconds (meaningful once finished).
    elapsed_ns: AtomicU64,
    count: AtomicU64,
    bytes: AtomicU64,
    /// `rank << 32 | peer` (`u32::MAX` for no peer).
    who: AtomicU64,
    /// `group << 16 | op << 8 | dtype` (`0xff` for none).
    what: AtomicU64,
}

const PENDING: u64 = 0;
const COMPLETED: u64 = 1;
const FAILED: u64 = 2;
const DROPPED: u64 = 3;
const WRITING: u64 = 0xfe;
const EMPTY: u64 = u64::MAX;

/// An operation's facts as a push records them (an [`OpRecord`] without group, timing
/// and state).
#[derive(Debug, Clone, Copy)]
pub(crate) struct OpFields {
    pub(crate) rank: usize,
    pub(crate) seq: u64,
    pub(crate) op: &'static str,
    pub(crate) dtype: Option<DType>,
    pub(crate) count: usize,
    pub(crate) bytes: usize,
    pub(crate) peer: Option<usize>,
    /// When it was issued, in nanoseconds from the recorder's base.
    pub(crate) started_ns: u64,
}

fn code(s: &OpState) -> u64 {
    match s {
        OpState::Pending => PENDING,
        OpState::Completed => COMPLETED,
        OpState::Failed(_) => FAILED,
        OpState::Dropped => DROPPED,
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(target_os = "linux")]
fn mono_ns(clock: rustix::time::ClockId) -> u64 {
    let t = rustix::time::clock_gettime(clock);
    (t.tv_sec.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec.max(0) as u64)
}

/// How finely completion times are known: the coarse clock's tick.
pub(crate) fn completion_resolution() -> Duration {
    #[cfg(target_os = "linux")]
    {
        let r = rustix::time::clock_getres(rustix::time::ClockId::MonotonicCoarse);
        Duration::new(r.tv_sec.max(0) as u64, r.tv_nsec.clamp(0, 999_999_999) as u32)
    }
    #[cfg(not(target_os = "linux"))]
    {
        Duration::ZERO
    }
}

/// A slot's words, copied.
#[derive(Debug, Clone, Copy)]
struct Copied {
    ticket: u64,
    state: u64,
    seq: u64,
    started_ns: u64,
    elapsed_ns: u64,
    count: u64,
    bytes: u64,
    who: u64,
    what: u64,
}

/// Names one pushed record, so finishing it is a lookup, not a search (it runs on every
/// operation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ticket(u64);

impl FlightRecorder {
    /// A recorder keeping the last `capacity` operations (1 to [`MAX_RECORDS`]).
    pub fn new(capacity: usize) -> Arc<Self> {
        let capacity = capacity.clamp(1, MAX_RECORDS);
        let slots: Box<[Slot]> =
            (0..capacity).map(|_| Slot { tag: AtomicU64::new(EMPTY), ..Slot::default() }).collect();
        let r = Arc::new(FlightRecorder {
            capacity,
            base: Instant::now(),
            #[cfg(target_os = "linux")]
            base_ns: mono_ns(rustix::time::ClockId::Monotonic),
            slots,
            pushed: AtomicU64::new(0),
            names: Mutex::new(Names::default()),
            failed: AtomicU64::new(0),
            ops: std::array::from_fn(|_| OnceLock::new()),
        });
        if let Ok(mut live) = LIVE.lock() {
            live.retain(|w| w.strong_count() > 0);
            live.push(Arc::downgrade(&r));
        }
        r
    }

    /// Every live recorder of the process, for a dump.
    pub(crate) fn live() -> Vec<Arc<FlightRecorder>> {
        LIVE.lock().map(|l| l.iter().filter_map(std::sync::Weak::upgrade).collect()).unwrap_or_default()
    }

    /// Keep the failure text of record `t` (counted in `failed` before its tag says FAILED).
    fn keep_failure(&self, t: u64, text: String) {
        let mut n = self.names();
        n.failures.insert(t, text);
        self.failed.store(n.failures.len() as u64, Ordering::Relaxed);
    }

    /// Drop the failure text of record `t`.
    fn forget_failure(&self, t: u64) {
        let mut n = self.names();
        n.failures.remove(&t);
        self.failed.store(n.failures.len() as u64, Ordering::Relaxed);
    }

    fn names(&self) -> std::sync::MutexGuard<'_, Names> {
        self.names.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The index of `group` in this recorder, for [`FlightRecorder::push_pending`].
    pub(crate) fn intern(&self, group: &Arc<str>) -> u16 {
        let mut n = self.names();
        let found = n.groups.iter().position(|x| Arc::ptr_eq(x, group) || **x == **group);
        let i = found.unwrap_or_else(|| {
            n.groups.push(group.clone());
            n.groups.len() - 1
        });
        u16::try_from(i).unwrap_or(u16::MAX)
    }

    /// The index of operation name `op`.
    fn op_index(&self, op: &'static str) -> u64 {
        for (i, cell) in self.ops.iter().enumerate() {
            match cell.get() {
                Some(x) if std::ptr::eq(*x, op) || *x == op => return i as u64,
                Some(_) => continue,
                None => {
                    let x = *cell.get_or_init(|| op);
                    if x == op {
                        return i as u64;
                    }
                }
            }
        }
        0xff
    }

    fn op_name(&self, what: u64) -> &'static str {
        self.ops.get(((what >> 8) & 0xff) as usize).and_then(|c| c.get().copied()).unwrap_or("?")
    }

    /// Record a newly enqueued operation.
    pub fn push(&self, rec: OpRecord) -> Ticket {
        let f = OpFields {
            rank: rec.rank,
            seq: rec.seq,
            op: rec.op,
            dtype: rec.dtype,
            count: rec.count,
            bytes: rec.bytes,
            peer: rec.peer,
            started_ns: nanos(rec.started.saturating_duration_since(self.base)),
        };
        let group = self.intern(&rec.group);
        let state = code(&rec.state);
        let elapsed = rec.elapsed.map_or(0, nanos);
        let t = self.write(group, &f, state, elapsed);
        if let OpState::Failed(m) = rec.state {
            self.keep_failure(t, m);
        }
        Ticket(t)
    }

    /// [`FlightRecorder::push`] of a pending operation of the group `intern` named `group`
    /// (what every operation pushes).
    pub(crate) fn push_pending(&self, group: u16, f: &OpFields) -> Ticket {
        Ticket(self.write(group, f, PENDING, 0))
    }

    fn write(&self, group: u16, f: &OpFields, state: u64, elapsed_ns: u64) -> u64 {
        let t = self.pushed.fetch_add(1, Ordering::Relaxed);
        let s = &self.slots[self.slot(t)];
        // One writer a slot (the ring would have to come round during this push for two).
        let old = (self.failed.load(Ordering::Relaxed) > 0).then(|| s.tag.load(Ordering::Relaxed));
        s.tag.store(t << 8 | WRITING, Ordering::Relaxed);
        // Fields written after the tag says so: a reader that saw the old tag sees it change.
        std::sync::atomic::fence(Ordering::Release);
        if let Some(old) = old.filter(|&o| o != EMPTY && o & 0xff == FAILED) {
            self.forget_failure(old >> 8);
        }
        // `DType::ALL` lists the variants in declaration order, so a variant's number is its
        // index there (the reader maps it back through `ALL`).
        let dtype = f.dtype.map_or(0xff, |d| d as u64);
        let peer = f.peer.map_or(u32::MAX as u64, |p| p.min(u32::MAX as usize - 1) as u64);
        s.seq.store(f.seq, Ordering::Relaxed);
        s.started_ns.store(f.started_ns, Ordering::Relaxed);
        s.elapsed_ns.store(elapsed_ns, Ordering::Relaxed);
        s.count.store(f.count as u64, Ordering::Relaxed);
        s.bytes.store(f.bytes as u64, Ordering::Relaxed);
        s.who.store((f.rank.min(u32::MAX as usize) as u64) << 32 | peer, Ordering::Relaxed);
        s.what.store((group as u64) << 16 | self.op_index(f.op) << 8 | dtype, Ordering::Relaxed);
        s.tag.store(t << 8 | state, Ordering::Release);
        t
    }

    /// The slot of ticket `t`: a mask where the capacity is a power of two (the default,
    /// 2,048), where a division cost tens of cycles twice an operation.
    fn slot(&self, t: u64) -> usize {
        let c = self.capacity as u64;
        (if c.is_power_of_two() { t & (c - 1) } else { t % c }) as usize
    }

    /// Mark a pending operation as finished (a no-op once it has left the ring).
    pub fn finish(&self, ticket: Ticket, state: OpState) {
        self.settle(ticket, state, true);
    }

    /// [`FlightRecorder::finish`] of an operation that was complete when its issue returned,
    /// right after its push: its time is zero to the coarse clock's tick, and it is not read
    /// again (every operation that completes at its issue comes here).
    pub(crate) fn finish_at_issue(&self, ticket: Ticket) {
        self.settle(ticket, OpState::Completed, false);
    }

    fn settle(&self, ticket: Ticket, state: OpState, timed: bool) {
        let t = ticket.0;
        let Some(s) = self.slots.get(self.slot(t)) else { return };
        let pending = t << 8 | PENDING;
        if s.tag.load(Ordering::Acquire) != pending {
            // Finished already, or overwritten by a later push.
            return;
        }
        if timed {
            let started = s.started_ns.load(Ordering::Relaxed);
            s.elapsed_ns.store(self.now_coarse_ns().saturating_sub(started), Ordering::Relaxed);
        }
        let code = code(&state);
        if let OpState::Failed(m) = state {
            self.keep_failure(t, m);
        }
        if s.tag.compare_exchange(pending, t << 8 | code, Ordering::Release, Ordering::Relaxed).is_err()
            && code == FAILED
        {
            self.forget_failure(t);
        }
    }

    /// Now, from `base`, to the coarse clock's tick ([`completion_resolution`]): a
    /// completion is stamped on every operation, and reading the tick costs a load where
    /// the precise clock costs a computation several times slower. Never later than the
    /// precise time.
    pub(crate) fn now_coarse_ns(&self) -> u64 {
        #[cfg(target_os = "linux")]
        {
            mono_ns(rustix::time::ClockId::MonotonicCoarse).saturating_sub(self.base_ns)
        }
        #[cfg(not(target_os = "linux"))]
        {
            nanos(self.base.elapsed())
        }
    }

    /// The instant `ns` nanoseconds after the base (a time from
    /// [`FlightRecorder::now_coarse_ns`]).
    pub(crate) fn instant(&self, ns: u64) -> Instant {
        self.base + Duration::from_nanos(ns)
    }

    /// Slot `i` copied whole, or `None` while it is empty or being written.
    fn copy(&self, i: usize) -> Option<Copied> {
        let s = &self.slots[i];
        for _ in 0..64 {
            let a = s.tag.load(Ordering::Acquire);
            if a == EMPTY {
                return None;
            }
            if a & 0xff == WRITING {
                std::hint::spin_loop();
                continue;
            }
            let c = Copied {
                ticket: a >> 8,
                state: a & 0xff,
                seq: s.seq.load(Ordering::Relaxed),
                started_ns: s.started_ns.load(Ordering::Relaxed),
                elapsed_ns: s.elapsed_ns.load(Ordering::Relaxed),
                count: s.count.load(Ordering::Relaxed),
                bytes: s.bytes.load(Ordering::Relaxed),
                who: s.who.load(Ordering::Relaxed),
                what: s.what.load(Ordering::Relaxed),
            };
            std::sync::atomic::fence(Ordering::Acquire);
            if s.tag.load(Ordering::Relaxed) == a {
                return Some(c);
            }
        }
        None
    }

    /// The records in the ring, oldest first.
    fn copies(&self) -> Vec<Copied> {
        let pushed = self.pushed.load(Ordering::Acquire);
        let first = pushed.saturating_sub(self.capacity as u64);
        (first..pushed).filter_map(|t| self.copy(self.slot(t)).filter(|c| c.ticket == t)).collect()
    }

    fn record(&self, c: &Copied, names: &Names) -> OpRecord {
        let state = match c.state {
            PENDING => OpState::Pending,
            COMPLETED => OpState::Completed,
            FAILED => OpState::Failed(names.failures.get(&c.ticket).cloned().unwrap_or_default()),
            _ => OpState::Dropped,
        };
        let peer = c.who & 0xffff_ffff;
        OpRecord {
            group: names.groups.get((c.what >> 16) as usize).cloned().unwrap_or_else(|| Arc::from("?")),
            rank: (c.who >> 32) as usize,
            seq: c.seq,
            op: self.op_name(c.what),
            dtype: DType::ALL.get((c.what & 0xff) as usize).copied(),
            count: c.count as usize,
            bytes: c.bytes as usize,
            peer: (peer != u32::MAX as u64).then_some(peer as usize),
            started: self.base + Duration::from_nanos(c.started_ns),
            elapsed: (c.state != PENDING).then(|| Duration::from_nanos(c.elapsed_ns)),
            state,
        }
    }

    /// A copy of the recorded operations, oldest first.
    pub fn snapshot(&self) -> Vec<OpRecord> {
        let copies = self.copies();
        let names = self.names();
        copies.iter().map(|c| self.record(c, &names)).collect()
    }

    /// The newest completed operation of `group` still in the ring: its name, sequence
    /// number and how long ago it finished (for errors: whether a group ever ran).
    pub fn last_completed(&self, group: &str) -> Option<(&'static str, u64, Duration)> {
        let g = self.names().groups.iter().position(|x| &**x == group)? as u64;
        let found = self.copies().into_iter().rev().find(|c| c.state == COMPLETED && c.what >> 16 == g)?;
        let done = self.base + Duration::from_nanos(found.started_ns.saturating_add(found.elapsed_ns));
        Some((self.op_name(found.what), found.seq, done.elapsed()))
    }

    /// Whether the ring came round: older records than those it holds were overwritten (a
    /// group with none completed among them may still have completed earlier ones).
    pub fn overwritten(&self) -> bool {
        self.pushed.load(Ordering::Relaxed) > self.capacity as u64
    }

    /// A human-readable table of the recorded operations, oldest first.
    pub fn dump(&self) -> String {
        let tick = completion_resolution();
        let mut s =
            String::from("group            rank   seq  op              dtype  bytes        peer  state      elapsed\n");
        for r in self.snapshot() {
            let state = match &r.state {
                OpState::Pending => "PENDING".to_string(),
                OpState::Completed => "ok".to_string(),
                OpState::Failed(m) => format!("FAILED: {m}"),
                OpState::Dropped => "dropped".to_string(),
            };
            let _ = writeln!(
                s,
                "{:<16} {:>4} {:>5}  {:<15} {:<5} {:>12} {:>5}  {:<10} {}",
                r.group,
                r.rank,
                r.seq,
                r.op,
                r.dtype.map(|d| d.name()).unwrap_or("-"),
                r.bytes,
                r.peer.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                state,
                match r.elapsed {
                    Some(d) if d < tick => format!("<{tick:?}"),
                    Some(d) => format!("{d:?}"),
                    None => format!("{:?}+", r.started.elapsed()),
                },
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(group: &str, seq: u64) -> OpRecord {
        OpRecord {
            group: Arc::from(group),
            rank: 0,
            seq,
            op: "all_reduce",
            dtype: None,
            count: 1,
            bytes: 4,
            peer: None,
            started: Instant::now(),
            elapsed: None,
            state: OpState::Pending,
        }
    }

    #[test]
    fn a_power_of_two_ring_wraps_as_any_other() {
        let r = FlightRecorder::new(4);
        let t: Vec<Ticket> = (0..6).map(|i| r.push(rec("a", i))).collect();
        r.finish(t[1], OpState::Completed);
        r.finish(t[5], OpState::Completed);
        let s = r.snapshot();
        assert_eq!(s.iter().map(|x| x.seq).collect::<Vec<_>>(), vec![2, 3, 4, 5]);
        assert_eq!(
            s.iter().map(|x| x.state.clone()).collect::<Vec<_>>(),
            vec![OpState::Pending, OpState::Pending, OpState::Pending, OpState::Completed]
        );
    }

    #[test]
    fn tickets_finish_their_own_record_even_after_the_ring_wraps() {
        let r = FlightRecorder::new(3);
        let t: Vec<Ticket> = (0..5).map(|i| r.push(rec(if i % 2 == 0 { "a" } else { "b" }, i))).collect();
        // Tickets 0 and 1 have left the ring: finishing them changes nothing.
        r.finish(t[0], OpState::Completed);
        r.finish(t[1], OpState::Dropped);
        r.finish(t[3], OpState::Failed("x".into()));
        let s = r.snapshot();
        assert_eq!(s.iter().map(|x| x.seq).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(
            s.iter().map(|x| x.state.clone()).collect::<Vec<_>>(),
            vec![OpState::Pending, OpState::Failed("x".into()), OpState::Pending]
        );
        assert!(s[1].elapsed.is_some() && s[0].elapsed.is_none());
        // A finished record keeps its first outcome.
        r.finish(t[3], OpState::Completed);
        assert_eq!(r.snapshot()[1].state, OpState::Failed("x".into()));
    }

    #[test]
    fn concurrent_pushes_and_finishes_leave_whole_records() {
        let r = FlightRecorder::new(64);
        let g: Arc<str> = Arc::from("g");
        let id = r.intern(&g);
        std::thread::scope(|sc| {
            for rank in 0..4usize {
                let r = &r;
                sc.spawn(move || {
                    for seq in 0..5000u64 {
                        let f = OpFields {
                            rank,
                            seq,
                            op: if seq % 2 == 0 { "all_reduce" } else { "send" },
                            dtype: Some(DType::F32),
                            count: seq as usize,
                            bytes: 4 * seq as usize,
                            peer: (seq % 2 == 1).then_some(rank),
                            started_ns: r.now_coarse_ns(),
                        };
                        let t = r.push_pending(id, &f);
                        r.finish(
                            t,
                            if seq % 3 == 0 { OpState::Failed(format!("{rank}/{seq}")) } else { OpState::Completed },
                        );
                    }
                });
            }
            for _ in 0..200 {
                for rec in r.snapshot() {
                    // Every field of a record comes from the same push.
                    assert_eq!(rec.count as u64, rec.seq);
                    assert_eq!(rec.bytes, 4 * rec.count);
                    assert_eq!(rec.op, if rec.seq % 2 == 0 { "all_reduce" } else { "send" });
                    assert_eq!(rec.peer, (rec.seq % 2 == 1).then_some(rec.rank));
                    if let OpState::Failed(m) = &rec.state {
                        assert!(m.is_empty() || *m == format!("{}/{}", rec.rank, rec.seq), "{m}");
                    }
                }
            }
        });
        let s = r.snapshot();
        assert_eq!(s.len(), 64);
        for rec in &s {
            let want = if rec.seq % 3 == 0 {
                OpState::Failed(format!("{}/{}", rec.rank, rec.seq))
            } else {
                OpState::Completed
            };
            assert_eq!(rec.state, want);
        }
        // Texts of failures that left the ring are not kept.
        assert!(r.names().failures.len() <= 64);
    }

    #[test]
    fn completion_times_are_never_later_than_the_clock() {
        let r = FlightRecorder::new(4);
        let started = Instant::now();
        let t = r.push(rec("g", 0));
        std::thread::sleep(Duration::from_millis(30));
        // The coarse clock only moves forward, so the stamp is at least its reading just
        // before the finish (how far it lags the true time depends on the kernel's ticks,
        // which a loaded machine delays past the nominal resolution).
        let before = r.now_coarse_ns();
        r.finish(t, OpState::Completed);
        let took = started.elapsed();
        let e = r.snapshot()[0].elapsed.expect("finished");
        assert!(e <= took, "{e:?} > {took:?}");
        let floor = Duration::from_nanos(before.saturating_sub(r.slots[0].started_ns.load(Ordering::Relaxed)));
        assert!(e >= floor, "{e:?} < {floor:?}");
        assert!(r.dump().contains(" ok "), "{}", r.dump());
        assert_eq!(r.last_completed("g").map(|(op, seq, _)| (op, seq)), Some(("all_reduce", 0)));
        assert_eq!(r.last_completed("h"), None);
        // Four more pending: the completed one is overwritten, and the ring says so.
        assert!(!r.overwritten());
        for s in 1..=4 {
            let _ = r.push(rec("g", s));
        }
        assert_eq!((r.last_completed("g"), r.overwritten()), (None, true));
    }

    #[test]
    fn an_operation_complete_at_its_issue_is_finished_with_no_time() {
        let r = FlightRecorder::new(4);
        let f = |seq| OpFields {
            rank: 0,
            seq,
            op: "all_reduce",
            dtype: Some(DType::F32),
            count: 2,
            bytes: 8,
            peer: None,
            started_ns: r.now_coarse_ns(),
        };
        let id = r.intern(&Arc::from("g"));
        let t = r.push_pending(id, &f(0));
        r.finish_at_issue(t);
        let got = r.snapshot();
        assert_eq!((got[0].state.clone(), got[0].elapsed), (OpState::Completed, Some(Duration::ZERO)));
        // Once finished, or once its slot holds a later push, an entry stays as it is.
        let failed = r.push_pending(id, &f(1));
        r.finish(failed, OpState::Failed("x".into()));
        r.finish_at_issue(failed);
        assert_eq!(r.snapshot()[1].state, OpState::Failed("x".into()));
        for seq in 2..6 {
            r.push_pending(id, &f(seq));
        }
        r.finish_at_issue(t);
        assert_eq!(r.snapshot().iter().filter(|e| e.state == OpState::Completed).count(), 0, "{}", r.dump());
    }

    #[test]
    fn every_dtype_is_recorded_as_itself() {
        // A slot stores a dtype as its variant number and reads it back through `DType::ALL`.
        for (i, d) in DType::ALL.iter().enumerate() {
            assert_eq!(*d as usize, i);
            let r = FlightRecorder::new(1);
            r.push(OpRecord { dtype: Some(*d), ..rec("g", 0) });
            assert_eq!(r.snapshot()[0].dtype, Some(*d));
        }
    }
}
