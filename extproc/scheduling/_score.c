/* extproc.scheduling._score: the scheduling profile's numeric loop in C (optional accelerator).
 *
 * What: `accumulate(totals, raw, candidates, weight, bounded)` adds one scorer's weighted, normalised
 * scores into `totals` (a list of floats, one per candidate, in candidate order): exactly
 * `profile.accumulate_py` (the reference), i.e. `normalise(raw, candidates, bounded)` times
 * `weight`, added in candidate order. `raw` must be a dict whose values for the candidates are
 * exact floats or ints (or missing); anything else (a bool, a numpy scalar, a string, an int too
 * large for a double) returns False with `totals` untouched and the caller normalises in Python.
 * `rank(candidates, totals, rnd, k)` is max-score-picker's order: it calls `rnd()` once per
 * candidate, in candidate order (as `sorted(..., key=lambda e: (-total(e), rnd()))` does), and
 * returns the first `k` candidates by (-total, u): highest total first, ties by the drawn u, a
 * full tie by position (Python's sort is stable); exactly `MaxScorePicker.pick_ranked`'s Python
 * code.
 * `predict(candidates, facts, loads, match, prompt_kb, request_tokens, kb_per_token, base, slot_wait,
 * prefill, slo)` is predicted-ttft-scorer's per-candidate formula: exactly its `predict_py` (the
 * reference), returning the same ({endpoint: score}, {endpoint: (wait, uncached KB, speed, KB ahead)});
 * the floor division is CPython's own float `//` algorithm.
 * Why: in Python a scorer's normalisation and sum cost a list, a lookup and a few float objects per
 * candidate, and the pick a key tuple per candidate and a sort; here each is one pass over a
 * C array. Arithmetic is IEEE double in the same order as the Python code (built with
 * -ffp-contract=off, so no fused multiply-add changes a last bit):
 * tests/extproc/scheduling/test_score_native.py checks both agree on random fleets.
 * Built by setup.py as an optional extension (setuptools `optional=True`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#define STACK_N 64

/* the value of one raw score: 1 present (in *out), 0 missing, -1 not a plain number (fall back), -2 error */
static int read_score(PyObject *raw, PyObject *key, double *out) {
    PyObject *v = PyDict_GetItemWithError(raw, key);
    if (v == NULL) return PyErr_Occurred() ? -2 : 0;
    if (v == Py_None) return 0;
    if (PyFloat_CheckExact(v)) {
        *out = PyFloat_AS_DOUBLE(v);
        return 1;
    }
    if (PyLong_CheckExact(v)) {
        double d = PyLong_AsDouble(v);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return -1;
        }
        *out = d;
        return 1;
    }
    return -1;
}

static PyObject *accumulate(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_Check(args[0]) || !PyTuple_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "accumulate(totals: list, raw: dict, candidates: tuple, weight, bounded)");
        return NULL;
    }
    PyObject *totals = args[0], *raw = args[1], *cands = args[2];
    double w = PyFloat_AsDouble(args[3]);
    if (w == -1.0 && PyErr_Occurred()) return NULL;
    int bounded = PyObject_IsTrue(args[4]);
    if (bounded < 0) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(cands);
    if (PyList_GET_SIZE(totals) != n) {
        PyErr_SetString(PyExc_ValueError, "totals and candidates differ in length");
        return NULL;
    }
    if (!PyDict_Check(raw)) Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyFloat_CheckExact(PyList_GET_ITEM(totals, i))) {
            PyErr_SetString(PyExc_TypeError, "totals must hold floats");
            return NULL;
        }
    }
    double vbuf[STACK_N];
    char pbuf[STACK_N];
    double *val = vbuf;
    char *has = pbuf;
    if (n > STACK_N) {
        val = PyMem_Malloc(n * sizeof(double));
        has = PyMem_Malloc(n);
        if (val == NULL || has == NULL) {
            PyMem_Free(val == vbuf ? NULL : val);
            PyMem_Free(has == pbuf ? NULL : has);
            return PyErr_NoMemory();
        }
    }
    PyObject *result = Py_False;
    Py_ssize_t present = 0;
    double lo = 0.0, hi = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) {
        double d = 0.0;
        int r = read_score(raw, PyTuple_GET_ITEM(cands, i), &d);
        if (r == -2) {
            result = NULL;
            goto done;
        }
        if (r == -1) goto done; /* not a plain number: Python normalises */
        has[i] = 0;
        if (r == 1 && (bounded || isfinite(d))) {
            has[i] = 1;
            val[i] = d;
            if (!bounded) {
                if (present == 0 || d < lo) lo = d;
                if (present == 0 || d > hi) hi = d;
            }
            present++;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!has[i]) continue; /* normalised 0: adds weight * 0.0, which changes no total */
        double v = val[i], add;
        if (bounded) {
            if (0.0 < v && v < 1.0) add = w * v;
            else if (1.0 <= v && v < INFINITY) add = w;
            else continue; /* <= 0, nan or inf: 0 */
        } else if (hi == lo) {
            add = w * 1.0;
        } else {
            add = w * ((v - lo) / (hi - lo));
        }
        PyObject *t = PyList_GET_ITEM(totals, i);
        PyObject *nt = PyFloat_FromDouble(PyFloat_AS_DOUBLE(t) + add);
        if (nt == NULL) {
            result = NULL;
            goto done;
        }
        PyList_SET_ITEM(totals, i, nt);
        Py_DECREF(t);
    }
    result = Py_True;
done:
    if (val != vbuf) PyMem_Free(val);
    if (has != pbuf) PyMem_Free(has);
    if (result == NULL) return NULL;
    return Py_NewRef(result);
}

static PyObject *rank(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "rank(candidates: tuple, totals: list, rnd, k)");
        return NULL;
    }
    PyObject *cands = args[0], *totals = args[1], *rnd = args[2];
    Py_ssize_t n = PyTuple_GET_SIZE(cands);
    Py_ssize_t k = PyLong_AsSsize_t(args[3]);
    if (k == -1 && PyErr_Occurred()) return NULL;
    if (PyList_GET_SIZE(totals) != n) {
        PyErr_SetString(PyExc_ValueError, "totals and candidates differ in length");
        return NULL;
    }
    if (k > n) k = n;
    if (k < 0) k = 0;
    double tbuf[STACK_N], ubuf[STACK_N];
    char cbuf[STACK_N];
    double *t = tbuf, *u = ubuf;
    char *taken = cbuf;
    if (n > STACK_N) {
        t = PyMem_Malloc(n * sizeof(double));
        u = PyMem_Malloc(n * sizeof(double));
        taken = PyMem_Malloc(n);
        if (t == NULL || u == NULL || taken == NULL) {
            PyMem_Free(t == tbuf ? NULL : t);
            PyMem_Free(u == ubuf ? NULL : u);
            PyMem_Free(taken == cbuf ? NULL : taken);
            return PyErr_NoMemory();
        }
    }
    PyObject *out = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = PyList_GET_ITEM(totals, i);
        t[i] = PyFloat_AsDouble(x);
        if (t[i] == -1.0 && PyErr_Occurred()) goto done;
        t[i] = -t[i]; /* the sort key's -total */
    }
    for (Py_ssize_t i = 0; i < n; i++) { /* one draw per candidate, in candidate order */
        PyObject *r = PyObject_CallNoArgs(rnd);
        if (r == NULL) goto done;
        u[i] = PyFloat_AsDouble(r);
        Py_DECREF(r);
        if (u[i] == -1.0 && PyErr_Occurred()) goto done;
        taken[i] = 0;
    }
    out = PyTuple_New(k);
    if (out == NULL) goto done;
    for (Py_ssize_t j = 0; j < k; j++) { /* the j-th smallest (-t, u), the first in position on a full tie */
        Py_ssize_t best = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (taken[i]) continue;
            if (best < 0 || t[i] < t[best] || (t[i] == t[best] && u[i] < u[best])) best = i;
        }
        taken[best] = 1;
        PyObject *e = PyTuple_GET_ITEM(cands, best);
        PyTuple_SET_ITEM(out, j, Py_NewRef(e));
    }
done:
    if (t != tbuf) PyMem_Free(t);
    if (u != ubuf) PyMem_Free(u);
    if (taken != cbuf) PyMem_Free(taken);
    return out;
}

/* CPython's float floor division (Objects/floatobject.c float_floor_div), for wx != 0 */
static double py_floordiv(double vx, double wx) {
    double mod = fmod(vx, wx);
    double div = (vx - mod) / wx;
    if (mod) {
        if ((wx < 0) != (mod < 0)) {
            mod += wx;
            div -= 1.0;
        }
    }
    double floordiv;
    if (div) {
        floordiv = floor(div);
        if (div - floordiv > 0.5) floordiv += 1.0;
    } else {
        floordiv = copysign(0.0, vx / wx);
    }
    return floordiv;
}

static int as_double(PyObject *o, double *out) {
    *out = PyFloat_AsDouble(o);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *predict(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11 || !PyTuple_Check(args[0]) || !PyList_Check(args[1]) || !PyDict_Check(args[2]) ||
        !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "predict(candidates: tuple, facts: list, loads: dict, match: dict, prompt_kb, "
                                         "request_tokens, kb_per_token, base, slot_wait, prefill, slo)");
        return NULL;
    }
    PyObject *cands = args[0], *facts = args[1], *loads = args[2], *match = args[3];
    double prompt_kb, request_tokens, kb_per_token, base, slot_wait, prefill, slo;
    if (as_double(args[4], &prompt_kb) || as_double(args[5], &request_tokens) || as_double(args[6], &kb_per_token) ||
        as_double(args[7], &base) || as_double(args[8], &slot_wait) || as_double(args[9], &prefill) ||
        as_double(args[10], &slo))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(cands);
    if (PyList_GET_SIZE(facts) < n) n = PyList_GET_SIZE(facts); /* zip() stops at the shorter */
    PyObject *out = PyDict_New(), *features = PyDict_New();
    if (out == NULL || features == NULL) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(cands, i), *f = PyList_GET_ITEM(facts, i);
        if (!PyTuple_Check(f) || PyTuple_GET_SIZE(f) != 3) {
            PyErr_SetString(PyExc_TypeError, "facts: (slots, speed, kv tokens or None) per candidate");
            goto fail;
        }
        double slots, speed, kv = 0.0;
        if (as_double(PyTuple_GET_ITEM(f, 0), &slots) || as_double(PyTuple_GET_ITEM(f, 1), &speed)) goto fail;
        int has_kv = PyTuple_GET_ITEM(f, 2) != Py_None;
        if (has_kv && as_double(PyTuple_GET_ITEM(f, 2), &kv)) goto fail;
        PyObject *load = PyDict_GetItemWithError(loads, e);
        if (load == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, e);
            goto fail;
        }
        if (!PyTuple_Check(load) || PyTuple_GET_SIZE(load) != 3) {
            PyErr_SetString(PyExc_TypeError, "loads: (requests, tokens, pending prefill) per candidate");
            goto fail;
        }
        long long running = PyLong_AsLongLong(PyTuple_GET_ITEM(load, 0));
        if (running == -1 && PyErr_Occurred()) goto fail;
        double pending;
        if (as_double(PyTuple_GET_ITEM(load, 2), &pending)) goto fail;
        double kb_ahead = pending * kb_per_token;
        if (has_kv && request_tokens > 0) {
            double fit = py_floordiv(kv, request_tokens);
            if (fit < 1.0) fit = 1.0;
            if (fit < slots) slots = fit;
        }
        double wait = (double)(running + 1) - slots;
        if (wait < 0) wait = 0.0;
        double uncached = prompt_kb;
        PyObject *m = PyDict_GetItemWithError(match, e);
        if (m == NULL && PyErr_Occurred()) goto fail;
        if (m != NULL) {
            int truthy = PyObject_IsTrue(m);
            if (truthy < 0) goto fail;
            if (truthy) {
                double mv;
                if (as_double(m, &mv)) goto fail;
                uncached = prompt_kb * (1.0 - mv);
            }
        }
        PyObject *feat = Py_BuildValue("(dddd)", wait, uncached, speed, kb_ahead);
        if (feat == NULL) goto fail;
        int rc = PyDict_SetItem(features, e, feat);
        Py_DECREF(feat);
        if (rc < 0) goto fail;
        double headroom = slo - (base + slot_wait * wait + prefill * (uncached + kb_ahead)) / speed;
        PyObject *score = PyFloat_FromDouble(headroom > 0.0 ? headroom / slo : 0.0);
        if (score == NULL) goto fail;
        rc = PyDict_SetItem(out, e, score);
        Py_DECREF(score);
        if (rc < 0) goto fail;
    }
    return Py_BuildValue("(NN)", out, features);
fail:
    Py_XDECREF(out);
    Py_XDECREF(features);
    return NULL;
}

static PyMethodDef methods[] = {
    {"accumulate", (PyCFunction)(void (*)(void))accumulate, METH_FASTCALL,
     "accumulate(totals, raw, candidates, weight, bounded) -> bool: one scorer's weighted, normalised scores "
     "added into totals (False, totals untouched: a value is not a plain number)"},
    {"rank", (PyCFunction)(void (*)(void))rank, METH_FASTCALL,
     "rank(candidates, totals, rnd, k) -> the first k candidates by (-total, rnd() drawn per candidate)"},
    {"predict", (PyCFunction)(void (*)(void))predict, METH_FASTCALL,
     "predict(candidates, facts, loads, match, prompt_kb, request_tokens, kb_per_token, base, slot_wait, prefill, "
     "slo) -> ({endpoint: score}, {endpoint: (wait, uncached, speed, kb_ahead)}): predicted-ttft-scorer's formula"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_score", "The scheduling profile's numeric loop (optional accelerator).", -1, methods,
};

PyMODINIT_FUNC PyInit__score(void) { return PyModule_Create(&module); }
