/* mqorder.store._pack: a pipeline's commands packed as RESP in one call.
 *
 * Why compiled: at a trickle a worker sends one round trip of four or five commands per message
 * (a commit, a blocking read, a state check, switch.lua's call), about 60 arguments in all, most of
 * them the same keys, tokens and settings message after message. hiredis's pack_command copies
 * every argument into an sds string, turns every int into its repr through Python, and formats
 * each length with sprintf: it was 16 % of a trickling worker's instructions (callgrind), and the
 * Python loop calling it once per command added more. Here one call packs the whole round trip:
 * str (its UTF-8, cached on the str object by CPython), bytes and int arguments are written
 * straight into one buffer, lengths and ints formatted by hand.
 *
 * The bytes are exactly hiredis's (tests/test_pack.py compares them over random commands). Ints
 * beyond 64 bits and floats are written as their repr, as hiredis writes them (but a repr that
 * fails raises here, where hiredis crashes). A command holding anything else (a memoryview, a
 * subclass of str, bytes or int, a bool, a type hiredis refuses) is handed to `fallback`
 * (hiredis.pack_command), whose bytes or error are the caller's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    char *buf;
    size_t len;
    size_t cap;
} Out;

static int out_reserve(Out *o, size_t more) {
    if (o->len + more <= o->cap)
        return 0;
    size_t cap = o->cap ? o->cap : 512;
    while (cap < o->len + more)
        cap *= 2;
    char *b = PyMem_Realloc(o->buf, cap);
    if (b == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = b;
    o->cap = cap;
    return 0;
}

/* The decimal digits of v into the end of tmp[24]; returns where they start. */
static char *digits_u(unsigned long long v, char *end) {
    char *p = end;
    do {
        *--p = (char)('0' + (v % 10));
        v /= 10;
    } while (v);
    return p;
}

static int put_header(Out *o, char kind, size_t n) {
    char tmp[24];
    char *end = tmp + sizeof(tmp);
    char *p = digits_u((unsigned long long)n, end);
    size_t w = (size_t)(end - p);
    if (out_reserve(o, w + 3) < 0)
        return -1;
    o->buf[o->len++] = kind;
    memcpy(o->buf + o->len, p, w);
    o->len += w;
    o->buf[o->len++] = '\r';
    o->buf[o->len++] = '\n';
    return 0;
}

static int put_bulk(Out *o, const char *s, size_t n) {
    if (put_header(o, '$', n) < 0 || out_reserve(o, n + 2) < 0)
        return -1;
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    o->buf[o->len++] = '\r';
    o->buf[o->len++] = '\n';
    return 0;
}

/* The repr of an int or a float as one bulk string (hiredis's spelling of both); -1: an error
 * (set: a repr that raised, or an int too long to spell, ValueError). */
static int put_repr(Out *o, PyObject *item) {
    PyObject *repr = PyObject_Repr(item);
    if (repr == NULL)
        return -1;
    Py_ssize_t len;
    const char *s = PyUnicode_AsUTF8AndSize(repr, &len);
    int r = s == NULL ? -1 : put_bulk(o, s, (size_t)len);
    Py_DECREF(repr);
    return r;
}

/* 1: packed; 0: an argument this packer leaves to the fallback (nothing written is kept);
 * -1: an error (set). */
static int pack_tuple(Out *o, PyObject *cmd) {
    size_t start = o->len;
    Py_ssize_t n = PyTuple_GET_SIZE(cmd);
    if (put_header(o, '*', (size_t)n) < 0)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(cmd, i);
        if (PyBytes_CheckExact(item)) {
            if (put_bulk(o, PyBytes_AS_STRING(item), (size_t)PyBytes_GET_SIZE(item)) < 0)
                return -1;
        } else if (PyUnicode_CheckExact(item)) {
            Py_ssize_t len;
            const char *s = PyUnicode_AsUTF8AndSize(item, &len);
            if (s == NULL) {
                PyErr_Clear(); /* not encodable: hiredis says so in its own words */
                o->len = start;
                return 0;
            }
            if (put_bulk(o, s, (size_t)len) < 0)
                return -1;
        } else if (PyLong_CheckExact(item)) {
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
            if (overflow) {
                /* Beyond 64 bits: its repr, as hiredis writes it (hiredis does not check for a
                 * failed repr, an int past sys.get_int_max_str_digits(), and crashes on it). */
                if (put_repr(o, item) < 0)
                    return -1;
                continue;
            }
            if (v == -1 && PyErr_Occurred())
                return -1;
            char tmp[24];
            char *end = tmp + sizeof(tmp);
            char *p = digits_u(v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v, end);
            if (v < 0)
                *--p = '-';
            if (put_bulk(o, p, (size_t)(end - p)) < 0)
                return -1;
        } else if (PyFloat_Check(item)) {
            /* Its repr (a subclass's own, as hiredis takes any float), checked for failure. */
            if (put_repr(o, item) < 0)
                return -1;
        } else {
            o->len = start;
            return 0;
        }
    }
    return 1;
}

static int put_bytes_of(Out *o, PyObject *b) {
    if (!PyBytes_Check(b)) {
        PyErr_SetString(PyExc_TypeError, "the fallback packer must return bytes");
        return -1;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(b);
    if (out_reserve(o, (size_t)n) < 0)
        return -1;
    memcpy(o->buf + o->len, PyBytes_AS_STRING(b), (size_t)n);
    o->len += (size_t)n;
    return 0;
}

static PyObject *pack_commands(PyObject *self, PyObject *args) {
    PyObject *commands, *fallback;
    if (!PyArg_ParseTuple(args, "OO:pack_commands", &commands, &fallback))
        return NULL;
    PyObject *seq = PySequence_Fast(commands, "commands must be a sequence");
    if (seq == NULL)
        return NULL;
    Out o = {NULL, 0, 0};
    PyObject *result = NULL;
    /* The size and each command are read again at every step, and each command held while it is
     * packed: a repr or the fallback may run Python code (a float subclass's __repr__, another
     * thread) that changes a list of commands, as iterating the list in Python would see it. */
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *cmd = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(cmd);
        int r;
        if (PyBytes_CheckExact(cmd)) /* packed already (RawPipeline.execute_packed) */
            r = put_bytes_of(&o, cmd) < 0 ? -1 : 1;
        else
            r = PyTuple_CheckExact(cmd) ? pack_tuple(&o, cmd) : 0;
        if (r == 0) {
            PyObject *b = PyObject_CallOneArg(fallback, cmd);
            r = b == NULL ? -1 : (put_bytes_of(&o, b) < 0 ? -1 : 1);
            Py_XDECREF(b);
        }
        Py_DECREF(cmd);
        if (r < 0)
            goto done;
    }
    result = PyBytes_FromStringAndSize(o.buf ? o.buf : "", (Py_ssize_t)o.len);
done:
    PyMem_Free(o.buf);
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"pack_commands", pack_commands, METH_VARARGS,
     "pack_commands(commands, fallback) -> bytes: every command (a tuple of arguments, or bytes "
     "packed already) as RESP, in order; a tuple this packer does not take goes to fallback(cmd)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
