//! Bad input: malformed settings, sizes and flags are errors naming the variable or flag,
//! before any communication starts.

#[allow(clippy::wildcard_imports)]
use super::*;

pub(super) fn huge_timeouts_are_errors() -> Outcome {
    for var in ["ANYCCL_TIMEOUT_S", "ANYCCL_INIT_TIMEOUT_S"] {
        let out = Command::new(bin("anyccl-demo"))
            .env("ANYCCL_BACKEND", "cpu")
            .env(var, "1e19")
            .env("RANK", "0")
            .env("WORLD_SIZE", "1")
            .env("MASTER_PORT", "0")
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(out.status.code() == Some(1) && err.contains(var), || format!("{var}=1e19: {:?} {err}", out.status))?;
    }
    // An environment error on rank 1 names rank 1.
    let out = Command::new(bin("anyccl-demo"))
        .env("ANYCCL_TIMEOUT_S", "soon")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    check(err.contains("on rank 1"), || format!("the error does not name rank 1: {err}"))?;
    Ok(())
}

/// A malformed CPU-backend setting fails the connect on every rank, naming the variable and
/// the rank, instead of being ignored.
pub(super) fn malformed_cpu_settings() -> Outcome {
    // A value that is not UTF-8 is malformed too, not taken for unset.
    let lots = OsStr::new("lots");
    let not_utf8 = OsStr::from_bytes(b"64\xffK");
    for (var, value) in [
        ("ANYCCL_CPU_ROUND", lots),
        ("ANYCCL_CPU_SPIN_US", lots),
        ("ANYCCL_CPU_ALLTOALL_DIRECT_MAX", lots),
        ("ANYCCL_CPU_ALLGATHER_DIRECT_MAX", lots),
        ("ANYCCL_CPU_HUGE_PAGES", lots),
        ("ANYCCL_CPU_HUGE_PAGES_MIN", lots),
        ("ANYCCL_CPU_STREAM_MIN", not_utf8),
        ("ANYCCL_CPU_HUGE_PAGES_MIN", not_utf8),
    ] {
        let out = launcher(2, &[bin("anyccl-bench"), "all_reduce", "-b", "8", "-e", "8", "-n", "1"])
            .env(var, value)
            .env("ANYCCL_INIT_TIMEOUT_S", "20")
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        // The error shows the value as Rust debug-prints it: "lots", "64\xFFK".
        check(!out.status.success() && err.contains(&format!("{var}={value:?}")) && err.contains("on rank 1"), || {
            format!("{var}={value:?}: {:?} {err}", out.status)
        })?;
    }
    Ok(())
}

pub(super) fn unresolvable_master_addr() -> Outcome {
    let t = Instant::now();
    let out = Command::new(bin("anyccl-demo"))
        .env("ANYCCL_BACKEND", "cpu")
        .env("MASTER_ADDR", "no-such-host.invalid")
        .env("MASTER_PORT", "29599")
        .env("RANK", "1")
        .env("WORLD_SIZE", "2")
        .env("ANYCCL_INIT_TIMEOUT_S", "2")
        .output()?;
    let took = t.elapsed();
    let err = String::from_utf8_lossy(&out.stderr);
    check(out.status.code() == Some(1) && err.contains("no-such-host.invalid"), || format!("{:?} {err}", out.status))?;
    check(took < Duration::from_secs(5), || format!("took {took:?} with ANYCCL_INIT_TIMEOUT_S=2"))?;
    println!("    MASTER_ADDR that does not resolve, ANYCCL_INIT_TIMEOUT_S=2: error after {took:.2?}");
    Ok(())
}

pub(super) fn bench_bad_sizes() -> Outcome {
    let cases: [(&[&str], &str); 6] = [
        (&["-b", "1G", "-e", "8"], "-b"),
        (&["-b", "1", "-e", "2"], "-e"),
        (&["-b", "17179869184G"], "-b"),
        (&["-e", "99999999999999999999"], "-e"),
        (&["-n", "0"], "-n"),
        (&["-c", "7"], "-c"),
    ];
    for (args, flag) in cases {
        let out =
            Command::new(bin("anyccl-bench")).arg("all_reduce").args(args).env("ANYCCL_BACKEND", "cpu").output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(!out.status.success() && err.contains(&format!("`{flag}`")), || {
            format!("{args:?}: {:?}\n{}{err}", out.status, String::from_utf8_lossy(&out.stdout))
        })?;
    }
    Ok(())
}

pub(super) fn recover_bad_arguments() -> Outcome {
    let cases: [(&[&str], &str); 6] = [
        (&["demo", "--ckpt-every", "0"], "--ckpt-every"),
        (&["demo", "--steps", "0"], "--steps"),
        (&["demo", "--width", "0"], "--width"),
        (&["demo", "--lr", "nan"], "--lr"),
        (&["demo", "--resume-from", "/tmp"], "--resume-from"),
        (&["demo", "--steps", "10", "--crash-at", "12"], "--crash-at"),
    ];
    for (args, flag) in cases {
        let out = Command::new(bin("anyccl-recover")).args(args).env("ANYCCL_BACKEND", "cpu").output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        check(!out.status.success() && out.status.code() != Some(101) && err.contains(flag), || {
            format!("{args:?}: {:?} {err}", out.status)
        })?;
    }
    Ok(())
}
