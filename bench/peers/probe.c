// The host's own cross-core latency now: two threads on the first two CPUs this process may
// run on pass a counter back and forth through one cache line; prints the round trip in ns.
// On a shared virtual machine it moves by several times from one minute to the next (the
// host's other tenants), and every peer's small-message time moves with it, so the spread
// scripts record it beside each run. Prints "n/a" where fewer than two CPUs are allowed.
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define ROUNDS 200000L
static _Alignas(128) _Atomic long ping;
static _Alignas(128) _Atomic long pong;
static int cpus[2];

static void pin(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  sched_setaffinity(0, sizeof s, &s);
}

static void *echo(void *arg) {
  (void)arg;
  pin(cpus[1]);
  for (long i = 1; i <= ROUNDS; i++) {
    while (atomic_load_explicit(&ping, memory_order_acquire) != i) {
    }
    atomic_store_explicit(&pong, i, memory_order_release);
  }
  return NULL;
}

int main(void) {
  cpu_set_t allowed;
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) {
    puts("n/a");
    return 0;
  }
  int n = 0;
  for (int c = 0; c < CPU_SETSIZE && n < 2; c++)
    if (CPU_ISSET(c, &allowed)) cpus[n++] = c;
  if (n < 2) {
    puts("n/a");
    return 0;
  }
  pthread_t t;
  if (pthread_create(&t, NULL, echo, NULL) != 0) {
    puts("n/a");
    return 0;
  }
  pin(cpus[0]);
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (long i = 1; i <= ROUNDS; i++) {
    atomic_store_explicit(&ping, i, memory_order_release);
    while (atomic_load_explicit(&pong, memory_order_acquire) != i) {
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &b);
  pthread_join(t, NULL);
  printf("%.0f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / ROUNDS);
  return 0;
}
