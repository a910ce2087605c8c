//! How each operation runs at a size, in words, for a benchmark's header: the same choices
//! the algorithms make.

use super::{Kind, Tuning, OP_ALL_REDUCE, OP_ALL_TO_ALL};

/// How `op` runs on a receive buffer of `bytes` bytes (a rank's output: the whole gathered
/// buffer for all_gather, one rank's share for reduce_scatter), in words: the algorithm, the
/// message of each step and how it travels to the next rank (`route(peer, (kind, op), len,
/// exchange)`: [`Mesh::route`]; `op` is [`OP_ALL_REDUCE`] for all_reduce, [`OP_ALL_TO_ALL`]
/// for all_to_all, 0 otherwise, as only their messages go by reference over ranges of their
/// own). The same choices as the algorithms (`algo`) make, so a bench can print which path
/// each size took; `None` for an operation this does not know.
pub(crate) fn path(
    op: &str,
    bytes: usize,
    (me, n): (usize, usize),
    tune: &Tuning,
    route: &dyn Fn(usize, (Kind, u8), usize, bool) -> &'static str,
) -> Option<String> {
    let next = (me + 1) % n;
    let code = match op {
        "all_reduce" => OP_ALL_REDUCE,
        "all_to_all" => OP_ALL_TO_ALL,
        _ => 0,
    };
    let via =
        |len: usize, exchange: bool| format!("{len} B messages, {}", route(next, (Kind::Coll, code), len, exchange));
    let stores = |out: usize| if out >= tune.stream_min { "; output with streaming stores" } else { "" };
    if n == 1 {
        return Some("one rank: a local copy".into());
    }
    Some(match op {
        "all_reduce" if n == 2 && bytes > tune.all_reduce_direct_max && bytes >= tune.pair_min => {
            let piece = tune.pair_piece.min(bytes);
            format!("pairwise in pieces of {piece} B: {}{}", via(piece / 2, true), stores(bytes))
        }
        "all_reduce" if bytes > tune.all_reduce_direct_max && bytes / n > 0 => {
            format!("ring reduce-scatter + all-gather: {}{}", via(bytes.div_ceil(n), true), stores(bytes))
        }
        "all_reduce" => {
            format!("direct (every rank's buffer to every rank, folded in rank order): {}", via(bytes, n == 2))
        }
        "broadcast" | "reduce" => format!("binomial tree: {}", via(bytes, false)),
        "all_gather" if n > 2 && bytes / n <= tune.all_gather_direct_max => {
            format!("every part sent to every rank, then every part received: {}", via(bytes / n, false))
        }
        "all_gather" => format!("ring: {}", via(bytes / n, true)),
        "reduce_scatter" if n > 2 && bytes * n <= tune.all_reduce_direct_max => {
            format!("every share sent to its rank, folded in rank order: {}", via(bytes, false))
        }
        "reduce_scatter" => format!("ring: {}", via(bytes, true)),
        "all_to_all" if n > 2 && bytes / n <= tune.all_to_all_direct_max => {
            format!("every segment sent, then every segment received: {}", via(bytes / n, false))
        }
        "all_to_all" => format!("pairwise exchange: {}", via(bytes / n, true)),
        "sendrecv" => format!(
            "exchange with the ring's neighbours: {} B messages, {}",
            bytes,
            route(next, (Kind::P2p, 0), bytes, true)
        ),
        "barrier" => "dissemination: empty messages".into(),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::{path, Kind, Tuning, OP_ALL_REDUCE};

    /// The path named for each size is the one `all_reduce` takes at the thresholds given,
    /// and the route is asked about the message each step sends.
    #[test]
    fn path_names_the_algorithm_each_size_takes() {
        let tune = Tuning {
            all_reduce_direct_max: 2048,
            all_to_all_direct_max: 8192,
            all_gather_direct_max: 8192,
            stream_min: 8 << 20,
            pair_min: 8 << 20,
            pair_piece: 256 << 10,
        };
        let asked = std::cell::RefCell::new(Vec::new());
        let route = |peer: usize, (kind, op): (Kind, u8), len: usize, exchange: bool| {
            asked.borrow_mut().push((peer, matches!(kind, Kind::P2p), op, len, exchange));
            "shm ring"
        };
        let p = |op: &str, bytes: usize, n: usize| path(op, bytes, (0, n), &tune, &route);
        assert!(p("all_reduce", 2048, 2).is_some_and(|s| s.starts_with("direct")));
        assert!(p("all_reduce", 4096, 2).is_some_and(|s| s.starts_with("ring")));
        assert!(p("all_reduce", 8 << 20, 2).is_some_and(|s| s.starts_with("pairwise") && s.contains("streaming")));
        assert!(p("all_reduce", 8 << 20, 3).is_some_and(|s| s.starts_with("ring")));
        assert_eq!(p("all_reduce", 8, 1).as_deref(), Some("one rank: a local copy"));
        assert!(p("all_to_all", 3 * 8192, 3).is_some_and(|s| s.starts_with("every segment")));
        assert!(p("all_to_all", 3 * 8193, 3).is_some_and(|s| s.starts_with("pairwise")));
        assert!(p("all_gather", 3 * 8192, 3).is_some_and(|s| s.starts_with("every part")));
        assert!(p("all_gather", 3 * 8193, 3).is_some_and(|s| s.starts_with("ring")));
        assert!(p("all_gather", 2 * 8192, 2).is_some_and(|s| s.starts_with("ring")));
        assert!(p("reduce_scatter", 512, 4).is_some_and(|s| s.starts_with("every share")));
        assert!(p("reduce_scatter", 1024, 4).is_some_and(|s| s.starts_with("ring")));
        assert!(p("reduce_scatter", 8, 2).is_some_and(|s| s.starts_with("ring")));
        assert_eq!(p("gather", 8, 2), None);
        asked.borrow_mut().clear();
        let _ = p("all_reduce", 4096, 2);
        let _ = p("all_gather", 4096, 2);
        let _ = p("sendrecv", 64, 4);
        // The ring step's chunk to the next rank, in an exchange (all_reduce's named: its
        // by-reference range is its own); the sendrecv's whole message.
        let want = vec![(1, false, OP_ALL_REDUCE, 2048, true), (1, false, 0, 2048, true), (1, true, 0, 64, true)];
        assert_eq!(*asked.borrow(), want);
    }
}
