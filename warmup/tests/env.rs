//! The warmup's environment variables: a value that does not parse is an error naming the
//! variable, its value and the rank, never a setting silently left at its default.
//!
//! The tests set variables of this process, so each holds one lock while it does.

use anyccl_warmup::{PlanFile, WarmupConfig};
use std::sync::Mutex;

static ENV: Mutex<()> = Mutex::new(());

/// Run `f` with `vars` set (and this process's rank named 7), then unset them again.
fn with_env<T>(vars: &[(&str, &str)], f: impl FnOnce() -> T) -> T {
    let _held = ENV.lock().unwrap_or_else(|p| p.into_inner());
    std::env::set_var("ANYCCL_RANK", "7");
    for (k, v) in vars {
        std::env::set_var(k, v);
    }
    let out = f();
    for (k, _) in vars {
        std::env::remove_var(k);
    }
    std::env::remove_var("ANYCCL_RANK");
    out
}

fn refused(var: &str, value: &str) -> String {
    let r = with_env(&[(var, value)], || WarmupConfig::from_env(WarmupConfig::default()));
    let e = r.expect_err(&format!("{var}={value} was accepted")).to_string();
    for part in [var, &format!("{value:?}"), "rank 7"] {
        assert!(e.contains(part), "'{part}' missing: {e}");
    }
    e
}

mod warmup {
    pub mod env {
        use super::super::*;

        #[test]
        fn warmup_switch_other_than_0_or_1_is_an_error() {
            for bad in ["2", "yes please", "-1"] {
                let e = refused("ANYCCL_WARMUP", bad);
                assert!(e.contains("0 or 1"), "{e}");
            }
            let on = with_env(&[("ANYCCL_WARMUP", "1")], || WarmupConfig::from_env(WarmupConfig::default()));
            assert!(on.expect("ANYCCL_WARMUP=1").enabled);
            let off = WarmupConfig { enabled: true, ..WarmupConfig::default() };
            let off = with_env(&[("ANYCCL_WARMUP", "0")], || WarmupConfig::from_env(off));
            assert!(!off.expect("ANYCCL_WARMUP=0").enabled);
        }

        #[test]
        fn margin_that_is_not_a_number_of_mib_is_an_error() {
            for bad in ["lots", "-5", "1.5", "256M", "18446744073709551615"] {
                let e = refused("ANYCCL_WARMUP_MARGIN_MIB", bad);
                assert!(e.contains("MiB"), "{e}");
            }
            let c =
                with_env(&[("ANYCCL_WARMUP_MARGIN_MIB", "512")], || WarmupConfig::from_env(WarmupConfig::default()));
            assert_eq!(c.expect("512 MiB").memory_margin, 512 << 20);
        }

        #[test]
        fn timeout_that_is_not_seconds_is_an_error() {
            for bad in ["nan", "0", "soon"] {
                refused("ANYCCL_WARMUP_TIMEOUT_S", bad);
            }
        }

        #[test]
        fn plan_file_cap_is_a_setting_and_checked() {
            let d = std::env::temp_dir().join(format!("anyccl-plan-env-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            let path = d.join("p.json");
            std::fs::write(&path, vec![b'x'; 4096]).unwrap();
            let small = with_env(&[("ANYCCL_WARMUP_PLAN_MAX_BYTES", "1K")], || PlanFile::read(&path)).unwrap_err();
            assert!(small.contains("4096 bytes") && small.contains("1024"), "{small}");
            let bad = with_env(&[("ANYCCL_WARMUP_PLAN_MAX_BYTES", "lots")], || PlanFile::read(&path)).unwrap_err();
            for part in ["ANYCCL_WARMUP_PLAN_MAX_BYTES", "\"lots\"", "rank 7", &path.display().to_string()] {
                assert!(bad.contains(part), "'{part}' missing: {bad}");
            }
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}
