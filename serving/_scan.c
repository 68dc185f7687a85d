/* The first stage of the catalogue's exact top-K (serving/catalogue.py): every item's
 * score bounded from 8-bit codes, without the GIL.
 *
 * Row i is held as codes c in 0..255 with x ~ scale[i] * c + offset[i]; a query q as int8
 * codes with q = step * qc + rho, |rho| <= rho_max. The integer dot products qc . c are
 * exact, and the caller's per-row and per-query terms bound everything else (the codes'
 * error, rho, float rounding), so each score lies within approx +- margin:
 *
 *     approx = scale * (step * (qc . c) + 128 * sum(rho)) + offset * sum(q)
 *     margin = error * |q|_1 + rounding * magnitude + spread * rho_max
 *
 * where spread = scale * sum_k |c_k - 128|. Per query a min-heap keeps the k best lower
 * bounds seen; a row whose upper bound reaches the heap's least is a candidate. Any row of
 * the exact top-k has its upper bound at or above the k-th best lower bound, so the
 * candidates hold the exact top-k, which the caller finds by scoring them from the rows.
 *
 * Codes are laid out in blocks of BLOCK rows: [blocks, dim / 4, BLOCK, 4] uint8, four
 * consecutive dimensions of a row together, the layout of AVX-512 VNNI's vpdpbusd (64
 * unsigned-by-signed byte products summed into 16 int32 lanes an instruction). Elsewhere a
 * portable kernel computes the same integers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64
#define GROUP 4   /* dimensions a 32-bit lane sums */
#define LANES 16  /* 32-bit lanes of a 512-bit vector */
#define ROW_TERMS 5
#define QUERY_TERMS 7

enum { SCALE, OFFSET, ERROR, ROUNDING, SPREAD };                  /* per-row terms */
enum { STEP, RHO_SUM, SUM, ABS_SUM, MAGNITUDE, RHO_MAX, UNUSED }; /* per-query terms */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define X86_KERNELS 1
#include <immintrin.h>
#define TARGETS __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TARGETS
#endif

typedef struct {
    int64_t row;
    int32_t query;
    float upper;
} Candidate;

typedef struct {
    Candidate *items;
    Py_ssize_t size, capacity;
} Candidates;

static int add_candidate(Candidates *out, int64_t row, int32_t query, float upper) {
    if (out->size == out->capacity) {
        Py_ssize_t capacity = out->capacity ? 2 * out->capacity : 4096;
        Candidate *items = realloc(out->items, (size_t)capacity * sizeof(Candidate));
        if (!items) return -1;
        out->items = items;
        out->capacity = capacity;
    }
    out->items[out->size++] = (Candidate){row, query, upper};
    return 0;
}

/* Replaces the least value of the min-heap `heap` [k] by `value` and restores the heap. */
static void heap_replace(float *heap, Py_ssize_t k, float value) {
    Py_ssize_t at = 0;
    for (;;) {
        Py_ssize_t child = 2 * at + 1;
        if (child >= k) break;
        if (child + 1 < k && heap[child + 1] < heap[child]) child++;
        if (heap[child] >= value) break;
        heap[at] = heap[child];
        at = child;
    }
    heap[at] = value;
}

/* dots [queries, BLOCK] = one block's codes [groups, BLOCK, GROUP] . each query's codes
 * [groups * GROUP], in int32 (exact: 255 * 127 * dim < 2^31). */
TARGETS static void block_dots_portable(const uint8_t *codes, Py_ssize_t groups,
                                        const int8_t *queries, Py_ssize_t n, int32_t *dots) {
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t acc[BLOCK] = {0};
        const int8_t *q = queries + j * groups * GROUP;
        for (Py_ssize_t g = 0; g < groups; g++) {
            const uint8_t *c = codes + g * BLOCK * GROUP;
            for (int r = 0; r < BLOCK; r++)
                for (int d = 0; d < GROUP; d++)
                    acc[r] += (int32_t)c[r * GROUP + d] * (int32_t)q[g * GROUP + d];
        }
        memcpy(dots + j * BLOCK, acc, sizeof acc);
    }
}

#ifdef X86_KERNELS
/* Two queries a pass: each block of codes loaded once for both, eight independent sums. */
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void block_dots_vnni(
    const uint8_t *codes, Py_ssize_t groups, const int8_t *queries, Py_ssize_t n,
    int32_t *dots) {
    for (Py_ssize_t j = 0; j < n; j += 2) {
        Py_ssize_t second = j + 1 < n ? j + 1 : j; /* an odd count: the last query twice */
        __m512i a[BLOCK / LANES], b[BLOCK / LANES];
        for (int part = 0; part < BLOCK / LANES; part++)
            a[part] = b[part] = _mm512_setzero_si512();
        const int8_t *qa = queries + j * groups * GROUP, *qb = queries + second * groups * GROUP;
        for (Py_ssize_t g = 0; g < groups; g++) {
            int32_t four_a, four_b;
            memcpy(&four_a, qa + g * GROUP, sizeof four_a);
            memcpy(&four_b, qb + g * GROUP, sizeof four_b);
            __m512i wa = _mm512_set1_epi32(four_a), wb = _mm512_set1_epi32(four_b);
            const uint8_t *c = codes + g * BLOCK * GROUP;
            for (int part = 0; part < BLOCK / LANES; part++) {
                __m512i values = _mm512_loadu_si512(c + part * LANES * GROUP);
                a[part] = _mm512_dpbusd_epi32(a[part], values, wa);
                b[part] = _mm512_dpbusd_epi32(b[part], values, wb);
            }
        }
        for (int part = 0; part < BLOCK / LANES; part++) {
            _mm512_storeu_si512(dots + j * BLOCK + part * LANES, a[part]);
            _mm512_storeu_si512(dots + second * BLOCK + part * LANES, b[part]);
        }
    }
}
#endif

/* Each query's lower and upper bounds [queries, BLOCK] from its dots; returns a bit per
 * query (bit 63 standing for queries 63 and on) for "some upper bound reaches the query's
 * threshold". */
TARGETS static uint64_t block_bounds(const int32_t *dots, const float *rows, Py_ssize_t padded,
                                     const float *terms, Py_ssize_t n, const float *threshold,
                                     float *lower, float *upper) {
    uint64_t reached = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        vint hit = {0};
        for (int part = 0; part < BLOCK / LANES; part++) {
            vint dot;
            vfloat scale, offset, error, rounding, spread;
            Py_ssize_t at = part * LANES;
            memcpy(&dot, dots + j * BLOCK + at, sizeof dot);
            memcpy(&scale, rows + SCALE * padded + at, sizeof scale);
            memcpy(&offset, rows + OFFSET * padded + at, sizeof offset);
            memcpy(&error, rows + ERROR * padded + at, sizeof error);
            memcpy(&rounding, rows + ROUNDING * padded + at, sizeof rounding);
            memcpy(&spread, rows + SPREAD * padded + at, sizeof spread);
            const float *t = terms + j * QUERY_TERMS;
            vfloat approx = scale * (__builtin_convertvector(dot, vfloat) * t[STEP] + t[RHO_SUM]) +
                            offset * t[SUM];
            vfloat margin = error * t[ABS_SUM] + rounding * t[MAGNITUDE] + spread * t[RHO_MAX];
            vfloat low = approx - margin, up = approx + margin;
            memcpy(lower + j * BLOCK + at, &low, sizeof low);
            memcpy(upper + j * BLOCK + at, &up, sizeof up);
            hit |= up >= threshold[j];
        }
        uint64_t words[sizeof hit / sizeof(uint64_t)], any = 0;
        memcpy(words, &hit, sizeof hit);
        for (size_t w = 0; w < sizeof hit / sizeof(uint64_t); w++) any |= words[w];
        if (any) reached |= (uint64_t)1 << (j < 63 ? j : 63);
    }
    return reached;
}

static int have_vnni(void) {
#ifdef X86_KERNELS
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

static int check_length(Py_buffer *view, const char *name, Py_ssize_t bytes, int writable) {
    if (view->len != bytes) {
        PyErr_Format(PyExc_ValueError, "scan: %s holds %zd bytes, expected %zd", name,
                     view->len, bytes);
        return -1;
    }
    if (writable && view->readonly) {
        PyErr_Format(PyExc_ValueError, "scan: %s must be writable", name);
        return -1;
    }
    return 0;
}

typedef struct {
    const uint8_t *codes;
    const float *rows, *terms;
    const int8_t *queries;
    const int64_t *excluded, *excluded_starts;
    float *heaps;
    Py_ssize_t groups, padded, n, k, first_block, stop_block, rows_count;
    int vnni;
} Scan;

/* The scan itself, without the GIL; -1 when out of memory. */
static int run_scan(const Scan *s, Candidates *out) {
    Py_ssize_t n = s->n, k = s->k;
    int32_t *dots = malloc((size_t)(n * BLOCK) * sizeof(int32_t));
    float *bounds = malloc((size_t)(2 * n * BLOCK + n) * sizeof(float));
    int64_t *cursor = malloc((size_t)n * sizeof(int64_t));
    int failed = !dots || !bounds || !cursor;
    float *lower = bounds, *upper = bounds + n * BLOCK, *threshold = upper + n * BLOCK;
    for (Py_ssize_t j = 0; j < n && !failed; j++) { /* each query's first excluded row here */
        int64_t at = s->excluded_starts[j];
        while (at < s->excluded_starts[j + 1] && s->excluded[at] < s->first_block * BLOCK) at++;
        cursor[j] = at;
    }
    for (Py_ssize_t block = s->first_block; block < s->stop_block && !failed; block++) {
        Py_ssize_t base = block * BLOCK;
        const uint8_t *codes = s->codes + base * s->groups * GROUP;
#ifdef X86_KERNELS
        if (s->vnni)
            block_dots_vnni(codes, s->groups, s->queries, n, dots);
        else
#endif
            block_dots_portable(codes, s->groups, s->queries, n, dots);
        for (Py_ssize_t j = 0; j < n; j++) threshold[j] = s->heaps[j * k];
        uint64_t reached = block_bounds(dots, s->rows + base, s->padded, s->terms, n, threshold,
                                        lower, upper);
        for (Py_ssize_t j = 0; j < n && reached && !failed; j++) {
            if (!(reached >> (j < 63 ? j : 63) & 1)) continue;
            float *heap = s->heaps + j * k;
            int64_t stop = s->excluded_starts[j + 1];
            for (int r = 0; r < BLOCK; r++) {
                int64_t row = base + r;
                if (row >= s->rows_count) break;
                if (!(upper[j * BLOCK + r] >= heap[0])) continue;
                while (cursor[j] < stop && s->excluded[cursor[j]] < row) cursor[j]++;
                if (cursor[j] < stop && s->excluded[cursor[j]] == row) continue;
                if (lower[j * BLOCK + r] > heap[0]) heap_replace(heap, k, lower[j * BLOCK + r]);
                if (add_candidate(out, row, (int32_t)j, upper[j * BLOCK + r])) {
                    failed = 1;
                    break;
                }
            }
        }
    }
    free(dots);
    free(bounds);
    free(cursor);
    return failed ? -1 : 0;
}

PyDoc_STRVAR(scan_doc,
             "scan(codes, rows, queries, terms, heaps, excluded, excluded_starts, groups, k, "
             "first_block, stop_block, rows_count, portable) -> bytes\n\n"
             "Scans blocks [first_block, stop_block) of `codes` (uint8 [blocks, groups, 64, 4]) "
             "against the int8 `queries` [n, groups * 4]. `rows` is float32 [5, blocks * 64]: "
             "scale, offset, error, rounding, spread; `terms` float32 [n, 7]: step, 128 * "
             "sum(rho), sum(q), |q|_1, magnitude, rho_max, unused. Updates each query's heap "
             "of its k best lower bounds (float32 [n, k], -inf where empty) and returns the "
             "candidates as packed (int64 row, int32 query, float32 upper) records. "
             "`excluded` holds each query's excluded rows, sorted, query j's at "
             "[excluded_starts[j], excluded_starts[j + 1]); rows at or past rows_count are "
             "padding. `portable`: the portable kernel even where VNNI is there.");

static PyObject *scan(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer codes, rows, queries, terms, heaps, excluded, starts;
    Py_ssize_t groups, k, first_block, stop_block, rows_count;
    int portable;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*y*y*nnnnnp", &codes, &rows, &queries, &terms, &heaps,
                          &excluded, &starts, &groups, &k, &first_block, &stop_block,
                          &rows_count, &portable))
        return NULL;
    PyObject *result = NULL;
    Candidates out = {NULL, 0, 0};
    Py_ssize_t n = terms.len / (Py_ssize_t)(QUERY_TERMS * sizeof(float));
    Py_ssize_t padded = rows.len / (Py_ssize_t)(ROW_TERMS * sizeof(float));
    Py_ssize_t blocks = padded / BLOCK;
    if (groups <= 0 || k <= 0 || n <= 0 || first_block < 0 || stop_block < first_block ||
        stop_block > blocks || rows_count > padded) {
        PyErr_SetString(PyExc_ValueError, "scan: bad groups, k, queries or block range");
        goto done;
    }
    if (check_length(&codes, "codes", padded * groups * GROUP, 0) ||
        check_length(&rows, "rows", ROW_TERMS * padded * (Py_ssize_t)sizeof(float), 0) ||
        check_length(&queries, "queries", n * groups * GROUP, 0) ||
        check_length(&heaps, "heaps", n * k * (Py_ssize_t)sizeof(float), 1) ||
        check_length(&starts, "excluded_starts", (n + 1) * (Py_ssize_t)sizeof(int64_t), 0) ||
        check_length(&excluded, "excluded", excluded.len - excluded.len % 8, 0))
        goto done;
    const int64_t *start_at = starts.buf;
    for (Py_ssize_t j = 0; j <= n; j++) { /* each query's range of excluded rows, in order */
        int64_t lowest = j ? start_at[j - 1] : 0;
        if (start_at[j] < lowest || start_at[j] > excluded.len / 8) {
            PyErr_SetString(PyExc_ValueError, "scan: excluded_starts out of order or range");
            goto done;
        }
    }
    Scan s = {codes.buf, rows.buf, terms.buf, queries.buf, excluded.buf, starts.buf, heaps.buf,
              groups, padded, n, k, first_block, stop_block, rows_count,
              !portable && have_vnni()};
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = run_scan(&s, &out);
    Py_END_ALLOW_THREADS;
    if (status) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyBytes_FromStringAndSize((const char *)out.items,
                                       out.size * (Py_ssize_t)sizeof(Candidate));
done:
    free(out.items);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&queries);
    PyBuffer_Release(&terms);
    PyBuffer_Release(&heaps);
    PyBuffer_Release(&excluded);
    PyBuffer_Release(&starts);
    return result;
}

static PyObject *kernel(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(args)) {
    return PyUnicode_FromString(have_vnni() ? "avx512-vnni" : "portable");
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {"kernel", kernel, METH_NOARGS, "The integer kernel this CPU runs: avx512-vnni or portable."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_scan", "The catalogue scan's bounded first stage.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__scan(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddIntConstant(m, "BLOCK", BLOCK) ||
              PyModule_AddIntConstant(m, "GROUP", GROUP))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
