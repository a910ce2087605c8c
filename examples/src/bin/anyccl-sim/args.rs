//! The command line: the flags, the parallel layout they describe and the fault to inject,
//! checked before anything starts.

use crate::backend::Fault;
use anyccl::Role;
use clap::Parser;

#[derive(Parser, Debug, Clone)]
#[command(about = "Simulate the warmup protocol of N ranks against the real store")]
pub(crate) struct Args {
    /// Simulated ranks.
    #[arg(long)]
    pub(crate) ranks: usize,
    /// Parallel layout, outermost first: data × tensor × pipeline [× expert] (e.g. 64x8x8);
    /// the product is the rank count. Default: data × 8 × 8 where it divides, else data × 8,
    /// else data only.
    #[arg(long)]
    pub(crate) layout: Option<String>,
    /// Processes the ranks are spread over (each rank keeps its own store client).
    #[arg(long, default_value_t = 4)]
    pub(crate) procs: usize,
    /// `fail:R` (rank R's first operation fails), `hang:R` (never completes), `die:R` (kills
    /// its process, with every rank in it), or `kill-rank:R[@start|@steady]`: every rank is a
    /// member of the job's membership (anyccl-membership) instead of warming, and rank R alone
    /// stops as a kill would stop it (its member is dropped; its liveness record goes stale);
    /// the others must agree on a view without it. `@steady` (the default): once every rank
    /// holds epoch 0; `@start`: during the job's first agreement (epoch 0), right after it
    /// arrives and tries to take the lead or sees another rank lead (a rank that took the
    /// lead dies as the leader).
    #[arg(long, default_value = "none")]
    pub(crate) fault: String,
    /// With `--fault kill-rank:R`: once the survivors agree, a replacement for rank R joins
    /// (a new incarnation) and must be admitted at the next epoch. `--rejoin=J` starts the
    /// replacement for rank J instead: for a rank that was never killed, the newer process
    /// replaces the one that still runs, which must be told it is out.
    #[arg(long, num_args = 0..=1, require_equals = true, value_name = "J")]
    pub(crate) rejoin: Option<Option<usize>>,
    /// With `--fault kill-rank`: each member's liveness beat, milliseconds (1 to 60000); the
    /// library's default (`ANYCCL_LIVENESS_BEAT_MS`).
    #[arg(long, default_value_t = 250, value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub(crate) beat_ms: u64,
    /// With `--fault kill-rank`: a liveness record not renewed for this long is evidence that
    /// its member is gone, milliseconds (above two beats, below --timeout).
    #[arg(long, default_value_t = 3000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub(crate) stale_ms: u64,
    /// With `--fault kill-rank`: `shared` (one liveness thread per process beats for all of
    /// its members) or `own` (a thread per member, as a process with one rank has).
    #[arg(long, default_value = "shared")]
    pub(crate) liveness: String,
    /// The warmup's deadline, seconds.
    #[arg(long, default_value_t = 60)]
    pub(crate) timeout: u64,
    /// Simulated time of each new connection, milliseconds (at most an hour).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub(crate) connect_ms: u64,
    /// Simulated device memory of each new connection, MiB (at most 1 TiB).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub(crate) connect_mib: u64,
    /// The store: `tcp` (a TCP store server in this process) or `etcd://host:port[,...]`
    /// (keys under a prefix of this run's own).
    #[arg(long, default_value = "tcp")]
    pub(crate) store: String,
    /// Warm from a saved plan per rank (`warmup_saved`), so the members first agree on
    /// each group's plan source.
    #[arg(long)]
    pub(crate) saved: bool,
    /// Call the same generation again afterwards: it must replay the outcome.
    #[arg(long)]
    pub(crate) repeat: bool,
    /// Instead of a warmup, measure the store: every rank's client sets and reads its own
    /// key for this many seconds (at most 3600); prints requests per second.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub(crate) store_bench: u64,
    /// Print the figures as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    /// Internal: run the ranks of child K against the store at --store-addr.
    #[arg(long, hide = true)]
    pub(crate) child: Option<usize>,
    /// Internal: the store's address.
    #[arg(long, hide = true)]
    pub(crate) store_addr: Option<String>,
    /// Internal: the etcd key prefix.
    #[arg(long, hide = true)]
    pub(crate) store_prefix: Option<String>,
}

/// The dimensions of a layout, outermost first, with their roles.
#[derive(Debug, Clone)]
pub(crate) struct Layout {
    pub(crate) dims: Vec<(&'static str, Role, usize)>,
}

impl Layout {
    pub(crate) fn parse(spec: Option<&str>, ranks: usize) -> Result<Layout, String> {
        let sizes: Vec<usize> = match spec {
            Some(s) => s
                .split('x')
                .map(|d| d.trim().parse::<usize>().ok().filter(|&d| d > 0))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    format!("--layout {s:?}: expected sizes like 64x8x8 (data x tensor x pipeline [x expert])")
                })?,
            None if ranks.is_multiple_of(64) && ranks >= 128 => vec![ranks / 64, 8, 8],
            None if ranks.is_multiple_of(8) && ranks >= 16 => vec![ranks / 8, 8],
            None => vec![ranks],
        };
        if sizes.len() > 4 {
            return Err(format!(
                "--layout: at most 4 dimensions (data x tensor x pipeline x expert), got {}",
                sizes.len()
            ));
        }
        // Checked: sizes near usize::MAX would wrap to a small product that matches --ranks.
        let product = sizes.iter().try_fold(1usize, |p, &d| p.checked_mul(d)).ok_or_else(|| {
            format!("--layout {}: the product of its sizes overflows (it must equal --ranks, {ranks})", join(&sizes))
        })?;
        if product != ranks {
            return Err(format!("--layout {}: its product is {product}, --ranks is {ranks}", join(&sizes)));
        }
        let names = [("dp", Role::Data), ("tp", Role::Tensor), ("pp", Role::Pipeline), ("ep", Role::Expert)];
        Ok(Layout { dims: sizes.iter().zip(names).map(|(&n, (name, role))| (name, role, n)).collect() })
    }

    /// Every group `rank` is a member of: its name, role and members.
    pub(crate) fn groups_of(&self, rank: usize) -> Vec<(String, Role, Vec<usize>)> {
        // Coordinates with the tensor dimension innermost: rank = ((dp·pp + p)·ep + e)·tp + t.
        let order: Vec<usize> = [0, 2, 3, 1].into_iter().filter(|&d| d < self.dims.len()).collect();
        let mut stride = vec![0usize; self.dims.len()];
        let mut s = 1;
        for &d in order.iter().rev() {
            stride[d] = s;
            s *= self.dims[d].2;
        }
        let coord = |r: usize, d: usize| (r / stride[d]) % self.dims[d].2;
        self.dims
            .iter()
            .enumerate()
            .filter(|(_, (_, _, n))| *n > 1)
            .map(|(d, (name, role, n))| {
                let base = rank - coord(rank, d) * stride[d];
                (name.to_string(), role.clone(), (0..*n).map(|i| base + i * stride[d]).collect())
            })
            .collect()
    }

    pub(crate) fn describe(&self) -> String {
        self.dims.iter().map(|(n, _, s)| format!("{n}{s}")).collect::<Vec<_>>().join("x")
    }
}

pub(crate) fn join(v: &[usize]) -> String {
    v.iter().map(|d| d.to_string()).collect::<Vec<_>>().join("x")
}

/// When `--fault kill-rank:R` stops its rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KillAt {
    /// During the job's first agreement (epoch 0), once it tried to take the lead or saw
    /// another rank lead.
    Start,
    /// Once every rank holds epoch 0.
    Steady,
}

/// `--fault kill-rank:R[@when]` with its `--rejoin`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Kill {
    pub(crate) rank: usize,
    pub(crate) at: KillAt,
    /// The rank a replacement joins for, once the survivors agree.
    pub(crate) rejoin: Option<usize>,
}

/// What the flags ask for, checked.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) layout: Layout,
    /// The warmup's fault and its rank (`usize::MAX` for none).
    pub(crate) fault: Fault,
    pub(crate) fault_rank: usize,
    /// `--fault kill-rank`: the membership runs instead of the warmup.
    pub(crate) kill: Option<Kill>,
}

enum Parsed {
    Warmup(Fault, usize),
    Kill(usize, KillAt),
}

fn parse_fault(s: &str, ranks: usize) -> Result<Parsed, String> {
    if s == "none" {
        return Ok(Parsed::Warmup(Fault::None, usize::MAX));
    }
    let (kind, rest) = s
        .split_once(':')
        .ok_or_else(|| format!("--fault {s:?}: expected none, fail:R, hang:R, die:R or kill-rank:R[@start|@steady]"))?;
    let (rank, when) = match rest.split_once('@') {
        Some((r, w)) if kind == "kill-rank" => (r, Some(w)),
        _ => (rest, None),
    };
    let rank: usize = rank.parse().map_err(|_| format!("--fault {s:?}: {rank:?} is not a rank"))?;
    if rank >= ranks {
        return Err(format!("--fault {s:?}: rank {rank} is outside the {ranks} ranks"));
    }
    let f = match kind {
        "fail" => Fault::Fail,
        "hang" => Fault::Hang,
        "die" => Fault::Die,
        "kill-rank" => {
            let at = match when {
                None | Some("steady") => KillAt::Steady,
                Some("start") => KillAt::Start,
                Some(w) => return Err(format!("--fault {s:?}: {w:?} is not start or steady")),
            };
            return Ok(Parsed::Kill(rank, at));
        }
        _ => return Err(format!("--fault {s:?}: {kind:?} is not fail, hang, die or kill-rank")),
    };
    Ok(Parsed::Warmup(f, rank))
}

/// The membership flags, checked against the kill (`None`: no `--fault kill-rank`).
fn check_kill(a: &Args, kill: Option<(usize, KillAt)>) -> Result<Option<Kill>, String> {
    let Some((rank, at)) = kill else {
        if a.rejoin.is_some() {
            return Err("--rejoin: a replacement joins after --fault kill-rank:R, which is not given".into());
        }
        return Ok(None);
    };
    if a.ranks < 2 {
        return Err(format!("--fault {:?}: the membership needs a survivor, and --ranks is {}", a.fault, a.ranks));
    }
    for (flag, set) in [("--saved", a.saved), ("--repeat", a.repeat), ("--store-bench", a.store_bench > 0)] {
        if set {
            return Err(format!("{flag}: a warmup flag, and --fault {:?} runs the membership instead", a.fault));
        }
    }
    if a.liveness != "shared" && a.liveness != "own" {
        return Err(format!("--liveness {:?}: expected shared or own", a.liveness));
    }
    if a.stale_ms <= 2 * a.beat_ms {
        return Err(format!("--stale-ms {}: expected above two beats (--beat-ms {})", a.stale_ms, a.beat_ms));
    }
    if a.stale_ms >= a.timeout.saturating_mul(1000) {
        return Err(format!("--stale-ms {}: expected below --timeout ({} s)", a.stale_ms, a.timeout));
    }
    let rejoin = match a.rejoin {
        None => None,
        Some(None) => Some(rank),
        Some(Some(j)) if j >= a.ranks => {
            return Err(format!("--rejoin={j}: rank {j} is outside the {} ranks", a.ranks));
        }
        Some(Some(j)) => Some(j),
    };
    Ok(Some(Kill { rank, at, rejoin }))
}

pub(crate) fn check_args(a: &Args) -> Result<Plan, String> {
    if a.ranks == 0 || a.ranks > 65536 {
        return Err(format!("--ranks {}: expected 1 to 65536", a.ranks));
    }
    if a.procs == 0 || a.procs > a.ranks || a.procs > 64 {
        return Err(format!("--procs {}: expected 1 to min(64, --ranks)", a.procs));
    }
    if a.timeout == 0 || a.timeout > 3600 {
        return Err(format!("--timeout {}: expected 1 to 3600 seconds", a.timeout));
    }
    if a.store != "tcp" && !a.store.starts_with("etcd://") {
        return Err(format!("--store {:?}: expected tcp or etcd://host:port[,host:port...]", a.store));
    }
    let layout = Layout::parse(a.layout.as_deref(), a.ranks)?;
    let (fault, fault_rank, kill) = match parse_fault(&a.fault, a.ranks)? {
        Parsed::Warmup(f, r) => (f, r, None),
        Parsed::Kill(r, at) => (Fault::None, usize::MAX, Some((r, at))),
    };
    let kill = check_kill(a, kill)?;
    Ok(Plan { layout, fault, fault_rank, kill })
}

pub(crate) fn block(k: usize, procs: usize, ranks: usize) -> std::ops::Range<usize> {
    k * ranks / procs..(k + 1) * ranks / procs
}

pub(crate) fn layout_arg(l: &Layout) -> String {
    join(&l.dims.iter().map(|d| d.2).collect::<Vec<_>>())
}
