"""torch.distributed peer of anyccl-bench: the same nccl-tests-style rows, for comparing
both in one command. Run with torchrun, e.g.

    torchrun --nproc_per_node 2 bench/torch_bench.py all_reduce -b 8 -e 1G -f 2 -n 20 -w 5

Timing matches anyccl-bench: the ranks meet, run the warm-up calls, then `iters` calls
issued back to back on distinct output buffers, one synchronisation at the end. The cold columns are the first call's time and
the device memory it took (free-memory delta).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def size(s):
    s = s.strip()
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mul > 1 else s) * mul


DTYPES = {"float": torch.float32, "f32": torch.float32, "half": torch.float16, "f16": torch.float16,
          "bf16": torch.bfloat16, "double": torch.float64, "f64": torch.float64, "int32": torch.int32, "i32": torch.int32}
OPS = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "avg": dist.ReduceOp.AVG}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("op")
    p.add_argument("-b", default="8")
    p.add_argument("-e", default="128M")
    p.add_argument("-f", type=int, default=2)
    p.add_argument("-n", type=int, default=20)
    p.add_argument("-w", type=int, default=5)
    # As anyccl-bench: before the first timed row, warm up for this long (ms), so a device
    # that sat idle through the connect has left its low clocks.
    p.add_argument("--warmup-ms", type=float, default=100.0)
    p.add_argument("-d", default="float")
    p.add_argument("-o", default="sum")
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    n, me = dist.get_world_size(), dist.get_rank()
    dt, op = DTYPES[a.d], OPS[a.o]
    es = torch.tensor([], dtype=dt).element_size()
    store = dist.distributed_c10d._get_default_store()

    def store_barrier(name):
        # Meet through the store: dist.barrier() is an all_reduce and would connect the
        # transports before the cold call is measured.
        if store.add(f"bench/{name}", 1) == n:
            store.set(f"bench/{name}/done", "1")
        store.wait([f"bench/{name}/done"])
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "broadcast": 1.0, "sendrecv": 1.0}[a.op]
    if me == 0:
        print(f"# torch.distributed {a.op} on {n} ranks, torch {torch.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
        print("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong     time   devmem")
    nbytes = max(size(a.b), es * n)
    total = 0.0
    rows = 0
    while nbytes <= size(a.e):
        count = (nbytes // es // n) * n
        depth = max(1, min(a.n, (4 << 30) // max(1, count * es)))
        send = torch.ones(count, dtype=dt, device="cuda")
        if a.op == "all_gather":
            send = torch.ones(count // n, dtype=dt, device="cuda")
            outs = [torch.empty(count, dtype=dt, device="cuda") for _ in range(depth)]
        elif a.op == "reduce_scatter":
            outs = [torch.empty(count // n, dtype=dt, device="cuda") for _ in range(depth)]
        else:
            outs = [torch.empty(count, dtype=dt, device="cuda") for _ in range(depth)]

        def call(out):
            if a.op == "all_reduce":
                dist.all_reduce(out, op=op)
            elif a.op == "all_gather":
                dist.all_gather_into_tensor(out, send)
            elif a.op == "reduce_scatter":
                dist.reduce_scatter_tensor(out, send, op=op)
            elif a.op == "broadcast":
                dist.broadcast(out, 0)
            elif a.op == "sendrecv":
                ops = [dist.P2POp(dist.isend, send, (me + 1) % n), dist.P2POp(dist.irecv, out, (me - 1) % n)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

        store_barrier(f"cold{nbytes}")
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t = time.perf_counter()
        call(outs[0])
        torch.cuda.synchronize()
        cold_us = (time.perf_counter() - t) * 1e6
        cold_mib = (free0 - torch.cuda.mem_get_info()[0]) / (1 << 20)
        # Meet before the warm-up calls, not right before the timer (as anyccl-bench): the
        # last warm-up collective lines the ranks up more closely than a store barrier.
        store_barrier(f"timed{nbytes}")
        t = time.perf_counter()
        for i in range(max(1, a.w)):
            call(outs[i % depth])
        torch.cuda.synchronize()
        if rows == 0 and a.warmup_ms > 0:
            # Every rank issues the same calls: rank 0 says how many, in rounds, until the
            # time has passed on its clock, each round's count from the pace of the one
            # before (as anyccl-bench does: one count from the first calls' pace, which
            # include the ranks' start apart, fell short of the time).
            spent, calls = time.perf_counter() - t, max(1, a.w)
            took = spent
            for rnd in range(8):
                left = a.warmup_ms / 1e3 - spent
                want = 0 if left <= 0 else min(10**6, int(left / max(took / calls, 1e-7)) + 1)
                if me == 0:
                    store.set(f"bench/warm{nbytes}/{rnd}", str(want))
                calls = int(store.get(f"bench/warm{nbytes}/{rnd}"))
                if calls == 0:
                    break
                t = time.perf_counter()
                for i in range(calls):
                    call(outs[i % depth])
                torch.cuda.synchronize()
                took = time.perf_counter() - t
                spent += took
        t = time.perf_counter()
        done = 0
        while done < a.n:
            k = min(depth, a.n - done)
            for i in range(k):
                call(outs[i])
            torch.cuda.synchronize()
            done += k
        us = (time.perf_counter() - t) * 1e6 / a.n
        b = count * es
        algbw = b / us / 1e3
        total += algbw * factor
        rows += 1
        if me == 0:
            rop = a.o if a.op in ("all_reduce", "reduce_scatter") else "none"
            print(f"{b:12} {count:13} {str(dt).replace('torch.', ''):>9} {rop:>7} {-1:>7} {us:8.2f} {algbw:7.2f} {algbw * factor:7.2f} {'N/A':>6} "
                  f"{'N/A':>8} {'N/A':>7} {'N/A':>7} {'N/A':>6} {cold_us:8.1f} {cold_mib:8.1f}", flush=True)
        del outs, send
        nbytes *= a.f
    if me == 0:
        print(f"# Avg bus bandwidth    : {total / max(rows, 1):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
