/*
 * closedloop host scanner (see closedloop_scan.h): one call per received chunk, the
 * segment rules of the Python FrameParser and the frame checks of closedloop_proto.c.
 */
#include "closedloop_scan.h"

#include <string.h>

int clp_scan_abi(void) { return CLP_SCAN_ABI; }

size_t clp_scanner_size(void) { return sizeof(clp_scanner_t); }

void clp_scanner_init(clp_scanner_t *s)
{
    s->held_len = 0;
    s->skipping = 0;
    (void)clp_crc32c(0, NULL, 0); /* fills a lazily built CRC table now, before threads share it */
}

typedef struct {
    uint8_t *out;
    size_t out_cap, out_used;
    clp_scan_record_t *rec;
    size_t n_rec;
} scan_sink_t;

static clp_scan_record_t *new_record(scan_sink_t *k, uint32_t result, size_t seg_len)
{
    clp_scan_record_t *r = &k->rec[k->n_rec++];
    memset(r, 0, sizeof *r);
    r->result = result;
    r->seg_len = (uint32_t)seg_len;
    return r;
}

/* COBS-decode a segment that holds no 0x00 (it was split on them).  Without 0xFF codes the
 * frame is the segment shifted by one with a zero at each later code byte's place, so one
 * memcpy and a walk over the code bytes decode it; sparse spike counts make blocks of one or
 * two bytes, where a per-byte loop costs several times more.  With 0xFF codes present,
 * clp_cobs_decode does it.  Same results as clp_cobs_decode (tests compare them). */
static size_t decode_segment(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, int *ok)
{
    size_t p = 0;
    if (memchr(src, 0xFF, len) != NULL || len - 1 > cap) {
        return clp_cobs_decode(src, len, dst, cap, ok);
    }
    memcpy(dst, src + 1, len - 1);
    for (;;) {
        p += src[p]; /* code bytes are 1..254 here */
        if (p >= len) {
            break;
        }
        dst[p - 1] = 0;
    }
    *ok = (p == len);
    return *ok ? len - 1 : 0;
}

/* One delimited, non-empty segment. */
static void scan_segment(scan_sink_t *k, const uint8_t *seg, size_t len, size_t max_payload)
{
    clp_scan_record_t *r;
    clp_frame_t f;
    clp_result_t result;
    size_t n;
    int ok;

    if (len > CLP_MAX_ENCODED_LEN) {
        new_record(k, CLP_SCAN_SEGMENT_OVERSIZE, len);
        return;
    }
    n = decode_segment(seg, len, k->out + k->out_used, k->out_cap - k->out_used, &ok);
    if (!ok) {
        new_record(k, CLP_SCAN_BAD_COBS, len);
        return;
    }
    result = clp_check_frame(k->out + k->out_used, n, max_payload, &f);
    r = new_record(k, (uint32_t)result, len);
    r->raw_off = (uint32_t)k->out_used;
    r->raw_len = (uint32_t)n;
    k->out_used += n; /* kept for rejected frames too: the caller may describe them */
    if (result == CLP_FRAME) {
        r->seq = f.seq;
        r->payload_len = f.payload_len;
        r->msg_type = f.msg_type;
        r->flags = f.flags;
        r->timestamp_us = f.timestamp_us;
    }
}

/* Bytes after the last delimiter: keep them for the next chunk, or drop the segment once
 * it is longer than any frame (counted once, here; its later bytes go to *skipped). */
static void hold(clp_scanner_t *s, scan_sink_t *k, const uint8_t *data, size_t len, uint64_t *skipped)
{
    if (s->skipping) {
        *skipped += len;
        return;
    }
    if (s->held_len + len > CLP_MAX_ENCODED_LEN) {
        new_record(k, CLP_SCAN_NO_DELIMITER, s->held_len + len);
        s->held_len = 0;
        s->skipping = 1;
        return;
    }
    memcpy(s->held + s->held_len, data, len);
    s->held_len += len;
}

long clp_scan(clp_scanner_t *s, const uint8_t *data, size_t len, size_t max_payload, uint8_t *out,
              size_t out_cap, clp_scan_record_t *rec, size_t rec_cap, uint64_t *skipped)
{
    scan_sink_t k;
    const uint8_t *zero;
    size_t pos, head;

    if (out_cap < len + CLP_MAX_ENCODED_LEN || rec_cap < len / 2 + 2) {
        return -1;
    }
    k.out = out;
    k.out_cap = out_cap;
    k.out_used = 0;
    k.rec = rec;
    k.n_rec = 0;
    *skipped = 0;
    zero = len > 0 ? (const uint8_t *)memchr(data, 0, len) : NULL;
    if (zero == NULL) {
        hold(s, &k, data, len, skipped);
        return (long)k.n_rec;
    }
    /* the first segment continues the bytes held from earlier chunks */
    head = (size_t)(zero - data);
    if (s->skipping) {
        *skipped += head;
        s->skipping = 0;
    } else if (s->held_len > 0) {
        if (s->held_len + head > CLP_MAX_ENCODED_LEN) {
            new_record(&k, CLP_SCAN_SEGMENT_OVERSIZE, s->held_len + head);
        } else {
            memcpy(s->held + s->held_len, data, head);
            scan_segment(&k, s->held, s->held_len + head, max_payload);
        }
        s->held_len = 0;
    } else if (head > 0) {
        scan_segment(&k, data, head, max_payload);
    }
    pos = head + 1;
    while (pos < len) {
        zero = (const uint8_t *)memchr(data + pos, 0, len - pos);
        if (zero == NULL) {
            break;
        }
        head = (size_t)(zero - (data + pos));
        if (head > 0) {
            scan_segment(&k, data + pos, head, max_payload);
        }
        pos += head + 1;
    }
    hold(s, &k, data + pos, len - pos, skipped);
    return (long)k.n_rec;
}
