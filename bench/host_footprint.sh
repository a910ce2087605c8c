#!/usr/bin/env bash
# anyccl's own work per call on the device path, counted exactly rather than timed: the
# `host_cost` example (the Communicator and the device layer over a library and a runtime that
# do nothing) under callgrind. Prints the instructions a call runs and the 64-byte lines of code
# that run on every call ("hot lines"), by object and by function.
#
# Why lines: on a GPU host each launch runs enough of the driver's and NCCL's code to push
# anyccl's out of the instruction caches, so every line of anyccl's code a call runs is fetched
# again at the next call (`launch_cost`'s rows 6-7 time straight-line code after each launch
# against the same code in a loop). Timings there move by more than a trim from run to run;
# these counts do not move at all, so they are the measure to work against.
#
#   bash bench/host_footprint.sh            # CALLS (default 5000) calls a run of host_cost
#
# Needs valgrind (installed from Debian if missing) and python3. The example is built into its
# own target directory with rustix's libc backend (`--cfg rustix_use_libc`): rustix's own
# reading of the vDSO is not something valgrind's emulation supports.
set -euo pipefail
cd "$(dirname "$0")/.."
CALLS=${CALLS:-5000}
case $CALLS in '' | *[!0-9]*) echo "host_footprint.sh: CALLS must be a whole number, not '$CALLS'" >&2; exit 2 ;; esac
[ "$CALLS" -ge 100 ] || { echo "host_footprint.sh: CALLS must be at least 100" >&2; exit 2; }
if ! command -v valgrind >/dev/null; then
  apt-get install -y valgrind >/dev/null || { echo "host_footprint.sh: valgrind is missing and could not be installed" >&2; exit 2; }
fi
TARGET=${TARGET:-target/footprint}
RUSTFLAGS="--cfg rustix_use_libc" CARGO_TARGET_DIR="$TARGET" cargo build -q --release -p anyccl-device --example host_cost
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
valgrind --tool=callgrind --dump-instr=yes --compress-pos=no --compress-strings=no \
  --callgrind-out-file="$OUT/callgrind.out" "$TARGET/release/examples/host_cost" "$CALLS" >"$OUT/run.txt" 2>"$OUT/valgrind.txt" || {
  echo "host_footprint.sh: host_cost failed under valgrind:" >&2
  tail -20 "$OUT/valgrind.txt" >&2
  exit 1
}
python3 - "$OUT/callgrind.out" "$CALLS" <<'PY'
import collections, sys

path, calls = sys.argv[1], int(sys.argv[2])
# host_cost runs 4 patterns, each once to warm up and 9 times timed.
runs = 4 * 10 * calls
ir = collections.Counter()
fn_of = {}
ob = fn = None
after_calls = False
for line in open(path):
    if line.startswith("ob="):
        ob = line[3:].strip()
    elif line.startswith("fn="):
        fn = line[3:].strip()
    elif line.startswith("calls="):
        # The next cost line is the call's inclusive cost, not an instruction's own.
        after_calls = True
    elif line.startswith("0x"):
        if after_calls:
            after_calls = False
            continue
        parts = line.split()
        key = (ob, int(parts[0], 16))
        ir[key] += int(parts[-1])
        fn_of[key] = fn
    else:
        after_calls = False
# Hot: run on every call of at least one pattern.
hot = {k: v for k, v in ir.items() if v >= 0.8 * 10 * calls}
lines = {(o, a >> 6) for (o, a) in hot}
print(f"# {calls} calls a run, 4 patterns x 10 runs ({runs} calls in all)")
print(f"instructions per call: {sum(ir.values()) / runs:.0f}")
print(f"hot lines of code per call: {len(lines)} ({len(lines) * 64 / 1024:.1f} KiB)")
by_ob = collections.Counter(o for (o, _) in lines)
ir_ob = collections.Counter()
for (o, _), v in hot.items():
    ir_ob[o] += v
for o, n in by_ob.most_common():
    print(f"  {n:4d} lines  {ir_ob[o] / runs:7.0f} instructions a call  {o.rsplit('/', 1)[-1]}")
print("# by function: hot lines, instructions a call")
seen = set()
per_fn = collections.Counter()
ir_fn = collections.Counter()
for (o, a), v in sorted(hot.items()):
    f = fn_of[(o, a)]
    ir_fn[f] += v
    if (o, a >> 6) not in seen:
        seen.add((o, a >> 6))
        per_fn[f] += 1
for f, n in per_fn.most_common(25):
    print(f"  {n:4d}  {ir_fn[f] / runs:7.1f}  {f[:140]}")
PY
