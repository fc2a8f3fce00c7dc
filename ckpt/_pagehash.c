/* The ids of the pages of a buffer: XXH3-128 of each 4 KiB page, one thread per core.
 *
 * Python can hash a page only through one call per page (python-xxhash holds the GIL), which
 * made hashing 2 GiB cost 0.35-0.45 s of one core plus a forked helper for the other half.
 * Here the GIL is released and each thread maps in (MADV_POPULATE_READ) and hashes its share,
 * 64 MiB at a time. An id is XXH3-128 with the store's seed in canonical (big-endian) form:
 * byte for byte what xxhash.xxh3_128_digest(page, seed) returns, as tests/unit check.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22 /* Linux 5.14 */
#endif

#define PAGE 4096
#define ID_LEN 16
#define MAX_THREADS 8
#define POPULATE_PAGES 16384 /* 64 MiB mapped in at a time, then hashed while still cached */
#define PAGES_PER_THREAD_MIN 4096 /* below 16 MiB a thread costs more than it saves */

struct share {
    const unsigned char *data;
    unsigned char *out;
    size_t first, end; /* pages [first, end) */
    XXH64_hash_t seed;
    int populate;
};

static void *hash_share(void *arg)
{
    const struct share *s = arg;
    for (size_t start = s->first; start < s->end; start += POPULATE_PAGES) {
        size_t end = start + POPULATE_PAGES < s->end ? start + POPULATE_PAGES : s->end;
        if (s->populate) /* a failure (an older kernel) only means page faults one by one */
            (void)madvise((void *)(s->data + start * PAGE), (end - start) * PAGE, MADV_POPULATE_READ);
        for (size_t i = start; i < end; i++) {
            XXH128_canonical_t id;
            XXH128_canonicalFromHash(&id, XXH3_128bits_withSeed(s->data + i * PAGE, PAGE, s->seed));
            memcpy(s->out + i * ID_LEN, id.digest, ID_LEN);
        }
    }
    return NULL;
}

PyDoc_STRVAR(page_ids_doc,
"page_ids(buffer, seed, threads=2) -> bytes\n\n"
"The 16-byte id of each 4 KiB page of buffer, one after the other.");

static PyObject *page_ids(PyObject *self, PyObject *args)
{
    Py_buffer view;
    unsigned long long seed;
    int threads = 2;
    if (!PyArg_ParseTuple(args, "y*K|i", &view, &seed, &threads))
        return NULL;
    if (view.len % PAGE) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "the buffer is not a whole number of pages");
        return NULL;
    }
    size_t pages = (size_t)view.len / PAGE;
    PyObject *result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(pages * ID_LEN));
    if (result == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if ((size_t)threads > pages / PAGES_PER_THREAD_MIN)
        threads = pages / PAGES_PER_THREAD_MIN > 0 ? (int)(pages / PAGES_PER_THREAD_MIN) : 1;

    struct share shares[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    /* Only a page-aligned buffer (a mapping) can be populated. */
    int populate = ((uintptr_t)view.buf % PAGE) == 0;
    for (int t = 0; t < threads; t++) {
        shares[t] = (struct share){.data = view.buf, .out = (unsigned char *)PyBytes_AS_STRING(result),
                                   .first = pages * t / threads, .end = pages * (t + 1) / threads,
                                   .seed = (XXH64_hash_t)seed, .populate = populate};
    }
    /* The buffer stays exported (a mapping cannot be closed under us) until released below. */
    Py_BEGIN_ALLOW_THREADS
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, hash_share, &shares[t]) == 0;
    hash_share(&shares[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            hash_share(&shares[t]); /* no thread to be had: hashed here */
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"page_ids", page_ids, METH_VARARGS, page_ids_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "ckpt._pagehash",
    "Page ids (XXH3-128 per 4 KiB page) computed without the GIL, in threads.", -1, methods,
};

PyMODINIT_FUNC PyInit__pagehash(void)
{
    return PyModule_Create(&module);
}
