//! Builds the stand-in as `libhccl.so` with the same compiler, so `cargo test` makes it
//! with no manual step (cargo builds a cdylib member only in `cargo build`, and names it
//! after the crate). `libascendcl.so` and `libhcomm.so` are links to it: one library, one
//! device-memory pool, as HCCL and ACL share one device.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=src/standin.rs");
    println!("cargo:rerun-if-changed=src/standin");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("lib");
    std::fs::create_dir_all(&out).expect("create the stand-in's folder");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let lib = out.join("libhccl.so");
    let tmp = out.join("libhccl.so.tmp");
    let status = Command::new(rustc)
        .args(["--edition=2021", "--crate-type=cdylib", "--crate-name=hccl", "-C", "opt-level=2", "-C", "panic=abort"])
        .args(["-D", "warnings", "-o"])
        .arg(&tmp)
        .arg("src/standin.rs")
        .status()
        .expect("run rustc for the stand-in");
    assert!(status.success(), "building the HCCL stand-in failed");
    std::fs::rename(&tmp, &lib).expect("move the stand-in into place");
    for alias in ["libascendcl.so", "libhcomm.so"] {
        let p = out.join(alias);
        let _ = std::fs::remove_file(&p);
        std::os::unix::fs::symlink("libhccl.so", &p).expect("link the stand-in's aliases");
    }
    println!("cargo:rustc-env=ANYCCL_HCCL_STANDIN_DIR={}", out.display());
}
