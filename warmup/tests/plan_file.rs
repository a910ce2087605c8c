//! The saved plan file: round trip, and every way a file can be wrong, each a message that
//! names the file.

use anyccl_core::{DType, Role};
use anyccl_warmup::{GroupPlan, Kind, MemSource, PlanFile, PlanIdentity, Step, StepCost};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn dir(case: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("anyccl-plan-file-{case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn identity() -> PlanIdentity {
    PlanIdentity { job: "job-a".into(), step: 10, rank: 1, world_size: 4, layout: "dp2 pp2".into() }
}

fn file() -> PlanFile {
    let steps = vec![
        Step { kind: Kind::AllReduce, dtype: DType::F32, count: 4096, pairs: vec![] },
        Step { kind: Kind::SendRecv, dtype: DType::F32, count: 2048, pairs: vec![(0, 1)] },
    ];
    PlanFile {
        identity: identity(),
        plans: vec![GroupPlan {
            group: "pp-replica0".into(),
            role: Role::Pipeline,
            owner: "trainer".into(),
            size: 2,
            steps,
            merge: false,
        }],
        cold_step: Some(StepCost {
            groups: vec![("pp-replica0".into(), 300 << 20)],
            total: 300 << 20,
            source: MemSource::Communicator,
        }),
        path: None,
    }
}

mod warmup {
    pub mod plan_file {
        use super::super::*;

        #[test]
        fn round_trip() {
            let d = dir("round");
            let path = d.join("ckpt/step000010/warmup-plan-rank1.json");
            let f = file();
            f.write(&path).expect("write");
            let back = PlanFile::load(&path, &identity()).expect("load");
            assert_eq!(back.path.as_deref(), Some(path.as_path()));
            assert_eq!(PlanFile { path: None, ..back.clone() }, f);
            assert_eq!(back.plans[0].fingerprint(), f.plans[0].fingerprint());
            // Written again over itself: still one file, no temporary left behind.
            f.write(&path).expect("rewrite");
            let names: Vec<_> =
                std::fs::read_dir(path.parent().unwrap()).unwrap().flatten().map(|e| e.file_name()).collect();
            assert_eq!(names.len(), 1, "{names:?}");
            let _ = std::fs::remove_dir_all(&d);
        }

        #[test]
        fn missing_names_the_file() {
            let d = dir("missing");
            let path = d.join("warmup-plan-rank0.json");
            let e = PlanFile::read(&path).unwrap_err();
            assert!(e.contains(&path.display().to_string()) && e.contains("missing"), "{e}");
        }

        #[test]
        fn corrupt_byte_is_a_checksum_mismatch() {
            let d = dir("corrupt");
            let path = d.join("p.json");
            file().write(&path).expect("write");
            let mut raw = std::fs::read(&path).unwrap();
            let at = raw.len() - 20;
            raw[at] ^= 0x01;
            std::fs::write(&path, &raw).unwrap();
            let e = PlanFile::read(&path).unwrap_err();
            assert!(e.contains(&path.display().to_string()) && e.contains("checksum"), "{e}");
            let _ = std::fs::remove_dir_all(&d);
        }

        #[test]
        fn truncated_garbage_and_other_formats_are_refused() {
            let d = dir("garbage");
            let path = d.join("p.json");
            file().write(&path).expect("write");
            let good = std::fs::read(&path).unwrap();
            let cases: Vec<(Vec<u8>, &str)> = vec![
                (good[..good.len() / 2].to_vec(), "checksum"),
                (Vec::new(), "no header"),
                (b"\x00\x01\x02\n{}".to_vec(), "not a plan file"),
                (String::from_utf8_lossy(&good).replacen(" 1 sha256", " 9 sha256", 1).into_bytes(), "format"),
                (String::from_utf8_lossy(&good).replacen("sha256=", "md5=", 1).into_bytes(), "no checksum"),
            ];
            for (bytes, want) in cases {
                std::fs::write(&path, &bytes).unwrap();
                let e = PlanFile::read(&path).unwrap_err();
                assert!(e.contains(&path.display().to_string()) && e.contains(want), "want '{want}': {e}");
            }
            let _ = std::fs::remove_dir_all(&d);
        }

        /// `read` of `path` on a thread, so a read that blocks or never ends fails the test
        /// after `limit` instead of hanging it.
        fn read_within(path: &std::path::Path, limit: Duration) -> Result<PlanFile, String> {
            let (tx, rx) = std::sync::mpsc::channel();
            let p = path.to_path_buf();
            std::thread::spawn(move || {
                let _ = tx.send(PlanFile::read(&p));
            });
            match rx.recv_timeout(limit) {
                Ok(r) => r,
                Err(_) => panic!("reading {} did not return within {limit:?}", path.display()),
            }
        }

        #[test]
        fn a_link_to_dev_zero_is_refused_at_once() {
            let d = dir("dev-zero");
            std::fs::create_dir_all(&d).unwrap();
            let path = d.join("warmup-plan-rank0.json");
            std::os::unix::fs::symlink("/dev/zero", &path).unwrap();
            let t = Instant::now();
            let e = read_within(&path, Duration::from_secs(10)).unwrap_err();
            assert!(e.contains(&path.display().to_string()) && e.contains("not a regular file"), "{e}");
            assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
            let _ = std::fs::remove_dir_all(&d);
        }

        #[test]
        fn a_fifo_is_refused_without_waiting_for_a_writer() {
            let d = dir("fifo");
            std::fs::create_dir_all(&d).unwrap();
            let path = d.join("warmup-plan-rank0.json");
            let made = std::process::Command::new("mkfifo").arg(&path).status().expect("run mkfifo");
            assert!(made.success(), "mkfifo {}: {made}", path.display());
            let t = Instant::now();
            let e = read_within(&path, Duration::from_secs(10)).unwrap_err();
            assert!(e.contains(&path.display().to_string()) && e.contains("FIFO"), "{e}");
            assert!(t.elapsed() < Duration::from_secs(2), "took {:?}", t.elapsed());
            let _ = std::fs::remove_dir_all(&d);
        }

        #[test]
        fn a_file_above_the_cap_is_refused_naming_both_sizes() {
            let d = dir("cap");
            let path = d.join("p.json");
            file().write(&path).expect("write");
            let len = std::fs::metadata(&path).unwrap().len();
            assert!(PlanFile::read_at_most(&path, len).is_ok());
            let e = PlanFile::read_at_most(&path, len - 1).unwrap_err();
            for part in [path.display().to_string(), format!("{len} bytes"), format!("{}", len - 1)] {
                assert!(e.contains(&part), "'{part}' missing: {e}");
            }
            let _ = std::fs::remove_dir_all(&d);
        }

        #[test]
        fn steps_that_cannot_run_are_found() {
            assert_eq!(file().plans[0].check(), Ok(()));
            let bad: Vec<(Step, &str)> = vec![
                (Step { kind: Kind::SendRecv, dtype: DType::F32, count: 4, pairs: vec![(0, 2)] }, "pair (0, 2)"),
                (Step { kind: Kind::SendRecv, dtype: DType::F32, count: 4, pairs: vec![(1, 1)] }, "pair (1, 1)"),
                (Step { kind: Kind::SendRecv, dtype: DType::F32, count: 4, pairs: vec![] }, "no pairs"),
                (Step { kind: Kind::AllReduce, dtype: DType::F32, count: 0, pairs: vec![] }, "count 0"),
                (Step { kind: Kind::AllReduce, dtype: DType::F32, count: usize::MAX / 2, pairs: vec![] }, "1 TiB"),
                (Step { kind: Kind::AllGather, dtype: DType::F64, count: 1 << 38, pairs: vec![] }, "1 TiB"),
                (Step { kind: Kind::AllToAll, dtype: DType::F32, count: 3, pairs: vec![] }, "multiple"),
                (Step { kind: Kind::AllReduce, dtype: DType::F32, count: 4, pairs: vec![(0, 1)] }, "pairs on"),
            ];
            for (step, want) in bad {
                let mut p = file().plans[0].clone();
                p.steps.push(step);
                let e = p.check().unwrap_err();
                assert!(e.contains(want) && e.contains("pp-replica0"), "want '{want}': {e}");
            }
        }

        #[test]
        fn another_checkpoints_plan_is_refused() {
            let d = dir("identity");
            let path = d.join("p.json");
            file().write(&path).expect("write");
            let want = PlanIdentity { job: "job-b".into(), step: 15, layout: "dp4 pp1".into(), ..identity() };
            let e = PlanFile::load(&path, &want).unwrap_err();
            for part in ["job 'job-a'", "step 10", "layout 'dp2 pp2'", &path.display().to_string()] {
                assert!(e.contains(part), "'{part}' missing: {e}");
            }
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}
