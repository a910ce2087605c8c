#!/usr/bin/env bash
# The warmup protocol and the store at scale, by simulation (anyccl-sim): store requests
# per rank and per phase (claim: the replay check and the claim; final: recording the
# outcome), and wall time per phase, at 256, 1,024 and 4,096 ranks; three
# layouts at 4,096; the fault cases at 4,096; the store's throughput; and, when
# ETCD=host:port names an etcd cluster, the same at 1,024 ranks on etcd beside TCP.
#   bash bench/sim_scale.sh            (about 3 minutes on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p anyccl-examples --bin anyccl-sim
sim=target/release/anyccl-sim
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
run() { local name=$1; shift; "$sim" "$@" --json >"$out/$name.json" || true; }

for n in 256 1024 4096; do run "tcp-$n" --ranks "$n"; done
run tcp-4096-512x8 --ranks 4096 --layout 512x8
run tcp-4096-8x8x8x8 --ranks 4096 --layout 8x8x8x8
run tcp-4096-saved-repeat --ranks 4096 --saved --repeat
for f in fail:1234 hang:777 die:3000 die:0; do run "fault-$f" --ranks 4096 --timeout 20 --fault "$f"; done
if [ -n "${ETCD:-}" ]; then
  run etcd-1024 --ranks 1024 --store "etcd://$ETCD"
  run tcp-1024b --ranks 1024
fi
for c in 256 4096; do "$sim" --ranks "$c" --store-bench 3; done
[ -n "${ETCD:-}" ] && "$sim" --ranks 256 --store-bench 3 --store "etcd://$ETCD"

python3 - "$out" <<'PY'
import json, os, sys
d = sys.argv[1]
rows = sorted(f[:-5] for f in os.listdir(d) if f.endswith(".json"))
phases = ["claim", "source", "agree", "outcome", "final"]
print("#%-20s %6s %-14s %9s %8s " % ("run", "ranks", "layout", "requests", "per rank")
      + " ".join("%15s" % (p + " ops/ms") for p in phases) + " %8s %7s  %s" % ("polls", "max ms", "check"))
for r in rows:
    try:
        j = json.load(open(os.path.join(d, r + ".json")))
    except Exception as e:
        print(" %-20s (no figures: %s)" % (r, e)); continue
    ph = j["phases"]
    cells = " ".join("%15s" % ("%d/%.0f" % (ph[p]["ops"], ph[p]["wall_ms"])) for p in phases)
    check = ("passed" if j["fault"]["passed"] else "FAILED") + ": " + j["fault"]["check"][:110]
    print(" %-20s %6d %-14s %9d %8.1f %s %8d %7.0f  %s" % (r, j["ranks"], j["layout"], j["store_ops_total"],
          j["store_ops_per_rank"], cells, j["polls"], j["warmup_ms"]["max"], check))
PY
