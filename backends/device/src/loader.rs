//! Opening a vendor library at run time: the first candidate that loads wins, and a
//! failure lists every place looked and why each failed.

use libloading::Library;
use std::path::{Path, PathBuf};

/// A loaded library and where it came from.
#[derive(Debug)]
pub struct Loaded {
    /// The library; symbols resolved from it stay valid while it is alive.
    pub lib: Library,
    /// The candidate that loaded.
    pub path: String,
}

/// `names` in each of `dirs`, then the bare names (the dynamic loader's own search path).
/// Directories that do not exist are skipped; duplicates keep their first place.
pub fn candidates(names: &[&str], dirs: &[PathBuf]) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = Vec::new();
    for d in dirs {
        for n in names {
            v.push(d.join(n));
        }
    }
    v.extend(names.iter().map(PathBuf::from));
    let mut seen = std::collections::HashSet::new();
    v.retain(|p| seen.insert(p.clone()));
    v
}

/// Open the first of `candidates` that loads.
///
/// # Errors
/// `"<what> not found; tried <path>: <why>; ...; <hint>"` when none loads.
pub fn open(what: &str, candidates: &[PathBuf], hint: &str) -> Result<Loaded, String> {
    let mut tried = Vec::new();
    for c in candidates {
        // A path with a directory that does not exist is reported without a dlopen attempt.
        if c.components().count() > 1 && !c.exists() {
            tried.push(format!("{}: no such file", c.display()));
            continue;
        }
        // SAFETY: loading a vendor library runs its initialisers, which set up its own state only.
        match unsafe { Library::new(c) } {
            Ok(lib) => return Ok(Loaded { lib, path: c.display().to_string() }),
            Err(e) => tried.push(format!("{}: {}", c.display(), short(&e.to_string()))),
        }
    }
    Err(format!("{what} not found; tried {}; {hint}", tried.join("; ")))
}

/// libloading repeats the path in its message: keep the reason only.
fn short(msg: &str) -> String {
    msg.rsplit(": ").next().unwrap_or(msg).to_string()
}

/// A required symbol.
///
/// # Safety
/// `T` must be the C signature of `name` in `lib`.
///
/// # Errors
/// `"symbol <name> missing from <path>"`.
pub unsafe fn sym<T: Copy>(l: &Loaded, name: &str) -> Result<T, String> {
    // SAFETY: the caller guarantees the signature.
    unsafe { l.lib.get::<T>(name.as_bytes()) }.map(|s| *s).map_err(|_| format!("symbol {name} missing from {}", l.path))
}

/// An optional symbol (newer library versions).
///
/// # Safety
/// As [`sym`].
pub unsafe fn opt<T: Copy>(l: &Loaded, name: &str) -> Option<T> {
    // SAFETY: the caller guarantees the signature.
    unsafe { l.lib.get::<T>(name.as_bytes()) }.ok().map(|s| *s)
}

/// A library's function table filled from `lib` (a [`Loaded`]), each field `Field` from the
/// symbol `<prefix>Field`, so a symbol's name is written once: `required` fields fail the
/// load when missing ([`sym`]), `optional` ones are `None` ([`opt`]), `gated` ones are `None`
/// unless their condition holds (a library version known to lack or to break them); the
/// `rest` are given as they are. Used inside an `unsafe` block whose
/// `SAFETY` line says the table's field types are the library's C signatures.
///
/// ```ignore
/// symbols!(NcclLib from lib, "nccl" {
///     required: [GetUniqueId, CommAbort],
///     optional: [CommSplit],
///     gated: [(version >= 22907) => [CommMemStats]],
///     rest: { _lib: lib, path, version },
/// })
/// ```
#[macro_export]
macro_rules! symbols {
    ($table:ident from $lib:ident, $prefix:literal {
        required: [$($req:ident),* $(,)?],
        optional: [$($opt:ident),* $(,)?],
        $(gated: [$(($cond:expr) => [$($c:ident),* $(,)?]),* $(,)?],)?
        rest: { $($field:ident $(: $value:expr)?),* $(,)? } $(,)?
    }) => {
        $table {
            $($req: $crate::loader::sym(&$lib, concat!($prefix, stringify!($req)))?,)*
            $($opt: $crate::loader::opt(&$lib, concat!($prefix, stringify!($opt))),)*
            $($($($c: if $cond { $crate::loader::opt(&$lib, concat!($prefix, stringify!($c))) } else { None },)*)*)?
            $($field $(: $value)?,)*
        }
    };
}

/// The directory named by environment variable `var`, when set and not empty, joined
/// with `sub`.
pub fn env_dir(var: &str, sub: &str) -> Option<PathBuf> {
    std::env::var_os(var).filter(|v| !v.is_empty()).map(|v| Path::new(&v).join(sub))
}
