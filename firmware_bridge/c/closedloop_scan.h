/*
 * closedloop host scanner: the frame checks of closedloop_proto.c over a whole received
 * chunk in one call, for a host that reads many frames per second (the Python package
 * loads it through ctypes; see docs/protocol.md, "Host parser").
 *
 * clp_scan() splits a chunk on the 0x00 delimiter exactly as the Python FrameParser does
 * (bytes after the last delimiter are held for the next call; more than
 * CLP_MAX_ENCODED_LEN bytes without a delimiter are dropped as one oversize segment),
 * COBS-decodes every non-empty segment into a caller's buffer and runs
 * clp_check_frame() on it.  It writes one record per non-empty segment, in stream order.
 * It does not verify signatures, track sequence numbers or read payload layouts: the
 * caller does those, in that order, for every record whose result is CLP_FRAME.
 *
 * Host only: the scanner keeps one segment (CLP_MAX_ENCODED_LEN bytes) of state and
 * uses memchr/memcpy from <string.h>.
 */
#ifndef CLOSEDLOOP_SCAN_H
#define CLOSEDLOOP_SCAN_H

#include "closedloop_proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a struct below or clp_scan()'s contract changes; the loader checks it. */
#define CLP_SCAN_ABI 1

/* Results of a record besides CLP_FRAME, CLP_ERR_CRC, CLP_ERR_MALFORMED, CLP_ERR_OVERSIZE. */
enum {
    CLP_SCAN_SEGMENT_OVERSIZE = 32, /* a delimited segment longer than CLP_MAX_ENCODED_LEN: not decoded */
    CLP_SCAN_NO_DELIMITER = 33,     /* more than CLP_MAX_ENCODED_LEN bytes held without a delimiter */
    CLP_SCAN_BAD_COBS = 34          /* the segment is not valid COBS */
};

/* One non-empty segment; 32 bytes, no padding. */
typedef struct {
    uint32_t result;        /* CLP_FRAME (every check of clp_check_frame passed) or why not */
    uint32_t seg_len;       /* encoded bytes of the segment: all discarded when it is rejected */
    uint32_t raw_off;       /* the decoded frame is out[raw_off .. raw_off + raw_len) ... */
    uint32_t raw_len;       /* ... (raw_len is 0 when the segment was not decoded) */
    uint32_t seq;           /* header fields, meaningful when result is CLP_FRAME */
    uint16_t payload_len;
    uint8_t msg_type;
    uint8_t flags;
    uint64_t timestamp_us;
} clp_scan_record_t;

typedef struct {
    uint8_t held[CLP_MAX_ENCODED_LEN]; /* bytes after the last delimiter seen */
    size_t held_len;
    int skipping; /* inside a segment already counted as CLP_SCAN_NO_DELIMITER: drop to the next 0x00 */
} clp_scanner_t;

int clp_scan_abi(void);
size_t clp_scanner_size(void);
void clp_scanner_init(clp_scanner_t *s);

/* Scan len bytes of data.  out receives the decoded frames (out_cap >= len +
 * CLP_MAX_ENCODED_LEN always suffices), rec the records (rec_cap >= len / 2 + 2 always
 * suffices).  *skipped is set to the bytes dropped without a record (the rest of a
 * CLP_SCAN_NO_DELIMITER segment).  Returns the number of records, or -1 (and changes
 * nothing) when out_cap or rec_cap is below those bounds. */
long clp_scan(clp_scanner_t *s, const uint8_t *data, size_t len, size_t max_payload, uint8_t *out,
              size_t out_cap, clp_scan_record_t *rec, size_t rec_cap, uint64_t *skipped);

#ifdef __cplusplus
}
#endif
#endif /* CLOSEDLOOP_SCAN_H */
