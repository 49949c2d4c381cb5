/* Float32 y[M, N] = x[M, K] @ W[N, K]^T on AMX (tdpbf16ps) over the bfloat16 panels.
 *
 * AMX's B tile ("VNNI" format) is k-pairs: row j holds, per output column, W[c][2j] and
 * W[c][2j+1]. Where the build has AMX it has AVX512-BF16, so gemv.pack_panels packs bfloat16
 * panels in k-pairs (gemv_f32.c), wp[p][j][c][e] = W[p * 32 + c][2j + e]: for a 32-column
 * panel, pair row j is 128 bytes, the B tiles' layout as it stands, and no second copy of the
 * weight is kept.
 * Then:
 *   - x's rows are rounded to bfloat16 once per call (vcvtne2ps2bf16: to nearest even, a
 *     subnormal read as zero) into a per-call scratch, rows padded with zeros to a multiple
 *     of 16; an A tile is 16 of its rows, 32 k (64 bytes) each. One thread rounds the first
 *     row chunk (below) up front and each next one while the chunk before it runs, a few 32-k
 *     segments per k step, so that reading x (float32, from memory) overlaps the tile unit's
 *     work;
 *   - a B tile is 16 pair rows of a panel at stride 128 bytes, columns 0-15 at +0 and 16-31 at
 *     +64; a C tile is 16 x 16 float32;
 *   - a block is 2 A tiles (32 rows) x 2 B tiles (one panel) -> 4 C tiles, over K in steps of
 *     32 (16 pairs); 16 leftover (padded) rows take 1 A tile x 2 B tiles; blocks whose rows or
 *     columns run past y's go through a 32 x 32 buffer;
 *   - rows go in chunks of about MCHUNK_BYTES of scratch (kept in L2 while every panel of the
 *     thread passes over it: each panel is then read from memory once a chunk, not once a
 *     32-row block). A team splits the rows (runs of 32) where there are more than (threads -
 *     1) chunks of them: each thread rounds its own rows as one thread does and runs every
 *     panel, and reads no more weight bytes in all than a panel split's ceil(M / chunk)
 *     passes (at 2 threads, from 1 to 2 chunks: 2 passes either way), with no barrier.
 *     Fewer rows: each thread takes one run of whole panels, so each weight byte is read by
 *     one thread, after the team has rounded the rows (split by rows) and met at a barrier;
 *   - while a panel's blocks run, the next panel's lines (of the k range) are prefetched into
 *     L2 (prefetcht1), spread evenly over the panel's k steps: the model's weights (SmolLM2-
 *     135M: 212 MB of bfloat16 over its 30 layers) never stay in cache between steps, and a
 *     B tile load that waits on memory stalls the tile unit;
 *   - a block's C tiles go to a buffer in L1 at its end, and on to y a few rows per k step of
 *     the next block (masked stores for a ragged block's columns): y's lines miss the caches,
 *     and 4 KiB of them stored at once held the tile unit up; when y is NT_MIN_BYTES or more,
 *     full rows (64-byte aligned) go with non-temporal stores: such a y does not stay in the
 *     caches anyway, and a store into it first read each line from memory;
 *   - K past KBLOCK (the 1B model's 8192) goes in blocks of KBLOCK, the C tiles stored to a
 *     padded float32 scratch and loaded back between blocks (exact: the same sums), so that a
 *     chunk still holds 128 rows rather than 32.
 * K must be a multiple of 32 (SmolLM2's 576 and 1536, the 1B model's 2048 and 8192 are): a
 * ragged K would need a second tile configuration for its last pairs, and its B tile would
 * read past the panel; other K are passed to gemm_panels_bf16 (amx.runs(k) tells callers).
 *
 * Arithmetic: Intel's SDM writes tdpbf16ps as, per output, the pair's even product then its
 * odd one added to a float32 sum, subnormal inputs read as zero and results flushed, MXCSR
 * ignored; the hardware's errors against float64 measured here are about a third of
 * vdpbf16ps's (SmolLM2's shapes), so it seems to sum more exactly than that, and the tests
 * hold it to the bound of a float32 sum, not to an emulation. Each C row depends only on its
 * own A row and the panel, in a fixed K order, so a row's result does not depend on the other
 * rows of its tile, block or batch. But x is rounded and the sums are neither the widening
 * kernel's nor vdpbf16ps's, so its bits differ from gemm_panels_bf16's: the deterministic mode
 * (one path at every row count) does not use it.
 *
 * Measured on this project's Xeon (2 vCPUs, a Sapphire Rapids-class core: L1d 48 KiB, L2
 * 2 MiB) with benchmarks/amx_gemm.py: a pass multiplies M rows by SmolLM2-135M's four shapes
 * (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) in each of 30 layers, "cold" with
 * 30 layers' distinct weights (212 MB, as the model reads them), "warm" with one layer's (7 MB)
 * repeated. Other jobs kept the machine at a load average of 7-8, which made 2-thread wall
 * times swing tenfold, so: 1 thread on its own CPU time (--threads 1 --clock thread --torch),
 * medians of 5 interleaved rounds, ms a pass (GFLOP/s), before the prefetch and non-temporal
 * stores / after / torch's bfloat16 F.linear (oneDNN; x already bfloat16, y bfloat16):
 *   cold 16 rows 20.4 (167) / 19.0 (178) / 40.6; 32: 26.4 (257) / 22.4 (303) / 44.0;
 *   64: 34.5 (394) / 30.9 (440) / 55.3; 128: 52.6 (516) / 43.2 (629) / 68.4 (398);
 *   512: 191 (568) / 139 (782) / 150 (723); 2048: 740 (588) / 506 (859) / 352 (1235);
 *   warm 16 rows 9.9 (343) / 10.2 (332) / 23.1; 32: 12.4 / 11.1 / 26.1; 64: 18.8 / 16.8 / 36.2;
 *   128: 33.7 (808) / 28.9 (939) / 47.1; 512: 145 (749) / 117 (930) / 123 (886);
 *   2048: 698 (623) / 481 (905) / 318 (1367).
 * The prefetch alone (an earlier run at load 4-5, same clock and passes) gave cold 16 rows
 * 191 -> 207 GFLOP/s, 128: 714 -> 813, 512: 888 -> 995; warm 16 rows lost 3% (its lines are
 * already in L2: 32 prefetches a k step for nothing), which the model's steps never see.
 * Prefetching one panel ahead beat two panels ahead and prefetcht0 (which evicted the panel
 * in use from L1); prefetching A's next k step into L1, loading tiles interleaved with the
 * TMULs, and rounding each row chunk just before its panels use it did not help.
 * At 2048 rows (4 layers, 3 rounds, against the build with the prefetch alone) the y stores
 * took 40% of the time: storing the tiles to a scratch instead of y ran 1234 GFLOP/s against
 * 762. Non-temporal stores from 4 MiB of y
 * (16 MiB: 816 GFLOP/s) give 862 against 631 at 2048 rows and 843 against 787 at 1024;
 * at 512 rows (only gate_up's 6.3 MB y streams) 892 against 912, at 128 and 512 with every
 * y streamed 687 / 836 against 781 / 900 (the L1 copy and a y the next op then reads from
 * memory), hence a threshold; plain stores through the same buffer were slower still.
 * End to end (benchmarks/throughput.py --dtype bfloat16 --num-prompts 128, quiet machine, 2
 * rounds each) they take the prompt linears from 5.39 / 5.30 s to 5.04 / 4.93 and the LM
 * head's 65-128 rows from 0.90 to 0.74 / 0.68, but the rest of the forward (the ops that then
 * read y from memory) from 4.93 / 4.73 to 5.14 / 4.97: elapsed 30.75 / 30.14 s against
 * 30.90 / 30.02, a wash there. What the run gains is the prefetch's: its decode linears
 * (9-128 rows) took 5.86 / 5.87 s before this change and 5.28 / 5.07 after it.
 * oneDNN stayed ahead from 512 rows (1.4-1.5x at 2048; it writes bfloat16 y, half the bytes).
 * What bound it there (issue 32; probes are builds with one part left out or made wrong, 1
 * thread, thread clock, 10 layers): at 5f989fe, warm, load 1.5, with no y stores 512 rows ran
 * 50.5 -> 34.5 ms and 2048 rows 249 -> 137 (1.5x, 1.8x); A tiles all read from one L1-resident
 * block (L2 bandwidth out of the way) 46.1 and 217 (1.1x): the y stores, not L2. This
 * machine's one core stores to memory at about 8 GB/s (plain, each line read first) and 12-17
 * GB/s (non-temporal), and a 2048-row y is 42 MB a layer; 4 KiB of it at each block's end
 * stalled the tile unit, and spreading them over the next block's k steps gained 5-10%. With
 * that, leaving the rounding out (load 3-5) ran 2048 rows warm 211 -> 174 ms, cold 278 -> 227,
 * 512 warm 53.7 -> 46.2: the rounding pass read 4.7-12.6 MB of float32 x a shape (2048 rows)
 * from memory while the tile unit idled, hence rounding a chunk ahead. Interleaved, at a load
 * average of 3.4 (other jobs share the memory and L3, so absolute times run 1.2-2x the
 * table's: compare within a row), 7 rounds, ms a pass of 10 layers (GFLOP/s), 5f989fe / now
 * / torch:
 *   cold 512 rows 61.2 (592) / 55.1 (658) / 95.0; 2048: 247 (587) / 206 (703) / 202 (716);
 *   warm 512 53.6 (676) / 47.4 (765) / 65.9; 2048: 228 (636) / 183 (794) / 171 (847);
 *   and (30 layers, 5 rounds, load 3.6-3.8, ranges of +-30% at 2048) cold 128 rows 105 / 84.0
 *   / 170, warm 128 45.3 / 41.7 / 90.5.
 * Now, at 2048 rows (probes at load 3.5-3.8): no y stores still 1.3x (cold 227 -> 176 ms),
 * no rounding 1.04x (the first chunk's, not overlapped): y's float32 bytes to memory bound
 * it, twice oneDNN's. Warm, 2048 rows (load 3.8-5): now 155 ms, no y stores 123, and A tiles
 * from L1 too 117, and B tiles too (no prefetch) 110 ms, 1312 GFLOP/s: half of 1024 flops a
 * cycle at 2.6 GHz, the tile loop's own ceiling here (oneDNN's best warm figure is about
 * that); L2 costs 5% an operand. Not kept, within the noise at 512 rows: the short chunk
 * first (its rounding the only one not overlapped), prefetchw of y's rows two k steps ahead,
 * non-temporal stores for every y (which also leaves y in memory for the next op).
 * 2 threads' wall times at a load of 4-5 swung 3-10x; their work instead (both threads' CPU
 * time, OMP_WAIT_POLICY=passive so that a waiting thread sleeps; --clock process, 5 rounds,
 * load 4-4.6, ms a pass of 10 layers), 5f989fe / now / torch: cold 512 rows 85.7 / 68.1 /
 * 89.1, 2048: 279 / 221 / 203; warm 512 60.2 / 47.4 / 64.9, 2048: 238 / 202 / 183; and the
 * row split against the panel split (3075430, rounding all rows at a barrier) 54.4 -> 52.1,
 * 228 -> 202, 62.4 -> 55.1, 197 -> 180: no more work for its weight passes, and no barrier
 * for a descheduled thread to hold up (wall time: not measured quietly).
 * Decode rows (16-128; issue 32, 2026-11-27, another helper's jobs on the other core, load
 * 1.4-2.1): what bounds them cold is the weight stream's 4 KiB pages, not the tile loop.
 * benchmarks/amx_gemm.py --huge also runs each build on the same 30 layers copied into one
 * buffer of 2 MiB transparent huge pages (madvise(MADV_HUGEPAGE) before the first touch;
 * /proc's AnonHugePages showed 202 of its 212 MB in them). Same code (HEAD), 5 rounds, ms a
 * 30-layer pass, 4 KiB pages / 2 MiB pages, each 4 KiB pass right after a 2 MiB one:
 *   1 thread, thread clock, load 1.7-2.1: 16 rows 34.2, 32.9 / 19.5, 19.1 (two copies of the
 *   build); 128: 66.4, 63.9 / 41.4, 40.4; in a quieter minute: 16 rows 22.5, 22.1 / 19.1,
 *   19.3; 128: 46.1, 46.8 / 41.1, 40.3; while the other core streamed memory (the 4 KiB
 *   passes in turn, not after a 2 MiB one): 16 rows 80.2, 52.8 / 22.5, 20.4; 128: 141, 101 /
 *   49.8, 44.6;
 *   2 threads, OMP_WAIT_POLICY=passive, process clock, load 2.8-3.1: 16 rows 29.0, 29.2 /
 *   21.5, 21.5; 32: 31.8, 32.6 / 24.9, 24.9; 64: 41.8, 42.4 / 32.8, 33.4; 128: 55.0, 53.2 /
 *   45.5, 44.9; an earlier run (load 1.6, the 4 KiB passes in turn) 16 rows 48.3, 36.8 /
 *   21.8, 20.8; 32: 58.3, 39.6 / 25.9, 24.2; 64: 69.9, 49.6 / 33.6, 32.1; 128: 92.6, 69.4 /
 *   46.0, 45.2 (2-thread wall times: no scaling to measure, the other core busy).
 * 2 MiB passes hold within +-5% whatever the other core does; 4 KiB passes run 1.15x their
 * time in a quiet minute, 1.2-1.75x with the page tables just evicted, 1.5-2.2x and up to
 * 3.6x while the other core streams memory. Each 36 KiB panel spans 9-10 pages, each a page
 * walk, and a page-table line (8 pages, 32 KiB of weights; 415 KB of them for 212 MB) does not
 * stay in the caches past the weight stream and the other core's work. The engine runs other
 * ops between a step's linears, so its walks start cold: its ~42 ms (wall, 2 threads) a step
 * at 65-128 rows sits with the 4 KiB figures here (128 rows, 2 threads: 53-93 ms of CPU a
 * pass, 27-46 ms of wall were the threads perfectly parallel), not the 2 MiB ones (45 ms).
 * The pages are not this kernel's to choose: they are the packed panels' (gemv.pack_panels
 * through torch's allocator, 4 KiB pages; THP mode "madvise" here, so only memory that asks
 * gets 2 MiB pages, and only whole aligned 2 MiB of it). Tried in the kernel with 4 KiB
 * pages, none beyond the noise: touching one line per page of panels 2-4 ahead with
 * prefetcht1 (to start the walks early), the same with a load (a sure walk and TLB fill; the
 * ROB holds ~0.8 us of tile work to hide it), prefetching 2 panels ahead, prefetching the
 * next panel twice as fast. With 2 MiB pages: 2 panels ahead 16 rows 19.4 -> 20.1 ms, 128
 * 41.3 -> 42.2; twice as fast 20.6, 43.7; no software prefetch 19.8 (the L2 streamer covers
 * 16 rows once it need not stop at 4 KiB) but 128 rows 46.2 (it does not keep up there).
 * This VM has no hardware counters (perf stat: not supported): the walks are inferred from
 * the pages, not counted. With 2 MiB pages, one thread, 16 rows read ~11 GB/s of weights
 * (one core's stream; torch.sum on 2 threads 17 GB/s) and 128 rows run ~660 GFLOP/s (warm
 * ~940): the overlap of the stream with the tile work, not either bound alone.
 *
 * Before the prefetch and stores (2 threads, a quiet machine), the 1B model's shapes, this
 * kernel / widening panel kernel / torch: 3072x2048 at 100 rows 0.64 / 3.11 / 0.85 ms, at 512
 * 2.87 (2242 GFLOP/s) / 15.92 / 2.86; 2048x8192 (K blocks) at 100 2.05 / 8.41 / 2.35, at 512
 * 8.89 (1932) / 43.75 / 8.69; 16384x2048 at 512 26.8 / 98.6 / 15.5. MCHUNK_BYTES of 64 KiB /
 * 256 KiB / 512 KiB / 1 MiB: 966 / 1195 / 1454 / 1479 GFLOP/s at 2048 rows, 2 MiB and 4 MiB no
 * better.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "include/pagedlm_ops.h"
#include "include/parallel.h"

#if defined(__linux__) && defined(__x86_64__) && defined(__AMX_TILE__) \
    && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Linux hands out the 8 KiB of tile data state only to a process that asks (arch_prctl,
 * since 5.16); without it the first tile instruction faults. */
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Rows of x scratch a chunk holds: about MCHUNK_BYTES of bfloat16 rows, a multiple of 32. */
#ifndef MCHUNK_BYTES
#define MCHUNK_BYTES (512 * 1024)
#endif
/* K is taken in blocks of at most this many (see amx_thread). */
#ifndef KBLOCK
#define KBLOCK 2048
#endif
/* From this many bytes of y the full blocks go to y with non-temporal stores (see
 * store_block). */
#ifndef NT_MIN_BYTES
#define NT_MIN_BYTES (4L << 20)
#endif
/* Below this many multiply-adds one thread does the whole call (an OpenMP team costs a few
 * microseconds to wake, which is what 2^21 take on the tile unit). */
#define PAR_MIN_MACS (1L << 21)

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

int amx_bf16_available(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        /* Asked once per process (two threads asking at once ask twice, which is harmless):
         * the permission is the process's, every thread's (later ones included). */
        unsigned long mask = 0;
        const int granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0
                            && syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &mask) == 0
                            && (mask >> XFEATURE_XTILEDATA & 1);
        s = granted ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s == 1;
}

/* LDTILECFG's 64-byte operand, palette 1. */
struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-3: C (rows 0-15 x columns 0-15, 0-15 x 16-31, 16-31 x 0-15, 16-31 x 16-31);
 * 4, 5: A (rows 0-15, 16-31); 6, 7: B (columns 0-15, 16-31). All 16 rows of 64 bytes. */
static void load_tiles(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
}

/* Rows [lo, hi) of x rounded to bfloat16, K (a multiple of 32) a row; rows past M zero. */
static void round_rows(uint16_t *xb, const float *x, int M, int K, int lo, int hi) {
    for (int m = lo; m < hi; m++) {
        uint16_t *out = xb + (size_t)m * K;
        if (m >= M) {
            memset(out, 0, (size_t)K * sizeof *out);
            continue;
        }
        const float *xr = x + (size_t)m * K;
        for (int k = 0; k < K; k += 32)
            _mm512_storeu_si512(out + k, (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(xr + k + 16), _mm512_loadu_ps(xr + k)));
    }
}

/* Rows [row, end) of x still to round into the scratch, one 32-k segment at a time: the next
 * row chunk's, spread over the k steps of the chunk in use (see amx_panels). */
struct rounder {
    const float *x;
    uint16_t *xb;
    int M, K, row, end, k, per_step;
};

static inline __attribute__((always_inline)) void round_some(struct rounder *r, int n) {
    for (int i = 0; i < n && r->row < r->end; i++) {
        uint16_t *out = r->xb + (size_t)r->row * r->K + r->k;
        if (r->row < r->M) {
            const float *xr = r->x + (size_t)r->row * r->K + r->k;
            _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + 16),
                                                                  _mm512_loadu_ps(xr)));
        } else {
            _mm512_storeu_si512(out, _mm512_setzero_si512());
        }
        if ((r->k += 32) == r->K) r->k = 0, r->row++;
    }
}

/* C tiles 0-1 (and 2-3 for 32 rows) to dst, rows ld bytes apart. */
static inline __attribute__((always_inline)) void store_tiles(float *dst, size_t ld, int rows) {
    _tile_stored(0, dst, ld);
    _tile_stored(1, dst + 16, ld);
    if (rows == 32) {
        _tile_stored(2, (char *)dst + 16 * ld, ld);
        _tile_stored(3, (char *)dst + 16 * ld + 64, ld);
    }
}

/* A block's C tiles, stored to an L1 buffer at the block's end and copied on to y a few rows
 * per k step of the next block (see amx_panels). */
struct pending {
    float buf[32 * 32] __attribute__((aligned(64)));
    float *dst;         /* y at the block's first row and column */
    size_t ld;          /* y's row stride in floats */
    int next, rows;     /* the next row to copy, the rows to copy (those in y) */
    int per_step;       /* rows copied per k step */
    __mmask16 lo, hi;   /* the columns in y of the row's two halves */
    int stream;         /* full, 64-byte aligned rows: non-temporal stores */
};

/* Copies up to n more of the pending rows to y. */
static inline __attribute__((always_inline)) void drain(struct pending *pd, int n) {
    const int end = pd->rows - pd->next < n ? pd->rows : pd->next + n;
    for (int m = pd->next; m < end; m++) {
        float *d = pd->dst + (size_t)m * pd->ld;
        const __m512 a = _mm512_load_ps(pd->buf + m * 32);
        const __m512 b = _mm512_load_ps(pd->buf + m * 32 + 16);
        if (pd->stream) {
            _mm512_stream_ps(d, a);
            _mm512_stream_ps(d + 16, b);
        } else {
            _mm512_mask_storeu_ps(d, pd->lo, a);
            _mm512_mask_storeu_ps(d + 16, pd->hi, b);
        }
    }
    pd->next = end;
}

/* The C tiles of the block at rows m0.. (rows: 16 or 32 of them valid in the scratch, fewer in
 * y's M) and columns n0.. (cols of them in y) become pending for y (rows ldy floats apart),
 * after the previous block's rows left; where stream (a y of NT_MIN_BYTES or more), full rows
 * at 64-byte aligned addresses go with non-temporal stores (the caller's sfence orders them).
 * ksteps: the next block's k steps, over which the rows are spread. */
static inline __attribute__((always_inline)) void store_block(
        struct pending *pd, float *y, int M, int ldy, int m0, int n0, int cols, int rows,
        int stream, int ksteps) {
    drain(pd, 32);
    const int valid = M - m0 < rows ? M - m0 : rows;
    store_tiles(pd->buf, 128, rows);
    pd->dst = y + (size_t)m0 * ldy + n0;
    pd->ld = (size_t)ldy;
    pd->next = 0;
    pd->rows = valid;
    pd->per_step = (valid + ksteps - 1) / ksteps;
    pd->lo = (__mmask16)(cols >= 16 ? 0xffff : (1u << cols) - 1);
    pd->hi = (__mmask16)(cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1);
    pd->stream = stream && cols == 32 && (((uintptr_t)pd->dst | pd->ld * 4) & 63) == 0;
}

/* Prefetches the next `n` lines of the stream [*pf, end) into L2 (see amx_panels). */
static inline __attribute__((always_inline)) void prefetch_lines(const char **pf,
                                                                 const char *end, int n) {
    for (int i = 0; i < n && *pf < end; i++, *pf += 64) _mm_prefetch(*pf, _MM_HINT_T1);
}

/* Rows of a chunk at kn k: about MCHUNK_BYTES of scratch, a multiple of 32. */
static int chunk_rows(int kn) {
    const int chunk = (int)(MCHUNK_BYTES / ((size_t)kn * 2)) / 32 * 32;
    return chunk < 32 ? 32 : chunk;
}

/* Panels [lo, hi), k in [k0, k1), against the scratch's M16 rows (a multiple of 16; K a row),
 * in row chunks, into y (My rows, ldy floats apart; columns past N are not stored): each C
 * tile starts at zero, or where accumulate, from y (then a K-blocked call's padded scratch,
 * which a float32 store and load keep exactly: the sums are the unblocked ones). The next
 * panel's k range is prefetched over this panel's k steps in all its blocks: 32 lines a step
 * at one block, 8 at four; the last panel of the run prefetches nothing. Where x is given
 * (one thread, k the whole K: x's M rows, float32), this call rounds them into the scratch,
 * chunk by chunk ahead of use; otherwise the scratch holds them already. */
static void amx_panels(float *y, int My, int ldy, int N, uint16_t *xb, const uint16_t *wp,
                       int M16, int K, int k0, int k1, int lo, int hi, int accumulate,
                       int stream, const float *x, int M) {
    const size_t lda = (size_t)K * 2, panel_bytes = (size_t)K * 64, ldc = (size_t)ldy * 4;
    const int kn = k1 - k0, ksteps = kn / 32;
    struct pending pd = {.next = 0, .rows = 0, .per_step = 0};
    const int chunk = chunk_rows(kn);
    struct rounder rd = {.x = x, .xb = xb, .M = M, .K = K, .row = 0, .end = 0, .k = 0};
    if (x != NULL) round_rows(xb, x, M, K, 0, M16 < chunk ? M16 : chunk);
    for (int c0 = 0; c0 < M16; c0 += chunk) {
        const int c1 = M16 - c0 < chunk ? M16 : c0 + chunk;
        const int blocks = (c1 - c0 + 31) / 32, per_step = (32 + blocks - 1) / blocks;
        if (x != NULL) {
            round_some(&rd, 1 << 30); /* this chunk's rows all rounded */
            rd.row = c1;
            rd.end = M16 - c1 < chunk ? M16 : c1 + chunk;
            const long segs = (long)(rd.end - rd.row) * (K / 32);
            const long steps = (long)(hi - lo) * blocks * (kn / 32);
            rd.per_step = steps > 0 ? (int)((segs + steps - 1) / steps) : 0;
        }
        for (int p = lo; p < hi; p++) {
            const char *w = (const char *)wp + (size_t)p * panel_bytes + (size_t)k0 * 64;
            const int n0 = p * 32, cols = N - n0 < 32 ? N - n0 : 32;
            const char *pf = w + panel_bytes, *pf_end = p + 1 < hi ? pf + (size_t)kn * 64 : pf;
            int m0 = c0;
            for (; m0 + 32 <= c1; m0 += 32) {
                const char *a = (const char *)(xb + (size_t)m0 * K + k0);
                if (accumulate) {
                    float *yb = y + (size_t)m0 * ldy + n0;
                    _tile_loadd(0, yb, ldc);
                    _tile_loadd(1, yb + 16, ldc);
                    _tile_loadd(2, yb + (size_t)16 * ldy, ldc);
                    _tile_loadd(3, yb + (size_t)16 * ldy + 16, ldc);
                } else {
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                }
                for (int k = 0; k < kn; k += 32) {
                    prefetch_lines(&pf, pf_end, per_step);
                    drain(&pd, pd.per_step);
                    round_some(&rd, rd.per_step);
                    _tile_loadd(6, w + (size_t)k * 64, 128);
                    _tile_loadd(7, w + (size_t)k * 64 + 64, 128);
                    _tile_loadd(4, a + (size_t)k * 2, lda);
                    _tile_loadd(5, a + 16 * lda + (size_t)k * 2, lda);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
                store_block(&pd, y, My, ldy, m0, n0, cols, 32, stream, ksteps);
            }
            if (m0 < c1) { /* 16 rows left (c1 - c0 is a multiple of 16) */
                const char *a = (const char *)(xb + (size_t)m0 * K + k0);
                if (accumulate) {
                    float *yb = y + (size_t)m0 * ldy + n0;
                    _tile_loadd(0, yb, ldc);
                    _tile_loadd(1, yb + 16, ldc);
                } else {
                    _tile_zero(0);
                    _tile_zero(1);
                }
                for (int k = 0; k < kn; k += 32) {
                    prefetch_lines(&pf, pf_end, per_step);
                    drain(&pd, pd.per_step);
                    round_some(&rd, rd.per_step);
                    _tile_loadd(6, w + (size_t)k * 64, 128);
                    _tile_loadd(7, w + (size_t)k * 64 + 64, 128);
                    _tile_loadd(4, a + (size_t)k * 2, lda);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
                store_block(&pd, y, My, ldy, m0, n0, cols, 16, stream, ksteps);
            }
        }
    }
    drain(&pd, 32);
    round_some(&rd, 1 << 30);
}

static void *alloc64(size_t bytes) {
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == NULL) abort();
    return p;
}

/* One thread's panels [lo, hi), its tile configuration loaded for them and released after,
 * so that an idle pool thread does not carry 8 KiB of tile state through context switches.
 * K past KBLOCK goes in blocks of KBLOCK into ys, the call's [M16, P * 32] float32 scratch,
 * whose valid part is then copied to y (without blocks, K = 8192 held a chunk to 32 rows, and
 * each 512 KiB panel was read from memory once per 32 rows). */
static void amx_thread(float *y, float *ys, uint16_t *xb, const float *x,
                       const uint16_t *wp, int M, int M16, int N, int K, int lo, int hi,
                       int stream) {
    load_tiles();
    if (ys == NULL) {
        amx_panels(y, M, N, N, xb, wp, M16, K, 0, K, lo, hi, 0, stream, x, M);
        _mm_sfence(); /* the non-temporal stores seen before the caller's (barrier's) */
    } else {
        const int ldy = (N + 31) / 32 * 32;
        if (x != NULL) round_rows(xb, x, M, K, 0, M16);
        for (int k0 = 0; k0 < K; k0 += KBLOCK)
            amx_panels(ys, M16, ldy, ldy, xb, wp, M16, K, k0,
                       K - k0 < KBLOCK ? K : k0 + KBLOCK, lo, hi, k0 > 0, 0, NULL, M);
        const int n0 = lo * 32, n1 = hi * 32 < N ? hi * 32 : N;
        for (int m = 0; m < M && n0 < n1; m++)
            memcpy(y + (size_t)m * N + n0, ys + (size_t)m * ldy + n0,
                   (size_t)(n1 - n0) * sizeof(float));
    }
    _tile_release();
}

static void gemm_amx(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                     int nthreads) {
    const int P = (N + 31) / 32, M16 = (M + 15) / 16 * 16;
    uint16_t *xb = alloc64((size_t)M16 * K * 2);
    float *ys = K > KBLOCK ? alloc64((size_t)M16 * P * 32 * sizeof(float)) : NULL;
    const int stream = (size_t)M * N * sizeof(float) >= NT_MIN_BYTES;
    if ((long)M * N * K < PAR_MIN_MACS || nthreads < 2 || P < 2) {
        amx_thread(y, ys, xb, x, wp, M, M16, N, K, 0, P, stream);
    } else if (ys == NULL && M16 > (nthreads - 1) * chunk_rows(K)) {
        /* Rows split (see the top): a thread's rows are a call of their own, each row's sums
         * the same as in any other split. */
#pragma omp parallel num_threads(nthreads)
        {
            int lo, hi;
            omp_thread_rows(M16, 32, &lo, &hi);
            if (lo < hi)
                amx_thread(y + (size_t)lo * N, NULL, xb + (size_t)lo * K, x + (size_t)lo * K, wp,
                           (M < hi ? M : hi) - lo, hi - lo, N, K, 0, P, stream);
        }
    } else {
#pragma omp parallel num_threads(nthreads < P ? nthreads : P)
        {
            int lo, hi;
            omp_thread_rows(M16, 16, &lo, &hi);
            round_rows(xb, x, M, K, lo, hi);
#pragma omp barrier
            omp_thread_rows(P, 1, &lo, &hi);
            amx_thread(y, ys, xb, NULL, wp, M, M16, N, K, lo, hi, stream);
        }
    }
    free(ys);
    free(xb);
}

void gemm_panels_bf16_amx(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                          int nthreads) {
    if (K % 32 != 0 || !amx_bf16_available())
        gemm_panels_bf16(y, x, wp, M, N, K, nthreads);
    else
        gemm_amx(y, x, wp, M, N, K, nthreads);
}
#else
int amx_bf16_available(void) { return 0; }

/* Without AMX in the build: the vdpbf16ps (or widening) panel kernel, never called by the
 * Python side (amx.available() is False). */
void gemm_panels_bf16_amx(float *y, const float *x, const uint16_t *wp, int M, int N, int K,
                          int nthreads) {
    gemm_panels_bf16(y, x, wp, M, N, K, nthreads);
}
#endif
