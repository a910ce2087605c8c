#!/usr/bin/env bash
# Run-to-run steadiness of the CPU backend beside Open MPI (shared memory): the same command
# RUNS times in a row per size, anyccl waited (`--depth 1`, the latency an MPI blocking loop
# measures), anyccl pipelined (calls issued back to back, then waited) and Open MPI, the
# three alternating so that a drift of the machine hits each alike. One row per size and
# mode: the fastest, median and slowest run's time per call, slowest / fastest, Open MPI's
# median (each a run's slowest rank's time, as Open MPI's harness prints it: `-a 3`), the
# worst ratio of a run's time to the Open MPI run right after it (the machine's own slow
# spells, which slow Open MPI too, cancel there), and whether every run was at least Open
# MPI's median speed. Before each run the host's own cross-core round trip is measured
# (`bench/peers/probe.c`: two threads passing a cache line); a second row per size and mode
# repeats the figures over the runs made while the host was quiet (a probe within 1.5x of
# the session's lowest), since on a shared virtual machine the host itself slows down by
# several times for minutes at a time (its other tenants), Open MPI alike.
#
#   bash bench/cpu_spread.sh                                  # all_reduce, 2 ranks, 10 runs
#   OP=broadcast RANKS=4 SIZES="8 4K" RUNS=5 bash bench/cpu_spread.sh
#
# Installs Debian's Open MPI if absent (run as root with --allow-run-as-root and
# --oversubscribe) and builds anyccl's release binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
OP=${OP:-all_reduce}
RANKS=${RANKS:-2}
SIZES=${SIZES:-"8 64K 2M 32M"}
RUNS=${RUNS:-10}
die() { echo "cpu_spread.sh: $*" >&2; exit 2; }
[[ $RUNS =~ ^[1-9][0-9]*$ ]] || die "RUNS=$RUNS: not a whole number of 1 or more"
[[ $RANKS =~ ^[1-9][0-9]*$ ]] && [ "$RANKS" -ge 2 ] || die "RANKS=$RANKS: not a world size of 2 or more"
case $OP in
  all_reduce | all_gather | reduce_scatter | broadcast | all_to_all | sendrecv) ;;
  *) die "OP: unknown operation '$OP' (all_reduce all_gather reduce_scatter broadcast all_to_all sendrecv)" ;;
esac
sizes=()
for s in $SIZES; do
  b=$(numfmt --from=iec "$s" 2>/dev/null) && [ "$b" -ge 1 ] || die "SIZES: '$s' is not a size of 1 byte or more (8, 64K, 2M)"
  sizes+=("$b")
done
[ "${#sizes[@]}" -gt 0 ] || die "SIZES is empty"
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "# installing Open MPI (apt)" >&2
  (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev) >/dev/null 2>&1
fi
WORK=${WORK:-$(mktemp -d /tmp/cpu-spread.XXXXXX)}
mkdir -p "$WORK"
cargo build -q --release -p anyccl-examples --bin anyccl-run --bin anyccl-bench
mpicc -O2 -o "$WORK/mpi_coll" bench/peers/mpi_coll.c
cc -O2 -o "$WORK/probe" bench/peers/probe.c -lpthread
R=target/release
# Calls per run: many for small sizes, few for large (about a tenth of a second or more each;
# 20,000 calls of 8 B took 6 ms, where one preemption of the host doubled a run's time: 0.58
# us in one run of 20 against 0.28-0.30, Open MPI's runs as short).
iters() { if [ "$1" -lt 4096 ]; then echo 200000; elif [ "$1" -lt 65536 ]; then echo 20000; elif [ "$1" -lt 4194304 ]; then echo 1000; else echo 50; fi; }
# anyccl's time per call at size "$1" (out of place; broadcast in place, as MPI_Bcast), mode "$2".
col='$6'
[ "$OP" = broadcast ] && col='$10'
anyccl() {
  local depth=()
  [ "$2" = waited ] && depth=(--depth 1)
  $R/anyccl-run -n "$RANKS" --no-prefix -- $R/anyccl-bench "$OP" --backend cpu -b "$1" -e "$1" -n "$(iters "$1")" \
    -w 20 -c 0 -a 3 ${depth[@]+"${depth[@]}"} | awk "!/^#/ && NF > 8 {print $col; exit}"
}
# Open MPI's time per call at size "$1".
ompi() {
  mpirun --allow-run-as-root --oversubscribe -np "$RANKS" "$WORK/mpi_coll" "$OP" "$1" "$1" "$(iters "$1")" \
    2>"$WORK/mpi.err" | awk 'NF >= 2 {print $2; exit}'
}
echo "# $(nproc) cores, $(uname -r); Open MPI $(mpirun --allow-run-as-root --version 2>/dev/null | head -1 | awk '{print $NF}')"
echo "# $OP float32 sum, $RANKS ranks, $RUNS runs a size; time in us per call"
for s in "${sizes[@]}"; do
  for f in waited pipelined ompi; do : >"$WORK/$f.$s"; : >"$WORK/$f.$s.probe"; done
  for ((r = 0; r < RUNS; r++)); do
    "$WORK/probe" >>"$WORK/waited.$s.probe"
    anyccl "$s" waited >>"$WORK/waited.$s"
    "$WORK/probe" >>"$WORK/pipelined.$s.probe"
    anyccl "$s" pipelined >>"$WORK/pipelined.$s"
    "$WORK/probe" >>"$WORK/ompi.$s.probe"
    ompi "$s" >>"$WORK/ompi.$s"
  done
done
# The session's quietest probe, and the runs made within 1.5x of it ("$1": a results file;
# its probes are "$1.probe", line by line).
low=$(cat "$WORK"/*.probe | awk '$1 + 0 > 0 && (m == "" || $1 < m) { m = $1 } END { print m + 0 }')
quiet() { paste "$1.probe" "$1" | awk -v low="$low" 'NF == 2 && low > 0 && $1 + 0 > 0 && $1 <= 1.5 * low { print $2 }'; }
echo "# host probe (cross-core round trip, ns): lowest $low, per run in $WORK/*.probe"
for s in "${sizes[@]}"; do
  for f in waited pipelined ompi; do quiet "$WORK/$f.$s" >"$WORK/$f.$s.quiet"; done
done
printf "%12s %10s %6s | %9s %9s %9s %9s | %9s %9s | %s\n" size mode runs fastest median slowest "slow/fast" "ompi-med" "worst/ompi" "every run >= ompi median"
stats() { sort -g "$1" | awk '{v[NR] = $1} END { if (NR) printf "%s %s %s", v[1], v[int((NR + 1) / 2)], v[NR] }'; }
for s in "${sizes[@]}"; do
  for set in all quiet; do
    suffix=""
    [ "$set" = quiet ] && suffix=".quiet"
    read -r _ om _ <<<"$(stats "$WORK/ompi.$s$suffix")"
    for mode in waited pipelined; do
      f="$WORK/$mode.$s$suffix"
      read -r lo med hi <<<"$(stats "$f")"
      [ -n "${lo:-}" ] || { printf "%12s %10s %6s | no result (see %s)\n" "$s" "$mode" "$set" "$WORK"; continue; }
      n=$(wc -l <"$f")
      # The worst of each run's time over its Open MPI neighbour's (every run only: the
      # quiet sets need not pair up).
      pair="-"
      [ "$set" = all ] && pair=$(paste "$f" "$WORK/ompi.$s" | awk 'NF == 2 && $2 > 0 { r = $1 / $2; if (r > w) w = r } END { printf "%.2f", w }')
      awk -v s="$s" -v m="$mode" -v set="$set:$n" -v lo="$lo" -v med="$med" -v hi="$hi" -v om="${om:-0}" -v pair="$pair" 'BEGIN {
        ok = (om > 0) ? (hi <= om ? "yes" : "no") : "n/a"
        printf "%12s %10s %6s | %9.2f %9.2f %9.2f %9.2f | %9.2f %10s | %s\n", s, m, set, lo, med, hi, hi / lo, om, pair, ok }'
    done
  done
done
echo "# raw outputs: $WORK"
