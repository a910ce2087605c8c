//! `--fault kill-rank:R`: every simulated rank is a member of the job's membership
//! (anyccl-membership) over its own counted store client, instead of warming. Rank R stops as
//! a kill would stop it (its member is dropped, so its liveness record goes stale); the
//! others hear of the proposed epoch on their liveness beat and agree on it; with `--rejoin`,
//! a replacement then joins and must be admitted at the next epoch.
//!
//! The parent drives the stages with one line to every child: `kill` (the child holding rank
//! R drops its member; `@start` kills it during the start instead), `rejoin` (the child
//! holding the rank starts its replacement) and `end`; each child answers `joined`, `agreed`
//! and `admitted` once each of its ranks is done with the stage, and at `end` reports what
//! every rank saw and when, with its store requests in 10 ms buckets of wall time, the
//! liveness threads' apart (see [`Timeline`]).

use crate::args::{Args, Kill, KillAt};
use crate::counting::now_ns;
use anyccl::membership::{LivenessDriver, Membership, MembershipConfig, View};
use anyccl::raw::async_trait;
use anyccl::{CasOutcome, Recovery, Store};
use anyccl_examples::outln;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch, Notify};

/// Width of a [`Timeline`] bucket, ns.
pub(crate) const BUCKET_NS: u64 = 10_000_000;

/// Store requests per 10 ms of wall time, those of liveness threads (renewals, the watched
/// peer's record, the look for a proposal, the evidence a watcher writes) apart from the
/// rest (joins and agreements). A window between two events is then summed from the buckets
/// (to within a bucket at each end), whatever the ranks were doing.
#[derive(Debug)]
pub(crate) struct Timeline {
    /// The bucket number (wall ns / [`BUCKET_NS`]) of the first bucket.
    base: u64,
    beat: Vec<AtomicU64>,
    other: Vec<AtomicU64>,
}

impl Timeline {
    fn new(seconds: u64) -> Timeline {
        let n = (seconds * 1_000_000_000 / BUCKET_NS) as usize;
        Timeline {
            base: now_ns() / BUCKET_NS,
            beat: (0..n).map(|_| AtomicU64::new(0)).collect(),
            other: (0..n).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn note(&self) {
        // The membership's liveness threads are named so (one per member, or the shared one).
        let beat = std::thread::current().name().is_some_and(|n| n.starts_with("anyccl-liveness"));
        let i = ((now_ns() / BUCKET_NS).saturating_sub(self.base) as usize).min(self.beat.len() - 1);
        let v = if beat { &self.beat[i] } else { &self.other[i] };
        v.fetch_add(1, Ordering::Relaxed);
    }

    /// (bucket number, beat requests, other requests) of every bucket with any.
    fn figures(&self) -> Vec<(u64, u64, u64)> {
        self.beat
            .iter()
            .zip(&self.other)
            .enumerate()
            .map(|(i, (b, o))| (self.base + i as u64, b.load(Ordering::Relaxed), o.load(Ordering::Relaxed)))
            .filter(|(_, b, o)| b + o > 0)
            .collect()
    }
}

/// A rank's store client, counted into its process's [`Timeline`]; the rank killed
/// `@start` has a trigger on who leads epoch 0: it fires once the rank has tried to take
/// the lead (so a rank that took it dies as the leader) or has seen another rank lead.
#[derive(Debug)]
struct MemberStore {
    inner: Arc<dyn Store>,
    timeline: Arc<Timeline>,
    trigger: Option<(String, Arc<Notify>, AtomicBool)>,
    /// The rank took the lead of epoch 0 (the trigger's try succeeded).
    led: AtomicBool,
    /// `ANYCCL_SIM_LATE_FIRST_LOOK`, on the rank killed at the start: its first look at
    /// epoch 0's decision and leader waits until another rank has decided, so the answer
    /// that fires the kill also holds the decision that ends the join (the race
    /// [`MemberStore::unless_killed`] settles, forced in every run).
    late_look: Option<(String, AtomicBool)>,
}

impl MemberStore {
    /// A request about `key` was answered; `led`: whether it showed a leader (a try to take
    /// the lead counts, whatever its outcome). Whether the answer fired the kill.
    fn answered(&self, key: &str, led: bool) -> bool {
        if let Some((k, kill, fired)) = &self.trigger {
            if k == key && led && !fired.swap(true, Ordering::AcqRel) {
                kill.notify_one();
                return true;
            }
        }
        false
    }

    /// The rank the answer just killed never reads it: the request does not return (the
    /// kill, notified already, drops it with the join). Returned, an answer that fired the
    /// kill could finish the join in the same poll (the decision of epoch 0 and the leader
    /// came in one look), and the join's future, ready first, won the race with the kill:
    /// the rank lived on as a member, nothing was left for the survivors to agree on, and
    /// the run failed at the stage's limit (about one run in eight at 64 ranks).
    async fn unless_killed<T>(fired: bool, r: T) -> T {
        if fired {
            std::future::pending::<()>().await;
        }
        r
    }
}

#[async_trait]
impl Store for MemberStore {
    async fn set(&self, key: &str, value: &[u8]) -> anyccl::Result<()> {
        self.timeline.note();
        self.inner.set(key, value).await
    }
    async fn get(&self, key: &str) -> anyccl::Result<Option<Vec<u8>>> {
        self.timeline.note();
        let r = self.inner.get(key).await;
        let fired = self.answered(key, matches!(r, Ok(Some(_))));
        Self::unless_killed(fired, r).await
    }
    async fn wait(&self, key: &str, deadline: std::time::Instant) -> anyccl::Result<Vec<u8>> {
        self.timeline.note();
        self.inner.wait(key, deadline).await
    }
    async fn add(&self, key: &str, delta: i64) -> anyccl::Result<i64> {
        self.timeline.note();
        self.inner.add(key, delta).await
    }
    async fn compare_set(&self, key: &str, expected: Option<&[u8]>, new: &[u8]) -> anyccl::Result<CasOutcome> {
        self.timeline.note();
        let r = self.inner.compare_set(key, expected, new).await;
        if self.trigger.as_ref().is_some_and(|t| t.0 == key) && r.as_ref().is_ok_and(|c| c.swapped) {
            self.led.store(true, Ordering::Release);
        }
        let fired = self.answered(key, true);
        Self::unless_killed(fired, r).await
    }
    async fn delete(&self, key: &str) -> anyccl::Result<bool> {
        self.timeline.note();
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> anyccl::Result<u64> {
        self.timeline.note();
        self.inner.delete_prefix(prefix).await
    }
    async fn wait_many(&self, keys: &[String], deadline: std::time::Instant) -> anyccl::Result<Vec<Option<Vec<u8>>>> {
        self.timeline.note();
        if let Some((decision, waited)) = &self.late_look {
            if keys.contains(decision) && !waited.swap(true, Ordering::AcqRel) {
                // Whatever this returns, the look below reads what is there by then.
                let _ = self.inner.wait(decision, std::time::Instant::now() + Duration::from_secs(60)).await;
            }
        }
        let r = self.inner.wait_many(keys, deadline).await;
        let mut fired = false;
        if let Ok(vs) = &r {
            for (k, v) in keys.iter().zip(vs) {
                fired |= self.answered(k, v.is_some());
            }
        }
        Self::unless_killed(fired, r).await
    }
}

/// A view as one rank held it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Seen {
    pub(crate) epoch: u64,
    /// When the rank's call returned it, wall ns.
    pub(crate) ns: u64,
    pub(crate) members: usize,
    /// CRC-32 of the members (rank and incarnation): equal views have equal digests.
    pub(crate) digest: u32,
    pub(crate) left: Vec<usize>,
    pub(crate) joined: Vec<usize>,
    /// The incarnation of the killed rank in the view (`None`: not a member).
    pub(crate) killed: Option<u64>,
    /// The incarnation of the `--rejoin` rank in the view.
    pub(crate) rejoined: Option<u64>,
}

impl Seen {
    fn of(v: &View, kill: Kill) -> Seen {
        // The time first: the digest below is the simulation's work, not the membership's.
        let ns = now_ns();
        let mut h = crc32fast::Hasher::new();
        for m in &v.members {
            h.update(&(m.rank as u64).to_le_bytes());
            h.update(&m.incarnation.to_le_bytes());
        }
        let digest = h.finalize();
        Seen {
            epoch: v.epoch,
            ns,
            members: v.members.len(),
            digest,
            left: v.left.clone(),
            joined: v.joined.clone(),
            killed: v.member(kill.rank).map(|m| m.incarnation),
            rejoined: kill.rejoin.and_then(|j| v.member(j)).map(|m| m.incarnation),
        }
    }
}

/// What one process of a rank (a member, or a replacement) did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct RankLog {
    pub(crate) rank: usize,
    /// Its incarnation (0: its join did not get so far).
    pub(crate) incarnation: u64,
    /// A replacement started by `rejoin`.
    pub(crate) replacement: bool,
    /// When its join began, wall ns.
    pub(crate) started_ns: u64,
    /// The views it held, in order (its join's first).
    pub(crate) views: Vec<Seen>,
    /// Proposals it heard on its beat: (epoch, wall ns, a failure).
    pub(crate) heard: Vec<(u64, u64, bool)>,
    /// When it was killed, wall ns.
    pub(crate) killed_ns: Option<u64>,
    /// Killed `@start` as the leader of epoch 0.
    #[serde(default)]
    pub(crate) killed_leading: bool,
    /// Errors of its join or agreements.
    pub(crate) errors: Vec<String>,
    /// Out for good (a fatal error: the others went on without it).
    pub(crate) out: bool,
}

/// What a child reports at `end`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct MemberReport {
    pub(crate) child: usize,
    pub(crate) connect_ms: f64,
    pub(crate) ranks: Vec<RankLog>,
    /// (bucket, beat requests, other requests), see [`Timeline`].
    pub(crate) timeline: Vec<(u64, u64, u64)>,
    /// Peak resident memory of the process, KiB, and its threads at `end`.
    pub(crate) rss_peak_kib: u64,
    pub(crate) threads: u64,
}

enum Event {
    Joined(std::result::Result<(u64, Seen), String>),
    Heard(u64, u64, bool),
    Agreed(Seen),
    Failed(String, bool),
    Killed(u64),
}

struct Rank {
    slot: usize,
    rank: usize,
    world: usize,
    kill: Kill,
    store: Arc<dyn Store>,
    cfg: MembershipConfig,
    tx: mpsc::UnboundedSender<(usize, Event)>,
    /// Set for the rank to be killed.
    doom: Option<Arc<Notify>>,
    end: watch::Receiver<bool>,
}

impl Rank {
    fn send(&self, e: Event) {
        let _ = self.tx.send((self.slot, e));
    }

    /// Join, then agree on every epoch proposed, until `end`, a fatal error or a kill.
    async fn run(mut self) {
        let joining = Membership::join(self.store.clone(), self.rank, self.world, self.cfg.clone());
        let joined = match (&self.doom, self.kill.at) {
            (Some(kill), KillAt::Start) => {
                let kill = kill.clone();
                tokio::select! {
                    j = joining => j,
                    _ = kill.notified() => {
                        // The join's future, with the member it made, is dropped here.
                        self.send(Event::Killed(now_ns()));
                        return;
                    }
                }
            }
            _ => joining.await,
        };
        let m = match joined {
            Ok(m) => m,
            Err(e) => {
                self.send(Event::Joined(Err(e.to_string())));
                return;
            }
        };
        self.send(Event::Joined(Ok((m.me().incarnation, Seen::of(&m.view(), self.kill)))));
        let proposed = Arc::new(Notify::new());
        {
            let (p, tx, slot) = (proposed.clone(), self.tx.clone(), self.slot);
            m.on_proposal(move |h| {
                let _ = tx.send((slot, Event::Heard(h.epoch, now_ns(), h.failure)));
                p.notify_one();
            });
        }
        let doom = self.doom.clone().filter(|_| self.kill.at == KillAt::Steady);
        let killed = || async {
            match &doom {
                Some(d) => d.notified().await,
                None => std::future::pending().await,
            }
        };
        loop {
            if let Some(p) = m.proposed() {
                match m.agree(&p.reason).await {
                    Ok(v) => self.send(Event::Agreed(Seen::of(&v, self.kill))),
                    Err(e) => {
                        let fatal = e.recovery() == Recovery::Fatal;
                        self.send(Event::Failed(e.to_string(), fatal));
                        if fatal {
                            return;
                        }
                    }
                }
                continue;
            }
            tokio::select! {
                _ = proposed.notified() => {}
                _ = killed() => {
                    self.send(Event::Killed(now_ns()));
                    // A member's drop waits for its own liveness thread to stop (up to a
                    // beat): not on this runtime's one thread.
                    let _ = tokio::task::spawn_blocking(move || drop(m)).await;
                    return;
                }
                _ = self.end.changed() => return,
            }
        }
    }
}

/// The membership's settings for the simulation: `--liveness shared` gives this process's
/// members one liveness driver.
fn config(a: &Args) -> Result<MembershipConfig, String> {
    let liveness_driver = match a.liveness.as_str() {
        "shared" => Some(LivenessDriver::start().map_err(|e| format!("cannot start the liveness driver: {e}"))?),
        _ => None,
    };
    Ok(MembershipConfig {
        prefix: "anyccl-sim/membership".into(),
        beat: Duration::from_millis(a.beat_ms),
        stale_after: Duration::from_millis(a.stale_ms),
        agree_timeout: Duration::from_secs(a.timeout),
        liveness_driver,
    })
}

/// Peak resident memory (KiB) and threads of this process.
pub(crate) fn process_figures() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap_or(0)
    };
    (field("VmHWM:"), field("Threads:"))
}

fn say(line: &str) {
    outln!("{line}");
    let _ = std::io::stdout().flush();
}

/// A child's ranks as members, through the stages the parent drives.
pub(crate) async fn child(
    a: &Args,
    k: usize,
    kill: Kill,
    mine: std::ops::Range<usize>,
    stores: Vec<Arc<dyn Store>>,
    connect_ms: f64,
) -> Result<ExitCode, String> {
    let timeline = Arc::new(Timeline::new(3 * a.timeout + 120));
    let cfg = config(a)?;
    let doom = Arc::new(Notify::new());
    let lead0 = format!("{}/epoch/0/leader", cfg.prefix);
    let late = std::env::var_os("ANYCCL_SIM_LATE_FIRST_LOOK").is_some_and(|v| v == "1");
    let members: Vec<Arc<MemberStore>> = mine
        .clone()
        .zip(stores)
        .map(|(r, inner)| {
            let doomed = r == kill.rank && kill.at == KillAt::Start;
            let trigger = doomed.then(|| (lead0.clone(), doom.clone(), AtomicBool::new(false)));
            let late_look =
                (doomed && late).then(|| (format!("{}/epoch/0/decision", cfg.prefix), AtomicBool::new(false)));
            Arc::new(MemberStore { inner, timeline: timeline.clone(), trigger, led: AtomicBool::new(false), late_look })
        })
        .collect();
    let stores: Vec<Arc<dyn Store>> = members.iter().map(|m| m.clone() as Arc<dyn Store>).collect();
    // The parent's lines, after `go`.
    let (line_tx, mut lines) = mpsc::unbounded_channel::<String>();
    std::thread::spawn(move || {
        for l in std::io::stdin().lock().lines() {
            let Ok(l) = l else { break };
            if line_tx.send(l.trim().to_string()).is_err() {
                break;
            }
        }
    });
    let (tx, mut events) = mpsc::unbounded_channel();
    let (end_tx, end) = watch::channel(false);
    let mut logs: Vec<RankLog> = Vec::new();
    let spawn = |slot: usize, r: usize, logs: &mut Vec<RankLog>, replacement: bool| {
        logs.push(RankLog { rank: r, replacement, started_ns: now_ns(), ..RankLog::default() });
        let rank = Rank {
            slot,
            rank: r,
            world: a.ranks,
            kill,
            store: stores[r - mine.start].clone(),
            cfg: cfg.clone(),
            tx: tx.clone(),
            doom: (r == kill.rank && !replacement).then(|| doom.clone()),
            end: end.clone(),
        };
        tokio::spawn(rank.run());
    };
    for (slot, r) in mine.clone().enumerate() {
        spawn(slot, r, &mut logs, false);
    }
    let mut said = [false; 3];
    loop {
        tokio::select! {
            l = lines.recv() => match l.as_deref() {
                Some("kill") => {
                    if mine.contains(&kill.rank) && kill.at == KillAt::Steady {
                        doom.notify_one();
                    }
                }
                Some("rejoin") => {
                    if let Some(j) = kill.rejoin.filter(|j| mine.contains(j)) {
                        let slot = logs.len();
                        spawn(slot, j, &mut logs, true);
                    }
                }
                Some("end") | None => break,
                Some(other) => return Err(format!("unexpected line from the parent: {other:?}")),
            },
            Some((slot, e)) = events.recv() => {
                let log = &mut logs[slot];
                match e {
                    Event::Joined(Ok((inc, seen))) => {
                        log.incarnation = inc;
                        log.views.push(seen);
                    }
                    Event::Joined(Err(msg)) => {
                        log.errors.push(msg);
                        log.out = true;
                    }
                    Event::Heard(epoch, ns, failure) => log.heard.push((epoch, ns, failure)),
                    Event::Agreed(seen) => log.views.push(seen),
                    Event::Failed(msg, fatal) => {
                        log.errors.push(msg);
                        log.out |= fatal;
                    }
                    Event::Killed(ns) => {
                        log.killed_ns = Some(ns);
                        log.killed_leading = members[log.rank - mine.start].led.load(Ordering::Acquire);
                        log.out = true;
                    }
                }
            }
        }
        for (i, stage) in ["joined", "agreed", "admitted"].into_iter().enumerate() {
            if !said[i] && done(i, &logs, kill) {
                said[i] = true;
                say(stage);
            }
        }
    }
    let _ = end_tx.send(true);
    let (rss_peak_kib, threads) = process_figures();
    let report =
        MemberReport { child: k, connect_ms, ranks: logs, timeline: timeline.figures(), rss_peak_kib, threads };
    say(&serde_json::to_string(&report).map_err(|e| e.to_string())?);
    // Not dropped one by one: with `--liveness own` each member's drop waits up to a beat
    // for its thread. The process ends with its members, as a job's processes do.
    std::process::exit(0)
}

/// Whether this child's ranks are done with stage `i` (0 joined, 1 agreed without the killed
/// rank, 2 admitted the replacement).
fn done(i: usize, logs: &[RankLog], kill: Kill) -> bool {
    let firsts = || logs.iter().filter(|l| !l.replacement);
    match i {
        0 => firsts().all(|l| l.out || !l.views.is_empty()),
        1 => firsts().all(|l| l.out || l.views.last().is_some_and(|v| v.killed.is_none())),
        _ => {
            let Some(j) = kill.rejoin else { return false };
            // The replacement's incarnation is above every first process's.
            let admitted = |l: &RankLog| l.views.last().is_some_and(|v| v.rejoined.is_some_and(|inc| inc > 1));
            let replacement_here = logs.iter().any(|l| l.replacement);
            let first_j_here = logs.iter().any(|l| !l.replacement && l.rank == j);
            (replacement_here || !first_j_here)
                && logs.iter().all(|l| l.out || admitted(l))
                && logs.iter().filter(|l| l.replacement).all(|l| !l.views.is_empty() || l.out)
        }
    }
}
