//! Sub-groups where the library has no `HcclCreateSubCommConfig` (the stand-in answers
//! `HCCL_E_NOT_SUPPORT` under `ANYCCL_STANDIN_NO_SUBCOMM=1`): the members exchange a fresh
//! root info through the store, and the new groups work.

use anyccl_core::{Backend, CommConfig, Communicator, DType, GroupSpec, MemoryStore, ReduceOp, Role, Store};
use anyccl_hccl::Hccl;
use std::sync::Arc;
use std::time::Duration;

mod hccl {
    pub mod split {
        use super::super::*;

        #[test]
        fn without_sub_comm_support_members_exchange_a_root_info() {
            std::env::set_var("ANYCCL_HCCL_LIBRARY_DIR", anyccl_hccl_standin::library_dir());
            std::env::set_var("ANYCCL_STANDIN_NO_SUBCOMM", "1");
            let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
            let handles: Vec<_> = (0..4usize)
                .map(|rank| {
                    let store = store.clone();
                    std::thread::spawn(move || -> Result<Vec<f32>, String> {
                        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                        let platform = Hccl.platform(rank).map_err(|e| e.to_string())?;
                        let config = CommConfig {
                            op_timeout: Duration::from_secs(20),
                            init_timeout: Duration::from_secs(20),
                            ..CommConfig::default()
                        };
                        let world = GroupSpec::new("world", (0..4).collect(), "test", Role::World);
                        let w = rt
                            .block_on(Communicator::connect(&Hccl, world, rank, store, platform.device(), config))
                            .map_err(|e| e.to_string())?;
                        // Even ranks and odd ranks, each a group of two.
                        let members: Vec<usize> = (0..4).filter(|r| r % 2 == rank % 2).collect();
                        let spec = GroupSpec::new(format!("half{}", rank % 2), members, "test", Role::Data);
                        let sub = rt.block_on(w.split(Some(spec))).map_err(|e| e.to_string())?.ok_or("no group")?;
                        let mut m = platform.alloc(DType::F32, 4).map_err(|e| e.to_string())?;
                        let v: Vec<u8> = (0..4).flat_map(|i| ((rank * 10 + i) as f32).to_le_bytes()).collect();
                        platform.copy_from_host(m.as_mut(), &v).map_err(|e| e.to_string())?;
                        let mut w8 = sub.all_reduce(None, m.view_mut(), ReduceOp::Sum).map_err(|e| e.to_string())?;
                        w8.wait(Duration::from_secs(20)).map_err(|e| e.to_string())?;
                        drop(w8);
                        let mut out = vec![0u8; 16];
                        platform.copy_to_host(m.as_ref(), &mut out).map_err(|e| e.to_string())?;
                        rt.block_on(sub.shutdown()).map_err(|e| e.to_string())?;
                        rt.block_on(w.shutdown()).map_err(|e| e.to_string())?;
                        Ok(out.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
                    })
                })
                .collect();
            for (rank, h) in handles.into_iter().enumerate() {
                let got = h.join().unwrap().unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                let peer = if rank % 2 == 0 { [0, 2] } else { [1, 3] };
                let want: Vec<f32> = (0..4).map(|i| peer.iter().map(|p| (p * 10 + i) as f32).sum()).collect();
                assert_eq!(got, want, "rank {rank}");
            }
        }
    }
}
