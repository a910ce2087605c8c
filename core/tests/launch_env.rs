//! The launcher's variables and the store's, read through the checked parser: a value that
//! does not parse is an error naming the variable, never a silent default (MASTER_PORT=0
//! waited 60 s and then said "connection refused"; ANYCCL_STORE_BIND=bogus fell back to
//! loopback). Its own test binary: it sets the process's environment, one case after another.

use anyccl_core::LaunchEnv;

fn error_of(vars: &[(&str, &str)]) -> String {
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let got = LaunchEnv::from_env().and_then(|env| rt.block_on(async { env.connect_store().await.map(|_| ()) }));
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    got.err().map(|e| e.to_string()).unwrap_or_default()
}

#[test]
fn malformed_launcher_and_store_variables_are_errors() {
    for (vars, want) in [
        (vec![("MASTER_PORT", "0")], "MASTER_PORT=\"0\" is not a port number from 1 to 65535"),
        (vec![("MASTER_PORT", "70000")], "MASTER_PORT=\"70000\""),
        (
            vec![("MASTER_PORT", "29511"), ("ANYCCL_STORE_BIND", "bogus")],
            "ANYCCL_STORE_BIND=\"bogus\" is not an IP address",
        ),
        (
            vec![("MASTER_PORT", "29512"), ("ANYCCL_STORE_EXTERNAL", "yes")],
            "ANYCCL_STORE_EXTERNAL=\"yes\" is not 0 or 1",
        ),
        (vec![("RANK", "x")], "RANK=\"x\" is not a non-negative integer"),
    ] {
        let t = std::time::Instant::now();
        let e = error_of(&vars);
        assert!(e.contains(want), "{vars:?}: {e:?}");
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "{vars:?} took {:?}", t.elapsed());
    }
}
