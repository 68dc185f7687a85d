/* Native kernels for the embedding store's hot paths; each runs without the GIL.
 *
 * The slot map's table is a C-contiguous [capacity, 2] uint64 array of (key, slot + 1)
 * entries (see _slot_map.py): slot value 0 is EMPTY and ends a probe chain, all ones is
 * a TOMBSTONE. Positions are splitmix64(id + offset) & (capacity - 1), probed linearly,
 * exactly as the numpy kernels probe, so either kind of kernel reads a table the other
 * wrote. Arguments arrive through the buffer protocol (numpy arrays, no numpy headers
 * needed); the Python side checks dtypes and lengths before calling.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#ifndef M_PI
#define M_PI 3.14159265358979323846
#endif

#define EMPTY 0ULL
#define PREFETCH 8 /* entries or rows ahead to prefetch in scattered loops */
#define TOMBSTONE 0xFFFFFFFFFFFFFFFFULL

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

/* Where `key`'s probe chain starts. */
static inline uint64_t home(uint64_t key, uint64_t offset, uint64_t mask) {
    return mix64(key + offset) & mask;
}

/* The position of `key`'s live entry, or -1 when the chain holds none. */
static inline int64_t live_entry(const uint64_t *table, uint64_t mask, uint64_t key,
                                 uint64_t offset) {
    for (uint64_t position = home(key, offset, mask);; position = (position + 1) & mask) {
        uint64_t stored = table[2 * position + 1];
        if (stored == EMPTY) return -1;
        if (stored != TOMBSTONE && table[2 * position] == key) return (int64_t)position;
    }
}

static int table_of(Py_buffer *entries, uint64_t **table, uint64_t *mask) {
    Py_ssize_t capacity = entries->len / 16;
    if (entries->len % 16 || capacity == 0 || (capacity & (capacity - 1))) {
        PyErr_SetString(PyExc_ValueError, "slot table: expected [2^k, 2] uint64 entries");
        return -1;
    }
    *table = (uint64_t *)entries->buf;
    *mask = (uint64_t)capacity - 1;
    return 0;
}

/* slot_find(entries, ids, out, offset): out[i] = slot of ids[i], -1 where absent. */
static PyObject *slot_find(PyObject *self, PyObject *args) {
    Py_buffer entries, ids, out;
    unsigned long long offset;
    if (!PyArg_ParseTuple(args, "y*y*w*K", &entries, &ids, &out, &offset)) return NULL;
    uint64_t *table, mask;
    PyObject *result = NULL;
    if (table_of(&entries, &table, &mask) < 0) goto done;
    Py_ssize_t n = ids.len / 8;
    if (out.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "slot_find: out must hold one int64 per id");
        goto done;
    }
    const uint64_t *keys = (const uint64_t *)ids.buf;
    int64_t *slots = (int64_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) __builtin_prefetch(table + 2 * home(keys[i + PREFETCH], offset, mask));
        int64_t position = live_entry(table, mask, keys[i], offset);
        slots[i] = position < 0 ? -1 : (int64_t)(table[2 * position + 1] - 1);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&entries);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return result;
}

/* slot_place(entries, ids, stored, offset): puts each (id, stored slot + 1) into the first
 * EMPTY entry of its chain; ids are unique and absent, and the table has room. */
static PyObject *slot_place(PyObject *self, PyObject *args) {
    Py_buffer entries, ids, stored;
    unsigned long long offset;
    if (!PyArg_ParseTuple(args, "w*y*y*K", &entries, &ids, &stored, &offset)) return NULL;
    uint64_t *table, mask;
    PyObject *result = NULL;
    if (table_of(&entries, &table, &mask) < 0) goto done;
    Py_ssize_t n = ids.len / 8;
    if (stored.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "slot_place: one stored slot per id");
        goto done;
    }
    const uint64_t *keys = (const uint64_t *)ids.buf, *values = (const uint64_t *)stored.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t position = home(keys[i], offset, mask);
        while (table[2 * position + 1] != EMPTY) position = (position + 1) & mask;
        table[2 * position] = keys[i];
        table[2 * position + 1] = values[i];
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&entries);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&stored);
    return result;
}

/* slot_remove(entries, ids, offset) -> how many live entries were tombstoned (the first
 * live entry of each id; absent ids are ignored). */
static PyObject *slot_remove(PyObject *self, PyObject *args) {
    Py_buffer entries, ids;
    unsigned long long offset;
    if (!PyArg_ParseTuple(args, "w*y*K", &entries, &ids, &offset)) return NULL;
    uint64_t *table, mask;
    PyObject *result = NULL;
    if (table_of(&entries, &table, &mask) < 0) goto done;
    Py_ssize_t n = ids.len / 8, removed = 0;
    const uint64_t *keys = (const uint64_t *)ids.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t position = live_entry(table, mask, keys[i], offset);
        if (position >= 0) {
            table[2 * position + 1] = TOMBSTONE;
            removed++;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(removed);
done:
    PyBuffer_Release(&entries);
    PyBuffer_Release(&ids);
    return result;
}

/* dedupe(ids, unique, inverse, scratch) -> u: the distinct ids in order of first
 * occurrence into unique[:u], and inverse[i] = index of ids[i] among them. scratch is a
 * zeroed int64 array of 2^k >= 2 n entries (index + 1 of the id held there). */
static PyObject *dedupe(PyObject *self, PyObject *args) {
    Py_buffer ids, unique, inverse, scratch;
    if (!PyArg_ParseTuple(args, "y*w*w*w*", &ids, &unique, &inverse, &scratch)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ids.len / 8, size = scratch.len / 8, u = 0;
    if (unique.len < n * 8 || inverse.len != n * 8 || size < 2 * n || (size & (size - 1))) {
        PyErr_SetString(PyExc_ValueError, "dedupe: bad output or scratch sizes");
        goto done;
    }
    const uint64_t *keys = (const uint64_t *)ids.buf;
    uint64_t *out = (uint64_t *)unique.buf, mask = (uint64_t)size - 1;
    int64_t *index = (int64_t *)inverse.buf, *table = (int64_t *)scratch.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = keys[i], position = mix64(key) & mask;
        for (;;) {
            int64_t held = table[position];
            if (held == 0) {
                table[position] = u + 1;
                out[u] = key;
                index[i] = u++;
                break;
            }
            if (out[held - 1] == key) {
                index[i] = held - 1;
                break;
            }
            position = (position + 1) & mask;
        }
    }
    Py_END_ALLOW_THREADS
    result = PyLong_FromSsize_t(u);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&unique);
    PyBuffer_Release(&inverse);
    PyBuffer_Release(&scratch);
    return result;
}

/* segment_sum(rows, inverse, out, width): out[inverse[i]] += rows[i] (float32 rows of
 * `width`), in input order; out starts zeroed. */
static PyObject *segment_sum(PyObject *self, PyObject *args) {
    Py_buffer rows, inverse, out;
    Py_ssize_t width;
    if (!PyArg_ParseTuple(args, "y*y*w*n", &rows, &inverse, &out, &width)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = inverse.len / 8, groups = width > 0 ? out.len / (4 * width) : 0;
    if (width <= 0 || rows.len != n * width * 4 || out.len != groups * width * 4) {
        PyErr_SetString(PyExc_ValueError, "segment_sum: bad shapes");
        goto done;
    }
    const float *in = (const float *)rows.buf;
    const int64_t *index = (const int64_t *)inverse.buf;
    float *sums = (float *)out.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t group = index[i];
        if (group < 0 || group >= groups) {
            bad = 1;
            break;
        }
        float *target = sums + group * width;
        const float *source = in + i * width;
        for (Py_ssize_t j = 0; j < width; j++) target[j] += source[j];
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "segment_sum: inverse index out of range");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&inverse);
    PyBuffer_Release(&out);
    return result;
}

/* sparse_step(kind, values, state, lines, grads, dim, state_width, lr, eps) -> skipped:
 * one optimizer step in place on rows `lines` of float32 values [rows, dim] and state
 * [rows, state_width], with float32 grads [n, dim] (lines unique). kind 0 is SGD, 1 is
 * Adagrad, with the float32 operations of the numpy version in the same order, so the
 * results are the same bits. Rows whose gradient is not finite are left alone and counted. */
static PyObject *sparse_step(PyObject *self, PyObject *args) {
    Py_buffer values, state, lines, grads;
    int kind;
    Py_ssize_t dim, width;
    float lr, eps;
    if (!PyArg_ParseTuple(args, "iw*w*y*y*nnff", &kind, &values, &state, &lines, &grads, &dim,
                          &width, &lr, &eps))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = lines.len / 8, rows = dim > 0 ? values.len / (4 * dim) : 0;
    if (dim <= 0 || grads.len != n * dim * 4 || values.len != rows * dim * 4 ||
        (kind == 1 && (width != dim || state.len != rows * width * 4)) || kind < 0 || kind > 1) {
        PyErr_SetString(PyExc_ValueError, "sparse_step: bad shapes or optimizer");
        goto done;
    }
    float *w = (float *)values.buf, *acc = (float *)state.buf;
    const float *g = (const float *)grads.buf;
    const int64_t *line = (const int64_t *)lines.buf;
    Py_ssize_t skipped = 0;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH < n) {  /* rows are scattered: ask for a later one's lines now */
            int64_t ahead = line[i + PREFETCH];
            if (ahead >= 0 && ahead < rows) {
                __builtin_prefetch(w + ahead * dim, 1);
                if (kind == 1) __builtin_prefetch(acc + ahead * dim, 1);
            }
        }
        const float *gi = g + i * dim;
        int finite = 1;
        for (Py_ssize_t j = 0; j < dim; j++) finite &= isfinite(gi[j]) != 0;
        if (!finite) {
            skipped++;
            continue;
        }
        int64_t r = line[i];
        if (r < 0 || r >= rows) {
            bad = 1;
            break;
        }
        float *wr = w + r * dim;
        if (kind == 0) {
            for (Py_ssize_t j = 0; j < dim; j++) wr[j] = wr[j] - lr * gi[j];
        } else {
            float *ar = acc + r * dim;
            for (Py_ssize_t j = 0; j < dim; j++) {
                float a = ar[j] + gi[j] * gi[j];
                float scale = a > 0.0f ? 1.0f / sqrtf(a + eps) : 0.0f;
                ar[j] = a;
                wr[j] = wr[j] - lr * (scale * gi[j]);
            }
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "sparse_step: row index out of range");
        goto done;
    }
    result = PyLong_FromSsize_t(skipped);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&state);
    PyBuffer_Release(&lines);
    PyBuffer_Release(&grads);
    return result;
}

/* init_rows(out, at, ids, row_offset, bits_offset, first_column, kind, a, b): out[at[i]]
 * = the initial values of ids[i] (float32 rows of out's width), columns first_column on;
 * kind 0: uniform in [a, b); 1: normal, mean a, standard deviation b (Box-Muller on the two
 * 32-bit halves). The same float64 arithmetic as _initializers.py, in the same order. */
static PyObject *init_rows(PyObject *self, PyObject *args) {
    Py_buffer out, at, ids;
    unsigned long long row_offset, bits_offset, first_column;
    Py_ssize_t dim;
    int kind;
    double a, b;
    if (!PyArg_ParseTuple(args, "w*y*y*nKKKidd", &out, &at, &ids, &dim, &row_offset,
                          &bits_offset, &first_column, &kind, &a, &b))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ids.len / 8, rows = dim > 0 ? out.len / (4 * dim) : 0;
    if (dim <= 0 || out.len != rows * 4 * dim || at.len != n * 8 || (kind != 0 && kind != 1)) {
        PyErr_SetString(PyExc_ValueError, "init_rows: bad output, positions or kind");
        goto done;
    }
    const uint64_t *keys = (const uint64_t *)ids.buf;
    const int64_t *where = (const int64_t *)at.buf;
    float *values = (float *)out.buf;
    int bad = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        if (where[i] < 0 || where[i] >= rows) {
            bad = 1;
            break;
        }
        float *row = values + where[i] * dim;
        uint64_t key = mix64(keys[i] + row_offset);
        for (Py_ssize_t j = 0; j < dim; j++) {
            uint64_t bits = mix64(key + (first_column + (uint64_t)j) * 0xD1B54A32D192ED03ULL
                                  + bits_offset);
            double v;
            if (kind == 0) {
                v = a + (b - a) * ((double)(bits >> 11) * (1.0 / 9007199254740992.0));
            } else {
                double u1 = ((double)(bits & 0xFFFFFFFFULL) + 1.0) * (1.0 / 4294967296.0);
                double u2 = (double)(bits >> 32) * (1.0 / 4294967296.0);
                v = a + b * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
            }
            row[j] = (float)v;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad) {
        PyErr_SetString(PyExc_IndexError, "init_rows: row position out of range");
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&at);
    PyBuffer_Release(&ids);
    return result;
}

static PyMethodDef methods[] = {
    {"slot_find", slot_find, METH_VARARGS, "slot_find(entries, ids, out, offset)"},
    {"slot_place", slot_place, METH_VARARGS, "slot_place(entries, ids, stored, offset)"},
    {"slot_remove", slot_remove, METH_VARARGS, "slot_remove(entries, ids, offset) -> int"},
    {"dedupe", dedupe, METH_VARARGS, "dedupe(ids, unique, inverse, scratch) -> u"},
    {"segment_sum", segment_sum, METH_VARARGS, "segment_sum(rows, inverse, out, width)"},
    {"sparse_step", sparse_step, METH_VARARGS,
     "sparse_step(kind, values, state, lines, grads, dim, width, lr, eps) -> skipped"},
    {"init_rows", init_rows, METH_VARARGS,
     "init_rows(out, at, ids, dim, row_offset, bits_offset, first_column, kind, a, b)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "embedding_store._native",
    "Native kernels for the embedding store's hot paths (no GIL held).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
