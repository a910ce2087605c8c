//! `HcclCommRegister` and `HcclCommDeregister`: a communicator's table of registered ranges.
//! A range must lie inside one allocation of the communicator's device; a handle is valid
//! on the communicator that issued it, once; destroying the communicator drops its table.

use super::*;

/// One communicator's registrations: handle -> (address, bytes).
#[derive(Debug, Default)]
pub(crate) struct Registry {
    next: u64,
    ranges: HashMap<u64, (usize, usize)>,
}

/// Registrations alive in this process, over every communicator.
static LIVE: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

impl Registry {
    /// The communicator is destroyed: its registrations go with it.
    pub(crate) fn clear(&mut self) {
        LIVE.fetch_sub(self.ranges.len() as i64, Ordering::AcqRel);
        self.ranges.clear();
    }
}

/// Whether `[addr, addr + bytes)` lies inside one allocation of device `dev`.
fn inside_allocation(dev: i32, addr: usize, bytes: usize) -> bool {
    let a = allocs().lock().unwrap_or_else(|e| e.into_inner());
    a.iter().any(|(&base, &(size, d))| d == dev && addr >= base && addr.saturating_add(bytes) <= base + size)
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommRegister(
    c: *mut c_void,
    addr: *mut c_void,
    size: u64,
    handle: *mut *mut c_void,
    flag: u32,
) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    if handle.is_null() || addr.is_null() {
        set_error("HcclCommRegister: null address or handle".into());
        return E_PTR;
    }
    if let Some(code) = injected("HcclCommRegister", cm.rank as i64) {
        return code;
    }
    if flag != 0 || size == 0 {
        set_error(format!("HcclCommRegister: flag {flag} (reserved, must be 0) or size {size} (must be > 0)"));
        return E_PARA;
    }
    if !inside_allocation(cm.device, addr as usize, size as usize) {
        set_error(format!(
            "HcclCommRegister: {size} bytes at {addr:p} are not device memory of device {} (aclrtMalloc)",
            cm.device
        ));
        return E_PARA;
    }
    let mut r = cm.regs.lock().unwrap_or_else(|e| e.into_inner());
    r.next += 1;
    let h = r.next;
    r.ranges.insert(h, (addr as usize, size as usize));
    LIVE.fetch_add(1, Ordering::AcqRel);
    *handle = h as usize as *mut c_void;
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommDeregister(c: *mut c_void, handle: *mut c_void) -> i32 {
    let Some(cm) = comm(c) else { return E_PTR };
    if let Some(code) = injected("HcclCommDeregister", cm.rank as i64) {
        return code;
    }
    let mut r = cm.regs.lock().unwrap_or_else(|e| e.into_inner());
    if r.ranges.remove(&(handle as usize as u64)).is_none() {
        set_error(format!("HcclCommDeregister: {handle:p} is not a registration of this communicator"));
        return E_PARA;
    }
    LIVE.fetch_sub(1, Ordering::AcqRel);
    SUCCESS
}

/// Registrations alive in this process, over every communicator (for tests: a buffer
/// dropped without its deregistration shows here).
#[no_mangle]
pub extern "C" fn anyccl_standin_registrations() -> i64 {
    LIVE.load(Ordering::Acquire)
}
