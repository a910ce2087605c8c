"""The Gloo side of bench/cpu_peers.sh: one collective over torch.distributed's Gloo
backend, float32 sum, each call issued and waited, one row per size on rank 0:
`size time_us algbw busbw` (nccl-tests conventions: all_gather's size is the gathered
output, reduce_scatter's the whole input). Started once per rank with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set. Usage: gloo_coll.py OP MINBYTES MAXBYTES ITERS"""
import os
import sys
import time

import torch
import torch.distributed as dist


def bus(op, n):
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def main():
    op, lo, hi, iters = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    me, n = dist.get_rank(), dist.get_world_size()
    size = lo
    while size <= hi:
        # A multiple of n elements where the buffer is split among the ranks, else of 1.
        unit = n if op in ("all_gather", "reduce_scatter", "all_to_all") else 1
        count = size // 4 // unit * unit
        if count == 0:
            size *= 2
            continue
        per = count // n
        a = torch.ones(count, dtype=torch.float32)
        b = torch.zeros(count, dtype=torch.float32)
        parts = [torch.zeros(per) for _ in range(n)]

        def call():
            if op == "all_reduce":
                dist.all_reduce(b)
            elif op == "all_gather":
                dist.all_gather(parts, a[:per])
            elif op == "reduce_scatter":
                dist.reduce_scatter(parts[0], list(a.split(per)))
            elif op == "broadcast":
                dist.broadcast(a, 0)
            elif op == "all_to_all":
                dist.all_to_all_single(b, a)
            elif op == "sendrecv":
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, a, (me + 1) % n),
                                               dist.P2POp(dist.irecv, b, (me + n - 1) % n)])
                for r in reqs:
                    r.wait()
            else:
                raise SystemExit(f"unknown op {op}")

        total = iters if size < (1 << 22) else max(5, iters // 100)
        try:
            for _ in range(5):
                call()
        except RuntimeError as e:  # an op this Gloo build does not have
            if me == 0:
                print(f"{count * 4} n/a n/a n/a  # {str(e).splitlines()[0][:80]}", flush=True)
            break
        dist.barrier()
        t = time.perf_counter()
        for _ in range(total):
            call()
        dt = (time.perf_counter() - t) / total
        worst = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if me == 0:
            alg = count * 4 / worst.item() / 1e9
            print(f"{count * 4} {worst.item() * 1e6:.2f} {alg:.3f} {alg * bus(op, n):.3f}", flush=True)
        size *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
