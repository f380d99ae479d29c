/* mqorder.spark._resp: an XRANGE reply's entries cut into byte ranges in one pass.
 *
 * Why: ``resp_pages.cut`` finds the entries of a raw reply with numpy, every "*2\r\n$" in the
 * buffer a candidate parsed all at once; that takes some thirty passes over arrays as long as the
 * page, about 1 us of a Spark read task's CPU per message, the largest part of the Python side of
 * a count. Walking the reply once from its start, as any RESP parser does, costs a few
 * nanoseconds a byte and gives the same answer: where each entry's id and field values start and
 * end, or "not a reply of this layout" (then the caller parses it with hiredis).
 *
 * Pure C against the buffer protocol: no numpy headers, nothing kept between calls. The module
 * is optional: without a compiler, resp_pages, headers and ledger_parse keep their numpy paths.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Digits of a RESP length read at most: 10 covers any value Redis may return here (a stream
 * value is at most 512 MB; 2^31 needs 10 digits), and keeps the value within int64. */
#define MAX_LEN_DIGITS 10

/* The length "<digits>\r\n" at p (within end): its value, and p moved past the CRLF; -1 if the
 * bytes are not 1 to MAX_LEN_DIGITS digits (no leading zero) followed by CRLF. */
static int64_t read_length(const uint8_t **pp, const uint8_t *end)
{
    const uint8_t *p = *pp;
    int64_t v = 0;
    int digits = 0;
    while (p < end && *p >= '0' && *p <= '9') {
        if (++digits > MAX_LEN_DIGITS)
            return -1;
        v = v * 10 + (*p - '0');
        p++;
    }
    if (digits == 0 || (digits > 1 && **pp == '0') || end - p < 2 || p[0] != '\r' || p[1] != '\n')
        return -1; /* "$00" and the like: hiredis refuses a leading zero, and Redis never sends one */
    *pp = p + 2;
    return v;
}

/* Whether the bytes at *pp are lit (then *pp moves past them). */
static int expect(const uint8_t **pp, const uint8_t *end, const char *lit, size_t n)
{
    if ((size_t)(end - *pp) < n || memcmp(*pp, lit, n) != 0)
        return 0;
    *pp += n;
    return 1;
}

/* A value "$<len>\r\n<bytes>\r\n" whose "$" was consumed: its range, relative to base. */
static int value(const uint8_t **pp, const uint8_t *end, const uint8_t *base, int64_t *lo, int64_t *hi)
{
    int64_t len = read_length(pp, end);
    if (len < 0 || end - *pp < len + 2)
        return 0;
    *lo = *pp - base;
    *hi = *lo + len;
    *pp += len;
    return expect(pp, end, "\r\n", 2);
}

/* The GIL is released while the reply is walked: every read is checked against ``end``, and each
 * byte is read once, so a buffer another thread changed meanwhile gives wrong ranges at worst
 * (then a refused page or a wrong row, never a read or write outside the buffers). */
static int walk(const uint8_t *base, Py_ssize_t first, Py_ssize_t stop, Py_ssize_t n,
                const char *fields, Py_ssize_t k, int64_t *out)
{
    const uint8_t *p = base + first, *end = base + stop;
    char array[16];
    int array_len = snprintf(array, sizeof array, "*%d\r\n$", (int)(2 * k));
    for (Py_ssize_t i = 0; i < n; i++) {
        /* out[2j][i] and out[2j + 1][i]: where range j (the id, then each value) starts and ends */
        if (!expect(&p, end, "*2\r\n$", 5) || !value(&p, end, base, &out[i], &out[n + i]))
            return 0;
        if (!expect(&p, end, array, (size_t)array_len))
            return 0;
        for (Py_ssize_t j = 0; j < k; j++) {
            const char name[7] = {'1', '\r', '\n', fields[j], '\r', '\n', '$'};
            if (j > 0 && !expect(&p, end, "$", 1))
                return 0;
            if (!expect(&p, end, name, sizeof name) ||
                !value(&p, end, base, &out[(2 * j + 2) * n + i], &out[(2 * j + 3) * n + i]))
                return 0;
        }
    }
    return p == end;
}

PyDoc_STRVAR(cut_spans_doc,
"cut_spans(data, first, end, n, fields, out) -> bool\n\n"
"Whether data[first:end] is exactly n XRANGE entries whose fields are the one-byte names of\n"
"``fields``, in that order (RESP2: ``*2 $<a> <id> *<2k> $1 <f> $<b> <value> ...``, each part\n"
"followed by CRLF). If so, ``out`` (a writable C-contiguous int64 buffer of 2 * (1 + k) rows of\n"
"n items) holds in rows 2j and 2j + 1 where range j of each entry starts and ends, as byte\n"
"positions in data: its id (j = 0), then each value. If not, ``out`` holds nothing to use.");

static PyObject *cut_spans(PyObject *self, PyObject *args)
{
    Py_buffer data, fields, out;
    Py_ssize_t first, stop, n;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnny*w*", &data, &first, &stop, &n, &fields, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = fields.len;
    if (k < 1 || k > 4) {
        PyErr_Format(PyExc_ValueError, "fields must be 1 to 4 one-byte names, got %zd bytes", k);
        goto done;
    }
    if (first < 0 || stop < first || stop > data.len || n < 0) {
        PyErr_Format(PyExc_ValueError, "range [%zd, %zd) of %zd entries does not fit a buffer of %zd bytes",
                     first, stop, n, data.len);
        goto done;
    }
    if (n > out.len / (Py_ssize_t)sizeof(int64_t) / (2 * (1 + k))) { /* divided: n may be anything */
        PyErr_Format(PyExc_ValueError, "out must be a writable buffer of 2 * (1 + %zd) rows of %zd int64 items "
                     "(it has %zd bytes)", k, n, out.len);
        goto done;
    }
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = walk((const uint8_t *)data.buf, first, stop, n, (const char *)fields.buf, k, (int64_t *)out.buf);
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&fields);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(gather_doc,
"gather(data, starts, ends) -> (offsets, values)\n\n"
"The byte ranges [starts[i], ends[i]) of ``data`` (int64 buffers of equal length, each range\n"
"within ``data``) copied one after the other into ``values`` (bytes), with ``offsets`` (bytes of\n"
"n + 1 int32, the first 0): the two buffers of an Arrow ``binary`` array. ValueError if a range\n"
"is out of ``data``, OverflowError if the values pass 2 GiB - 1 (int32 offsets).");

static PyObject *gather(PyObject *self, PyObject *args)
{
    Py_buffer data, starts, ends;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*", &data, &starts, &ends))
        return NULL;
    PyObject *offsets = NULL, *values = NULL, *result = NULL;
    Py_ssize_t n = starts.len / (Py_ssize_t)sizeof(int64_t);
    const int64_t *lo = (const int64_t *)starts.buf, *hi = (const int64_t *)ends.buf;
    if (ends.len != starts.len || starts.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "starts and ends must be int64 buffers of one length");
        goto done;
    }
    int64_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lo[i] < 0 || hi[i] < lo[i] || hi[i] > data.len) {
            PyErr_Format(PyExc_ValueError, "range %zd [%lld, %lld) is not within %zd bytes", i,
                         (long long)lo[i], (long long)hi[i], data.len);
            goto done;
        }
        total += hi[i] - lo[i];
        if (total > INT32_MAX) {
            PyErr_SetString(PyExc_OverflowError, "the values pass 2 GiB - 1 bytes: no int32 offsets hold them");
            goto done;
        }
    }
    offsets = PyBytes_FromStringAndSize(NULL, (n + 1) * (Py_ssize_t)sizeof(int32_t));
    values = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (offsets == NULL || values == NULL)
        goto done;
    int32_t *off = (int32_t *)PyBytes_AS_STRING(offsets);
    char *out = PyBytes_AS_STRING(values);
    const char *src = (const char *)data.buf;
    /* The GIL stays held: the ranges checked above cannot change before they are copied. */
    int32_t at = 0;
    off[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t len = (int32_t)(hi[i] - lo[i]);
        memcpy(out + at, src + lo[i], (size_t)len);
        at += len;
        off[i + 1] = at;
    }
    result = PyTuple_Pack(2, offsets, values);
done:
    Py_XDECREF(offsets);
    Py_XDECREF(values);
    PyBuffer_Release(&data);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&ends);
    return result;
}

/* A JSON string's contents at p, up to its closing quote (not consumed): no control character
 * and no backslash (so the quote ends it: no escapes), as headers.parse asks; then the quote
 * must begin the template's next segment. */
static int plain_string(const uint8_t **pp, const uint8_t *end, int64_t *lo, int64_t *hi, const uint8_t *base)
{
    const uint8_t *p = *pp;
    *lo = p - base;
    while (p < end && *p != '"') {
        if (*p < 0x20 || *p == '\\')
            return 0;
        p++;
    }
    if (p == end)
        return 0;
    *hi = p - base;
    *pp = p;
    return 1;
}

/* A JSON integer -?(0|[1-9][0-9]*) at p within int64: its value, p moved past it. */
static int json_integer(const uint8_t **pp, const uint8_t *end, int64_t *value)
{
    const uint8_t *p = *pp;
    int negative = p < end && *p == '-';
    p += negative;
    if (p == end || *p < '0' || *p > '9' || (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9'))
        return 0;
    uint64_t v = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    while (p < end && *p >= '0' && *p <= '9') {
        uint64_t d = (uint64_t)(*p - '0');
        if (v > (limit - d) / 10)
            return 0;
        v = v * 10 + d;
        p++;
    }
    *value = negative ? (int64_t)(0 - v) : (int64_t)v;
    *pp = p;
    return 1;
}

/* A JSON number -?(0|[1-9][0-9]*)\.[0-9]+ of at most 32 bytes at p (what orjson writes for a
 * rounded float): its range, p moved past it. Arrow's cast reads its value. */
static int json_fraction(const uint8_t **pp, const uint8_t *end, int64_t *lo, int64_t *hi, const uint8_t *base)
{
    const uint8_t *p = *pp, *start = *pp;
    p += p < end && *p == '-';
    if (p == end || *p < '0' || *p > '9')
        return 0;
    if (*p == '0')
        p++;
    else
        while (p < end && *p >= '0' && *p <= '9')
            p++;
    if (p == end || *p != '.')
        return 0;
    p++;
    const uint8_t *digits = p;
    while (p < end && *p >= '0' && *p <= '9')
        p++;
    if (p == digits || p - start > 32)
        return 0;
    *lo = start - base;
    *hi = p - base;
    *pp = p;
    return 1;
}

#define MAX_TEMPLATE_FIELDS 32

PyDoc_STRVAR(parse_template_doc,
"parse_template(data, offsets, n, segments, kinds, spans, ints) -> bool\n\n"
"Whether each of the n records data[offsets[i]:offsets[i + 1]] (offsets: n + 1 int64) is exactly\n"
"segments[0] value_0 segments[1] value_1 ... segments[F] (F = len(kinds), at most 32), value j of\n"
"kind kinds[j]: 's' a JSON string's contents (no escape, no control character, ended by the\n"
"next segment's quote), 'i' a JSON integer within int64, 'f' a JSON number with a fraction and\n"
"no exponent, at most 32 bytes. If so, ``spans`` (2F rows of n int64) holds where each value\n"
"starts and ends (rows 2j, 2j + 1) and ``ints`` (F rows of n int64) each integer's value.");

static PyObject *parse_template(PyObject *self, PyObject *args)
{
    Py_buffer data, offsets, spans, ints;
    Py_ssize_t n;
    PyObject *segments;
    const char *kinds;
    Py_ssize_t nk;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*nO!y#w*w*", &data, &offsets, &n, &PyTuple_Type, &segments, &kinds, &nk,
                          &spans, &ints))
        return NULL;
    PyObject *result = NULL;
    const char *seg[MAX_TEMPLATE_FIELDS + 1];
    Py_ssize_t seg_len[MAX_TEMPLATE_FIELDS + 1];
    const int64_t *off = (const int64_t *)offsets.buf;
    Py_ssize_t w = (Py_ssize_t)sizeof(int64_t);
    if (nk < 1 || nk > MAX_TEMPLATE_FIELDS || PyTuple_GET_SIZE(segments) != nk + 1) {
        PyErr_Format(PyExc_ValueError, "1 to %d kinds and one segment more than kinds, got %zd and %zd",
                     MAX_TEMPLATE_FIELDS, nk, PyTuple_GET_SIZE(segments));
        goto done;
    }
    for (Py_ssize_t j = 0; j < nk; j++) {
        if (kinds[j] != 's' && kinds[j] != 'i' && kinds[j] != 'f') {
            PyErr_Format(PyExc_ValueError, "kind %zd is byte 0x%02x: 's', 'i' or 'f'", j, (unsigned int)(unsigned char)kinds[j]);
            goto done;
        }
    }
    for (Py_ssize_t j = 0; j <= nk; j++) {
        PyObject *sj = PyTuple_GET_ITEM(segments, j);
        if (!PyBytes_Check(sj)) {
            PyErr_SetString(PyExc_TypeError, "segments must be bytes");
            goto done;
        }
        seg[j] = PyBytes_AS_STRING(sj);
        seg_len[j] = PyBytes_GET_SIZE(sj);
    }
    for (Py_ssize_t j = 0; j < nk; j++) { /* a string's quotes are its segments' last and first bytes */
        if (kinds[j] == 's' && (seg_len[j] < 1 || seg[j][seg_len[j] - 1] != '"' || seg_len[j + 1] < 1 || seg[j + 1][0] != '"')) {
            PyErr_Format(PyExc_ValueError, "string value %zd must sit between a segment ending in '\"' and one "
                         "starting with it", j);
            goto done;
        }
    }
    if (n < 0 || n >= offsets.len / w || n > spans.len / w / (2 * nk) || n > ints.len / w / nk) { /* divided */
        PyErr_SetString(PyExc_ValueError, "offsets must hold n + 1 int64, spans 2 * F * n and ints F * n");
        goto done;
    }
    for (Py_ssize_t i = 0; i <= n; i++) {
        if (off[i] < 0 || off[i] > data.len || (i > 0 && off[i] < off[i - 1])) {
            PyErr_Format(PyExc_ValueError, "offset %zd (%lld) is not within %zd bytes in order", i,
                         (long long)off[i], data.len);
            goto done;
        }
    }
    int ok = 1;
    int64_t *sp = (int64_t *)spans.buf, *iv = (int64_t *)ints.buf;
    const uint8_t *base = (const uint8_t *)data.buf;
    /* The GIL stays held, and each record's bounds are read once and checked again here: the
     * outputs may overlap the offsets (a caller's mistake), and then the walk overwrites them. */
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        int64_t o0 = off[i], o1 = off[i + 1];
        if (o0 < 0 || o1 < o0 || o1 > data.len) {
            ok = 0;
            break;
        }
        const uint8_t *p = base + o0, *end = base + o1;
        for (Py_ssize_t j = 0; ok && j < nk; j++) {
            int64_t *lo = &sp[2 * j * n + i], *hi = &sp[(2 * j + 1) * n + i];
            ok = expect(&p, end, seg[j], (size_t)seg_len[j]);
            if (ok && kinds[j] == 's')
                ok = plain_string(&p, end, lo, hi, base);
            else if (ok && kinds[j] == 'i') {
                *lo = p - base;
                ok = json_integer(&p, end, &iv[j * n + i]);
                *hi = p - base;
            } else if (ok)
                ok = json_fraction(&p, end, lo, hi, base);
        }
        ok = ok && expect(&p, end, seg[nk], (size_t)seg_len[nk]) && p == end;
    }
    result = PyBool_FromLong(ok);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&spans);
    PyBuffer_Release(&ints);
    return result;
}

static PyMethodDef methods[] = {
    {"parse_template", parse_template, METH_VARARGS, parse_template_doc},
    {"cut_spans", cut_spans, METH_VARARGS, cut_spans_doc},
    {"gather", gather, METH_VARARGS, gather_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mqorder.spark._resp",
    "An XRANGE reply's entries cut into byte ranges in one pass (see resp_pages.cut).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__resp(void)
{
    return PyModule_Create(&module);
}
