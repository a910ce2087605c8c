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
    /// its process, with every rank in it).
    #[arg(long, default_value = "none")]
    pub(crate) fault: String,
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

fn parse_fault(s: &str, ranks: usize) -> Result<(Fault, usize), String> {
    if s == "none" {
        return Ok((Fault::None, usize::MAX));
    }
    let (kind, rank) =
        s.split_once(':').ok_or_else(|| format!("--fault {s:?}: expected none, fail:R, hang:R or die:R"))?;
    let rank: usize = rank.parse().map_err(|_| format!("--fault {s:?}: {rank:?} is not a rank"))?;
    if rank >= ranks {
        return Err(format!("--fault {s:?}: rank {rank} is outside the {ranks} ranks"));
    }
    let f = match kind {
        "fail" => Fault::Fail,
        "hang" => Fault::Hang,
        "die" => Fault::Die,
        _ => return Err(format!("--fault {s:?}: {kind:?} is not fail, hang or die")),
    };
    Ok((f, rank))
}

pub(crate) fn check_args(a: &Args) -> Result<(Layout, Fault, usize), String> {
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
    let (fault, at) = parse_fault(&a.fault, a.ranks)?;
    Ok((layout, fault, at))
}

pub(crate) fn block(k: usize, procs: usize, ranks: usize) -> std::ops::Range<usize> {
    k * ranks / procs..(k + 1) * ranks / procs
}

pub(crate) fn layout_arg(l: &Layout) -> String {
    join(&l.dims.iter().map(|d| d.2).collect::<Vec<_>>())
}
