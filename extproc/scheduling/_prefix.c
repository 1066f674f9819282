/* extproc.scheduling._prefix: the two inner loops of prefix-cache-scorer in C (optional accelerator).
 *
 * What: `block_keys(seed, data, block_size, max_blocks)` returns, for each full leading block of
 * `data` (at most `max_blocks`), the key (depth << 32) | crc, crc the running zlib CRC-32 of the
 * data up to the end of that block started from `seed` (the CRC of the model name): exactly
 * `prefix_cache_scorer.block_hashes`. `matched(index, keys)` returns how many leading keys the dict
 * `index` (an endpoint's LRU, an OrderedDict: a dict subclass) holds, by binary search, since they
 * are always a leading run: exactly `PrefixCacheScorer.matched`'s search. `record(index, keys, cap)`
 * is `PrefixCacheScorer.picked`'s loop: each key, deepest first, moved to the end of the OrderedDict
 * or added there, then the oldest evicted down to `cap`.
 * Why: in Python each block costs a slice, a call and an int build (about 0.3 us); here the whole
 * 9 KB prompt costs about the CRC itself (2 us), and a lookup no call overhead.
 * The pure-Python versions stay the reference (tests/extproc/scheduling/test_prefix_native.py checks
 * both agree on random inputs) and are used when this module was not built (no compiler at install).
 * Built by setup.py as an optional extension (setuptools `optional=True`), linked with zlib.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <zlib.h>

static PyObject *block_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "block_keys(seed, data, block_size, max_blocks)");
        return NULL;
    }
    unsigned long seed = PyLong_AsUnsignedLongMask(args[0]);
    if (seed == (unsigned long)-1 && PyErr_Occurred()) return NULL;
    Py_ssize_t bs = PyLong_AsSsize_t(args[2]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t max_blocks = PyLong_AsSsize_t(args[3]);
    if (max_blocks == -1 && PyErr_Occurred()) return NULL;
    if (bs < 1 || max_blocks < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be >= 1 and max_blocks >= 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return NULL;
    Py_ssize_t n = view.len / bs;
    if (n > max_blocks) n = max_blocks;
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uLong crc = (uLong)(seed & 0xffffffffUL);
    const Bytef *p = (const Bytef *)view.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        crc = crc32(crc, p + i * bs, (uInt)bs);
        PyObject *key = PyLong_FromUnsignedLongLong(((unsigned long long)(i + 1) << 32) | (crc & 0xffffffffULL));
        if (key == NULL) {
            Py_DECREF(out);
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(out, i, key);
    }
    PyBuffer_Release(&view);
    return out;
}

static PyObject *matched(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyDict_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "matched(index: dict, keys: list)");
        return NULL;
    }
    PyObject *index = args[0], *keys = args[1];
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (n == 0 || PyDict_GET_SIZE(index) == 0) return PyLong_FromLong(0);
    int has = PyDict_Contains(index, PyList_GET_ITEM(keys, 0));
    if (has < 0) return NULL;
    if (!has) return PyLong_FromLong(0);
    Py_ssize_t lo = 1, hi = n; /* keys[:lo] held; the largest such lo */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        has = PyDict_Contains(index, PyList_GET_ITEM(keys, mid - 1));
        if (has < 0) return NULL;
        if (has) lo = mid;
        else hi = mid - 1;
    }
    return PyLong_FromSsize_t(lo);
}

static PyObject *s_move_to_end, *s_popitem;

static PyObject *record(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "record(index: OrderedDict, keys: list, capacity: int)");
        return NULL;
    }
    PyObject *index = args[0], *keys = args[1];
    Py_ssize_t cap = PyLong_AsSsize_t(args[2]);
    if (cap == -1 && PyErr_Occurred()) return NULL;
    PyObject *move = NULL; /* index.move_to_end, looked up once (when a key is already there) */
    for (Py_ssize_t i = PyList_GET_SIZE(keys) - 1; i >= 0; i--) { /* deepest first */
        PyObject *key = PyList_GET_ITEM(keys, i);
        int has = PyDict_Contains(index, key);
        if (has < 0) goto fail;
        if (has) {
            if (move == NULL && (move = PyObject_GetAttr(index, s_move_to_end)) == NULL) return NULL;
            PyObject *r = PyObject_CallOneArg(move, key);
            if (r == NULL) goto fail;
            Py_DECREF(r);
        } else if (PyObject_SetItem(index, key, Py_None) < 0) { /* the OrderedDict's own setitem */
            goto fail;
        }
    }
    Py_XDECREF(move);
    PyObject *pop = NULL; /* index.popitem, looked up once (when something is evicted) */
    while (PyObject_Length(index) > cap) {
        if (pop == NULL && (pop = PyObject_GetAttr(index, s_popitem)) == NULL) return NULL;
        PyObject *r = PyObject_CallOneArg(pop, Py_False); /* popitem(last=False) */
        if (r == NULL) {
            Py_DECREF(pop);
            return NULL;
        }
        Py_DECREF(r);
    }
    Py_XDECREF(pop);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(move);
    return NULL;
}

static PyMethodDef methods[] = {
    {"block_keys", (PyCFunction)(void (*)(void))block_keys, METH_FASTCALL,
     "block_keys(seed, data, block_size, max_blocks) -> list of (depth << 32) | running CRC-32 per full block"},
    {"matched", (PyCFunction)(void (*)(void))matched, METH_FASTCALL,
     "matched(index, keys) -> how many leading keys the dict holds (binary search)"},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL,
     "record(index, keys, capacity): keys deepest first into the OrderedDict (present: moved to the end), "
     "then evict the oldest beyond capacity"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_prefix", "C inner loops of prefix-cache-scorer (optional accelerator).", -1, methods,
};

PyMODINIT_FUNC PyInit__prefix(void) {
    s_move_to_end = PyUnicode_InternFromString("move_to_end");
    s_popitem = PyUnicode_InternFromString("popitem");
    if (s_move_to_end == NULL || s_popitem == NULL) return NULL;
    return PyModule_Create(&module);
}
