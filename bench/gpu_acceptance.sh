#!/usr/bin/env bash
# The NCCL backend's acceptance run on a machine with two GPUs, in one command (each
# device lease is short): the all_reduce benchmark beside torch.distributed, the whole
# conformance suite at world size 2, and the recovery demo with and without warmup.
#
#   BIN=.gpu bash bench/gpu_acceptance.sh        # BIN: where the anyccl binaries are
#   PARTS="bench recover" BIN=.gpu bash bench/gpu_acceptance.sh   # some parts only
#   PARTS=check BIN=.gpu bash bench/gpu_acceptance.sh            # bench wall time, -c 1 vs -c 0
#   PARTS=reliability BIN=.gpu bash bench/gpu_acceptance.sh      # the launcher killed, a
#       stopped rank (ANYCCL_TIMEOUT_S=10) with anyccl-trace, detail mode, the lifecycle cases
#   PARTS=warmup BIN=.gpu bash bench/gpu_acceptance.sh           # anyccl-warmup-check, warmed and cold
#   PARTS=plan BIN=.gpu bash bench/gpu_acceptance.sh             # warm what the step uses: the
#       step cold, recorded to a plan file, a fresh run warmed from it, one from the role
#       plans; the recovery demo replaying the plan saved with its checkpoint (SQUEEZE MiB)
#   PARTS=interleave OLD=.gpu/old BIN=.gpu bash bench/gpu_acceptance.sh
#       all_reduce 8 B-1 GiB, this build and an older one (OLD: its anyccl-run and
#       anyccl-bench) alternating, three rounds each, out-of-place time per size
#   PARTS=raw BIN=.gpu bash bench/gpu_acceptance.sh              # anyccl beside raw NCCL:
#       8 B-4 KiB in interleaved pairs; 256 MiB-1 GiB with CTAS (default 32) min CTAs against
#       raw defaults, then with registered buffers too; first-call memory with and without; the warmup with the setting
#   PARTS=streams BIN=.gpu bash bench/gpu_acceptance.sh          # the two-GPU stream and graph
#       tests ($BIN/nccl-streams-test: cargo test --release -p anyccl-nccl --test streams
#       --no-run), compute beside an all_reduce (--overlap-us), replayed graphs (--graph)
#   PARTS=one BIN=.gpu bash bench/gpu_acceptance.sh             # what one GPU can check: the
#       Work path and stream order against raw NCCL at world size 1 (--vs-raw, with and
#       without shared completion, raw with an event per call, alternating ROUNDS, default 2),
#       the host cost per call with real launches where $BIN has launch_cost (cargo build
#       --release -p anyccl-nccl --example launch_cost: raw, raw with events, each anyccl path),
#       the conformance suite at world size 1, sleep/wake cycles (CYCLES, default 20) and the
#       colocated demo and the sleep cases with two ranks sharing the GPU over NCCL's socket
#       transport
#   PARTS=elastic BIN=.gpu bash bench/gpu_acceptance.sh         # recovery in place on two GPUs
#       (dp 2 x pp 1, a rank killed mid-step, its replacement on the freed GPU): warmed, not
#       warmed, and the restart path for the same fault
#   PARTS=sleep BIN=.gpu bash bench/gpu_acceptance.sh           # sleep/wake on two GPUs: CYCLES
#       (default 20) cycles of anyccl-warmup-check, and the colocated demo with and without sleep
#   SQUEEZE=8: the MiB the recovery demo leaves free (default 16)
#
# Logs go to $OUT (default /tmp/anyccl-acceptance), one file per part; a summary is
# printed. Each part has its own time limit, so one that hangs cannot starve the rest.
set -uo pipefail
BIN=${BIN:-target/release}
OUT=${OUT:-/tmp/anyccl-acceptance}
mkdir -p "$OUT"
export PATH="$PWD/$BIN:$PATH" PYTHONUNBUFFERED=1
T0=$(date +%s)
t() { echo "t=$(( $(date +%s) - T0 ))s"; }
PARTS=" ${PARTS:-bench recover conformance} "
# Timestamped lines, to measure when each rank failed.
stamp() { while IFS= read -r l; do printf '%s %s\n' "$(date +%s.%N | cut -c1-14)" "$l"; done; }
rank_pid() { for p in $(pgrep -f "$1"); do tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx "RANK=$2" && echo "$p"; done | head -1; }
want() { [[ $PARTS == *" $1 "* ]]; }

if want bench; then
echo "### all_reduce, anyccl then torch ($(t))"
# Rank 0's time on both sides (`-a 0`): torch_bench.py prints its rank 0's.
{
  timeout 180 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl -b 8 -e 1G -f 2 -n 20 -w 5 -a 0 2>&1
  timeout 180 python3 -m torch.distributed.run --nproc_per_node 2 bench/torch_bench.py all_reduce \
    -b 8 -e 1G -f 2 -n 20 -w 5 2>&1
} | grep -v '^\[rank 1\]' > "$OUT/bench.log"
# busbw per size, side by side (out-of-place columns).
awk '/^\[rank 0\] +[0-9]/ { a[$3] = $10 } /^ +[0-9]+ +[0-9]+ +float32/ { t[$1] = $8 }
     END { for (s in a) if (s in t && t[s] > 0) printf "%12d  anyccl %8s  torch %8s  ratio %.3f\n", s, a[s], t[s], a[s] / t[s] }' \
  "$OUT/bench.log" | sort -n
fi

if want recover; then
echo "### recovery demo with and without warmup ($(t))"
rm -rf /tmp/anyccl-acceptance-rec
{
  timeout 120 anyccl-recover demo --backend nccl --squeeze "${SQUEEZE:-16}" --out /tmp/anyccl-acceptance-rec; echo "exit=$?"
  timeout 120 anyccl-recover demo --backend nccl --squeeze "${SQUEEZE:-16}" --no-warmup --out /tmp/anyccl-acceptance-rec; echo "exit=$?"
} > "$OUT/recover.log" 2>&1
grep -E 'exit=|bit-for-bit|failed with' "$OUT/recover.log" | cut -c1-300
fi

if want one; then
echo "### one GPU: the Work path and stream order against raw NCCL, world size 1 ($(t))"
for round in $(seq "${ROUNDS:-2}"); do for sc in 0 1; do
  log="$OUT/one-raw-$round-sc$sc.log"
  ANYCCL_SHARED_COMPLETION=$sc timeout 150 anyccl-run -n 1 -- anyccl-bench all_reduce --backend nccl \
    --vs-raw "${PAIRS:-16}" -b 8 -e 4K -f 2 -n 100 -w 20 > "$log" 2>&1
  echo "round $round, ANYCCL_SHARED_COMPLETION=$sc (exit $?):"
  grep -E '^\[rank 0\] #.*(completion|NCCL|version|host cost)' "$log" | cut -c1-220
  echo "   size raw(us) anyccl(us) ratio-median ratio-worst raw+events(us) enqueued(us) enqueued/raw vs-raw+events"
  awk '/^\[rank 0\] +[0-9]/ { print "  ", $3, $6, $7, $8, $9, $13, $16, $17, $18 }' "$log"
done; done
# Deep pipelines: 2,000 calls in flight before the first wait (more than the device layer's
# 1,024 marks before it looks for done ones); the Work path must stay where it is at 100.
log="$OUT/one-raw-deep.log"
timeout 150 anyccl-run -n 1 -- anyccl-bench all_reduce --backend nccl --vs-raw "${PAIRS:-16}" -b 8 -e 4K -f 8 \
  -n 2000 -w 20 > "$log" 2>&1
echo "2,000 calls in flight (exit $?):"
echo "   size raw(us) anyccl(us) ratio-median ratio-worst raw+events(us) enqueued(us) enqueued/raw vs-raw+events"
awk '/^\[rank 0\] +[0-9]/ { print "  ", $3, $6, $7, $8, $9, $13, $16, $17, $18 }' "$log"
if [ -x "$BIN/launch_cost" ]; then
  echo "### one GPU: host cost per call with real launches, world size 1 ($(t))"
  timeout 120 "$BIN/launch_cost" 20000 7 > "$OUT/one-launch-cost.log" 2>&1
  echo "exit $?"; cut -c1-220 "$OUT/one-launch-cost.log"
fi
SOCK=(env ANYCCL_RANK_ENV='NCCL_HOSTID=h{rank}' NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME=lo)
echo "### one GPU: ${CYCLES:-20} sleep/wake cycles, two ranks over sockets ($(t))"
"${SOCK[@]}" timeout 240 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl --sleep-cycles "${CYCLES:-20}" \
  > "$OUT/one-sleep.log" 2>&1
echo "exit $?"; grep -E '^\[rank 0\].*(sleep|wake|cycle|step|MiB)' "$OUT/one-sleep.log" | cut -c1-220 | tail -40
echo "### one GPU: the colocated demo, two ranks over sockets ($(t))"
rm -rf /tmp/anyccl-acceptance-col
"${SOCK[@]}" timeout 240 anyccl-recover demo --backend nccl --dp 1 --pp 2 --colocated-phases 3 --steps 12 \
  --out /tmp/anyccl-acceptance-col > "$OUT/one-colocated.log" 2>&1
echo "exit $?"; grep -vE '^\[rank [0-9]+\] step ' "$OUT/one-colocated.log" | tail -25 | cut -c1-220
echo "### one GPU: conformance at world size 1 ($(t))"
timeout 360 anyccl-conformance --backend nccl --world-sizes 1 > "$OUT/one-conformance.log" 2>&1
echo "exit $?"; grep -E 'passed|failed|FAIL' "$OUT/one-conformance.log" | tail -5
echo "### one GPU: the sleep cases at world size 2, two ranks over sockets ($(t))"
"${SOCK[@]}" timeout 200 anyccl-conformance --backend nccl --world-sizes 2 --filter sleep > "$OUT/one-sleep-cases.log" 2>&1
echo "exit $?"; grep -E 'passed|failed|FAIL' "$OUT/one-sleep-cases.log" | tail -5
fi

if want elastic; then
echo "### recovery in place on two GPUs, dp 2 x pp 1 ($(t))"
for mode in "" "--no-warmup"; do
  rm -rf /tmp/anyccl-acceptance-ip
  timeout 200 anyccl-recover demo --backend nccl --in-place --dp 2 --pp 1 --steps 30 $mode \
    --out /tmp/anyccl-acceptance-ip > "$OUT/elastic${mode:+-cold}.log" 2>&1
  echo "in place ${mode:-warmed}: exit $?"
  grep -vE '^\[rank [0-9]+\] step ' "$OUT/elastic${mode:+-cold}.log" | grep -iE 'timeline|fault|detect|agreed|rebuilt|warm|first step|back|MiB|bit-for-bit|lost|FAIL' | tail -25 | cut -c1-220
done
rm -rf /tmp/anyccl-acceptance-ip
timeout 200 anyccl-recover demo --backend nccl --dp 2 --pp 1 --steps 30 --out /tmp/anyccl-acceptance-ip \
  > "$OUT/elastic-restart.log" 2>&1
echo "restart path: exit $?"; grep -vE '^\[rank [0-9]+\] step ' "$OUT/elastic-restart.log" | tail -12 | cut -c1-220
fi

if want sleep; then
echo "### sleep and wake on two GPUs: ${CYCLES:-20} cycles ($(t))"
timeout 300 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl --sleep-cycles "${CYCLES:-20}" > "$OUT/sleep.log" 2>&1
echo "exit $?"; grep -E '^\[rank 0\]' "$OUT/sleep.log" | grep -vE '\] step ' | tail -45 | cut -c1-220
for mode in "" "--no-sleep"; do
  rm -rf /tmp/anyccl-acceptance-col
  timeout 200 anyccl-recover demo --backend nccl --colocated-phases 3 --steps 12 $mode \
    --out /tmp/anyccl-acceptance-col > "$OUT/colocated${mode:+-awake}.log" 2>&1
  echo "colocated ${mode:-asleep}: exit $?"
  grep -vE '^\[rank [0-9]+\] step ' "$OUT/colocated${mode:+-awake}.log" | tail -14 | cut -c1-220
done
fi

if want check; then
echo "### the benchmark's check mode: wall time with -c 1 against -c 0 ($(t))"
for c in 0 1 0 1; do
  s0=$(date +%s%N)
  timeout 200 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl -b 64M -e 1G -f 4 -n 40 -c $c 2>&1 \
    | grep -E '^\[rank 0\] +[0-9]' > "$OUT/check$c.log"
  echo "-c $c: $(( ($(date +%s%N) - s0) / 1000000 )) ms; rows: $(wc -l < "$OUT/check$c.log"); wrong (1 GiB row): $(awk '$3 == 1073741824 {print $11, $15}' "$OUT/check$c.log")"
done
fi

if want reliability; then
echo "### reliability ($(t))"
DEMO="anyccl-demo --backend nccl --count 1048576 --steps 100000000"
# 1. kill -9 of the launcher: no rank may be left 5 s later.
anyccl-run -n 2 -- $DEMO 2>&1 | grep --line-buffered -v '\] step ' > "$OUT/kill9.log" &
sleep 15
kill -9 "$(pgrep -x anyccl-run)"
sleep 5
echo "kill -9 of the launcher: $(pgrep -fc 'anyccl-demo --backend') rank processes left 5 s later"
ps -eo pid,ppid,stat,cmd | grep -E 'anyccl-(demo|run|reaper)' | grep -v grep
echo "GPU processes 5 s later (pid, MiB):"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
sleep 5; echo "GPU processes 10 s later:"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader
pkill -9 -f 'anyccl-demo --backend'; sleep 1
# 2. SIGSTOP of rank 1 mid-run, ANYCCL_TIMEOUT_S=10: the survivor's error, its time, the
#    memory release after the abort, and what anyccl-trace says.
rm -rf "$OUT/trace"
ANYCCL_TIMEOUT_S=10 ANYCCL_TRACE_DIR="$OUT/trace" ANYCCL_LOG=warn anyccl-run -n 2 -- $DEMO 2>&1 \
  | grep --line-buffered -v '\] step ' | stamp > "$OUT/stop.log" &
sleep 15
P=$(rank_pid 'anyccl-demo --backend' 1)
S=$(date +%s.%N | cut -c1-14); kill -STOP "$P"; echo "stopped rank 1 (pid $P) at $S"
for i in $(seq 1 60); do pgrep -x anyccl-run > /dev/null || break; sleep 1; done
cut -c1-400 "$OUT/stop.log"
anyccl-trace "$OUT/trace"
pkill -9 -f 'anyccl-demo --backend'; sleep 1
# 3. ANYCCL_DEBUG=detail, rank 1 calls all_gather where rank 0 calls all_reduce.
ANYCCL_DEBUG=detail timeout 60 anyccl-run -n 2 -- anyccl-demo --backend nccl --count 1024 --steps 5 \
  --mismatch-rank 1 2>&1 | stamp | cut -c1-400
# 4. The lifecycle cases (detail mode among them) at world size 2.
timeout 240 anyccl-conformance --backend nccl --world-sizes 2 --filter lifecycle 2>&1 | cut -c1-300
fi

if want warmup; then
echo "### anyccl-warmup-check, warmed then cold ($(t))"
{ timeout 120 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl; echo "exit=$?"
  timeout 120 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl --no-warmup; echo "exit=$?"; } > "$OUT/warmup.log" 2>&1
grep -E 'exit=|MiB|step' "$OUT/warmup.log" | grep -v '^\[rank 1\]' | cut -c1-200 | tail -30
fi

if want plan; then
echo "### anyccl-warmup-check: cold, recorded, warmed from the recorded plan, from the role plans ($(t))"
D="$OUT/plans"; rm -rf "$D"
for mode in "--no-warmup" "--record $D" "--plan $D" ""; do
  echo "=== anyccl-warmup-check $mode"
  timeout 120 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl $mode; echo "exit=$?"
done > "$OUT/plan.log" 2>&1
grep -v '^\[rank 1\]   ' "$OUT/plan.log" | cut -c1-260
echo "### recovery demo: replaying the plan saved with the checkpoint, then the role plans, then cold ($(t))"
rm -rf /tmp/anyccl-acceptance-rec
for mode in "" "--role-plan" "--no-warmup"; do
  echo "=== anyccl-recover demo --squeeze ${SQUEEZE:-4} $mode"
  timeout 120 anyccl-recover demo --backend nccl --squeeze "${SQUEEZE:-4}" $mode --out /tmp/anyccl-acceptance-rec; echo "exit=$?"
done > "$OUT/plan-recover.log" 2>&1
grep -E '===|exit=|bit-for-bit|failed with|out of memory|recorded the first|warmed |plan of|total  |group total|squeezed|succeeded' \
  "$OUT/plan-recover.log" | cut -c1-260
fi

if want raw; then
echo "### all_reduce 8 B-4 KiB: raw NCCL and anyccl in ${PAIRS:-8} interleaved pairs ($(t))"
timeout 200 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl --vs-raw "${PAIRS:-8}" -b 8 -e 4K -f 2 -n 100 -w 20 2>&1 \
  | grep -v '^\[rank 1\]' | tee "$OUT/raw-small.log" | cut -c1-250
echo "### all_reduce 256 MiB-1 GiB: raw NCCL's defaults against anyccl with ANYCCL_MIN_CTAS=${CTAS:-32} ($(t))"
ANYCCL_MIN_CTAS=${CTAS:-32} timeout 300 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl --vs-raw 3 -b 256M -e 1G -f 2 -n 20 -w 5 2>&1 \
  | grep -v '^\[rank 1\]' | tee "$OUT/raw-large.log" | cut -c1-250
echo "### the same with anyccl's buffers from ncclMemAlloc, registered (--register) ($(t))"
ANYCCL_MIN_CTAS=${CTAS:-32} timeout 300 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl --vs-raw 3 --register -b 256M -e 1G -f 2 -n 20 -w 5 2>&1 \
  | grep -v '^\[rank 1\]' | tee "$OUT/raw-large-registered.log" | cut -c1-250
echo "### the first call's memory and busbw: defaults, then ANYCCL_MIN_CTAS=${CTAS:-32} ($(t))"
for ctas in "" "${CTAS:-32}"; do
  env ${ctas:+ANYCCL_MIN_CTAS=$ctas} timeout 200 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl -b 8 -e 1G -f 8 -n 20 -w 5 -c 0 2>&1 \
    | grep -E '^\[rank 0\] +[0-9]' | awk -v c="${ctas:-default}" '{ printf "min_ctas %-8s %12d  busbw %8s  first-call us %9s  MiB %7s\n", c, $3, $10, $16, $17 }'
done | tee "$OUT/raw-mem.log"
echo "### warmup with ANYCCL_MIN_CTAS=${CTAS:-32}: warmed memory, then the step ($(t))"
{ ANYCCL_MIN_CTAS=${CTAS:-32} timeout 120 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl; echo "exit=$?"
  ANYCCL_MIN_CTAS=${CTAS:-32} timeout 120 anyccl-run -n 2 -- anyccl-warmup-check --backend nccl --no-warmup; echo "exit=$?"; } \
  > "$OUT/raw-warmup.log" 2>&1
grep -E 'exit=|total|step \(' "$OUT/raw-warmup.log" | grep -v '^\[rank 1\]   ' | cut -c1-200
fi

if want streams; then
echo "### stream ordering and graphs ($(t))"
if [ -x "$BIN/nccl-streams-test" ]; then timeout 120 "$BIN/nccl-streams-test" 2>&1 | tail -6
else echo "no $BIN/nccl-streams-test: build it with cargo test --release -p anyccl-nccl --test streams --no-run"; fi
for us in 100 1000; do
  timeout 120 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl --overlap-us $us -b 1M -e 256M -f 4 -n 20 -w 3 2>&1 \
    | grep -v '^\[rank 1\]' | cut -c1-200
done | tee "$OUT/overlap.log"
timeout 120 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl --graph 20 -b 8 -e 4K -f 8 -n 50 -w 5 2>&1 \
  | grep -v '^\[rank 1\]' | tee "$OUT/graph.log" | cut -c1-200
fi

if want interleave; then
echo "### all_reduce, this build (new) and $OLD (old), alternating ($(t))"
for round in 1 2 3; do
  for who in old new; do
    dir=$BIN; [ "$who" = old ] && dir=$OLD
    timeout 150 "$dir/anyccl-run" -n 2 -- "$dir/anyccl-bench" all_reduce --backend nccl -b 8 -e 1G -f 2 -n 20 -w 5 2>&1 \
      | grep -E '^\[rank 0\] +[0-9]' > "$OUT/il-$who-$round.log"
  done
done
# Out-of-place time (us) per size: each round of old and new, then the medians' ratio.
awk 'FNR == 1 { split(FILENAME, p, "-"); who = p[2]; r = substr(p[3], 1, 1) }
     { t[$3, who, r] = $8; s[$3] = 1 }
     END { for (z in s) { printf "%12d", z;
             for (r = 1; r <= 3; r++) printf "  old %9s new %9s", t[z, "old", r], t[z, "new", r];
             printf "\n" } }' "$OUT"/il-*.log | sort -n
fi

if want conformance; then
echo "### conformance at world size 2 ($(t))"
timeout 480 anyccl-conformance --backend nccl --world-sizes 2 > "$OUT/conformance.log" 2>&1
grep -E 'FAILED|passed,' "$OUT/conformance.log" | cut -c1-400
fi
t
