//! Reading a file that a program trusts only so far (a checkpoint shard, a saved plan, a
//! dump): only a regular file, never more than its caller expects, and an error that names
//! the file at once, never a read that blocks on a FIFO or fills memory from `/dev/zero`.

use crate::error::{Ctx, Result};
use std::io::Read;
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
