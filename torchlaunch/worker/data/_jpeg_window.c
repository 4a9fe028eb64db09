/* The training crop's window decode: one JPEG's (left, top, width, height) box as interleaved RGB
 * uint8, decoded by libjpeg-turbo's libjpeg API (>= 1.5) with only that window inverse-transformed,
 * upsampled and colour-converted (jpeg_crop_scanline for the columns, jpeg_skip_scanlines for the rows).
 *
 * Why: at ImageNet size a RandomResizedCrop keeps ~40% of an image's area on average, and the IDCT,
 * upsampling and colour conversion of the rest was most of a whole decode's work (worker/data/jpeg.py
 * has the measurements). Neither PIL nor torchvision exposes a window decode, and the turbojpeg API
 * has one only from TurboJPEG 3; the libjpeg API has it from libjpeg-turbo 1.5 on.
 *
 * The pixels are those of a whole decode cropped, byte for byte: the same library with the settings
 * PIL and torchvision use (accurate integer IDCT, fancy upsampling, RGB out). libjpeg-turbo starts the
 * window at an iMCU column boundary and treats its edges as image edges for fancy (context)
 * upsampling, so the window is widened by MARGIN pixels each side, decoded, and the box copied out.
 *
 * Errors: every libjpeg error AND warning (corrupt or truncated data) fails the call with libjpeg's
 * message (a ValueError), as torchvision's decoder fails on them; the caller then takes the path it
 * took before (worker/data/jpeg.py), which names the error as it always did. With to_end (a member not
 * yet proven clean), so that a JPEG damaged below the box is refused as a whole decode refuses it, the
 * rows after the box are entropy-decoded too (skipped: no IDCT) and the stream is read to its end
 * marker: a success then proves that the whole stream decodes without an error or a warning. Without
 * to_end (a member with that proof, for the very bytes: worker/data/jpeg.py) the decode stops after
 * the box's last row; the box's pixels are the same either way. libjpeg's error_exit never returns:
 * here it longjmps back to window_decode, a C frame below which only libjpeg runs (the GIL released,
 * no Python frame in between); warnings take the same jump. Nothing is printed.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

#ifndef LIBJPEG_TURBO_VERSION
#error "libjpeg-turbo's jpeglib.h is needed (jpeg_crop_scanline, jpeg_skip_scanlines: libjpeg-turbo >= 1.5)"
#endif

/* Pixels of context each side of the box (2 covers h2 fancy upsampling's neighbour column at both
   edges of the window; the unit tests check every subsampling against a whole decode). */
#define MARGIN 2

/* JPEG's own limit on a side (SOF holds 16 bits). */
#define MAX_SIDE 65535

/* The most libjpeg may allocate for one decode. A progressive JPEG keeps every coefficient (2 bytes a
   sample: ~540 MB for 4:4:4 at PIL's 89.5 Mpixel bomb limit, which callers check first); a forged header
   asking for more is refused here without allocating it, and a real image that needs more is decoded
   whole by the caller's other path, as before. */
#define MAX_MEMORY (1024L * 1024L * 1024L)

typedef struct {
    struct jpeg_error_mgr pub; /* first: libjpeg sees a jpeg_error_mgr */
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} failure_mgr;

static void fail_exit(j_common_ptr cinfo) {
    failure_mgr *failure = (failure_mgr *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, failure->message);
    longjmp(failure->jump, 1);
}

static void fail_on_warning(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a warning: corrupt data that libjpeg would decode past */
        fail_exit(cinfo);
    } /* trace messages (level >= 0) are not emitted: trace_level stays 0 */
}

typedef struct {
    const unsigned char *data;
    size_t size;
    JDIMENSION width, height;            /* the image's size the caller expects */
    JDIMENSION left, top, cols, rows;    /* the box, inside the image */
    int flip;                            /* mirror the box left-right */
    int to_end;                          /* decode the rest of the stream and read to its end marker */
    unsigned char *out;                  /* rows * cols * 3 bytes */
} window_job;

/* Whether a progressive JPEG's scans, all read by jpeg_start_decompress (a multi-scan file is absorbed
   whole before the first row), refined every coefficient of every component to its last bit. A stream
   cut short (an end marker before its last scans: no warning) leaves some unknown, and libjpeg then
   smooths the blocks (do_block_smoothing), which this system's libjpeg-turbo does differently from the
   one PIL bundles (measured: up to 30 levels on an arithmetic-coded file): such a file takes PIL's path. */
static int scans_complete(const struct jpeg_decompress_struct *cinfo) {
    if (!cinfo->progressive_mode || cinfo->coef_bits == NULL) {
        return 1;
    }
    for (int c = 0; c < cinfo->num_components; c++) {
        for (int k = 0; k < DCTSIZE2; k++) {
            if (cinfo->coef_bits[c][k] != 0) {
                return 0;
            }
        }
    }
    return 1;
}

/* Decode job->box into job->out; 0 on success, else -1 with the reason in failure->message. Runs
   without the GIL: touches no Python object. */
static int window_decode(window_job *job, failure_mgr *failure) {
    struct jpeg_decompress_struct cinfo;
    int status = -1;

    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = jpeg_std_error(&failure->pub);
    failure->pub.error_exit = fail_exit;
    failure->pub.emit_message = fail_on_warning;
    failure->message[0] = '\0';
    if (setjmp(failure->jump)) {
        jpeg_destroy_decompress(&cinfo); /* frees every libjpeg allocation, the row buffer included */
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    cinfo.mem->max_memory_to_use = MAX_MEMORY;
    jpeg_mem_src(&cinfo, job->data, (unsigned long)job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.image_width != job->width || cinfo.image_height != job->height) {
        snprintf(failure->message, sizeof failure->message, "the image is %ux%u, not %ux%u",
                 (unsigned)cinfo.image_width, (unsigned)cinfo.image_height, (unsigned)job->width,
                 (unsigned)job->height);
        goto done;
    }
    cinfo.out_color_space = JCS_RGB; /* grey and YCbCr to RGB, as PIL's convert("RGB") and torchvision */
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_width != job->width || cinfo.output_height != job->height || cinfo.output_components != 3) {
        snprintf(failure->message, sizeof failure->message, "unexpected output %ux%ux%d",
                 (unsigned)cinfo.output_width, (unsigned)cinfo.output_height, cinfo.output_components);
        goto done;
    }
    if (!scans_complete(&cinfo)) {
        snprintf(failure->message, sizeof failure->message,
                 "the progressive scans do not give every coefficient (a stream cut short)");
        goto done;
    }
    JDIMENSION first = job->left >= MARGIN ? job->left - MARGIN : 0;
    JDIMENSION end = job->left + job->cols + MARGIN < job->width ? job->left + job->cols + MARGIN : job->width;
    JDIMENSION span = end - first;
    if (span < cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &first, &span); /* first moves left to an iMCU boundary */
    }
    JSAMPARRAY row = (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, span * 3, 1);
    if (job->top > 0 && jpeg_skip_scanlines(&cinfo, job->top) != job->top) {
        snprintf(failure->message, sizeof failure->message, "could not skip to row %u", (unsigned)job->top);
        goto done;
    }
    const unsigned char *from = row[0] + (size_t)(job->left - first) * 3;
    size_t stride = (size_t)job->cols * 3;
    for (JDIMENSION y = 0; y < job->rows; y++) {
        if (jpeg_read_scanlines(&cinfo, row, 1) != 1) {
            snprintf(failure->message, sizeof failure->message, "row %u could not be read", (unsigned)(job->top + y));
            goto done;
        }
        unsigned char *to = job->out + (size_t)y * stride;
        if (job->flip) {
            for (JDIMENSION x = 0; x < job->cols; x++) {
                memcpy(to + (size_t)(job->cols - 1 - x) * 3, from + (size_t)x * 3, 3);
            }
        } else {
            memcpy(to, from, stride);
        }
    }
    if (!job->to_end) { /* proven clean: jpeg_destroy_decompress below aborts the rest */
        status = 0;
        goto done;
    }
    /* The rest of the stream, as a whole decode reads it: skipping all but the last row still
       entropy-decodes them (a skip to the very end would not), and finish reads to the end marker. */
    JDIMENSION left_over = cinfo.output_height - cinfo.output_scanline;
    if (left_over > 1) {
        jpeg_skip_scanlines(&cinfo, left_over - 1);
    }
    if (cinfo.output_scanline < cinfo.output_height) {
        jpeg_read_scanlines(&cinfo, row, 1);
    }
    jpeg_finish_decompress(&cinfo);
    status = 0;
done:
    jpeg_destroy_decompress(&cinfo);
    return status;
}

PyDoc_STRVAR(decode_doc,
             "decode(data, width, height, left, top, cols, rows, flip, to_end) -> bytearray\n\n"
             "The box (left, top, cols, rows) of the width x height JPEG `data` as rows * cols * 3 bytes of\n"
             "RGB (mirrored when flip), the pixels of a whole decode cropped. to_end: decode the rest of the\n"
             "stream too and read to its end marker (else stop after the box). ValueError for a box outside\n"
             "the image, another size in the header, and any libjpeg error or warning met.");

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t width, height, left, top, cols, rows;
    int flip, to_end;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*nnnnnnpp", &data, &width, &height, &left, &top, &cols, &rows, &flip,
                          &to_end)) {
        return NULL;
    }
    if (width < 1 || height < 1 || width > MAX_SIDE || height > MAX_SIDE || left < 0 || top < 0 || cols < 1 ||
        rows < 1 || left > width - cols || top > height - rows) {
        PyBuffer_Release(&data);
        PyErr_Format(PyExc_ValueError, "box (%zd, %zd, %zd, %zd) is not inside a %zdx%zd image", left, top, cols,
                     rows, width, height);
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, rows * cols * 3);
    if (out == NULL) {
        PyBuffer_Release(&data);
        return NULL;
    }
    window_job job = {data.buf, (size_t)data.len, (JDIMENSION)width, (JDIMENSION)height, (JDIMENSION)left,
                      (JDIMENSION)top, (JDIMENSION)cols, (JDIMENSION)rows, flip, to_end,
                      (unsigned char *)PyByteArray_AS_STRING(out)};
    failure_mgr failure;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = window_decode(&job, &failure);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (status != 0) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_ValueError, failure.message[0] ? failure.message : "libjpeg failed");
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpeg_window",
    "A JPEG's crop box decoded alone by libjpeg-turbo (torchlaunch/worker/data/jpeg.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__jpeg_window(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef LIBJPEG_TURBO_VERSION_NUMBER
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER", LIBJPEG_TURBO_VERSION_NUMBER) < 0) {
#else
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_TURBO_VERSION_NUMBER", 0) < 0) {
#endif
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
