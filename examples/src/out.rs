//! The programs' own output. `println!` panics when stdout cannot be written (a full disk,
//! a closed pipe); here a line that cannot be written is counted instead, the program goes
//! on (a rank that stops on a full log would fail its peers), and [`finish`] turns lost
//! output into a failed exit that says how much was lost and why.

use std::fmt;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// One of the program's two output streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

impl Stream {
    fn index(self) -> usize {
        match self {
            Stream::Out => 0,
            Stream::Err => 1,
        }
    }
    fn name(self) -> &'static str {
        match self {
            Stream::Out => "stdout",
            Stream::Err => "stderr",
        }
    }
}

/// Bytes that could not be written, per stream.
static LOST: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];
/// The first error of each stream, as the system said it.
static FIRST: Mutex<[Option<String>; 2]> = Mutex::new([None, None]);

/// Write `bytes` to `stream` at once (the stream locked, so that lines of several threads do
/// not mix) and flush; what cannot be written is counted. Returns whether all of it was.
pub fn write(stream: Stream, bytes: &[u8]) -> bool {
    let r = match stream {
        Stream::Out => {
            let mut o = std::io::stdout().lock();
            o.write_all(bytes).and_then(|()| o.flush())
        }
        Stream::Err => std::io::stderr().lock().write_all(bytes),
    };
    match r {
        Ok(()) => true,
        Err(e) => {
            LOST[stream.index()].fetch_add(bytes.len() as u64, Ordering::Relaxed);
            let mut first = FIRST.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            first[stream.index()].get_or_insert_with(|| e.to_string());
            false
        }
    }
}

/// Write `args` and a newline to `stream` (what [`outln!`](crate::outln) and
/// [`errln!`](crate::errln) call).
pub fn line(stream: Stream, args: fmt::Arguments) {
    let mut s = args.to_string();
    s.push('\n');
    write(stream, s.as_bytes());
}

/// Write `args` as they are, with no newline added.
pub fn text(stream: Stream, args: fmt::Arguments) {
    write(stream, args.to_string().as_bytes());
}

/// What was lost, one entry per stream: "1234 bytes to stdout (No space left on device
/// (os error 28))".
pub fn lost() -> Vec<String> {
    let first = FIRST.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    [Stream::Out, Stream::Err]
        .into_iter()
        .filter_map(|s| {
            let n = LOST[s.index()].load(Ordering::Relaxed);
            let why = first[s.index()].as_deref().unwrap_or("unknown error");
            (n > 0).then(|| format!("{n} bytes to {} ({why})", s.name()))
        })
        .collect()
}

/// The program's exit: `code`, unless output was lost, in which case the loss is said on
/// whichever stream still works and a successful `code` becomes 1 (a run whose output is
/// gone did not do all it was asked to).
pub fn finish(program: &str, code: ExitCode) -> ExitCode {
    let lost = lost();
    if lost.is_empty() {
        return code;
    }
    let note = format!("{program}: output could not be written: {}\n", lost.join("; "));
    // Stderr first; where it is the stream that failed, stdout may still work.
    if !write(Stream::Err, note.as_bytes()) {
        write(Stream::Out, note.as_bytes());
    }
    if code == ExitCode::SUCCESS {
        ExitCode::from(1)
    } else {
        code
    }
}

/// `println!` that does not panic: a line to stdout, counted when it cannot be written.
#[macro_export]
macro_rules! outln {
    () => { $crate::out::line($crate::out::Stream::Out, format_args!("")) };
    ($($t:tt)*) => { $crate::out::line($crate::out::Stream::Out, format_args!($($t)*)) };
}

/// `eprintln!` that does not panic: a line to stderr, counted when it cannot be written.
#[macro_export]
macro_rules! errln {
    () => { $crate::out::line($crate::out::Stream::Err, format_args!("")) };
    ($($t:tt)*) => { $crate::out::line($crate::out::Stream::Err, format_args!($($t)*)) };
}

/// `print!` that does not panic.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => { $crate::out::text($crate::out::Stream::Out, format_args!($($t)*)) };
}
