#!/usr/bin/env bash
# The NCCL backend's acceptance run on a machine with two GPUs, in one command (each
# device lease is short): the all_reduce benchmark beside torch.distributed, the whole
# conformance suite at world size 2, and the recovery demo with and without warmup.
#
#   BIN=.gpu bash bench/gpu_acceptance.sh        # BIN: where the anyccl binaries are
#   PARTS="bench recover" BIN=.gpu bash bench/gpu_acceptance.sh   # some parts only
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
want() { [[ $PARTS == *" $1 "* ]]; }

if want bench; then
echo "### all_reduce, anyccl then torch ($(t))"
{
  timeout 180 anyccl-run -n 2 -- anyccl-bench all_reduce --backend nccl -b 8 -e 1G -f 2 -n 20 -w 5 2>&1
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
  timeout 120 anyccl-recover demo --backend nccl --squeeze 16 --out /tmp/anyccl-acceptance-rec; echo "exit=$?"
  timeout 120 anyccl-recover demo --backend nccl --squeeze 16 --no-warmup --out /tmp/anyccl-acceptance-rec; echo "exit=$?"
} > "$OUT/recover.log" 2>&1
grep -E 'exit=|bit-for-bit|failed with' "$OUT/recover.log" | cut -c1-300
fi

if want conformance; then
echo "### conformance at world size 2 ($(t))"
timeout 480 anyccl-conformance --backend nccl --world-sizes 2 > "$OUT/conformance.log" 2>&1
grep -E 'FAILED|passed,' "$OUT/conformance.log" | cut -c1-400
fi
t
