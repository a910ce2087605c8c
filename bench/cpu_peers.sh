#!/usr/bin/env bash
# The CPU backend beside Open MPI (shared memory) and Gloo (PyTorch, TCP), side by side in
# one run on this machine: each collective at each world size, float32 sum, every call
# issued and waited (the latency an MPI blocking loop measures), one row per size with
# each peer's time and bus bandwidth and anyccl's ratios to them (busbw ratio: above 1 is
# faster). anyccl's pipelined time per call (calls issued back to back, then waited, as
# nccl-tests measures; the median of REPS runs too) is printed beside its latency.
#
# Every time is the slowest rank's, as Open MPI's and Gloo's harnesses here print theirs
# (`anyccl-bench -a 3`; rank 0's alone hid a broadcast's receivers, up to 20% slower than
# its root at 8 B).
#
# Timings on a shared 2-core machine drift by tens of percent between runs, so anyccl and
# Open MPI each run REPS times, alternating, and every row shows the median of the REPS
# times per size (Gloo, slower by far, runs REPS times only from 4 MiB, where its time is
# closest to anyccl's, and once below). broadcast compares anyccl in place: MPI_Bcast
# and torch.distributed.broadcast have one buffer (out of place adds the root's copy); its
# calls run back to back on buffers filled once, as MPI's loop runs them (anyccl-bench puts
# an in-place input back before each call only where the call changes it).
#
#   bash bench/cpu_peers.sh                      # everything (about 40 minutes on 2 cores)
#   OPS="all_reduce" RANKS="2" MAXB=64M REPS=5 bash bench/cpu_peers.sh
#   MPI_ENV="GLIBC_TUNABLES=glibc.malloc.hugetlb=1" bash bench/cpu_peers.sh   # Open MPI's
#     buffers in transparent huge pages, as anyccl's platform maps its own from 512 KiB
#     (MPI_ENV: VAR=value words, each given to Open MPI's ranks with mpirun -x)
#
# Installs what it needs: Debian's Open MPI (run as root with --allow-run-as-root and
# --oversubscribe), PyTorch from PyPI for Gloo; builds anyccl's release binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
OPS=${OPS:-"all_reduce all_gather reduce_scatter broadcast all_to_all sendrecv"}
RANKS=${RANKS:-"2 4"}
MINB=${MINB:-8}
MAXB=${MAXB:-256M}
ITERS=${ITERS:-1000}
REPS=${REPS:-3}
MPI_ENV=${MPI_ENV:-}
die() { echo "cpu_peers.sh: $*" >&2; exit 2; }
for v in ITERS REPS; do [[ ${!v} =~ ^[1-9][0-9]*$ ]] || die "$v=${!v}: not a whole number of 1 or more"; done
for n in $RANKS; do [[ $n =~ ^[1-9][0-9]*$ ]] && [ "$n" -ge 2 ] || die "RANKS: '$n' is not a world size of 2 or more"; done
for op in $OPS; do
  case $op in
    all_reduce | all_gather | reduce_scatter | broadcast | all_to_all | sendrecv) ;;
    *) die "OPS: unknown operation '$op' (all_reduce all_gather reduce_scatter broadcast all_to_all sendrecv)" ;;
  esac
done
# Bytes in "$1" (8, 64K, 256M), named "$2" in the error.
bytes() {
  local b
  b=$(numfmt --from=iec "$1" 2>/dev/null) && [ "$b" -ge 1 ] || die "$2=$1: not a size of 1 byte or more (8, 64K, 256M)"
  echo "$b"
}
minb=$(bytes "$MINB" MINB); maxb=$(bytes "$MAXB" MAXB)
[ "$minb" -le "$maxb" ] || die "MINB=$MINB is above MAXB=$MAXB"
mpi_env=()
for kv in $MPI_ENV; do mpi_env+=(-x "$kv"); done
WORK=${WORK:-$(mktemp -d /tmp/cpu-peers.XXXXXX)}
mkdir -p "$WORK"

# The rows of "$1.0" .. "$1.$((REPS - 1))" (size time algbw busbw): per size, the row whose
# time is the median of the REPS times.
median() {
  local files=()
  for ((rep = 0; rep < REPS; rep++)); do files+=("$1.$rep"); done
  median_of "${files[@]}"
}
# The same over the rows of the files named, a size in any number of them.
median_of() {
  cat "$@" | sort -k1,1n -k2,2g | awk '
    { if ($1 != s) { flush(); s = $1; k = 0 } row[++k] = $0 }
    function flush() { if (k) print row[int((k + 1) / 2)] }
    END { flush() }'
}

if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null; then
  echo "# installing Open MPI (apt)" >&2
  (apt-get update -qq && apt-get install -y -qq openmpi-bin libopenmpi-dev) >"$WORK/apt.log" 2>&1
fi
if ! python3 -c "import torch" 2>/dev/null; then
  echo "# installing PyTorch (pip, about 5 GB)" >&2
  python3 -m pip install -q torch >"$WORK/pip.log" 2>&1
fi
cargo build -q --release -p anyccl-examples --bin anyccl-run --bin anyccl-bench
mpicc -O2 -o "$WORK/mpi_coll" bench/peers/mpi_coll.c
R=target/release

echo "# $(nproc) cores, $(uname -r); Open MPI $(mpirun --allow-run-as-root --version 2>/dev/null | head -1 | awk '{print $NF}'), torch $(python3 -c 'import torch; print(torch.__version__)' 2>/dev/null)"
[ -z "$MPI_ENV" ] || echo "# Open MPI's ranks run with $MPI_ENV"
echo "# float32 sum; time in us per call, busbw in GB/s; x-ompi, x-gloo = anyccl busbw / peer busbw (= peer time / anyccl time)"
port=29700
for n in $RANKS; do
  for op in $OPS; do
    a="$WORK/anyccl-$op-$n"; m="$WORK/mpi-$op-$n"; g="$WORK/gloo-$op-$n"; p="$WORK/pipe-$op-$n"
    # anyccl's columns: out of place (time, algbw, busbw), in place for broadcast.
    cols='$6, $7, $8'; tcol='$6'
    [ "$op" = broadcast ] && cols='$10, $11, $12' && tcol='$10'
    split=$(( 1 << 22 ))
    # The first size from `split` on in the sequence minb, 2 minb, 4 minb... (Open MPI's).
    big=$minb; while [ "$big" -lt "$split" ]; do big=$(( big * 2 )); done
    for ((rep = 0; rep < REPS; rep++)); do
      # anyccl: latency (one call in flight), small sizes with many calls, large with few.
      : >"$a.$rep"
      for range in "$minb $(( split - 1 )) $ITERS" "$big $maxb $(( ITERS / 100 > 5 ? ITERS / 100 : 5 ))"; do
        set -- $range
        hi=$2; [ "$hi" -le "$maxb" ] || hi=$maxb
        [ "$1" -le "$hi" ] || continue
        $R/anyccl-run -n "$n" --no-prefix -- $R/anyccl-bench "$op" --backend cpu -b "$1" -e "$hi" -n "$3" -w 5 --depth 1 -a 3 \
          | awk "!/^#/ && NF > 8 {print \$1, $cols}" >>"$a.$rep"
      done
      mpirun --allow-run-as-root --oversubscribe ${mpi_env[@]+"${mpi_env[@]}"} -np "$n" "$WORK/mpi_coll" "$op" "$minb" "$maxb" "$ITERS" >"$m.$rep" 2>"$m.err" || true
      # anyccl pipelined, small sizes only (what the latency rows do not show), REPS times
      # as well: a single run's row was now and then several times the others'.
      : >"$p.$rep"
      if [ "$minb" -le 4096 ]; then
        $R/anyccl-run -n "$n" --no-prefix -- $R/anyccl-bench "$op" --backend cpu -b "$minb" -e 4K -n "$ITERS" -w 5 -a 3 \
          | awk "!/^#/ && NF > 8 {print \$1, $tcol}" >"$p.$rep"
      fi
    done
    median "$a" >"$a"; median "$m" >"$m"; median "$p" >"$p"
    # Gloo: every size once, then the sizes from `split` REPS - 1 times more.
    gfiles=()
    for ((rep = 0; rep < REPS; rep++)); do
      lo=$minb; [ "$rep" = 0 ] || lo=$big
      [ "$lo" -le "$maxb" ] || break
      port=$((port + 1))
      pids=()
      for ((r = 0; r < n; r++)); do
        RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
          python3 bench/peers/gloo_coll.py "$op" "$lo" "$maxb" "$ITERS" >"$g.$rep.$r" 2>"$g.$rep.$r.err" & pids+=($!)
      done
      for pid in "${pids[@]}"; do wait "$pid" || true; done
      grep -v '^#' "$g.$rep.0" >"$g.$rep" || true
      gfiles+=("$g.$rep")
    done
    median_of "${gfiles[@]}" >"$g"
    echo
    echo "## $op, $n ranks"
    printf "%12s | %9s %9s %8s | %9s %8s | %9s %8s | %7s %7s\n" size "anyccl-us" "pipe-us" busbw "ompi-us" busbw "gloo-us" busbw "x-ompi" "x-gloo"
    awk -v A="$a" -v M="$m" -v G="$g" -v P="$p" '
      BEGIN {
        while ((getline l < A) > 0) { split(l, f, " "); at[f[1]] = f[2]; ab[f[1]] = f[4]; sizes[++k] = f[1] }
        while ((getline l < P) > 0) { split(l, f, " "); pt[f[1]] = f[2] }
        while ((getline l < M) > 0) { split(l, f, " "); mt[f[1]] = f[2]; mb[f[1]] = f[4] }
        while ((getline l < G) > 0) { split(l, f, " "); gt[f[1]] = f[2]; gb[f[1]] = f[4] }
        for (i = 1; i <= k; i++) {
          s = sizes[i]
          # Same size, so the busbw ratio is the inverse ratio of the times (exact where
          # busbw rounds to zero).
          xm = (s in mt && mt[s] + 0 > 0 && at[s] + 0 > 0) ? sprintf("%7.2f", mt[s] / at[s]) : "    n/a"
          xg = (s in gt && gt[s] + 0 > 0 && at[s] + 0 > 0) ? sprintf("%7.2f", gt[s] / at[s]) : "    n/a"
          printf "%12s | %9s %9s %8s | %9s %8s | %9s %8s | %s %s\n", s, at[s], (s in pt ? pt[s] : "-"), ab[s],
            (s in mt ? mt[s] : "n/a"), (s in mb ? mb[s] : "n/a"), (s in gt ? gt[s] : "n/a"), (s in gb ? gb[s] : "n/a"), xm, xg
        }
      }'
  done
done
echo
echo "# raw outputs: $WORK"
