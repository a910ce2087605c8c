/* The Open MPI side of bench/cpu_peers.sh: nccl-tests-style rows for one collective,
 * each call issued and waited (MPI's blocking calls), float32 sum, as
 * `size time_us algbw busbw` per line on rank 0. Usage: mpi_coll OP MINBYTES MAXBYTES ITERS */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static double busf(const char *op, int n) {
    if (!strcmp(op, "all_reduce")) return 2.0 * (n - 1) / n;
    if (!strcmp(op, "all_gather") || !strcmp(op, "reduce_scatter") || !strcmp(op, "all_to_all")) return (double)(n - 1) / n;
    return 1.0;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int me, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &me);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    if (argc < 5) {
        if (me == 0) fprintf(stderr, "usage: mpi_coll OP MINBYTES MAXBYTES ITERS\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *op = argv[1];
    long min = atol(argv[2]), max = atol(argv[3]);
    int iters = atoi(argv[4]);
    float *a = malloc(max + 64), *b = malloc(max + 64);
    if (!a || !b) MPI_Abort(MPI_COMM_WORLD, 3);
    memset(a, 0, max + 64);
    memset(b, 0, max + 64);
    for (long bytes = min; bytes <= max; bytes *= 2) {
        /* a multiple of n elements where the buffer is split among the ranks, else of 1 */
        int split = !strcmp(op, "all_gather") || !strcmp(op, "reduce_scatter") || !strcmp(op, "all_to_all");
        long unit = split ? n : 1;
        long count = bytes / 4 / unit * unit;
        if (count == 0) continue;
        int per = (int)(count / n);
        int warm = 5, total = iters;
        /* fewer calls from 4 MiB on, at least 5 */
        if (bytes >= (1 << 22)) total = iters / 100 > 5 ? iters / 100 : 5;
        double t0 = 0;
        for (int i = 0; i < warm + total; i++) {
            if (i == warm) { MPI_Barrier(MPI_COMM_WORLD); t0 = MPI_Wtime(); }
            if (!strcmp(op, "all_reduce")) MPI_Allreduce(a, b, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (!strcmp(op, "all_gather")) MPI_Allgather(a, per, MPI_FLOAT, b, per, MPI_FLOAT, MPI_COMM_WORLD);
            else if (!strcmp(op, "reduce_scatter")) MPI_Reduce_scatter_block(a, b, per, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            else if (!strcmp(op, "broadcast")) MPI_Bcast(a, (int)count, MPI_FLOAT, 0, MPI_COMM_WORLD);
            else if (!strcmp(op, "all_to_all")) MPI_Alltoall(a, per, MPI_FLOAT, b, per, MPI_FLOAT, MPI_COMM_WORLD);
            else if (!strcmp(op, "barrier")) MPI_Barrier(MPI_COMM_WORLD);
            else if (!strcmp(op, "sendrecv")) MPI_Sendrecv(a, (int)count, MPI_FLOAT, (me + 1) % n, 0, b, (int)count, MPI_FLOAT, (me + n - 1) % n, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
            else { if (me == 0) fprintf(stderr, "unknown op %s\n", op); MPI_Abort(MPI_COMM_WORLD, 2); }
        }
        double dt = (MPI_Wtime() - t0) / total, worst;
        MPI_Reduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        long size = count * 4;
        if (me == 0) {
            double alg = size / worst / 1e9;
            printf("%ld %.2f %.3f %.3f\n", size, worst * 1e6, alg, alg * busf(op, n));
        }
    }
    free(a);
    free(b);
    MPI_Finalize();
    return 0;
}
