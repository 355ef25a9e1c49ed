// A cache line's round trip between two CPUs, in ns: how far apart they are right now (benchmarks/_cores.py).
// Built by _cores.py with `$CC -O2 -shared -fPIC -pthread` and called through ctypes (which releases the GIL).
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#define STOP (-1L)

static _Alignas(64) _Atomic long flag;  // odd: the caller's turn is done; even: the partner's; STOP: partner exits

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int pin_self(int cpu) {
  cpu_set_t s;
  CPU_ZERO(&s);
  CPU_SET(cpu, &s);
  return pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

static void *partner(void *unused) {  // answers every odd value with the next even one until STOP
  (void)unused;
  for (long i = 1;; i += 2) {
    long f;
    while ((f = atomic_load_explicit(&flag, memory_order_acquire)) != i && f != STOP) {
    }
    if (f == STOP) return 0;
    atomic_store_explicit(&flag, i + 1, memory_order_release);
  }
}

// Mean ns per round trip between the calling thread pinned to cpu_a and a partner thread on cpu_b, over `trips`
// round trips or until `max_s` seconds have passed (checked every 1024 trips); negative when a thread cannot be
// pinned (a CPU this process may not use). The caller's own affinity is restored.
double round_trip_ns(int cpu_a, int cpu_b, long trips, double max_s) {
  cpu_set_t old, b;
  pthread_attr_t attr;
  pthread_t t;
  long done = 0;
  double result = -1.0;
  pthread_getaffinity_np(pthread_self(), sizeof old, &old);
  CPU_ZERO(&b);
  CPU_SET(cpu_b, &b);
  atomic_store(&flag, 0);
  pthread_attr_init(&attr);
  pthread_attr_setaffinity_np(&attr, sizeof b, &b);
  int failed = pthread_create(&t, &attr, partner, 0);
  pthread_attr_destroy(&attr);
  if (failed) return -1.0;
  if (pin_self(cpu_a) == 0) {
    double t0 = now_s(), deadline = t0 + max_s;
    for (long i = 1; done < trips; i += 2) {
      atomic_store_explicit(&flag, i, memory_order_release);
      while (atomic_load_explicit(&flag, memory_order_acquire) != i + 1) {
      }
      done++;
      if ((done & 1023) == 0 && now_s() > deadline) break;
    }
    result = (now_s() - t0) * 1e9 / (double)done;
  }
  atomic_store_explicit(&flag, STOP, memory_order_release);
  pthread_join(t, 0);
  pthread_setaffinity_np(pthread_self(), sizeof old, &old);
  return result;
}
