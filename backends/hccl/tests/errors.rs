//! Every HCCL code the stand-in can inject reaches the caller as the public error the
//! backend maps it to, naming the operation, the rank and the group, with HCCL's own
//! error as the source of `Backend` errors.

use anyccl_core::{Backend, CommConfig, Communicator, DType, Error, GroupSpec, MemoryStore, ReduceOp, Role, Store};
use anyccl_device::LibError;
use anyccl_hccl::Hccl;
use std::sync::Arc;
use std::time::Duration;

type Inject = unsafe extern "C" fn(*const std::ffi::c_char, i32, i32, u32) -> i32;

fn inject(lib: &libloading::Library, call: &str, code: i32) {
    let c = std::ffi::CString::new(call).unwrap();
    // SAFETY: the stand-in's own entry point, with its C signature.
    let f: libloading::Symbol<Inject> = unsafe { lib.get(b"anyccl_standin_inject") }.unwrap();
    // SAFETY: a valid C string; rank 0, once.
    assert_eq!(unsafe { f(c.as_ptr(), code, 0, 1) }, 0);
}

fn connect(rt: &tokio::runtime::Runtime, name: &str) -> Communicator {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let platform = Hccl.platform(0).unwrap();
    let config = CommConfig {
        op_timeout: Duration::from_secs(20),
        init_timeout: Duration::from_secs(20),
        ..CommConfig::default()
    };
    rt.block_on(Communicator::connect(
        &Hccl,
        GroupSpec::new(name, vec![0], "test", Role::Data),
        0,
        store,
        platform.device(),
        config,
    ))
    .unwrap()
}

mod hccl {
    pub mod errors {
        use super::super::*;

        #[test]
        fn injected_codes_reach_the_caller() {
            std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let platform = Hccl.platform(0).unwrap();
            let path = anyccl_hccl_standin::library_dir().join("libhccl.so");
            // SAFETY: the stand-in the backend loaded: the same object, its initialisers ran.
            let lib = unsafe { libloading::Library::new(&path) }.unwrap();
            // (code, name, public error kind)
            let cases = [
                (1, "HCCL_E_PARA", "Backend"),
                (2, "HCCL_E_PTR", "Backend"),
                (3, "HCCL_E_MEMORY", "Backend"),
                (4, "HCCL_E_INTERNAL", "Backend"),
                (5, "HCCL_E_NOT_SUPPORT", "Backend"),
                (7, "HCCL_E_UNAVAIL", "Backend"),
                (9, "HCCL_E_TIMEOUT", "Timeout"),
                (11, "HCCL_E_TCP_CONNECT", "PeerFailed"),
                (13, "HCCL_E_TCP_TRANSFER", "PeerFailed"),
                (19, "HCCL_E_NETWORK", "PeerFailed"),
                (20, "HCCL_E_AGAIN", "Backend"),
                (21, "HCCL_E_REMOTE", "PeerFailed"),
                (22, "HCCL_E_SUSPENDING", "Backend"),
                (24, "HCCL_E_OOM", "Backend"),
            ];
            for (code, name, kind) in cases {
                let group = format!("inject-{code}");
                let comm = connect(&rt, &group);
                let mut buf = platform.alloc(DType::F32, 16).unwrap();
                inject(&lib, "HcclAllReduce", code);
                let err = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).map(|_| ()).unwrap_err();
                let text = err.to_string();
                assert_eq!(err.kind(), kind, "code {code}: {text}");
                assert!(text.contains("all_reduce"), "code {code} does not name the op: {text}");
                assert!(text.contains(&format!("group '{group}'")), "code {code} does not name the group: {text}");
                assert!(text.contains("rank 0"), "code {code} does not name the rank: {text}");
                assert!(text.contains(name), "code {code} does not carry HCCL's name {name}: {text}");
                if let Error::Timeout { after, .. } = &err {
                    assert!(!after.is_zero(), "code {code}: a timeout that waited no time: {text}");
                }
                if let Error::Backend { code: c, source, .. } = &err {
                    assert_eq!(*c, code as i64);
                    let lib_err = source.as_ref().and_then(|s| s.downcast_ref::<LibError>());
                    assert!(lib_err.is_some_and(|e| e.code == code as i64), "code {code}: no HCCL source");
                }
                // The communicator failed with it: later calls say so instead of running.
                let again = comm.all_reduce(None, buf.view_mut(), ReduceOp::Sum).map(|_| ()).unwrap_err();
                assert_eq!(again.kind(), "Aborted", "after code {code}: {again}");
            }
            // A timeout HCCL reports while the communicator is made says how long connect
            // waited (it read "connect timed out after 0ns").
            inject(&lib, "HcclCommInitRootInfoConfig", 9);
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let spec = GroupSpec::new("inject-init", vec![0], "test", Role::Data);
            let config = CommConfig { init_timeout: Duration::from_secs(20), ..CommConfig::default() };
            let err = rt
                .block_on(Communicator::connect(&Hccl, spec, 0, store, platform.device(), config))
                .map(|_| ())
                .unwrap_err();
            let Error::Timeout { after, .. } = &err else { panic!("not a timeout: {err}") };
            assert!(!after.is_zero() && !err.to_string().contains("after 0ns"), "{err}");
            assert!(err.to_string().contains("HCCL_E_TIMEOUT") && err.to_string().contains("inject-init"), "{err}");
            // An asynchronous error reported by HcclGetCommAsyncError.
            let comm = connect(&rt, "inject-async");
            inject(&lib, "HcclGetCommAsyncError", 21);
            let err = rt.block_on(comm.health()).unwrap_err();
            assert_eq!(err.kind(), "PeerFailed", "{err}");
            assert!(err.to_string().contains("inject-async") && err.to_string().contains("HCCL_E_REMOTE"), "{err}");
        }
    }
}

mod hccl_registration {
    use super::*;

    fn live(lib: &libloading::Library) -> i64 {
        // SAFETY: the stand-in's own entry point, with its C signature.
        let f: libloading::Symbol<extern "C" fn() -> i64> =
            unsafe { lib.get(b"anyccl_standin_registrations") }.unwrap();
        f()
    }

    /// Registrations reach HCCL and are undone when dropped or given back; HCCL's refusals
    /// come back as errors naming the call, the rank and the group, and a refused
    /// deregistration neither panics nor leaks the memory.
    #[test]
    fn registrations_reach_hccl_and_are_undone() {
        std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let platform = Hccl.platform(0).unwrap();
        let path = anyccl_hccl_standin::library_dir().join("libhccl.so");
        // SAFETY: the stand-in the backend loaded: the same object, its initialisers ran.
        let lib = unsafe { libloading::Library::new(&path) }.unwrap();
        let comm = connect(&rt, "registration");
        assert!(comm.capabilities().buffer_registration);
        let base = live(&lib);
        let regs: Vec<_> =
            (0..3).map(|_| comm.register(platform.alloc_registrable(DType::F32, 256).unwrap()).unwrap()).collect();
        assert!(regs.iter().all(|r| r.is_registered()));
        assert_eq!(live(&lib), base + 3);
        let mut regs = regs.into_iter();
        let first = regs.next().unwrap().into_inner().unwrap();
        assert_eq!(first.count(), 256);
        assert_eq!(live(&lib), base + 2);
        drop(regs);
        assert_eq!(live(&lib), base);

        inject(&lib, "HcclCommRegister", 1);
        let e = comm.register(platform.alloc_registrable(DType::F32, 16).unwrap()).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, Error::Backend { .. }), "{e:?}");
        assert!(text.contains("register") && text.contains("rank 0") && text.contains("'registration'"), "{text}");
        let Error::Backend { source, .. } = &e else { unreachable!() };
        let lib_err = source.as_ref().and_then(|s| s.downcast_ref::<LibError>());
        assert!(lib_err.is_some_and(|l| l.call == "HcclCommRegister" && l.code == 1), "{e:?}");
        assert_eq!(live(&lib), base);

        let reg = comm.register(platform.alloc_registrable(DType::F32, 16).unwrap()).unwrap();
        inject(&lib, "HcclCommDeregister", 1);
        assert!(reg.into_inner().is_err());
        // Refused once: the registration stays with the communicator until it goes.
        assert_eq!(live(&lib), base + 1);
        rt.block_on(comm.shutdown()).unwrap();
        assert_eq!(live(&lib), base);
    }
}
