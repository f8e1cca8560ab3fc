/* mmmesh.wire._cwire: the compiled fast path of the MMH v1 codec.
 *
 * The reference is the pure-Python codec in mmmesh/wire/_codec.py; this file
 * implements the same functions for the inputs they accept, and nothing
 * else: whenever an input is malformed, out of range or merely unusual
 * (unknown TLVs to encode, a non-contiguous buffer, a memoryview traceparent,
 * a message that is not valid UTF-8 ...), it calls the Python reference with
 * the same arguments, which raises the documented WireError (or returns the
 * same result).  So errors, their reasons and offsets are the reference's by
 * construction, and the valid path is held byte for byte against it by
 * tests/mmmesh/wire/test_wire_fast.py (hypothesis).
 *
 * Built by setuptools at install ([[tool.setuptools.ext-modules]] in
 * pyproject.toml, optional: a machine without a compiler installs the pure
 * Python codec); selected in _codec.py unless MMMESH_WIRE=python.
 *
 * Layout of a header (docs/wire-format.md; constants from mmmesh/abi.py):
 *   0 "MMH" 3 version 4 hdr_len 5 modality 6 class 7 flags 8 payload_len (u32 BE) 12 TLVs
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MMH_MAGIC_V1 0x4D4D4801u
#define MMH_PREAMBLE_LEN 12
#define MMH_HDR_MAX 255
#define MMH_MAX_TLVS 16
#define MMH_MAX_PAYLOAD (1u << 30)
#define TENSOR_MAX_DIMS 8
#define TRACEPARENT_LEN 26

enum {
    TLV_PAD = 0x00, TLV_STREAM_ID = 0x01, TLV_SEQUENCE = 0x02, TLV_TIMESTAMP_NS = 0x03,
    TLV_DEADLINE_NS = 0x04, TLV_VIDEO_FPS = 0x10, TLV_AUDIO_BITRATE = 0x11,
    TLV_POINT_DENSITY = 0x12, TLV_TENSOR = 0x20, TLV_TRACEPARENT = 0x30, TLV_ERROR = 0x40,
};

/* The integer TLVs, in emission order (as _codec._INT_TLVS). */
#define N_INT 7
static const uint8_t INT_TYPE[N_INT] = {TLV_STREAM_ID, TLV_SEQUENCE, TLV_TIMESTAMP_NS,
                                        TLV_DEADLINE_NS, TLV_VIDEO_FPS, TLV_AUDIO_BITRATE,
                                        TLV_POINT_DENSITY};
static const uint8_t INT_SIZE[N_INT] = {4, 8, 8, 8, 2, 4, 4};
static const char *INT_NAME[N_INT] = {"stream_id", "sequence", "timestamp_ns", "deadline_ns",
                                      "fps", "bitrate", "density"};

/* Set once by setup(): the Python types and the reference functions. */
static PyObject *Header_T, *TensorSpec_T, *py_decode_header, *py_encode_header, *py_frame,
    *py_decode_frame;
static PyObject *empty_tuple, *empty_bytes;
static PyObject *s_modality, *s_sla_class, *s_flags, *s_payload_len, *s_hdr_len, *s_tensor,
    *s_traceparent, *s_error, *s_extra, *s_dtype, *s_shape, *s_cast, *s_B, *s_align;
static PyObject *s_int[N_INT];

static int ready(void) {
    if (Header_T == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "mmmesh.wire._cwire.setup() was not called");
        return 0;
    }
    return 1;
}

static inline uint32_t be32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const uint8_t *p) {
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}
static inline void put_be(uint8_t *p, uint64_t v, int size) {
    for (int i = size - 1; i >= 0; i--) {
        p[i] = (uint8_t)(v & 0xFF);
        v >>= 8;
    }
}

/* ---------------------------------------------------------------------- */
/* Decoding                                                               */
/* ---------------------------------------------------------------------- */

/* object.__setattr__(obj, name, value), stealing value. */
static int set_steal(PyObject *obj, PyObject *name, PyObject *value) {
    if (value == NULL)
        return -1;
    int r = PyObject_GenericSetAttr(obj, name, value);
    Py_DECREF(value);
    return r;
}

/* A new instance of `type` without calling __init__ (as object.__new__). */
static PyObject *bare(PyObject *type) {
    return PyBaseObject_Type.tp_new((PyTypeObject *)type, empty_tuple, NULL);
}

/* Parses the header at p[0:n].  Returns a new Header, or NULL with no
 * exception set when the input is not a valid header (the caller then asks
 * the reference, which raises the precise WireError), or NULL with an
 * exception set on a real failure (memory). */
static PyObject *parse(const uint8_t *p, Py_ssize_t n) {
    if (n < MMH_PREAMBLE_LEN || be32(p) != MMH_MAGIC_V1)
        return NULL;
    unsigned hdr_len = p[4];
    uint32_t plen = be32(p + 8);
    if (hdr_len < MMH_PREAMBLE_LEN || plen > MMH_MAX_PAYLOAD || (Py_ssize_t)hdr_len > n)
        return NULL;

    /* validate every TLV first: nothing is allocated for a header refused */
    unsigned off = MMH_PREAMBLE_LEN, count = 0, seen = 0, n_extra = 0;
    while (off < hdr_len) {
        if (++count > MMH_MAX_TLVS || off + 2 > hdr_len)
            return NULL;
        unsigned typ = p[off], ln = p[off + 1], end = off + 2 + ln;
        if (end > hdr_len)
            return NULL;
        if (typ != TLV_PAD) {
            int bit = -1, fixed = -1;
            for (int i = 0; i < N_INT; i++)
                if (INT_TYPE[i] == typ) {
                    bit = i;
                    fixed = INT_SIZE[i];
                }
            if (typ == TLV_TENSOR)
                bit = 7;
            else if (typ == TLV_TRACEPARENT) {
                bit = 8;
                fixed = TRACEPARENT_LEN;
            } else if (typ == TLV_ERROR)
                bit = 9;
            if (bit < 0) {
                n_extra++;
            } else {
                if (seen & (1u << bit))
                    return NULL; /* duplicate */
                seen |= 1u << bit;
                if (fixed >= 0 && ln != (unsigned)fixed)
                    return NULL;
                if (typ == TLV_TENSOR) {
                    if (ln < 2 || p[off + 3] > TENSOR_MAX_DIMS || ln != 2u + 4u * p[off + 3])
                        return NULL;
                } else if (typ == TLV_ERROR) {
                    if (ln < 2)
                        return NULL;
                }
            }
        }
        off = end;
    }

    PyObject *h = bare(Header_T);
    if (h == NULL)
        return NULL;
    PyObject *extra = NULL;
    if (set_steal(h, s_modality, PyLong_FromLong(p[5])) < 0 ||
        set_steal(h, s_sla_class, PyLong_FromLong(p[6])) < 0 ||
        set_steal(h, s_flags, PyLong_FromLong(p[7])) < 0 ||
        set_steal(h, s_payload_len, PyLong_FromUnsignedLong(plen)) < 0 ||
        set_steal(h, s_hdr_len, PyLong_FromLong(hdr_len)) < 0)
        goto fail;
    if (n_extra && (extra = PyTuple_New(n_extra)) == NULL)
        goto fail;
    unsigned k = 0;
    for (off = MMH_PREAMBLE_LEN; off < hdr_len; off += 2u + p[off + 1]) {
        unsigned typ = p[off], ln = p[off + 1];
        const uint8_t *v = p + off + 2;
        if (typ == TLV_PAD)
            continue;
        int i;
        for (i = 0; i < N_INT && INT_TYPE[i] != typ; i++) {
        }
        if (i < N_INT) {
            uint64_t x = ln == 2 ? ((uint64_t)v[0] << 8 | v[1]) : ln == 4 ? be32(v) : be64(v);
            if (set_steal(h, s_int[i], PyLong_FromUnsignedLongLong(x)) < 0)
                goto fail;
        } else if (typ == TLV_TENSOR) {
            unsigned ndim = v[1];
            PyObject *shape = PyTuple_New(ndim);
            if (shape == NULL)
                goto fail;
            for (unsigned d = 0; d < ndim; d++) {
                PyObject *dim = PyLong_FromUnsignedLong(be32(v + 2 + 4 * d));
                if (dim == NULL) {
                    Py_DECREF(shape);
                    goto fail;
                }
                PyTuple_SET_ITEM(shape, d, dim);
            }
            PyObject *spec = bare(TensorSpec_T);
            if (spec == NULL) {
                Py_DECREF(shape);
                goto fail;
            }
            if (set_steal(spec, s_dtype, PyLong_FromLong(v[0])) < 0) {
                Py_DECREF(shape);
                Py_DECREF(spec);
                goto fail;
            }
            if (set_steal(spec, s_shape, shape) < 0) {
                Py_DECREF(spec);
                goto fail;
            }
            if (set_steal(h, s_tensor, spec) < 0)
                goto fail;
        } else if (typ == TLV_TRACEPARENT) {
            if (set_steal(h, s_traceparent, PyBytes_FromStringAndSize((const char *)v, ln)) < 0)
                goto fail;
        } else if (typ == TLV_ERROR) {
            PyObject *msg = PyUnicode_DecodeUTF8((const char *)v + 2, ln - 2, "strict");
            if (msg == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                    goto fail;
                PyErr_Clear(); /* not UTF-8: the reference says where */
                Py_XDECREF(extra);
                Py_DECREF(h);
                return NULL;
            }
            PyObject *code = PyLong_FromLong((long)v[0] << 8 | v[1]);
            if (code == NULL) {
                Py_DECREF(msg);
                goto fail;
            }
            PyObject *pair = PyTuple_Pack(2, code, msg);
            Py_DECREF(code);
            Py_DECREF(msg);
            if (set_steal(h, s_error, pair) < 0)
                goto fail;
        } else {
            PyObject *val = PyBytes_FromStringAndSize((const char *)v, ln);
            if (val == NULL)
                goto fail;
            PyObject *t = PyLong_FromLong(typ);
            if (t == NULL) {
                Py_DECREF(val);
                goto fail;
            }
            PyObject *pair = PyTuple_Pack(2, t, val);
            Py_DECREF(t);
            Py_DECREF(val);
            if (pair == NULL)
                goto fail;
            PyTuple_SET_ITEM(extra, k++, pair);
        }
    }
    if (extra != NULL) {
        int r = PyObject_GenericSetAttr(h, s_extra, extra);
        Py_DECREF(extra);
        extra = NULL;
        if (r < 0)
            goto fail;
    }
    return h;
fail:
    Py_XDECREF(extra);
    Py_DECREF(h);
    if (!PyErr_Occurred())
        PyErr_SetString(PyExc_SystemError, "mmmesh.wire._cwire: decode failed");
    return NULL;
}

/* The reference on the same arguments (it raises, or returns what it returns). */
static PyObject *reference(PyObject *fn, PyObject *const *args, Py_ssize_t nargs,
                           PyObject *kwnames) {
    return PyObject_Vectorcall(fn, args, nargs, kwnames);
}

PyDoc_STRVAR(decode_header_doc,
             "decode_header(buf)\n--\n\n"
             "Parse the MMH header at the start of ``buf`` (the compiled path of\n"
             "mmmesh.wire.decode_header: same result, same WireError).");

static PyObject *c_decode_header(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready())
        return NULL;
    if (nargs != 1)
        return reference(py_decode_header, args, nargs, NULL);
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not a contiguous buffer: the reference decides */
        return reference(py_decode_header, args, nargs, NULL);
    }
    PyObject *h = parse((const uint8_t *)view.buf, view.len);
    PyBuffer_Release(&view);
    if (h == NULL) { /* not a valid header (or out of memory): the reference decides */
        PyErr_Clear();
        return reference(py_decode_header, args, nargs, NULL);
    }
    return h;
}

/* memoryview(byte_view(obj)) as _codec.frame / decode_frame make it. */
static PyObject *byte_memoryview(PyObject *obj) {
    PyObject *mv = PyMemoryView_FromObject(obj);
    if (mv == NULL)
        return NULL;
    Py_buffer *b = PyMemoryView_GET_BUFFER(mv);
    if (b->ndim == 1 && b->format != NULL && strcmp(b->format, "B") == 0)
        return mv;
    if (b->len == 0) {
        Py_DECREF(mv);
        return PyMemoryView_FromObject(empty_bytes);
    }
    PyObject *cast = PyObject_CallMethodOneArg(mv, s_cast, s_B);
    Py_DECREF(mv);
    return cast;
}

PyDoc_STRVAR(decode_frame_doc,
             "decode_frame(buf)\n--\n\n"
             "Header and payload view of the frame at the start of ``buf`` (the\n"
             "compiled path of mmmesh.wire.decode_frame).");

static PyObject *c_decode_frame(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!ready())
        return NULL;
    if (nargs != 1)
        return reference(py_decode_frame, args, nargs, NULL);
    PyObject *view = byte_memoryview(args[0]);
    if (view == NULL) {
        PyErr_Clear();
        return reference(py_decode_frame, args, nargs, NULL);
    }
    Py_buffer *b = PyMemoryView_GET_BUFFER(view);
    PyObject *h = NULL;
    if (PyBuffer_IsContiguous(b, 'C'))
        h = parse((const uint8_t *)b->buf, b->len);
    if (h == NULL) {
        Py_DECREF(view);
        PyErr_Clear();
        return reference(py_decode_frame, args, nargs, NULL);
    }
    Py_ssize_t start = ((const uint8_t *)b->buf)[4];
    Py_ssize_t end = start + (Py_ssize_t)be32((const uint8_t *)b->buf + 8);
    if (end > b->len) { /* truncated payload: the reference raises */
        Py_DECREF(view);
        Py_DECREF(h);
        return reference(py_decode_frame, args, nargs, NULL);
    }
    PyObject *payload = PySequence_GetSlice(view, start, end);
    Py_DECREF(view);
    if (payload == NULL) {
        Py_DECREF(h);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, h, payload);
    Py_DECREF(h);
    Py_DECREF(payload);
    return out;
}

/* ---------------------------------------------------------------------- */
/* Encoding                                                               */
/* ---------------------------------------------------------------------- */

/* 1: *out = value, an int (not a bool) in 0..2**bits-1; 0: anything else
 * (the reference raises for it); -1: an exception. */
static int uint_of(PyObject *value, int bits, uint64_t *out) {
    if (!PyLong_Check(value) || PyBool_Check(value))
        return 0;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow) {
        if (overflow < 0 || bits < 64)
            return 0;
        unsigned long long u = PyLong_AsUnsignedLongLong(value);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        *out = u;
        return 1;
    }
    if (v < 0 || (bits < 64 && (unsigned long long)v >> bits))
        return 0;
    *out = (uint64_t)v;
    return 1;
}

/* An attribute as a uint; 1 ok, 0 "ask the reference", -1 error. */
static int attr_uint(PyObject *h, PyObject *name, int bits, uint64_t *out) {
    PyObject *v = PyObject_GetAttr(h, name);
    if (v == NULL)
        return -1;
    int r = uint_of(v, bits, out);
    Py_DECREF(v);
    return r;
}

/* Writes the header of `h` (payload_len `plen`, or h.payload_len when
 * plen_obj is NULL) into a new bytes object.  NULL with no exception:
 * the reference must decide. */
static PyObject *encode(PyObject *h, PyObject *plen_obj, long align) {
    uint8_t buf[MMH_HDR_MAX + 64];
    uint64_t modality, sla, flags, plen;
    int r;
    if ((r = attr_uint(h, s_modality, 8, &modality)) <= 0 ||
        (r = attr_uint(h, s_sla_class, 8, &sla)) <= 0 || (r = attr_uint(h, s_flags, 8, &flags)) <= 0)
        return NULL;
    if (plen_obj == NULL) {
        if ((r = attr_uint(h, s_payload_len, 32, &plen)) <= 0)
            return NULL;
    } else if ((r = uint_of(plen_obj, 32, &plen)) <= 0)
        return NULL;
    if (plen > MMH_MAX_PAYLOAD || align < 1 || align > 64)
        return NULL;

    unsigned off = MMH_PREAMBLE_LEN, tlvs = 0;
    PyObject *v = NULL;
    for (int i = 0; i < N_INT; i++) {
        if ((v = PyObject_GetAttr(h, s_int[i])) == NULL)
            return NULL;
        if (v != Py_None) {
            uint64_t x;
            if ((r = uint_of(v, INT_SIZE[i] * 8, &x)) <= 0)
                goto out;
            buf[off] = INT_TYPE[i];
            buf[off + 1] = INT_SIZE[i];
            put_be(buf + off + 2, x, INT_SIZE[i]);
            off += 2u + INT_SIZE[i];
            tlvs++;
        }
        Py_DECREF(v);
    }
    v = NULL;

    /* TENSOR: dtype u8, ndim u8, ndim x u32 */
    PyObject *spec = PyObject_GetAttr(h, s_tensor);
    if (spec == NULL)
        return NULL;
    if (spec != Py_None) {
        PyObject *shape = NULL;
        uint64_t dtype;
        r = attr_uint(spec, s_dtype, 8, &dtype);
        if (r > 0) {
            shape = PyObject_GetAttr(spec, s_shape);
            if (shape == NULL)
                r = -1;
            else if (!PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) > TENSOR_MAX_DIMS)
                r = 0;
        }
        if (r > 0) {
            Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
            buf[off] = TLV_TENSOR;
            buf[off + 1] = (uint8_t)(2 + 4 * ndim);
            buf[off + 2] = (uint8_t)dtype;
            buf[off + 3] = (uint8_t)ndim;
            for (Py_ssize_t d = 0; d < ndim && r > 0; d++) {
                uint64_t dim;
                r = uint_of(PyTuple_GET_ITEM(shape, d), 32, &dim);
                if (r > 0)
                    put_be(buf + off + 4 + 4 * d, dim, 4);
            }
            off += 4u + 4u * (unsigned)ndim;
            tlvs++;
        }
        Py_XDECREF(shape);
        if (r <= 0) {
            Py_DECREF(spec);
            return NULL;
        }
    }
    Py_DECREF(spec);

    /* TRACEPARENT: 26 raw bytes (bytes or bytearray here; a memoryview asks the reference) */
    if ((v = PyObject_GetAttr(h, s_traceparent)) == NULL)
        return NULL;
    if (v != Py_None) {
        const char *raw;
        Py_ssize_t n;
        if (PyBytes_Check(v)) {
            raw = PyBytes_AS_STRING(v);
            n = PyBytes_GET_SIZE(v);
        } else if (PyByteArray_Check(v)) {
            raw = PyByteArray_AS_STRING(v);
            n = PyByteArray_GET_SIZE(v);
        } else {
            r = 0;
            goto out;
        }
        if (n != TRACEPARENT_LEN) {
            r = 0;
            goto out;
        }
        buf[off] = TLV_TRACEPARENT;
        buf[off + 1] = TRACEPARENT_LEN;
        memcpy(buf + off + 2, raw, TRACEPARENT_LEN);
        off += 2 + TRACEPARENT_LEN;
        tlvs++;
    }
    Py_DECREF(v);

    /* ERROR: u16 code, UTF-8 message; the header stays <= 255 bytes */
    if ((v = PyObject_GetAttr(h, s_error)) == NULL)
        return NULL;
    if (v != Py_None) {
        uint64_t code;
        Py_ssize_t n;
        const char *msg;
        if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 2 ||
            (r = uint_of(PyTuple_GET_ITEM(v, 0), 16, &code)) <= 0 ||
            !PyUnicode_Check(PyTuple_GET_ITEM(v, 1))) {
            r = PyErr_Occurred() ? -1 : 0;
            goto out;
        }
        msg = PyUnicode_AsUTF8AndSize(PyTuple_GET_ITEM(v, 1), &n);
        if (msg == NULL) { /* lone surrogates: the reference raises */
            PyErr_Clear();
            r = 0;
            goto out;
        }
        if (n + 2 > 0xFF || off + 4 + n > MMH_HDR_MAX) {
            r = 0;
            goto out;
        }
        buf[off] = TLV_ERROR;
        buf[off + 1] = (uint8_t)(n + 2);
        put_be(buf + off + 2, code, 2);
        memcpy(buf + off + 4, msg, (size_t)n);
        off += 4u + (unsigned)n;
        tlvs++;
    }
    Py_DECREF(v);

    /* unknown TLVs to encode: the reference does them */
    if ((v = PyObject_GetAttr(h, s_extra)) == NULL)
        return NULL;
    if (!PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) != 0) {
        r = 0;
        goto out;
    }
    Py_DECREF(v);
    v = NULL;

    /* PAD to a multiple of align (a TLV is at least 2 bytes) */
    unsigned need = (unsigned)((align - (long)(off % (unsigned long)align)) % align);
    if (need == 1)
        need += (unsigned)align;
    if (need) {
        if (off + need > MMH_HDR_MAX)
            return NULL;
        buf[off] = TLV_PAD;
        buf[off + 1] = (uint8_t)(need - 2);
        memset(buf + off + 2, 0, need - 2);
        off += need;
        tlvs++;
    }
    if (tlvs > MMH_MAX_TLVS || off > MMH_HDR_MAX)
        return NULL;
    put_be(buf, MMH_MAGIC_V1, 4);
    buf[4] = (uint8_t)off;
    buf[5] = (uint8_t)modality;
    buf[6] = (uint8_t)sla;
    buf[7] = (uint8_t)flags;
    put_be(buf + 8, plen, 4);
    return PyBytes_FromStringAndSize((const char *)buf, off);
out:
    Py_XDECREF(v);
    (void)r;
    return NULL;
}

/* keyword-only arguments of encode_header / frame: align=, payload_len= */
static int kwargs(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, int allow_plen,
                  long *align, PyObject **plen) {
    if (kwnames == NULL)
        return 1;
    Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t i = 0; i < nk; i++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, i), *val = args[nargs + i];
        if (PyUnicode_Compare(name, s_align) == 0) {
            uint64_t a;
            int r = uint_of(val, 8, &a);
            if (r <= 0)
                return r;
            *align = (long)a;
        } else if (allow_plen && PyUnicode_Compare(name, s_payload_len) == 0) {
            *plen = val == Py_None ? NULL : val;
        } else {
            return 0; /* an unknown keyword: the reference raises TypeError */
        }
    }
    return 1;
}

PyDoc_STRVAR(encode_header_doc,
             "encode_header(h, *, align=1, payload_len=None)\n--\n\n"
             "The wire bytes of ``h`` (the compiled path of mmmesh.wire.encode_header:\n"
             "same bytes, same WireError).");

static PyObject *c_encode_header(PyObject *self, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    if (!ready())
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    long align = 1;
    PyObject *plen = NULL;
    int r = nargs == 1 ? kwargs(args, nargs, kwnames, 1, &align, &plen) : 0;
    if (r > 0) {
        PyObject *out = encode(args[0], plen, align);
        if (out != NULL)
            return out;
    }
    PyErr_Clear(); /* anything the fast path does not take: the reference decides */
    return reference(py_encode_header, args, nargs, kwnames);
}

PyDoc_STRVAR(frame_doc,
             "frame(h, payload=b'', *, align=1)\n--\n\n"
             "``[header bytes, payload view]`` for socket.sendmsg, no copy of\n"
             "``payload`` (the compiled path of mmmesh.wire.frame).");

static PyObject *c_frame(PyObject *self, PyObject *const *args, size_t nargsf,
                         PyObject *kwnames) {
    if (!ready())
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    long align = 1;
    PyObject *unused = NULL;
    if ((nargs != 1 && nargs != 2) || kwargs(args, nargs, kwnames, 0, &align, &unused) <= 0)
        goto slow;
    PyObject *view = byte_memoryview(nargs == 2 ? args[1] : empty_bytes);
    if (view == NULL)
        goto slow;
    PyObject *plen = PyLong_FromSsize_t(PyObject_Length(view));
    PyObject *hdr = plen == NULL ? NULL : encode(args[0], plen, align);
    Py_XDECREF(plen);
    PyObject *out = hdr == NULL ? NULL : PyList_New(2);
    if (out == NULL) {
        Py_XDECREF(hdr);
        Py_DECREF(view);
        goto slow;
    }
    PyList_SET_ITEM(out, 0, hdr);
    PyList_SET_ITEM(out, 1, view);
    return out;
slow: /* anything the fast path does not take: the reference decides (and raises) */
    PyErr_Clear();
    return reference(py_frame, args, nargs, kwnames);
}

/* ---------------------------------------------------------------------- */

PyDoc_STRVAR(setup_doc,
             "setup(Header, TensorSpec, decode_header, decode_frame, encode_header, frame)\n--\n\n"
             "Gives the module the value types it builds and the Python reference\n"
             "functions it defers to (mmmesh.wire._codec calls it once).");

static PyObject *c_setup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "setup() takes 6 arguments");
        return NULL;
    }
    PyObject **slots[6] = {&Header_T, &TensorSpec_T, &py_decode_header, &py_decode_frame,
                           &py_encode_header, &py_frame};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode_header", (PyCFunction)(void (*)(void))c_decode_header, METH_FASTCALL,
     decode_header_doc},
    {"decode_frame", (PyCFunction)(void (*)(void))c_decode_frame, METH_FASTCALL,
     decode_frame_doc},
    {"encode_header", (PyCFunction)(void (*)(void))c_encode_header,
     METH_FASTCALL | METH_KEYWORDS, encode_header_doc},
    {"frame", (PyCFunction)(void (*)(void))c_frame, METH_FASTCALL | METH_KEYWORDS, frame_doc},
    {"setup", (PyCFunction)(void (*)(void))c_setup, METH_FASTCALL, setup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "mmmesh.wire._cwire",
    "The compiled fast path of the MMH codec (see mmmesh/wire/_cwire.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__cwire(void) {
#define INTERN(var, text)                                                                      \
    if ((var = PyUnicode_InternFromString(text)) == NULL)                                      \
        return NULL;
    INTERN(s_modality, "modality");
    INTERN(s_sla_class, "sla_class");
    INTERN(s_flags, "flags");
    INTERN(s_payload_len, "payload_len");
    INTERN(s_hdr_len, "hdr_len");
    INTERN(s_tensor, "tensor");
    INTERN(s_traceparent, "traceparent");
    INTERN(s_error, "error");
    INTERN(s_extra, "extra");
    INTERN(s_dtype, "dtype");
    INTERN(s_shape, "shape");
    INTERN(s_cast, "cast");
    INTERN(s_B, "B");
    INTERN(s_align, "align");
    for (int i = 0; i < N_INT; i++)
        INTERN(s_int[i], INT_NAME[i]);
#undef INTERN
    if ((empty_tuple = PyTuple_New(0)) == NULL || (empty_bytes = PyBytes_FromString("")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
