#!/usr/bin/env bash
# Where the host's time goes per call with real launches, on a GPU machine without perf: here,
# PACK=1 copies perf and the libraries it loads (glibc's own excepted: the GPU machine's newer
# ones serve) into $BIN/perf (about 34 MiB); there, perf samples launch_cost's rows one at a time
# (1: raw NCCL with an event per call, 4: the backend's Collective alone, 3: the Work path
# through the Communicator) and prints each row's symbols by their own time, then the hottest
# instructions of anyccl's per-call functions (a line a launch pushed out shows as a stall on
# the first instruction that reads it).
#
#   PACK=1 BIN=.gpu bash bench/gpu_profile.sh     # here, after copying launch_cost into $BIN
#   BIN=.gpu bash bench/gpu_profile.sh            # there (source the NCCL env.sh first)
#
# Output goes to $OUT (default /tmp/anyccl-profile), one file per row and function, and all of
# them in $OUT.tar.gz. CALLS (default 3000000, about 12 s a row on an H100 host) calls a row, sampled from DELAY_MS (default 3000).
set -uo pipefail
BIN=${BIN:-.gpu}
OUT=${OUT:-/tmp/anyccl-profile}
if [ "${PACK:-0}" = 1 ]; then
  command -v perf >/dev/null || { echo "gpu_profile.sh: perf is not installed here (apt-get install linux-perf)" >&2; exit 2; }
  rm -rf "$BIN/perf" && mkdir -p "$BIN/perf/lib" && cp "$(command -v perf)" "$BIN/perf/"
  for l in $(ldd "$(command -v perf)" | awk '/=>/ {print $3}'); do
    case $(basename "$l") in libc.so* | libm.so* | libpthread* | libdl.so* | librt.so* | ld-linux*) ;; *) cp -L "$l" "$BIN/perf/lib/" ;; esac
  done
  du -sh "$BIN/perf"
  exit 0
fi
[ -x "$BIN/perf/perf" ] && [ -x "$BIN/launch_cost" ] || { echo "gpu_profile.sh: $BIN needs perf/ (PACK=1) and launch_cost" >&2; exit 2; }
mkdir -p "$OUT"
P() { LD_LIBRARY_PATH="$PWD/$BIN/perf/lib" "$BIN/perf/perf" "$@"; }
P stat -e task-clock true >/dev/null 2>&1 || { echo "gpu_profile.sh: perf cannot sample here (kernel.perf_event_paranoid = $(cat /proc/sys/kernel/perf_event_paranoid))" >&2; exit 2; }
for row in 1 4 3; do
  echo "### row $row"
  # Sampling starts after DELAY_MS, past the driver's and NCCL's start (which otherwise fill
  # the profile), and CALLS keep the row running well beyond it.
  timeout 90 env LD_LIBRARY_PATH="$PWD/$BIN/perf/lib:${LD_LIBRARY_PATH:-}" "$BIN/perf/perf" record -F 15000 -D "${DELAY_MS:-3000}" -o "$OUT/row$row.data" \
    "$BIN/launch_cost" "${CALLS:-3000000}" 1 "$row" > "$OUT/row$row.run" 2>&1 || { echo "perf record failed (exit $?)"; tail -3 "$OUT/row$row.run"; continue; }
  # Samples per library first (the rows differ by anyccl's code, or by what it asks of the
  # driver and NCCL), then per symbol.
  P report -i "$OUT/row$row.data" --stdio --no-children --sort dso 2>/dev/null | grep -E '^ +[0-9]' | head -8 | tee "$OUT/row$row.txt"
  P report -i "$OUT/row$row.data" --stdio --no-children --sort dso,sym 2>/dev/null | grep -E '^ +[0-9]' | head -40 | tee -a "$OUT/row$row.txt"
  i=0
  while IFS= read -r s; do
    i=$((i + 1))
    { echo "# $s"; P annotate -i "$OUT/row$row.data" --stdio -s "$s" 2>/dev/null | grep -E '^\s+[0-9]+\.[0-9]+ :' | sort -rn | head -12; } > "$OUT/row$row-fn$i.txt"
  done <<'SYMS'
anyccl_device::comm::launch::<impl anyccl_device::comm::DeviceComm<L>>::launch_op
anyccl_device::comm::launch::<impl anyccl_device::comm::DeviceComm<L>>::lock_settled
anyccl_device::comm::launch::<impl anyccl_device::comm::DeviceComm<L>>::record_mark
anyccl_device::comm::launch::<impl anyccl_device::comm::DeviceComm<L>>::look
anyccl_core::communicator::Communicator::all_reduce
anyccl_core::recorder::FlightRecorder::write
SYMS
  rm -f "$OUT/row$row.data"
done
tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$(basename "$OUT")"
