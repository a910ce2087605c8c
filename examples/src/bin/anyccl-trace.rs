//! `anyccl-trace DIR`: read every rank's flight-recorder dump (`rank<R>.json`, written to
//! `ANYCCL_TRACE_DIR` on a timeout, failure, abort or SIGTERM) and say which rank is behind
//! and on which operation.
//!
//! Per group, operations are matched across ranks by sequence number. The first operation
//! that did not complete everywhere is the one the job hung in; members that never issued
//! it are behind (a rank that left no dump at all is named first: it was killed, or stopped
//! until it was). When every member issued it, the ranks' own errors say whom they waited
//! for, and the rank most of them name is the suspect.
//!
//! A dump is read only when it is a regular file no larger than `--max-dump-bytes`, and
//! what it claims is bounded before anything is sized by it: its rank and world size (at
//! most [`MAX_WORLD`] ranks) and its records per recorder (at most [`MAX_RECORDS`]). A dump
//! outside these bounds is an error naming the file and the field.
#![forbid(unsafe_code)]

use anyccl::raw::{parse_bytes, read_regular_file, Ctx, MAX_RECORDS};
use anyccl::trace::{TraceDump, TraceRecord, TRACE_FORMAT};
use anyccl_examples::{errln, outln};
use clap::Parser;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The largest world a dump may claim: the largest any program here runs (`anyccl-sim`'s).
const MAX_WORLD: usize = 1 << 20;

#[derive(Parser, Debug)]
#[command(
    name = "anyccl-trace",
    about = "Say which rank a hung or failed job waited for, from its flight-recorder dumps"
)]
struct Args {
    /// The folder the ranks dumped into (their ANYCCL_TRACE_DIR).
    dir: PathBuf,
    /// Print every rank's last operations too.
    #[arg(long)]
    verbose: bool,
    /// The largest dump read, in bytes (K, M, G suffixes): a larger one is an error.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    max_dump_bytes: u64,
}

fn parse_size(s: &str) -> Result<u64, String> {
    parse_bytes(s).map(|b| b as u64).ok_or_else(|| format!("'{s}' is not a size in bytes (K, M, G suffixes)"))
}

fn main() -> ExitCode {
    // Output that could not be written fails the run, and says so.
    anyccl_examples::out::finish("anyccl-trace", program())
}

fn program() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            errln!("anyccl-trace: {e}");
            ExitCode::from(1)
        }
    }
}

/// What a dump claims, within bounds: its world size and rank, and its records per
/// recorder (one recorder per group and group rank keeps at most [`MAX_RECORDS`]).
fn check_claims(path: &Path, d: &TraceDump) -> Result<(), String> {
    let bad = |field: &str, what: String| format!("{}: field {field} {what}", path.display());
    if d.world_size == 0 || d.world_size > MAX_WORLD {
        return Err(bad("world_size", format!("is {}, not between 1 and {MAX_WORLD}", d.world_size)));
    }
    // A rank at or past its own world_size is read as before (a process given RANK without
    // WORLD_SIZE dumps world_size 1; the analyzer takes the world from the highest rank), but
    // within the same bound.
    if d.rank >= MAX_WORLD {
        return Err(bad("rank", format!("is {}, not below {MAX_WORLD}", d.rank)));
    }
    let mut per_recorder: BTreeMap<(&str, usize), usize> = BTreeMap::new();
    for r in &d.records {
        let n = per_recorder.entry((r.group.as_str(), r.group_rank)).or_default();
        *n += 1;
        if *n > MAX_RECORDS {
            return Err(bad(
                "records",
                format!(
                    "holds more than {MAX_RECORDS} records of group '{}' rank {}, more than a recorder keeps",
                    r.group, r.group_rank
                ),
            ));
        }
    }
    Ok(())
}

fn load(dir: &Path, max_bytes: u64) -> Result<BTreeMap<usize, TraceDump>, String> {
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let ctx = Ctx::process("anyccl-trace");
    let mut dumps = BTreeMap::new();
    let mut from: BTreeMap<usize, PathBuf> = BTreeMap::new();
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !(name.starts_with("rank") && name.ends_with(".json")) {
            continue;
        }
        let path = e.path();
        let text = read_regular_file(&ctx, "read flight-recorder dump", &path, max_bytes).map_err(|e| {
            let over = std::fs::metadata(&path).is_ok_and(|m| m.is_file() && m.len() > max_bytes);
            if over {
                format!("{e} (--max-dump-bytes raises the limit)")
            } else {
                e.to_string()
            }
        })?;
        let d: TraceDump = serde_json::from_slice(&text)
            .map_err(|err| format!("{} is not a flight-recorder dump: {err}", path.display()))?;
        drop(text);
        if d.format != TRACE_FORMAT {
            return Err(format!("{} has format {}, this tool reads {TRACE_FORMAT}", path.display(), d.format));
        }
        check_claims(&path, &d)?;
        if let Some(other) = from.insert(d.rank, path.clone()) {
            return Err(format!("{} and {} both claim rank {}", other.display(), path.display(), d.rank));
        }
        dumps.insert(d.rank, d);
    }
    if dumps.is_empty() {
        return Err(format!("no rank*.json dumps in {}", dir.display()));
    }
    Ok(dumps)
}

fn name(r: &TraceRecord) -> String {
    format!("{} #{}", r.op, r.seq)
}

/// Ranks that the failures of `texts` blame: "nothing arrived from rank N", "rank N
/// accepted no data", "rank N made no progress" (a shared-memory wait).
fn blamed(texts: &[&str]) -> BTreeMap<usize, usize> {
    let mut votes = BTreeMap::new();
    for t in texts {
        let mut seen = BTreeSet::new();
        for (pat, after) in [("from rank ", true), (" accepted no data", false), (" made no progress", false)] {
            let mut rest = *t;
            while let Some(i) = rest.find(pat) {
                let n = if after {
                    rest[i + pat.len()..].chars().take_while(|c| c.is_ascii_digit()).collect::<String>()
                } else {
                    let before: String = rest[..i]
                        .chars()
                        .rev()
                        .take_while(|c| c.is_ascii_digit())
                        .collect::<Vec<_>>()
                        .into_iter()
                        .rev()
                        .collect();
                    before
                };
                if let Ok(r) = n.parse::<usize>() {
                    seen.insert(r);
                }
                rest = &rest[i + pat.len()..];
            }
        }
        for r in seen {
            *votes.entry(r).or_default() += 1;
        }
    }
    votes
}

/// The ranks a store barrier's timeout names: `... ranks [0, 3] never arrived`.
fn never_arrived(text: &str) -> Vec<usize> {
    let Some(at) = text.find("] never arrived") else { return Vec::new() };
    let Some(open) = text[..at].rfind('[') else { return Vec::new() };
    text[open + 1..at].split(',').filter_map(|x| x.trim().parse().ok()).collect()
}

/// Among `ranks`, those whose first trouble came well after the others' (by more than
/// `LATE_MS`): a process that was stopped or busy notices a hang only once it runs again
/// (a launcher resumes it to stop it), while the ranks waiting on it time out together.
fn late_noticers(dumps: &BTreeMap<usize, TraceDump>, ranks: impl Iterator<Item = usize>) -> Vec<usize> {
    const LATE_MS: u64 = 250;
    let firsts: Vec<(usize, u64)> = ranks.filter_map(|r| dumps.get(&r).map(|d| (r, d.first_unix_ms))).collect();
    let Some(earliest) = firsts.iter().map(|f| f.1).min() else { return Vec::new() };
    let late: Vec<usize> = firsts.iter().filter(|f| f.1 > earliest + LATE_MS).map(|f| f.0).collect();
    // Only a minority can be the cause; if most noticed late, timing says nothing.
    if late.len() * 2 < firsts.len() {
        late
    } else {
        Vec::new()
    }
}

fn run(args: &Args) -> Result<(), String> {
    let dumps = load(&args.dir, args.max_dump_bytes)?;
    let world = dumps.values().map(|d| d.world_size).max().unwrap_or(1).max(dumps.keys().max().map_or(0, |m| m + 1));
    outln!("anyccl-trace: {} of {world} ranks left a dump in {}", dumps.len(), args.dir.display());
    for d in dumps.values() {
        outln!(
            "  rank {:>4}  pid {:>7} on {:<12} first trouble at +{} ms: {}",
            d.rank,
            d.pid,
            d.host,
            d.first_unix_ms.saturating_sub(dumps.values().map(|x| x.first_unix_ms).min().unwrap_or(0)),
            d.first_reason
        );
    }
    let silent: Vec<usize> = (0..world).filter(|r| !dumps.contains_key(r)).collect();
    let mut suspects: Vec<String> = Vec::new();
    if !silent.is_empty() {
        suspects.push(format!(
            "ranks {silent:?} left no dump: killed, or stopped until the end (a stopped rank dumps on SIGTERM only \
             once it runs again)"
        ));
    }

    // Per group: each rank's records by sequence number (the group rank -> global rank map
    // comes from the dumps).
    let mut groups: BTreeMap<String, BTreeMap<usize, Vec<&TraceRecord>>> = BTreeMap::new();
    for d in dumps.values() {
        for r in &d.records {
            groups.entry(r.group.clone()).or_default().entry(d.rank).or_default().push(r);
        }
    }
    // An operation a rank completed only after another rank had already failed (a stopped
    // rank resumed to write its dump finishes with what its peers sent before giving up)
    // shows that rank was behind, not that the operation went through: it counts as not
    // completed.
    let first_failure = dumps.values().map(|d| d.first_unix_ms).min().unwrap_or(u64::MAX);
    let done_in_time = |r: &TraceRecord| {
        r.state == "completed" && r.elapsed_ms.is_none_or(|e| r.started_unix_ms as f64 + e <= first_failure as f64)
    };
    let mut verdicts = Vec::new();
    for (g, by_rank) in &groups {
        // The first operation not completed by every member that recorded the group.
        let unfinished = by_rank.values().flat_map(|rs| rs.iter().filter(|r| !done_in_time(r)).map(|r| r.seq)).min();
        let Some(seq) = unfinished else { continue };
        let mut completed = Vec::new();
        let mut stuck = Vec::new();
        let mut never = Vec::new();
        // Members whose recorder's oldest record came after it: they issued it and went on
        // (a pipelined rank can be thousands of operations ahead, past its recorder's
        // window), so they are not behind.
        let mut past = Vec::new();
        let mut texts = Vec::new();
        // Members that failed it with a timeout of their own: they waited for a peer, so
        // they are not the cause (in a ring each waits on the one before, and the errors
        // name one rank each; the cause is the one named that waited for nobody).
        let mut waited = Vec::new();
        let mut what = String::new();
        for (rank, rs) in by_rank {
            match rs.iter().find(|r| r.seq == seq) {
                Some(r) => {
                    what = name(r);
                    if done_in_time(r) {
                        completed.push(*rank);
                    } else {
                        stuck.push((*rank, r.state.clone()));
                    }
                    if let Some(e) = &r.error {
                        texts.push(e.as_str());
                        if e.contains("timed out") {
                            waited.push(*rank);
                        }
                    }
                }
                None if rs.iter().all(|r| r.seq > seq) => {
                    past.push((*rank, rs.iter().map(|r| r.seq).min().unwrap_or(seq)));
                }
                None => {
                    let last = rs.iter().filter(|r| r.seq < seq).max_by_key(|r| r.seq);
                    never.push((*rank, last.map(|l| format!("{} ({})", name(l), l.state)).unwrap_or("nothing".into())));
                }
            }
        }
        let mut line = format!("group '{g}': {what} is the first operation that did not complete everywhere");
        if !completed.is_empty() {
            line.push_str(&format!("; completed by ranks {completed:?}"));
        }
        if !stuck.is_empty() {
            let s: Vec<String> = stuck.iter().map(|(r, st)| format!("{r} ({st})")).collect();
            line.push_str(&format!("; not completed by ranks {}", s.join(", ")));
        }
        if !never.is_empty() {
            let b: Vec<String> = never.iter().map(|(r, last)| format!("{r} (its last: {last})")).collect();
            line.push_str(&format!("; never issued by ranks {}", b.join(", ")));
        }
        if !past.is_empty() {
            let b: Vec<String> = past.iter().map(|(r, oldest)| format!("{r} (its oldest record: #{oldest})")).collect();
            line.push_str(&format!("; issued and gone past by ranks {}", b.join(", ")));
        }
        // Members that never issued it are behind; so are those that did not finish what
        // others finished. Only when every member is stuck in it do their errors decide.
        // Members that never issued it are behind. Otherwise the cause is among those stuck
        // in it: the one stuck alone where others completed; else the ones that noticed
        // only after the others (stopped or busy); else the peer their errors name; else
        // all of them, when others completed it.
        let never_ranks: Vec<usize> = never.iter().map(|(r, _)| *r).collect();
        let stuck_ranks: Vec<usize> = stuck.iter().map(|(r, _)| *r).collect();
        // Timing is judged against every member: the ranks that waited time out together.
        // A rank past it may be stuck further on (a pipelined rank stopped with operations
        // queued): it counts for timing as the stuck ones do.
        let late: Vec<usize> = late_noticers(&dumps, by_rank.keys().copied())
            .into_iter()
            .filter(|r| stuck_ranks.contains(r) || past.iter().any(|p| p.0 == *r))
            .collect();
        // Where no record of it carries an error (the failed operation fell out of the
        // recorders, as thousands queued behind it), the ranks' first troubles speak.
        if texts.is_empty() {
            for d in dumps.values().filter(|d| by_rank.contains_key(&d.rank)) {
                texts.push(d.first_reason.as_str());
                if d.first_reason.contains("timed out") {
                    waited.push(d.rank);
                }
            }
        }
        let mut votes = blamed(&texts);
        if votes.keys().any(|r| !waited.contains(r)) {
            votes.retain(|r, _| !waited.contains(r));
        }
        if !never_ranks.is_empty() {
            suspects.push(format!("rank(s) {never_ranks:?} behind in group '{g}' at {what}"));
        } else if stuck_ranks.len() == 1 && !completed.is_empty() {
            suspects.push(format!("rank(s) {stuck_ranks:?} behind in group '{g}' at {what} (the others completed it)"));
        } else if !late.is_empty() {
            line.push_str(&format!(
                "; ranks {late:?} noticed nothing until after the others had failed (stopped, or busy elsewhere)"
            ));
            suspects.push(format!(
                "rank(s) {late:?}: stuck in {what} of group '{g}' like the others, but noticed the trouble only after \
                 them (a stopped or busy process)"
            ));
        } else if stuck_ranks.len() == 1 && !past.is_empty() {
            suspects.push(format!(
                "rank(s) {stuck_ranks:?} behind in group '{g}' at {what} (the others issued later ones)"
            ));
        } else if let Some((&r, &v)) = votes.iter().max_by_key(|(_, v)| **v) {
            line.push_str(&format!("; their errors name rank {r} ({v} of {})", texts.len()));
            suspects.push(format!("rank {r}: the errors in group '{g}' point at it ({v} of {})", texts.len()));
        } else if !completed.is_empty() {
            suspects.push(format!("rank(s) {stuck_ranks:?} did not complete {what} of group '{g}', which others did"));
        } else {
            line.push_str("; every member is stuck in it and none names a peer");
        }
        verdicts.push(line);
    }
    outln!();
    for v in &verdicts {
        outln!("{v}");
    }
    if args.verbose {
        for d in dumps.values() {
            outln!("\nrank {}:", d.rank);
            for r in d.records.iter().rev().take(8).rev() {
                outln!("  {:<16} {:<16} {:<9} {}", r.group, name(r), r.state, r.error.as_deref().unwrap_or(""));
            }
        }
    }
    if suspects.is_empty() {
        // No operation left unfinished: a store barrier that timed out names who never came.
        let mut absent: BTreeMap<usize, usize> = BTreeMap::new();
        for d in dumps.values() {
            for r in never_arrived(&d.first_reason) {
                *absent.entry(r).or_default() += 1;
            }
        }
        if let Some((&r, &v)) = absent.iter().max_by_key(|(_, v)| **v) {
            suspects.push(format!("rank(s) [{r}] never arrived at the store barrier that {v} rank(s) timed out in"));
        }
    }
    outln!();
    match suspects.first() {
        Some(s) => {
            outln!("SUSPECT: {s}");
            for s in &suspects[1..] {
                outln!("also: {s}");
            }
        }
        None => outln!("no operation was left unfinished: nothing to blame"),
    }
    Ok(())
}
