//! Graph capture (`aclmdlRICapture*`, `aclmdlRIExecuteAsync`): between a capture's begin and
//! end, work put on the capturing stream, or on a stream that joined the capture by waiting
//! for an event recorded in it, is recorded instead of run. A replay issues the recorded
//! work on its stream in the order it was recorded: an order every dependency between the
//! streams agrees with (a wait is issued after the record it waits for), run on one stream.
//! A recorded collective takes its communicator's next sequence number when a replay is
//! issued, as a call issued then would. Ending fails, as CUDA's does, when a stream that
//! joined the capture has work no other member waited for (it was not joined back), and
//! when a stream of the capture was synchronized (the capture is invalidated).

use super::*;

/// What a recorded task does; the argument is its sequence number when numbered.
pub(crate) type Run = Arc<dyn Fn(u64) + Send + Sync>;

/// A recorded task: `numbered` is the communicator whose next sequence number each issue
/// of a collective takes (none for copies, waits and point-to-point calls).
#[derive(Clone)]
pub(crate) struct Node {
    pub(crate) numbered: Option<Arc<Comm>>,
    pub(crate) run: Run,
}

impl Node {
    /// Put the task on `s` to run once, numbered now.
    pub(crate) fn issue(&self, s: &StreamObj) -> bool {
        let seq = self.numbered.as_ref().map_or(0, |c| c.seq.fetch_add(1, Ordering::AcqRel));
        let run = self.run.clone();
        s.submit(Box::new(move || run(seq)))
    }
}

#[derive(Default)]
struct Member {
    /// Tasks this stream recorded.
    added: u64,
    /// How many of them another member waited for.
    joined: u64,
}

#[derive(Default)]
struct State {
    nodes: Vec<Node>,
    members: HashMap<usize, Member>,
    invalid: Option<String>,
    /// Set by the end, under this lock: a task put after it is not recorded.
    ended: bool,
}

/// A capture under way, shared by the streams in it.
pub(crate) struct Capture {
    origin: usize,
    state: Mutex<State>,
}

impl Capture {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
    pub(crate) fn ended(&self) -> bool {
        self.state().ended
    }
    pub(crate) fn invalid(&self) -> bool {
        self.state().invalid.is_some()
    }
    /// Record `node` as stream `s`'s next task; `Err(node)` once the capture has ended.
    pub(crate) fn record(&self, s: usize, node: Node) -> Result<(), Node> {
        let mut st = self.state();
        if st.ended {
            return Err(node);
        }
        st.nodes.push(node);
        st.members.entry(s).or_default().added += 1;
        Ok(())
    }
    /// How many tasks stream `s` has recorded (an event recorded now stands behind them).
    pub(crate) fn position(&self, s: usize) -> u64 {
        self.state().members.get(&s).map_or(0, |m| m.added)
    }
    /// A member waited for stream `s`'s first `pos` tasks.
    pub(crate) fn join(&self, s: usize, pos: u64) {
        if let Some(m) = self.state().members.get_mut(&s) {
            m.joined = m.joined.max(pos);
        }
    }
    /// Stream `s` joins.
    pub(crate) fn add(&self, s: usize) {
        self.state().members.entry(s).or_default();
    }
    pub(crate) fn invalidate(&self, why: String) {
        let mut st = self.state();
        if st.invalid.is_none() {
            st.invalid = Some(why);
        }
    }
}

/// An ended capture, replayable.
struct Model {
    nodes: Vec<Node>,
}

/// `mode`: 0 global, 1 thread-local, 2 relaxed (the stand-in treats them alike).
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureBegin(stream: *mut c_void, mode: i32) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    if !(0..=2).contains(&mode) {
        set_error(format!("aclmdlRICaptureBegin: capture mode {mode} is not one of 0, 1, 2"));
        return ACL_ERROR_INVALID_PARAM;
    }
    let mut c = s.capture.lock().unwrap_or_else(|e| e.into_inner());
    if c.as_ref().is_some_and(|c| !c.ended()) {
        set_error("aclmdlRICaptureBegin: the stream is capturing already".into());
        return ACL_ERROR_INVALID_PARAM;
    }
    let key = s.key();
    let cap = Capture { origin: key, state: Mutex::new(State::default()) };
    cap.add(key);
    *c = Some(Arc::new(cap));
    ACL_SUCCESS
}

/// `status`: 0 none, 1 active, 2 invalidated; `model` (may be null): null (the stand-in
/// makes the model at the end).
#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureGetInfo(stream: *mut c_void, status: *mut i32, model: *mut *mut c_void) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    if status.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    *status = match s.capturing() {
        None => 0,
        Some(c) if c.invalid() => 2,
        Some(_) => 1,
    };
    if !model.is_null() {
        // The model exists once the capture ends (`aclmdlRICaptureEnd`): none to hand out.
        *model = std::ptr::null_mut();
    }
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclmdlRICaptureEnd(stream: *mut c_void, model: *mut *mut c_void) -> i32 {
    let Some(s) = stream_ref(stream) else { return ACL_ERROR_INVALID_PARAM };
    if model.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    let Some(cap) = s.capturing() else {
        set_error("aclmdlRICaptureEnd: the stream is not capturing".into());
        return ACL_ERROR_INVALID_PARAM;
    };
    if cap.origin != s.key() {
        set_error("aclmdlRICaptureEnd: not the stream the capture began on".into());
        return ACL_ERROR_INVALID_PARAM;
    }
    // Every stream of the capture leaves it, whatever the outcome.
    let st = {
        let mut st = cap.state();
        // Taken whole, leaving it ended: a task put from now on is not recorded.
        std::mem::replace(&mut *st, State { ended: true, ..State::default() })
    };
    if let Some(why) = st.invalid {
        set_error(format!("aclmdlRICaptureEnd: the capture was invalidated: {why}"));
        return ACL_ERROR_INVALID_PARAM;
    }
    let unjoined = st.members.iter().filter(|(k, m)| **k != cap.origin && m.joined < m.added).count();
    if unjoined > 0 {
        set_error(format!(
            "aclmdlRICaptureEnd: {unjoined} stream(s) joined the capture and were not joined back \
             (their last work is waited for by no other stream of it)"
        ));
        return ACL_ERROR_INVALID_PARAM;
    }
    *model = Box::into_raw(Box::new(Model { nodes: st.nodes })) as *mut c_void;
    ACL_SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn aclmdlRIExecuteAsync(model: *mut c_void, stream: *mut c_void) -> i32 {
    let (Some(m), Some(s)) = ((model as *const Model).as_ref(), stream_ref(stream)) else {
        return ACL_ERROR_INVALID_PARAM;
    };
    if s.capturing().is_some() {
        set_error("aclmdlRIExecuteAsync: the stream is capturing".into());
        return ACL_ERROR_INVALID_PARAM;
    }
    for n in &m.nodes {
        if !n.issue(s) {
            return ACL_ERROR_INVALID_PARAM;
        }
    }
    ACL_SUCCESS
}

/// Replays already issued keep what they run.
#[no_mangle]
pub unsafe extern "C" fn aclmdlRIDestroy(model: *mut c_void) -> i32 {
    if model.is_null() {
        return ACL_ERROR_INVALID_PARAM;
    }
    drop(Box::from_raw(model as *mut Model));
    ACL_SUCCESS
}
