/* Yardstick for benchmarks/planner_speed.py: the rotor dynamic program written
 * plainly, as rotor's own C code does it -- a memory-major table cost[m][s][t]
 * filled for every m with O(M * L^3) loops, no pruning, no vectorisation tricks.
 * It solves the same integer problem as lightning_rotor's planner (the recursion
 * of tests/reference_planner.py), so the two optimal costs must be equal.
 *
 * Input on stdin (integers, whitespace separated):
 *   L slots loss_tmp
 *   size[0..L]  saved[0..L-1]  fwd_tmp[0..L-1]  fwd_tmp_nograd[0..L-1]  bwd_tmp[0..L-1]
 *   fwd_cost[0..L-1]  bwd_cost[0..L-1]
 * Output: "<optimal cost> <seconds spent in the dynamic program>" or "infeasible <seconds>".
 * Build: gcc -O2 -o rotor_yardstick rotor_yardstick.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static const double INF = 1e300;
static long L, M;
static long *size, *saved, *ftmp, *ftmp_ng, *btmp, loss_tmp;
static double *fcost, *bcost;
static double *given_cost;   /* given_cost[(m * (L + 1) + s) * (L + 1) + t] */
static double *pending_cost; /* pending_cost[m * (L + 1) + s]: t = L, loss still to compute */

static double *G(long m, long s, long t) { return &given_cost[(m * (L + 1) + s) * (L + 1) + t]; }
static double *P(long m, long s) { return &pending_cost[m * (L + 1) + s]; }
static long max2(long a, long b) { return a > b ? a : b; }

static long fe_need(long s, long t, int given) {
    long held = given ? size[t] : 0;
    long need = max2(held + saved[s] + ftmp[s], saved[s] + size[s + 1] + size[s] + btmp[s]);
    if (!given && s + 1 == L) need = max2(need, saved[s] + size[L] + loss_tmp);
    return need;
}

static double cost_of(long m, long s, long t, int given) {
    if (m < 0) return INF;
    return given ? *G(m, s, t) : *P(m, s);
}

static double best(long m, long s, long t, int given) {
    double found = INF;
    if (m >= fe_need(s, t, given)) {
        double sub = s + 1 == t ? 0 : cost_of(m - saved[s], s + 1, t, given);
        if (sub < INF) found = fcost[s] + bcost[s] + sub;
    }
    long held = given ? size[t] : 0;
    long last = given ? t - 1 : t;
    long run = 0;
    double forward = 0;
    for (long s2 = s + 1; s2 <= last; s2++) {
        forward += fcost[s2 - 1];
        long step = s2 == s + 1 ? size[s + 1] + ftmp_ng[s] : size[s2 - 1] + size[s2] + ftmp_ng[s2 - 1];
        run = max2(run, step);
        if (m < held + run) break;
        double right;
        if (!given && s2 == L) {
            if (m < 2 * size[L] + loss_tmp) continue;
            right = 0;
        } else {
            right = cost_of(m - size[s2], s2, t, given);
        }
        double left = *G(m, s, s2);
        if (right >= INF || left >= INF) continue;
        double cost = forward + right + left;
        if (cost < found) found = cost;
    }
    return found;
}

static long read_long(void) {
    long x;
    if (scanf("%ld", &x) != 1) { fprintf(stderr, "rotor_yardstick: bad input\n"); exit(1); }
    return x;
}

int main(void) {
    L = read_long();
    long slots = read_long();
    loss_tmp = read_long();
    size = malloc(sizeof(long) * (L + 1));
    saved = malloc(sizeof(long) * L);
    ftmp = malloc(sizeof(long) * L);
    ftmp_ng = malloc(sizeof(long) * L);
    btmp = malloc(sizeof(long) * L);
    fcost = malloc(sizeof(double) * L);
    bcost = malloc(sizeof(double) * L);
    for (long k = 0; k <= L; k++) size[k] = read_long();
    for (long k = 0; k < L; k++) saved[k] = read_long();
    for (long k = 0; k < L; k++) ftmp[k] = read_long();
    for (long k = 0; k < L; k++) ftmp_ng[k] = read_long();
    for (long k = 0; k < L; k++) btmp[k] = read_long();
    for (long k = 0; k < L; k++) fcost[k] = (double)read_long();
    for (long k = 0; k < L; k++) bcost[k] = (double)read_long();
    M = slots - size[0];
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    if (M < 0) {
        printf("infeasible 0\n");
        return 0;
    }
    given_cost = malloc(sizeof(double) * (M + 1) * (L + 1) * (L + 1));
    pending_cost = malloc(sizeof(double) * (M + 1) * (L + 1));
    if (!given_cost || !pending_cost) { fprintf(stderr, "rotor_yardstick: out of memory\n"); return 1; }
    for (long m = 0; m <= M; m++) {
        for (long d = 1; d <= L; d++)          /* sub-chain length */
            for (long s = 0; s + d <= L; s++) *G(m, s, s + d) = best(m, s, s + d, 1);
        for (long s = L - 1; s >= 0; s--) *P(m, s) = best(m, s, L, 0);
    }
    double answer = *P(M, 0);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double seconds = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
    if (answer >= INF) printf("infeasible %.6f\n", seconds);
    else printf("%.0f %.6f\n", answer, seconds);
    return 0;
}
