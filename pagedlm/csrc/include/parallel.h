/* How the kernels split rows over an OpenMP team. */
#ifndef PAGEDLM_PARALLEL_H
#define PAGEDLM_PARALLEL_H

#ifdef _OPENMP
#include <omp.h>
#endif

/* This thread's index in its team and the team's size (0 and 1 without OpenMP). */
static inline void omp_team(int *t, int *nt) {
#ifdef _OPENMP
    *t = omp_get_thread_num();
    *nt = omp_get_num_threads();
#else
    *t = 0;
    *nt = 1;
#endif
}

/* The calling thread's rows [lo, hi) of n rows taken grain rows at a time: one contiguous run
 * of ceil(grains / threads) whole grains per thread, so each thread's weight reads form one
 * sequential stream and only the last thread has a ragged end. */
static inline void omp_thread_rows(int n, int grain, int *lo, int *hi) {
    int t, nt;
    omp_team(&t, &nt);
    const int grains = (n + grain - 1) / grain, per = (grains + nt - 1) / nt;
    *lo = t * per * grain < n ? t * per * grain : n;
    *hi = *lo + per * grain < n ? *lo + per * grain : n;
}

#endif
