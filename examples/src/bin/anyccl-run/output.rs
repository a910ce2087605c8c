//! The ranks' output: bytes copied as they come (never decoded: a rank may print anything),
//! cut into lines, each line prefixed with its rank (`[rank 3] `), and with its incarnation
//! for a replacement that an elastic launcher started (`[rank 3.2] `: the rank's second
//! process). A line longer than the launcher holds is written out in pieces, each with the
//! prefix, so what the launcher buffers stays bounded whatever a rank prints.

use anyccl_examples::out::{self, Stream};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Stack of a pump's thread: it holds one read buffer.
const THREAD_STACK: usize = 128 << 10;
/// Bytes read from a rank's pipe at a time.
const READ: usize = 8 << 10;

/// Cuts a byte stream into records: `prefix`, up to `max` bytes of one line, and a newline.
/// A line of more than `max` bytes becomes several records; without a prefix those pieces are
/// written as they are (the bytes unchanged), with one, each piece ends in a newline so that
/// every record starts with its rank.
pub struct Lines {
    /// The record being filled: the prefix, then the line so far.
    rec: Vec<u8>,
    prefix: usize,
    max: usize,
}

impl Lines {
    pub fn new(prefix: &[u8], max: usize) -> Lines {
        Lines { rec: prefix.to_vec(), prefix: prefix.len(), max: max.max(1) }
    }

    /// Feed `data`; `emit` gets each finished record.
    pub fn feed(&mut self, mut data: &[u8], emit: &mut impl FnMut(&[u8])) {
        while !data.is_empty() {
            let room = self.max - (self.rec.len() - self.prefix);
            // A newline right after a full piece still ends that piece's line.
            let window = &data[..data.len().min(room + 1)];
            match window.iter().position(|&b| b == b'\n') {
                Some(i) => {
                    self.rec.extend_from_slice(&data[..=i]);
                    data = &data[i + 1..];
                    self.emit(false, emit);
                }
                None if data.len() >= room => {
                    self.rec.extend_from_slice(&data[..room]);
                    data = &data[room..];
                    self.emit(true, emit);
                }
                None => {
                    self.rec.extend_from_slice(data);
                    data = &[];
                }
            }
        }
    }

    /// The end of the stream: a last line without its newline gets one.
    pub fn finish(&mut self, emit: &mut impl FnMut(&[u8])) {
        if self.rec.len() > self.prefix {
            self.rec.push(b'\n');
            self.emit(false, emit);
        }
    }

    fn emit(&mut self, cut: bool, emit: &mut impl FnMut(&[u8])) {
        if cut && self.prefix > 0 {
            self.rec.push(b'\n');
        }
        emit(&self.rec);
        self.rec.truncate(self.prefix);
        // A long line's buffer is not kept for the short ones after it.
        if self.rec.capacity() > 2 * (self.prefix + READ) {
            self.rec.shrink_to(self.prefix + READ);
        }
    }
}

/// How the launcher copies output.
#[derive(Debug, Clone)]
pub struct Copying {
    pub prefix: bool,
    /// Longest piece of a line held before it is written out.
    pub max_line: usize,
    /// Bytes copied so far, over every stream: a drain waits while this moves.
    pub moved: Arc<AtomicU64>,
}

/// The end of one process's output stream: its rank, its incarnation and when.
pub type Ended = (usize, u64, Instant);

/// The prefix of a process's lines: `[rank 3] ` for a rank's first process, `[rank 3.2] `
/// for its second (a replacement), so that a log says which process printed what while
/// `[rank 3` still finds them all.
pub fn rank_prefix(rank: usize, incarnation: u64) -> String {
    match incarnation {
        0 | 1 => format!("[rank {rank}] "),
        i => format!("[rank {rank}.{i}] "),
    }
}

/// Copy a rank's stream to the launcher's stdout or stderr on a thread of its own; report
/// its end. An exiting process closes its standard streams before its sockets, so the end
/// of its output comes before any peer can notice its death: the earliest end among failed
/// ranks names the rank that failed first, even when a peer that noticed is reaped before it.
pub fn pump(
    (rank, incarnation): (usize, u64),
    how: &Copying,
    mut r: impl Read + Send + 'static,
    to_err: bool,
    ended: mpsc::Sender<Ended>,
) -> std::io::Result<()> {
    let prefix = if how.prefix { rank_prefix(rank, incarnation) } else { String::new() };
    let mut lines = Lines::new(prefix.as_bytes(), how.max_line);
    let moved = how.moved.clone();
    let run = move || {
        let _guard = EndGuard(rank, incarnation, ended);
        let stream = if to_err { Stream::Err } else { Stream::Out };
        let mut write = |rec: &[u8]| {
            // A launcher whose own output is gone still reads its ranks' output to the end,
            // so that no rank is stopped by a full or broken pipe; what is lost is counted,
            // and the launcher's exit says so.
            out::write(stream, rec);
        };
        let mut buf = [0u8; READ];
        loop {
            match r.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    lines.feed(&buf[..n], &mut write);
                    moved.fetch_add(n as u64, Ordering::Relaxed);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        lines.finish(&mut write);
    };
    std::thread::Builder::new().name(format!("rank{rank}-out")).stack_size(THREAD_STACK).spawn(run).map(|_| ())
}

/// Reports the end of a rank's output, however the pump ends.
struct EndGuard(usize, u64, mpsc::Sender<Ended>);
impl Drop for EndGuard {
    fn drop(&mut self) {
        let _ = self.2.send((self.0, self.1, Instant::now()));
    }
}

/// The ends of the ranks' output streams, as their pumps report them.
pub struct Outputs {
    pub rx: mpsc::Receiver<Ended>,
    /// Streams whose end has been seen.
    pub seen: usize,
    /// The earliest end of each rank's output, its newest process's.
    pub first_end: Vec<Option<Instant>>,
    /// Each rank's newest incarnation: the ends of earlier ones only count as seen.
    pub incarnation: Vec<u64>,
    pub moved: Arc<AtomicU64>,
}

impl Outputs {
    pub fn new(rx: mpsc::Receiver<Ended>, ranks: usize, moved: Arc<AtomicU64>) -> Outputs {
        Outputs { rx, seen: 0, first_end: vec![None; ranks], incarnation: vec![1; ranks], moved }
    }
    /// Rank `rank`'s newest process is now `incarnation`: what ended before is forgotten.
    pub fn replaced(&mut self, rank: usize, incarnation: u64) {
        self.poll();
        if let (Some(e), Some(i)) = (self.first_end.get_mut(rank), self.incarnation.get_mut(rank)) {
            *e = None;
            *i = incarnation;
        }
    }
    fn note(&mut self, (r, inc, t): Ended) {
        self.seen += 1;
        if self.incarnation.get(r) != Some(&inc) {
            return;
        }
        if let Some(e) = self.first_end.get_mut(r) {
            *e = Some(e.map_or(t, |e| e.min(t)));
        }
    }
    /// Note every end reported so far.
    pub fn poll(&mut self) {
        while let Ok(x) = self.rx.try_recv() {
            self.note(x);
        }
    }
    /// Wait until `streams` ends are seen, for as long as output still moves: give up once
    /// no stream ended and no byte was copied for `stall` (a process outside the job holds
    /// a rank's pipe open).
    pub fn drain(&mut self, streams: usize, stall: Duration) {
        let mut last = self.moved.load(Ordering::Relaxed);
        let mut quiet_since = Instant::now();
        while self.seen < streams {
            match self.rx.recv_timeout(Duration::from_millis(50)) {
                Ok(x) => {
                    self.note(x);
                    quiet_since = Instant::now();
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let now = self.moved.load(Ordering::Relaxed);
                    if now != last {
                        last = now;
                        quiet_since = Instant::now();
                    } else if quiet_since.elapsed() >= stall {
                        break;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{rank_prefix, Lines};

    #[test]
    fn a_replacement_is_prefixed_with_its_incarnation() {
        assert_eq!(rank_prefix(3, 1), "[rank 3] ");
        assert_eq!(rank_prefix(3, 2), "[rank 3.2] ");
    }

    fn cut(prefix: &str, max: usize, input: &[&[u8]]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut l = Lines::new(prefix.as_bytes(), max);
        for chunk in input {
            l.feed(chunk, &mut |r: &[u8]| out.push(r.to_vec()));
        }
        l.finish(&mut |r: &[u8]| out.push(r.to_vec()));
        out
    }

    #[test]
    fn lines_pass_bytes_through_and_cut_long_lines() {
        // Not UTF-8, split across reads.
        assert_eq!(cut("[r] ", 8, &[b"a\xff", b"b\nc\n"]), vec![b"[r] a\xffb\n".to_vec(), b"[r] c\n".to_vec()]);
        // A line of 20 bytes with a limit of 8: three pieces, each prefixed.
        let long = [b'x'; 20];
        assert_eq!(
            cut("[r] ", 8, &[&long, b"\n"]),
            vec![b"[r] xxxxxxxx\n".to_vec(), b"[r] xxxxxxxx\n".to_vec(), b"[r] xxxx\n".to_vec()]
        );
        // A newline right after a full piece ends that line: no empty record.
        assert_eq!(cut("[r] ", 4, &[b"abcd\nef"]), vec![b"[r] abcd\n".to_vec(), b"[r] ef\n".to_vec()]);
        // Without a prefix the pieces are the bytes unchanged.
        let joined: Vec<u8> = cut("", 8, &[&long, b"\nend"]).concat();
        assert_eq!(joined, [&long[..], b"\nend\n"].concat());
    }
}
