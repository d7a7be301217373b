/* The shared-memory core's hot paths in C: the barrier, and the chunk loops of the collectives that move
 * floats and bytes (all_reduce and reduce_scatter of SUM and AVG, broadcast, all_gather, the rows' sum).
 *
 * Built by sn_trainer/shm/native.py with the machine's C compiler; called as a CPython module where
 * Python's headers were found, else through ctypes (either way without the GIL). Everything here has a Python twin in shm/group.py and
 * shm/collectives.py, which runs where no compiler is found: both follow one protocol on one layout,
 * which shm/layout.py defines, and give the same bits.
 *
 * Every element of a reduction is combined in the order rank 0, 1, ..., W-1 with IEEE operations only
 * (no -ffast-math, no reassociation), so every rank gets the same bits from the same values.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define SN_ABI 6

/* What the Python side passes: pointers into the segment and the rank's counters (shm/layout.py's
 * NativeGroup mirrors this struct field by field). */
typedef struct {
    char *lines;          /* W lines of LINE_BYTES: arrival (int64; once broken, -1 - the last barrier passed),
                             bell (int32), sleepers (int32) */
    char *mutexes;        /* W process-shared robust mutexes, MUTEX_BYTES apart: each rank holds its own */
    int64_t *headers;     /* [2][W][HEADER_WORDS]: what each rank's collective is */
    char *slots;          /* [2][W][slot_bytes]: data, two alternating sets */
    int64_t slot_bytes;
    int64_t line_bytes, mutex_bytes, header_words;
    int64_t generation;   /* barriers this rank has passed */
    int64_t chunks;       /* chunks moved: the slot set the next one uses */
    int64_t ops;          /* collectives begun: the header set the next one uses */
    int64_t spins;        /* polls before the waiter yields its core */
    int64_t yield_ns;     /* then yields for this long before it sleeps, while yielding costs nothing */
    int32_t world, rank;
    int32_t culprit;      /* the rank a failure names */
    int32_t pad;
    int64_t passed;       /* the last barrier this rank passed (what a break keeps) */
    int64_t yield_cost_ns;   /* a yield that took longer gave the core to another task: the core is shared */
    int64_t shared_ns;       /* for this long after, waits sleep without yielding first */
    int64_t shared_until;    /* (monotonic ns) */
    int64_t shared_spin_ns;  /* meanwhile, how long a waiter polls before it sleeps */
} sn_group;

enum { SN_OK = 0, SN_BROKEN = 1, SN_GONE = 2, SN_TIMEOUT = 3, SN_MISMATCH = 4 };
enum { DT_F32 = 0, DT_F64 = 1, DT_F16 = 2, DT_BF16 = 3 };

static int64_t *arrival(sn_group *g, int r) { return (int64_t *)(g->lines + r * g->line_bytes); }
static int32_t *bell(sn_group *g, int r) { return (int32_t *)(g->lines + r * g->line_bytes + 8); }
static int32_t *sleepers(sn_group *g, int r) { return (int32_t *)(g->lines + r * g->line_bytes + 12); }
static char *slot(sn_group *g, int64_t set, int r) { return g->slots + (set * g->world + r) * g->slot_bytes; }

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void futex_wake(int32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0); }

static void futex_wait(int32_t *word, int32_t expected, int64_t ns) {
    struct timespec t = {ns / 1000000000, ns % 1000000000};
    syscall(SYS_futex, word, FUTEX_WAIT, expected, &t, NULL, 0);
}

int sn_abi(void) { return SN_ABI; }

/* Whether rank r has left: its mutex is no longer held by a live thread of its (the kernel marks a
 * robust mutex whose owner died, whatever PID namespace it ran in). A CAS when it is held: no syscall. */
int sn_gone(sn_group *g, int r) {
    int rc = pthread_mutex_trylock((pthread_mutex_t *)(g->mutexes + r * g->mutex_bytes));
    return rc != EBUSY; /* 0: nobody holds it; EOWNERDEAD: its holder died. Either way we keep it. */
}

/* This rank has written what the next barrier publishes; a rank that broke the group (here, or from
 * another of its threads: a Work's wait that timed out) stays broken. */
int sn_arrive(sn_group *g) {
    int me = g->rank;
    int64_t generation = ++g->generation, current = __atomic_load_n(arrival(g, me), __ATOMIC_ACQUIRE);
    if (current < 0 || !__atomic_compare_exchange_n(arrival(g, me), &current, generation, 0, __ATOMIC_SEQ_CST,
                                                    __ATOMIC_SEQ_CST)) {
        g->culprit = me;
        return SN_BROKEN;
    }
    __atomic_store_n(bell(g, me), (int32_t)(generation & 0x7fffffff), __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers(g, me), __ATOMIC_SEQ_CST) > 0) futex_wake(bell(g, me));
    return SN_OK;
}

/* Wait until every rank has arrived at this rank's generation: spin, then yield, then sleep on the late
 * rank's bell, checking that it still runs and that nobody broke the group.
 *
 * Yielding keeps the waiter on its core, so it goes on the moment its peer arrives; that is right while
 * nothing else wants the core (a yield then returns at once). Where another task shares the core (other
 * work on the machine), a yield hands it a whole time slice, and a waiter that yields or spins keeps
 * spending the time its peer, maybe queued behind other work too, needs: the first yield that takes
 * longer than yield_cost_ns sends the waiter to sleep in the kernel, as gloo's does, and for shared_ns
 * after, waits poll for shared_spin_ns (a peer that runs arrives within a chunk's copy) and then sleep,
 * without yielding. */
int sn_wait(sn_group *g, int64_t deadline_ns) {
    int64_t generation = g->generation, polls = 0, yield_until = 0;
    int shared = 0;
    for (;;) {
        int late = -1;
        for (int r = 0; r < g->world; r++) {
            int64_t a = __atomic_load_n(arrival(g, r), __ATOMIC_ACQUIRE);
            /* A rank that broke the group after it passed this barrier passed it: so do its peers (else one
             * rank would return from a collective its peer raises in). One that broke before never will. */
            if (a < 0) {
                if (-1 - a < generation) { g->culprit = r; return SN_BROKEN; }
            } else if (a < generation && late < 0) late = r;
        }
        if (late < 0) { g->passed = generation; return SN_OK; }
        /* No PAUSE in this loop: in a KVM guest a run of PAUSEs exits to the hypervisor (pause-loop exiting),
         * which then may run something else than this rank (measured: 32 MB all-reduces 3-4x slower, at
         * random); the workers are pinned to physical cores, so no SMT sibling is slowed by the loads. */
        if (++polls < g->spins) continue;
        if (sn_gone(g, late)) { g->culprit = late; return SN_GONE; }
        int64_t now = now_ns();
        if (now > deadline_ns) { g->culprit = late; return SN_TIMEOUT; }
        if (!yield_until) {
            shared = now < g->shared_until;
            yield_until = now + (shared ? g->shared_spin_ns : g->yield_ns);
        }
        if (shared && now < yield_until) continue; /* a peer a chunk's copy away: not worth a sleep */
        if (now < yield_until) {
            sched_yield();
            int64_t after = now_ns();
            if (after - now > g->yield_cost_ns) {
                g->shared_until = after + g->shared_ns;
                yield_until = after;
            }
            continue;
        }
        int32_t expected = __atomic_load_n(bell(g, late), __ATOMIC_SEQ_CST);
        __atomic_add_fetch(sleepers(g, late), 1, __ATOMIC_SEQ_CST);
        int64_t a = __atomic_load_n(arrival(g, late), __ATOMIC_SEQ_CST);
        if (a >= 0 && a < generation) {
            int64_t ns = deadline_ns - now;
            futex_wait(bell(g, late), expected, ns < 50000000 ? ns : 50000000);
        }
        __atomic_sub_fetch(sleepers(g, late), 1, __ATOMIC_SEQ_CST);
    }
}

int sn_barrier(sn_group *g, int64_t deadline_ns) {
    int rc = sn_arrive(g);
    return rc ? rc : sn_wait(g, deadline_ns);
}

/* Mark the group broken by this rank (its reason is in the segment already), keeping the last barrier it
 * passed (as -1 - that barrier), and wake every sleeper. */
void sn_break(sn_group *g) {
    int64_t current = __atomic_load_n(arrival(g, g->rank), __ATOMIC_ACQUIRE);
    while (current >= 0 && !__atomic_compare_exchange_n(arrival(g, g->rank), &current, -1 - g->passed, 0,
                                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    for (int r = 0; r < g->world; r++) {
        __atomic_add_fetch(bell(g, r), 1, __ATOMIC_SEQ_CST);
        futex_wake(bell(g, r));
    }
}

/* What this rank is about to do, in its header of the next set (compared after the first barrier). */
static int64_t begin(sn_group *g, int64_t kind, int64_t dtype, int64_t numel, int64_t nbytes, int64_t extra) {
    int64_t index = g->ops++;
    int64_t *mine = g->headers + ((index % 2) * g->world + g->rank) * g->header_words;
    mine[0] = index + 1, mine[1] = kind, mine[2] = dtype, mine[3] = numel, mine[4] = nbytes, mine[5] = extra;
    return index;
}

/* After the first barrier of a collective: whether every rank wrote the same header as this one. */
static int headers_agree(sn_group *g, int64_t op_index) {
    int64_t *set = g->headers + (op_index % 2) * g->world * g->header_words;
    int64_t *mine = set + g->rank * g->header_words;
    for (int r = 0; r < g->world; r++)
        if (memcmp(set + r * g->header_words, mine, 6 * 8)) { g->culprit = r; return 0; }
    return 1;
}

/* ---- combining rows, in rank order ---------------------------------------------------------------- */

static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) bits = sign | 0x7f800000 | (mantissa << 13);
    else if (exponent) bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else if (!mantissa) bits = sign;
    else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_f16(float f) { /* round to nearest even; NaN as torch writes it (0x7e00) */
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    if (f != f) bits = (bits & 0x8000) | 0x7e00;
    return bits;
}

static float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* round to nearest even; NaN as torch writes it (0x7fc0) */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) return 0x7fc0;
    bits += 0x7fff + ((bits >> 16) & 1);
    return (uint16_t)(bits >> 16);
}

/* out[i] = rows[0][i] + rows[1][i] + ... in that order, then / W for the mean. Each pass over a row is a
 * vectorisable loop; ``out`` may be rows[0]. */
#define SUM_ROWS(NAME, T)                                                                                   \
    __attribute__((target_clones("avx512f", "avx2", "default")))                                           \
    static void NAME(char **rows, int count, int64_t n, T *out, int mean) {                                 \
        const T *a = (const T *)rows[0], *b = (const T *)rows[count > 1 ? 1 : 0];                            \
        if (count > 1) for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];                                 \
        else if ((const T *)out != a) memcpy(out, a, n * sizeof(T));                                        \
        for (int r = 2; r < count; r++) {                                                                    \
            const T *c = (const T *)rows[r];                                                                 \
            for (int64_t i = 0; i < n; i++) out[i] += c[i];                                                  \
        }                                                                                                    \
        if (mean) for (int64_t i = 0; i < n; i++) out[i] /= (T)count;                                        \
    }
SUM_ROWS(sum_f32, float)
SUM_ROWS(sum_f64, double)

#define SUM_HALF(NAME, TO, FROM)                                                                            \
    static void NAME(char **rows, int count, int64_t n, uint16_t *out, int mean) {                          \
        for (int64_t i = 0; i < n; i++) {                                                                    \
            float acc = TO(((const uint16_t *)rows[0])[i]);                                                  \
            for (int r = 1; r < count; r++) acc += TO(((const uint16_t *)rows[r])[i]);                      \
            if (mean) acc /= (float)count;                                                                   \
            out[i] = FROM(acc);                                                                              \
        }                                                                                                    \
    }
SUM_HALF(sum_f16, f16_to_f32, f32_to_f16)
SUM_HALF(sum_bf16, bf16_to_f32, f32_to_bf16)

static const int64_t ITEMSIZE[] = {4, 8, 2, 2};

/* rows[r] + offset elements, for each of ``count`` rows ``stride`` bytes apart from ``base``. */
static void combine(int dtype, char *base, int64_t stride, int count, int64_t offset, int64_t n, void *out,
                    int mean) {
    char *rows[count];
    for (int r = 0; r < count; r++) rows[r] = base + r * stride + offset * ITEMSIZE[dtype];
    switch (dtype) {
    case DT_F32: sum_f32(rows, count, n, out, mean); break;
    case DT_F64: sum_f64(rows, count, n, out, mean); break;
    case DT_F16: sum_f16(rows, count, n, out, mean); break;
    default: sum_bf16(rows, count, n, out, mean); break;
    }
}

/* ---- the collectives' chunk loops ---------------------------------------------------------------- */

/* Post this rank's ``n`` bytes into its slot of the next set, and wait for every rank's; on the
 * collective's first chunk, compare the headers. */
static int post(sn_group *g, const void *piece, int64_t n, int first, int64_t op_index, int64_t deadline,
                int64_t *set) {
    *set = g->chunks++ % 2;
    memcpy(slot(g, *set, g->rank), piece, n);
    int rc = sn_barrier(g, deadline);
    if (rc == SN_OK && first && !headers_agree(g, op_index)) rc = SN_MISMATCH;
    return rc;
}

/* ``data`` (numel elements of dtype) summed (or averaged) over the ranks, in place. A chunk is combined
 * whole by every rank while that reads little (two ranks, or small chunks); otherwise each rank combines
 * its part into rank 0's slot, and after a second barrier every rank reads the parts. */
int sn_all_reduce(sn_group *g, char *data, int64_t numel, int dtype, int mean, int64_t whole_bytes,
                  int64_t kind, int64_t header_dtype, int64_t extra, int64_t deadline) {
    int64_t size = ITEMSIZE[dtype], chunk = g->slot_bytes / size, set;
    int64_t op_index = begin(g, kind, header_dtype, numel, numel * size, extra);
    if (chunk < 1) chunk = 1;
    for (int64_t start = 0; start < (numel > 0 ? numel : 1); start += chunk) {
        int64_t n = numel - start < chunk ? numel - start : chunk;
        if (n < 0) n = 0;
        char *piece = data + start * size;
        int rc = post(g, piece, n * size, start == 0, op_index, deadline, &set);
        if (rc) return rc;
        if (g->world <= 2 || n * size * g->world <= whole_bytes) {
            combine(dtype, slot(g, set, 0), g->slot_bytes, g->world, 0, n, piece, mean);
            continue;
        }
        int64_t lo = n * g->rank / g->world, hi = n * (g->rank + 1) / g->world;
        combine(dtype, slot(g, set, 0), g->slot_bytes, g->world, lo, hi - lo, slot(g, set, 0) + lo * size, mean);
        if ((rc = sn_barrier(g, deadline))) return rc;
        memcpy(piece, slot(g, set, 0), n * size);
    }
    return SN_OK;
}

/* Part ``rank`` (``numel`` elements) of the sum of every rank's ``data`` (W * numel) into ``out``. */
int sn_reduce_scatter(sn_group *g, const char *data, char *out, int64_t numel, int dtype, int mean,
                      int64_t kind, int64_t header_dtype, int64_t extra, int64_t deadline) {
    int64_t size = ITEMSIZE[dtype], world = g->world, chunk = g->slot_bytes / size / world, set;
    int64_t op_index = begin(g, kind, header_dtype, numel, numel * size, extra);
    if (chunk < 1) chunk = 1;
    for (int64_t start = 0; start < (numel > 0 ? numel : 1); start += chunk) {
        int64_t n = numel - start < chunk ? numel - start : chunk;
        if (n < 0) n = 0;
        set = g->chunks++ % 2;
        char *mine = slot(g, set, g->rank);
        for (int64_t part = 0; part < world; part++)
            memcpy(mine + part * n * size, data + (part * numel + start) * size, n * size);
        int rc = sn_barrier(g, deadline);
        if (rc == SN_OK && start == 0 && !headers_agree(g, op_index)) rc = SN_MISMATCH;
        if (rc) return rc;
        combine(dtype, slot(g, set, 0), g->slot_bytes, g->world, g->rank * n, n, out + start * size, mean);
    }
    return SN_OK;
}

/* ``nbytes`` of rank ``root``'s ``data`` into every rank's. */
int sn_broadcast(sn_group *g, char *data, int64_t nbytes, int root, int64_t kind, int64_t header_dtype,
                 int64_t numel, int64_t deadline) {
    int64_t chunk = g->slot_bytes * g->world;
    int64_t op_index = begin(g, kind, header_dtype, numel, nbytes, root);
    for (int64_t start = 0; start < (nbytes > 0 ? nbytes : 1); start += chunk) {
        int64_t n = nbytes - start < chunk ? nbytes - start : chunk;
        if (n < 0) n = 0;
        int64_t set = g->chunks++ % 2;
        char *buffer = slot(g, set, 0);
        if (g->rank == root) memcpy(buffer, data + start, n);
        int rc = sn_barrier(g, deadline);
        if (rc == SN_OK && start == 0 && !headers_agree(g, op_index)) rc = SN_MISMATCH;
        if (rc) return rc;
        if (g->rank != root) memcpy(data + start, buffer, n);
    }
    return SN_OK;
}

/* Every rank's ``nbytes`` of ``data`` into ``out`` + rank * nbytes, on every rank. */
int sn_all_gather(sn_group *g, const char *data, char *out, int64_t nbytes, int64_t kind, int64_t header_dtype,
                  int64_t numel, int64_t deadline) {
    int64_t chunk = g->slot_bytes, set;
    int64_t op_index = begin(g, kind, header_dtype, numel, nbytes, 0);
    for (int64_t start = 0; start < (nbytes > 0 ? nbytes : 1); start += chunk) {
        int64_t n = nbytes - start < chunk ? nbytes - start : chunk;
        if (n < 0) n = 0;
        int rc = post(g, data + start, n, start == 0, op_index, deadline, &set);
        if (rc) return rc;
        for (int r = 0; r < g->world; r++) memcpy(out + r * nbytes + start, slot(g, set, r), n);
    }
    return SN_OK;
}

/* The barrier as a collective of its own (its header compared like any other's). */
int sn_collective_barrier(sn_group *g, int64_t kind, int64_t header_dtype, int64_t deadline) {
    int64_t op_index = begin(g, kind, header_dtype, 0, 0, 0);
    int rc = sn_barrier(g, deadline);
    return rc == SN_OK && !headers_agree(g, op_index) ? SN_MISMATCH : rc;
}

/* The Trainer's reduce: columns [start, start + n) of ``count`` rows ``stride`` bytes apart, summed in row
 * order into ``out`` (no barrier: the caller's). */
void sn_sum_rows(char *rows, int64_t stride, int count, int64_t start, int64_t n, int dtype, char *out) {
    combine(dtype, rows, stride, count, start, n, out, 0);
}

#ifdef SN_PYTHON_MODULE
/* The same functions as a CPython module of this library (built where Python's headers are found): a call
 * through it costs a tenth of a ctypes call, which is most of a small collective's time. Each takes
 * integers only (addresses, sizes, codes), as through ctypes, and releases the GIL while it runs. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static int integers(PyObject *const *args, Py_ssize_t given, Py_ssize_t wanted, int64_t *out) {
    if (given != wanted) {
        PyErr_Format(PyExc_TypeError, "%zd arguments given, %zd wanted", given, wanted);
        return -1;
    }
    for (Py_ssize_t i = 0; i < given; i++) {
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

#define WRAP(NAME, COUNT, CALL)                                                                             \
    static PyObject *py_##NAME(PyObject *self, PyObject *const *args, Py_ssize_t given) {                  \
        (void)self;                                                                                          \
        int64_t a[COUNT];                                                                                    \
        if (integers(args, given, COUNT, a)) return NULL;                                                    \
        int rc;                                                                                              \
        Py_BEGIN_ALLOW_THREADS rc = CALL;                                                                    \
        Py_END_ALLOW_THREADS return PyLong_FromLong(rc);                                                     \
    }
#define G ((sn_group *)a[0])
WRAP(sn_barrier, 2, sn_barrier(G, a[1]))
WRAP(sn_all_reduce, 10, sn_all_reduce(G, (char *)a[1], a[2], (int)a[3], (int)a[4], a[5], a[6], a[7], a[8], a[9]))
WRAP(sn_reduce_scatter, 10, sn_reduce_scatter(G, (const char *)a[1], (char *)a[2], a[3], (int)a[4], (int)a[5], a[6],
                                               a[7], a[8], a[9]))
WRAP(sn_broadcast, 8, sn_broadcast(G, (char *)a[1], a[2], (int)a[3], a[4], a[5], a[6], a[7]))
WRAP(sn_all_gather, 8, sn_all_gather(G, (const char *)a[1], (char *)a[2], a[3], a[4], a[5], a[6], a[7]))
WRAP(sn_collective_barrier, 4, sn_collective_barrier(G, a[1], a[2], a[3]))
WRAP(sn_sum_rows, 7, (sn_sum_rows((char *)a[0], a[1], (int)a[2], a[3], a[4], (int)a[5], (char *)a[6]), 0))
#undef G

#define METHOD(NAME) {#NAME, (PyCFunction)(void (*)(void))py_##NAME, METH_FASTCALL, NULL}
static PyMethodDef methods[] = {METHOD(sn_barrier), METHOD(sn_all_reduce), METHOD(sn_reduce_scatter),
                                METHOD(sn_broadcast), METHOD(sn_all_gather), METHOD(sn_collective_barrier),
                                METHOD(sn_sum_rows), {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "sn_native", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_sn_native(void) { return PyModule_Create(&module); }
#endif
