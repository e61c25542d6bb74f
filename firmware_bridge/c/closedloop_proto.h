/*
 * closedloop wire protocol, portable C99 implementation for device firmware.
 *
 * What it does: CRC-32C, COBS encoding and decoding, building a complete frame
 * (header + payload + optional HMAC-SHA256 signature + CRC, COBS-encoded, 0x00
 * delimiter) straight into an output buffer, and an incremental parser fed one byte
 * at a time that applies the rules of docs/protocol.md sections 3-7 (as the Python
 * FrameParser does): rejection reasons in the same order, sequence-number tracking
 * (lost / duplicate / out-of-order), signing-counter replay protection.  It does not
 * know payload layouts: step 13 of section 5 (a payload matches its message type's
 * layout) is the application's, as are the payloads themselves (little-endian fields,
 * section 9).  firmware_bridge/c/examples/headstage_example.c is a whole device built
 * on this header (handshake, streaming, heartbeats, payload packing and checks).
 *
 * No heap, no libc beyond <string.h> (memcpy, memset, memcmp) and <stdint.h>/<stddef.h>.
 * The parser keeps one decoded frame (CLP_RX_MAX_RAW_LEN bytes, ~4.1 KiB) in its
 * struct; define CLP_RX_MAX_PAYLOAD smaller to save RAM on a device that never
 * receives large payloads (it then refuses them as oversize).  Define CLP_NO_SIGNING
 * to leave out SHA-256/HMAC (signed frames are then refused as bad_tag).
 * Define CLP_CRC_SLICE8 on a host to compute CRC-32C with an 8 KiB table (about 8x faster
 * than the default 64-byte nibble table; the host's scanner library is built this way).
 *
 * Typical firmware use (one parser and one output buffer, both static):
 *
 *     static clp_parser_t rx;            clp_parser_init(&rx, NULL, 0, 0);
 *     static uint8_t tx[CLP_MAX_WIRE_LEN];
 *     uint32_t seq = 0;
 *     // send: payload laid out as in docs/protocol.md (little-endian)
 *     size_t n = clp_frame_encode(CLP_MSG_NEURAL_FRAME, seq++, now_us(), payload, len, NULL, tx, sizeof tx);
 *     uart_write(tx, n);
 *     // receive: feed every byte; act on CLP_FRAME
 *     clp_frame_t f;
 *     if (clp_parser_feed(&rx, uart_read_byte(), &f) == CLP_FRAME && f.msg_type == CLP_MSG_ACTUATOR_COMMAND) {
 *         apply_command(f.payload, f.payload_len);
 *     }
 */
#ifndef CLOSEDLOOP_PROTO_H
#define CLOSEDLOOP_PROTO_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CLP_PROTOCOL_VERSION 1u
#define CLP_MAGIC0 0x43u /* 'C' */
#define CLP_MAGIC1 0x4Cu /* 'L' */
#define CLP_HEADER_LEN 20u
#define CLP_CRC_LEN 4u
#define CLP_TAG_LEN 16u
#define CLP_SIGNATURE_LEN 24u /* u64 counter + 16-byte tag */
#define CLP_FLAG_SIGNED 0x01u
#define CLP_MAX_PAYLOAD_LEN 4096u
#define CLP_MAX_RAW_LEN (CLP_HEADER_LEN + CLP_MAX_PAYLOAD_LEN + CLP_SIGNATURE_LEN + CLP_CRC_LEN)
#define CLP_COBS_MAX_LEN(n) ((n) + 1u + (n) / 254u)
#define CLP_MAX_ENCODED_LEN CLP_COBS_MAX_LEN(CLP_MAX_RAW_LEN) /* 4161, delimiter excluded */
#define CLP_MAX_WIRE_LEN (CLP_MAX_ENCODED_LEN + 1u)

#ifndef CLP_RX_MAX_PAYLOAD
#define CLP_RX_MAX_PAYLOAD CLP_MAX_PAYLOAD_LEN
#endif
#define CLP_RX_MAX_RAW_LEN (CLP_HEADER_LEN + CLP_RX_MAX_PAYLOAD + CLP_SIGNATURE_LEN + CLP_CRC_LEN)

/* Message type ids (payload layouts: docs/protocol.md). */
enum clp_msg_type {
    CLP_MSG_HELLO = 0x01,
    CLP_MSG_HEARTBEAT = 0x02,
    CLP_MSG_STATUS = 0x03,
    CLP_MSG_NEURAL_FRAME = 0x10,
    CLP_MSG_DECODER_OUTPUT = 0x11,
    CLP_MSG_PLANT_MEASUREMENT = 0x20,
    CLP_MSG_ACTUATOR_COMMAND = 0x21,
    CLP_MSG_JOINT_STATE = 0x30,
    CLP_MSG_JOINT_COMMAND = 0x31
};

/* HEARTBEAT state and STATUS severity values (docs/protocol.md section 9). */
enum clp_device_state { CLP_STATE_IDLE = 0, CLP_STATE_RUNNING = 1, CLP_STATE_SAFE_STOP = 2, CLP_STATE_FAULT = 3 };
enum clp_severity {
    CLP_SEV_DEBUG = 0, CLP_SEV_INFO = 1, CLP_SEV_WARNING = 2, CLP_SEV_ERROR = 3, CLP_SEV_CRITICAL = 4
};

/* What clp_parser_feed() reports for one byte. */
typedef enum {
    CLP_NONE = 0,          /* nothing completed (mid-frame, or an empty segment) */
    CLP_FRAME,             /* a new frame is in *out */
    CLP_ERR_CRC,           /* rejected: CRC-32C mismatch */
    CLP_ERR_MALFORMED,     /* rejected: bad COBS, too short, bad header, length mismatch */
    CLP_ERR_OVERSIZE,      /* rejected: longer than the maximum frame */
    CLP_ERR_BAD_TAG,       /* rejected: signature does not verify (or no key) */
    CLP_ERR_REPLAYED,      /* rejected: signing counter not increasing */
    CLP_ERR_UNSIGNED,      /* rejected: unsigned frame, signing required */
    CLP_DROP_DUPLICATE,    /* valid frame, sequence number already seen: dropped */
    CLP_DROP_OUT_OF_ORDER  /* valid frame, older sequence number arriving late: dropped */
} clp_result_t;

typedef struct {
    uint8_t msg_type;
    uint8_t flags;
    uint32_t seq;
    uint64_t timestamp_us;
    uint16_t payload_len;
    const uint8_t *payload;   /* points into the parser; valid until the next feed */
    uint64_t sign_counter;    /* meaningful when flags & CLP_FLAG_SIGNED */
} clp_frame_t;

typedef struct {
    uint32_t accepted, crc_errors, malformed, oversize, bad_tag, replayed, unsigned_frames;
    uint32_t duplicate, out_of_order, seq_resets;
    int64_t lost; /* net of late arrivals */
    uint64_t bytes_in, bytes_discarded;
} clp_stats_t;

typedef struct {
    uint8_t key[64];
    size_t key_len;
    uint64_t next_counter;
} clp_signer_t;

typedef struct {
    /* decoded frame being assembled */
    uint8_t raw[CLP_RX_MAX_RAW_LEN];
    size_t raw_len;      /* decoded bytes so far (may exceed the buffer: then overflow) */
    size_t enc_len;      /* encoded bytes of the current segment */
    uint8_t remaining;   /* data bytes left in the current COBS block */
    uint8_t prev_code;   /* 0 before the first code byte of a segment */
    uint8_t skipping;    /* segment longer than CLP_MAX_ENCODED_LEN: counted, being dropped */
    /* signing */
    uint8_t key[64];
    size_t key_len;
    uint8_t has_key, require_signed, have_counter;
    uint64_t last_counter;
    /* sequence tracking */
    uint8_t have_top;
    uint32_t top;
    uint64_t seen, lost_bits;
    clp_stats_t stats;
} clp_parser_t;

/* CRC-32C (Castagnoli, reflected 0x82F63B78, init and xorout 0xFFFFFFFF).  Pass 0 to
 * start, or a previous result to continue.  clp_crc32c(0, "123456789", 9) == 0xE3069283. */
uint32_t clp_crc32c(uint32_t crc, const uint8_t *data, size_t len);

/* Canonical COBS encoding of src into dst (no delimiter).  Returns the encoded length,
 * or 0 when cap is too small (CLP_COBS_MAX_LEN(len) always suffices). */
size_t clp_cobs_encode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap);

/* Decode one COBS segment (no 0x00 inside).  Returns the decoded length and sets *ok to
 * 1, or sets *ok to 0 when src is not valid COBS or dst is too small. */
size_t clp_cobs_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, int *ok);

/* Signing key set-up (key_len >= 16; keys longer than 64 bytes are hashed first). */
void clp_signer_init(clp_signer_t *s, const uint8_t *key, size_t key_len, uint64_t counter_start);

/* Encode a whole frame into out: COBS(header + payload [+ counter + tag] + crc) + 0x00.
 * signer may be NULL (unsigned).  Returns the bytes written, or 0 when payload_len is
 * over CLP_MAX_PAYLOAD_LEN, msg_type is reserved, or cap is too small
 * (CLP_MAX_WIRE_LEN always suffices). */
size_t clp_frame_encode(uint8_t msg_type, uint32_t seq, uint64_t timestamp_us,
                        const uint8_t *payload, uint16_t payload_len, clp_signer_t *signer,
                        uint8_t *out, size_t cap);

/* Parser set-up: key may be NULL (no signing).  require_signed refuses unsigned frames. */
void clp_parser_init(clp_parser_t *p, const uint8_t *key, size_t key_len, int require_signed);

/* The frame checks of docs/protocol.md, "Receiving", on one COBS-decoded frame of n bytes:
 * length (oversize, short), CRC-32C, magic/version, reserved bits and types, payload_len
 * against max_payload, and the length match.  Returns CLP_FRAME with the header fields,
 * payload pointer (into raw) and sign_counter (0 when unsigned) in *out, or
 * CLP_ERR_OVERSIZE, CLP_ERR_MALFORMED or CLP_ERR_CRC.  Signature and sequence checks are
 * the caller's (clp_parser_feed does both).  Reads raw only after n passed the length check. */
clp_result_t clp_check_frame(const uint8_t *raw, size_t n, size_t max_payload, clp_frame_t *out);

/* Feed one received byte.  On CLP_FRAME, *out holds the frame. Never fails on input. */
clp_result_t clp_parser_feed(clp_parser_t *p, uint8_t byte, clp_frame_t *out);

/* Forget sequence history (e.g. after re-connecting); counters are kept. */
void clp_parser_reset_sequence(clp_parser_t *p);

#ifndef CLP_NO_SIGNING
/* HMAC-SHA256 of one message; exposed for key derivation and tests. */
void clp_hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t len, uint8_t out[32]);
/* Per-direction keys from one shared secret (see docs/protocol.md, "Signing"). */
void clp_derive_link_keys(const uint8_t *secret, size_t len, uint8_t host_to_device[32],
                          uint8_t device_to_host[32]);
#endif

#ifdef __cplusplus
}
#endif
#endif /* CLOSEDLOOP_PROTO_H */
