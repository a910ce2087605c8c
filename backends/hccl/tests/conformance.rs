//! The conformance suite on the HCCL backend, against the workspace's stand-in library
//! unless `ANYCCL_HCCL_LIBRARY_DIR` (or a CANN installation) says otherwise. With no HCCL
//! anywhere every case is reported ignored with the probe's reason. The stream cases get
//! ACL engine streams (`engine`).
mod engine;

fn main() -> std::process::ExitCode {
    if std::env::var_os("ANYCCL_HCCL_LIBRARY_DIR").is_none() && std::env::var_os("ASCEND_HOME_PATH").is_none() {
        // Set before any other thread of this test binary starts.
        std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
    }
    anyccl_conformance::cases::streams::set_engine(engine::open);
    anyccl_conformance::run_libtest(std::sync::Arc::new(anyccl_hccl::Hccl))
}
