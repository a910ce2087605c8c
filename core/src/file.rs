//! Files a job keeps (a checkpoint shard, a saved plan, a dump): written atomically, so a
//! reader sees the old file or the new one and a failed write leaves nothing behind; read
//! only when regular and never more than the caller expects, with an error that names the
//! file at once, never a read that blocks on a FIFO or fills memory from `/dev/zero`.

use crate::error::{Ctx, Result};
use std::io::{Read, Write};
use std::path::Path;

/// The bytes of the regular file at `path`, at most `max_bytes` of them, for `op` in `ctx`.
///
/// The file is opened without blocking (a FIFO's open would wait for a writer) and checked
/// to be a regular file (a link is followed to what it names) before anything is read; a
/// file longer than `max_bytes`, or one that grows past it while read, is refused.
///
/// # Examples
/// ```
/// use anyccl_core::{read_regular_file, Ctx};
/// let ctx = Ctx::process("doc");
/// let e = read_regular_file(&ctx, "load plan", "/dev/zero", 1 << 20).unwrap_err();
/// assert!(e.to_string().contains("/dev/zero") && e.to_string().contains("not a regular file"));
/// ```
///
/// # Errors
/// `Io` naming the file: it cannot be opened or read (the system's error as the source), it
/// is not a regular file, or it is larger than `max_bytes`.
pub fn read_regular_file(ctx: &Ctx, op: &str, path: impl AsRef<Path>, max_bytes: u64) -> Result<Vec<u8>> {
    let path = path.as_ref();
    let mut f = open_nonblocking(path).map_err(|e| ctx.io(op, path, e))?;
    let meta = f.metadata().map_err(|e| ctx.io(op, path, e))?;
    if !meta.file_type().is_file() {
        return Err(ctx.file(op, path, format!("not a regular file ({})", kind(&meta))));
    }
    if meta.len() > max_bytes {
        return Err(ctx.file(op, path, format!("{} bytes, more than the {max_bytes} expected", meta.len())));
    }
    let mut out = Vec::new();
    out.try_reserve_exact(meta.len() as usize)
        .map_err(|_| ctx.file(op, path, format!("cannot allocate {} bytes to read it", meta.len())))?;
    (&mut f).take(max_bytes.saturating_add(1)).read_to_end(&mut out).map_err(|e| ctx.io(op, path, e))?;
    if out.len() as u64 > max_bytes {
        return Err(ctx.file(op, path, format!("grew past the {max_bytes} bytes expected while it was read")));
    }
    Ok(out)
}

/// Write `parts`, one after another, as the file at `path` for `op` in `ctx`, atomically: a
/// temporary file beside it (`.<name>.tmp<pid>`), fsync, rename over `path`, fsync of the
/// folder (made when missing). A reader sees the old file or the new one, never a part;
/// when a step fails (a full disk, an fsync or a rename error) the temporary file is
/// removed and the error says so.
///
/// # Errors
/// `Io` naming the file (or its folder, when that cannot be made or synced), with the
/// system's error as the source.
pub fn write_file_atomically(ctx: &Ctx, op: &str, path: impl AsRef<Path>, parts: &[&[u8]]) -> Result<()> {
    let path = path.as_ref();
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| ctx.io(op, dir, e))?;
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "file".into());
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let written = std::fs::File::create(&tmp)
        .and_then(|mut f| parts.iter().try_for_each(|p| f.write_all(p)).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = written {
        let mut e = ctx.io(op, path, e);
        let note = match std::fs::remove_file(&tmp) {
            Ok(()) => format!("; its partial file {} was removed", tmp.display()),
            Err(r) if r.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(r) => format!("; its partial file {} could not be removed ({r})", tmp.display()),
        };
        if let crate::Error::Io { detail, .. } = &mut e {
            detail.push_str(&note);
        }
        return Err(e);
    }
    std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(|e| ctx.io(op, dir, e))
}

#[cfg(unix)]
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    // O_NONBLOCK: the open of a FIFO without a writer returns at once (a regular file's
    // reads ignore the flag).
    std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)
}

#[cfg(not(unix))]
fn open_nonblocking(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::File::open(path)
}

fn kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a file"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("anyccl-file-{}-{}", std::process::id(), rand::random::<u32>()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn an_atomic_write_replaces_the_file_and_a_failed_one_leaves_nothing() {
        let d = dir();
        let ctx = Ctx::new("test", 0, "");
        let p = d.join("sub/f");
        write_file_atomically(&ctx, "save", &p, &[b"ab", b"cd"]).unwrap();
        write_file_atomically(&ctx, "save", &p, &[b"new"]).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"new");
        // A folder in the file's place: the rename fails, the temporary file goes.
        let q = d.join("sub/occupied");
        std::fs::create_dir_all(q.join("x")).unwrap();
        let e = write_file_atomically(&ctx, "save", &q, &[b"x"]).unwrap_err().to_string();
        assert!(e.contains("occupied") && e.contains("was removed"), "{e}");
        let mut left: Vec<String> = std::fs::read_dir(d.join("sub"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into())
            .collect();
        left.sort();
        assert_eq!(left, vec!["f".to_string(), "occupied".to_string()]);
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn reads_a_file_within_its_cap_and_refuses_one_above() {
        let d = dir();
        let p = d.join("f");
        std::fs::write(&p, b"12345").unwrap();
        let ctx = Ctx::new("test", 1, "g");
        assert_eq!(read_regular_file(&ctx, "load", &p, 5).unwrap(), b"12345");
        let e = read_regular_file(&ctx, "load", &p, 4).unwrap_err().to_string();
        assert!(e.contains("5 bytes") && e.contains(&p.display().to_string()) && e.contains("rank 1"), "{e}");
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn a_link_to_dev_zero_a_fifo_and_a_directory_are_refused_at_once() {
        let d = dir();
        let link = d.join("zero");
        std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
        let fifo = d.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().map(|s| s.success()).unwrap_or(false);
        let ctx = Ctx::process("test");
        let t = std::time::Instant::now();
        let mut paths = vec![(link, "character device"), (d.clone(), "directory")];
        if made {
            paths.push((fifo, "FIFO"));
        }
        for (p, want) in paths {
            let e = read_regular_file(&ctx, "load", &p, 1 << 30).unwrap_err().to_string();
            assert!(e.contains(want) && e.contains(&p.display().to_string()), "{e}");
        }
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "took {:?}", t.elapsed());
        std::fs::remove_dir_all(d).unwrap();
    }
}
