/*
 * closedloop wire protocol, portable C99 implementation (see closedloop_proto.h and
 * docs/protocol.md).  Byte-compatible with the Python package; checked on the host by
 * test_vectors.c against firmware_bridge/testvectors/frames.json.
 */
#include "closedloop_proto.h"

#include <string.h>

/* ------------------------------------------------------------------ CRC-32C */

#ifdef CLP_CRC_SLICE8
/* Host builds (the Python package's scanner): slicing-by-8 over an 8 KiB table, about 8x
 * the nibble table's speed, filled on first use.  The host library calls clp_crc32c once
 * when it is loaded, so the table is complete before any thread can race to fill it. */
static uint32_t crc_slice[8][256];
static int crc_slice_ready;

static void crc_slice_build(void)
{
    unsigned b, k;
    for (b = 0; b < 256; b++) {
        uint32_t c = b;
        for (k = 0; k < 8; k++) {
            c = (c & 1u) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
        }
        crc_slice[0][b] = c;
    }
    for (k = 1; k < 8; k++) {
        for (b = 0; b < 256; b++) {
            uint32_t prev = crc_slice[k - 1][b];
            crc_slice[k][b] = (prev >> 8) ^ crc_slice[0][prev & 0xFFu];
        }
    }
    crc_slice_ready = 1;
}

uint32_t clp_crc32c(uint32_t crc, const uint8_t *data, size_t len)
{
    uint32_t reg = ~crc;
    if (!crc_slice_ready) {
        crc_slice_build();
    }
    while (len >= 8) {
        uint32_t lo = reg ^ ((uint32_t)data[0] | ((uint32_t)data[1] << 8) | ((uint32_t)data[2] << 16) |
                             ((uint32_t)data[3] << 24));
        uint32_t hi = (uint32_t)data[4] | ((uint32_t)data[5] << 8) | ((uint32_t)data[6] << 16) |
                      ((uint32_t)data[7] << 24);
        reg = crc_slice[7][lo & 0xFFu] ^ crc_slice[6][(lo >> 8) & 0xFFu] ^ crc_slice[5][(lo >> 16) & 0xFFu] ^
              crc_slice[4][lo >> 24] ^ crc_slice[3][hi & 0xFFu] ^ crc_slice[2][(hi >> 8) & 0xFFu] ^
              crc_slice[1][(hi >> 16) & 0xFFu] ^ crc_slice[0][hi >> 24];
        data += 8;
        len -= 8;
    }
    while (len-- > 0) {
        reg = (reg >> 8) ^ crc_slice[0][(reg ^ *data++) & 0xFFu];
    }
    return ~reg;
}
#else
/* Nibble table: 64 bytes of constants, two lookups per byte; fast enough for a
 * Cortex-M at link rates and small enough for any flash. */
static const uint32_t crc_nibble[16] = {
    0x00000000u, 0x105EC76Fu, 0x20BD8EDEu, 0x30E349B1u, 0x417B1DBCu, 0x5125DAD3u, 0x61C69362u, 0x7198540Du,
    0x82F63B78u, 0x92A8FC17u, 0xA24BB5A6u, 0xB21572C9u, 0xC38D26C4u, 0xD3D3E1ABu, 0xE330A81Au, 0xF36E6F75u};

uint32_t clp_crc32c(uint32_t crc, const uint8_t *data, size_t len)
{
    uint32_t reg = ~crc;
    size_t i;
    for (i = 0; i < len; i++) {
        reg ^= data[i];
        reg = (reg >> 4) ^ crc_nibble[reg & 0x0Fu];
        reg = (reg >> 4) ^ crc_nibble[reg & 0x0Fu];
    }
    return ~reg;
}
#endif /* CLP_CRC_SLICE8 */

/* --------------------------------------------------------------------- COBS */

typedef struct {
    uint8_t *out;
    size_t cap, pos, code_pos;
    uint8_t code;
    int overflow;
} cobs_writer_t;

static void cobs_begin(cobs_writer_t *w, uint8_t *out, size_t cap)
{
    w->out = out;
    w->cap = cap;
    w->code_pos = 0;
    w->pos = 1;
    w->code = 1;
    w->overflow = (cap == 0);
}

static void cobs_close_block(cobs_writer_t *w)
{
    if (w->code_pos < w->cap) {
        w->out[w->code_pos] = w->code;
    } else {
        w->overflow = 1;
    }
    w->code_pos = w->pos++;
    w->code = 1;
}

static void cobs_put(cobs_writer_t *w, const uint8_t *data, size_t len)
{
    size_t i;
    for (i = 0; i < len; i++) {
        if (data[i] == 0) {
            cobs_close_block(w);
            continue;
        }
        if (w->pos < w->cap) {
            w->out[w->pos] = data[i];
        } else {
            w->overflow = 1;
        }
        w->pos++;
        if (++w->code == 0xFFu) {
            cobs_close_block(w);
        }
    }
}

/* Finish the last block; returns the encoded length or 0 on overflow. */
static size_t cobs_end(cobs_writer_t *w)
{
    if (w->code_pos < w->cap) {
        w->out[w->code_pos] = w->code;
    } else {
        w->overflow = 1;
    }
    if (w->pos > w->cap) {
        w->overflow = 1;
    }
    return w->overflow ? 0 : w->pos;
}

size_t clp_cobs_encode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap)
{
    cobs_writer_t w;
    cobs_begin(&w, dst, cap);
    cobs_put(&w, src, len);
    return cobs_end(&w);
}

size_t clp_cobs_decode(const uint8_t *src, size_t len, uint8_t *dst, size_t cap, int *ok)
{
    size_t i = 0, n = 0;
    *ok = 0;
    if (len == 0) {
        return 0;
    }
    while (i < len) {
        uint8_t code = src[i];
        size_t k;
        if (code == 0 || i + code > len) {
            return 0;
        }
        for (k = 1; k < code; k++) {
            if (src[i + k] == 0 || n >= cap) {
                return 0;
            }
            dst[n++] = src[i + k];
        }
        i += code;
        if (code != 0xFFu && i < len) {
            if (n >= cap) {
                return 0;
            }
            dst[n++] = 0;
        }
    }
    *ok = 1;
    return n;
}

/* ------------------------------------------------------- SHA-256 and HMAC */
#ifndef CLP_NO_SIGNING

typedef struct {
    uint32_t h[8];
    uint64_t nbytes;
    uint8_t buf[64];
    size_t fill;
} sha256_t;

static const uint32_t sha_k[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u};

static uint32_t ror32(uint32_t x, unsigned n) { return (x >> n) | (x << (32u - n)); }

static void sha256_block(uint32_t h[8], const uint8_t *b)
{
    uint32_t w[64], v[8];
    unsigned i;
    for (i = 0; i < 16; i++) {
        w[i] = ((uint32_t)b[4 * i] << 24) | ((uint32_t)b[4 * i + 1] << 16) | ((uint32_t)b[4 * i + 2] << 8) |
               (uint32_t)b[4 * i + 3];
    }
    for (i = 16; i < 64; i++) {
        uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    memcpy(v, h, sizeof v);
    for (i = 0; i < 64; i++) {
        uint32_t t1 = v[7] + (ror32(v[4], 6) ^ ror32(v[4], 11) ^ ror32(v[4], 25)) +
                      ((v[4] & v[5]) ^ (~v[4] & v[6])) + sha_k[i] + w[i];
        uint32_t t2 = (ror32(v[0], 2) ^ ror32(v[0], 13) ^ ror32(v[0], 22)) +
                      ((v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]));
        v[7] = v[6];
        v[6] = v[5];
        v[5] = v[4];
        v[4] = v[3] + t1;
        v[3] = v[2];
        v[2] = v[1];
        v[1] = v[0];
        v[0] = t1 + t2;
    }
    for (i = 0; i < 8; i++) {
        h[i] += v[i];
    }
}

static void sha256_init(sha256_t *s)
{
    static const uint32_t h0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(s->h, h0, sizeof h0);
    s->nbytes = 0;
    s->fill = 0;
}

static void sha256_update(sha256_t *s, const uint8_t *data, size_t len)
{
    s->nbytes += len;
    while (len > 0) {
        size_t take = 64 - s->fill;
        if (take > len) {
            take = len;
        }
        memcpy(s->buf + s->fill, data, take);
        s->fill += take;
        data += take;
        len -= take;
        if (s->fill == 64) {
            sha256_block(s->h, s->buf);
            s->fill = 0;
        }
    }
}

static void sha256_final(sha256_t *s, uint8_t out[32])
{
    uint64_t bits = s->nbytes * 8u;
    uint8_t pad = 0x80;
    uint8_t len_be[8];
    unsigned i;
    sha256_update(s, &pad, 1);
    pad = 0;
    while (s->fill != 56) {
        sha256_update(s, &pad, 1);
    }
    for (i = 0; i < 8; i++) {
        len_be[i] = (uint8_t)(bits >> (56 - 8 * i));
    }
    sha256_update(s, len_be, 8);
    for (i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->h[i];
    }
}

typedef struct {
    sha256_t inner;
    uint8_t k0[64];
} hmac_t;

/* key_len <= 64 here: longer keys are hashed once, at set-up. */
static void hmac_begin(hmac_t *m, const uint8_t *key, size_t key_len)
{
    uint8_t ipad[64];
    unsigned i;
    memset(m->k0, 0, sizeof m->k0);
    memcpy(m->k0, key, key_len);
    for (i = 0; i < 64; i++) {
        ipad[i] = (uint8_t)(m->k0[i] ^ 0x36u);
    }
    sha256_init(&m->inner);
    sha256_update(&m->inner, ipad, 64);
}

static void hmac_end(hmac_t *m, uint8_t out[32])
{
    uint8_t inner_digest[32], opad[64];
    sha256_t outer;
    unsigned i;
    sha256_final(&m->inner, inner_digest);
    for (i = 0; i < 64; i++) {
        opad[i] = (uint8_t)(m->k0[i] ^ 0x5cu);
    }
    sha256_init(&outer);
    sha256_update(&outer, opad, 64);
    sha256_update(&outer, inner_digest, 32);
    sha256_final(&outer, out);
}

static size_t normalise_key(const uint8_t *key, size_t key_len, uint8_t out[64])
{
    if (key_len > 64) {
        sha256_t s;
        sha256_init(&s);
        sha256_update(&s, key, key_len);
        sha256_final(&s, out);
        return 32;
    }
    memcpy(out, key, key_len);
    return key_len;
}

void clp_hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t len, uint8_t out[32])
{
    uint8_t k[64];
    hmac_t m;
    size_t n = normalise_key(key, key_len, k);
    hmac_begin(&m, k, n);
    sha256_update(&m.inner, msg, len);
    hmac_end(&m, out);
}

void clp_derive_link_keys(const uint8_t *secret, size_t len, uint8_t host_to_device[32],
                          uint8_t device_to_host[32])
{
    static const char h2d[] = "closedloop/v1 host-to-device";
    static const char d2h[] = "closedloop/v1 device-to-host";
    clp_hmac_sha256(secret, len, (const uint8_t *)h2d, sizeof h2d - 1, host_to_device);
    clp_hmac_sha256(secret, len, (const uint8_t *)d2h, sizeof d2h - 1, device_to_host);
}
#endif /* CLP_NO_SIGNING */

/* ----------------------------------------------------------------- framing */

static void put_le(uint8_t *p, uint64_t v, unsigned n)
{
    unsigned i;
    for (i = 0; i < n; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static uint64_t get_le(const uint8_t *p, unsigned n)
{
    uint64_t v = 0;
    unsigned i;
    for (i = 0; i < n; i++) {
        v |= (uint64_t)p[i] << (8 * i);
    }
    return v;
}

void clp_signer_init(clp_signer_t *s, const uint8_t *key, size_t key_len, uint64_t counter_start)
{
#ifndef CLP_NO_SIGNING
    s->key_len = normalise_key(key, key_len, s->key);
#else
    (void)key;
    s->key_len = key_len > 64 ? 64 : key_len;
#endif
    s->next_counter = counter_start;
}

size_t clp_frame_encode(uint8_t msg_type, uint32_t seq, uint64_t timestamp_us,
                        const uint8_t *payload, uint16_t payload_len, clp_signer_t *signer,
                        uint8_t *out, size_t cap)
{
    uint8_t header[CLP_HEADER_LEN], tail[CLP_SIGNATURE_LEN + CLP_CRC_LEN];
    size_t tail_len = 0, n;
    uint32_t crc;
    cobs_writer_t w;

    if (payload_len > CLP_MAX_PAYLOAD_LEN || msg_type == 0x00u || msg_type == 0xFFu) {
        return 0;
    }
#ifdef CLP_NO_SIGNING
    if (signer != NULL) {
        return 0;
    }
#endif
    header[0] = CLP_MAGIC0;
    header[1] = CLP_MAGIC1;
    header[2] = CLP_PROTOCOL_VERSION;
    header[3] = msg_type;
    header[4] = signer != NULL ? CLP_FLAG_SIGNED : 0u;
    header[5] = 0;
    put_le(header + 6, payload_len, 2);
    put_le(header + 8, seq, 4);
    put_le(header + 12, timestamp_us, 8);

    crc = clp_crc32c(0, header, CLP_HEADER_LEN);
    crc = clp_crc32c(crc, payload, payload_len);
#ifndef CLP_NO_SIGNING
    if (signer != NULL) {
        hmac_t m;
        uint8_t digest[32];
        put_le(tail, signer->next_counter, 8);
        signer->next_counter++;
        hmac_begin(&m, signer->key, signer->key_len);
        sha256_update(&m.inner, header, CLP_HEADER_LEN);
        sha256_update(&m.inner, payload, payload_len);
        sha256_update(&m.inner, tail, 8);
        hmac_end(&m, digest);
        memcpy(tail + 8, digest, CLP_TAG_LEN);
        tail_len = CLP_SIGNATURE_LEN;
        crc = clp_crc32c(crc, tail, tail_len);
    }
#endif
    put_le(tail + tail_len, crc, 4);
    tail_len += CLP_CRC_LEN;

    cobs_begin(&w, out, cap);
    cobs_put(&w, header, CLP_HEADER_LEN);
    cobs_put(&w, payload, payload_len);
    cobs_put(&w, tail, tail_len);
    n = cobs_end(&w);
    if (n == 0 || n >= cap) {
        return 0;
    }
    out[n] = 0x00; /* delimiter */
    return n + 1;
}

/* ------------------------------------------------------------------ parser */

void clp_parser_reset_sequence(clp_parser_t *p)
{
    p->have_top = 0;
    p->top = 0;
    p->seen = 0;
    p->lost_bits = 0;
}

void clp_parser_init(clp_parser_t *p, const uint8_t *key, size_t key_len, int require_signed)
{
    memset(p, 0, sizeof *p);
    if (key != NULL) {
#ifndef CLP_NO_SIGNING
        p->key_len = normalise_key(key, key_len, p->key);
        p->has_key = 1;
#else
        (void)key_len;
#endif
    }
    p->require_signed = require_signed ? 1u : 0u;
}

static void start_segment(clp_parser_t *p)
{
    p->raw_len = 0;
    p->enc_len = 0;
    p->remaining = 0;
    p->prev_code = 0;
    p->skipping = 0;
}

static void append_raw(clp_parser_t *p, uint8_t b)
{
    if (p->raw_len < CLP_RX_MAX_RAW_LEN) {
        p->raw[p->raw_len] = b;
    }
    p->raw_len++; /* keeps counting past the buffer, to report oversize */
}

static clp_result_t reject(clp_parser_t *p, clp_result_t why)
{
    switch (why) {
    case CLP_ERR_CRC: p->stats.crc_errors++; break;
    case CLP_ERR_MALFORMED: p->stats.malformed++; break;
    case CLP_ERR_OVERSIZE: p->stats.oversize++; break;
    case CLP_ERR_BAD_TAG: p->stats.bad_tag++; break;
    case CLP_ERR_REPLAYED: p->stats.replayed++; break;
    case CLP_ERR_UNSIGNED: p->stats.unsigned_frames++; break;
    default: break;
    }
    p->stats.bytes_discarded += p->enc_len;
    return why;
}

/* Serial-number arithmetic over a 64-frame window; mirrors SequenceTracker in parser.py. */
static clp_result_t observe_seq(clp_parser_t *p, uint32_t seq)
{
    uint32_t d, back;
    uint64_t bit;
    if (!p->have_top) {
        p->have_top = 1;
        p->top = seq;
        p->seen = 1;
        p->lost_bits = 0;
        return CLP_FRAME;
    }
    d = (uint32_t)(seq - p->top);
    if (d == 0) {
        p->stats.duplicate++;
        return CLP_DROP_DUPLICATE;
    }
    if (d < 0x80000000u) {
        p->stats.lost += (int64_t)d - 1;
        p->top = seq;
        if (d < 64) {
            p->seen = (p->seen << d) | 1u;
            p->lost_bits = (p->lost_bits << d) | (((uint64_t)1 << d) - 2u);
        } else {
            p->seen = 1;
            p->lost_bits = ~(uint64_t)1;
        }
        return CLP_FRAME;
    }
    back = (uint32_t)(p->top - seq);
    if (back >= 64) {
        p->stats.seq_resets++;
        p->top = seq;
        p->seen = 1;
        p->lost_bits = 0;
        return CLP_FRAME;
    }
    bit = (uint64_t)1 << back;
    if (p->seen & bit) {
        p->stats.duplicate++;
        return CLP_DROP_DUPLICATE;
    }
    p->seen |= bit;
    if (p->lost_bits & bit) {
        p->lost_bits &= ~bit;
        p->stats.lost--;
    }
    p->stats.out_of_order++;
    return CLP_DROP_OUT_OF_ORDER;
}

clp_result_t clp_check_frame(const uint8_t *raw, size_t n, size_t max_payload, clp_frame_t *out)
{
    size_t end;
    uint16_t plen;
    uint8_t flags, msg_type;

    if (n > CLP_HEADER_LEN + max_payload + CLP_SIGNATURE_LEN + CLP_CRC_LEN) {
        return CLP_ERR_OVERSIZE;
    }
    if (n < CLP_HEADER_LEN + CLP_CRC_LEN) {
        return CLP_ERR_MALFORMED;
    }
    if (clp_crc32c(0, raw, n - CLP_CRC_LEN) != (uint32_t)get_le(raw + n - CLP_CRC_LEN, 4)) {
        return CLP_ERR_CRC;
    }
    msg_type = raw[3];
    flags = raw[4];
    if (raw[0] != CLP_MAGIC0 || raw[1] != CLP_MAGIC1 || raw[2] != CLP_PROTOCOL_VERSION) {
        return CLP_ERR_MALFORMED;
    }
    if ((flags & (uint8_t)~CLP_FLAG_SIGNED) != 0 || raw[5] != 0 || msg_type == 0x00u || msg_type == 0xFFu) {
        return CLP_ERR_MALFORMED;
    }
    plen = (uint16_t)get_le(raw + 6, 2);
    if (plen > max_payload) {
        return CLP_ERR_OVERSIZE;
    }
    end = CLP_HEADER_LEN + plen;
    if (n != end + ((flags & CLP_FLAG_SIGNED) ? CLP_SIGNATURE_LEN : 0u) + CLP_CRC_LEN) {
        return CLP_ERR_MALFORMED;
    }
    out->msg_type = msg_type;
    out->flags = flags;
    out->payload_len = plen;
    out->seq = (uint32_t)get_le(raw + 8, 4);
    out->timestamp_us = get_le(raw + 12, 8);
    out->payload = raw + CLP_HEADER_LEN;
    out->sign_counter = (flags & CLP_FLAG_SIGNED) ? get_le(raw + end, 8) : 0u;
    return CLP_FRAME;
}

/* The checks of docs/protocol.md, "Receiving", in order. */
static clp_result_t finish_segment(clp_parser_t *p, clp_frame_t *out)
{
    const uint8_t *raw = p->raw;
    clp_result_t result;

    if (p->skipping) {
        p->stats.bytes_discarded += p->enc_len; /* counted as oversize when detected */
        return CLP_ERR_OVERSIZE;
    }
    if (p->remaining != 0) {
        return reject(p, CLP_ERR_MALFORMED);
    }
    /* raw_len keeps counting past the buffer: the length check comes first and reads no byte */
    result = clp_check_frame(raw, p->raw_len, CLP_RX_MAX_PAYLOAD, out);
    if (result != CLP_FRAME) {
        return reject(p, result);
    }
    if (out->flags & CLP_FLAG_SIGNED) {
#ifndef CLP_NO_SIGNING
        size_t end = CLP_HEADER_LEN + out->payload_len;
        uint8_t digest[32], diff = 0;
        unsigned i;
        if (!p->has_key) {
            return reject(p, CLP_ERR_BAD_TAG);
        }
        clp_hmac_sha256(p->key, p->key_len, raw, end + 8, digest);
        for (i = 0; i < CLP_TAG_LEN; i++) {
            diff |= (uint8_t)(digest[i] ^ raw[end + 8 + i]); /* constant time */
        }
        if (diff != 0) {
            return reject(p, CLP_ERR_BAD_TAG);
        }
        if (p->have_counter && out->sign_counter <= p->last_counter) {
            return reject(p, CLP_ERR_REPLAYED);
        }
        p->have_counter = 1;
        p->last_counter = out->sign_counter;
#else
        return reject(p, CLP_ERR_BAD_TAG);
#endif
    } else if (p->require_signed) {
        return reject(p, CLP_ERR_UNSIGNED);
    }
    if (out->msg_type == CLP_MSG_HELLO && p->have_top) {
        clp_parser_reset_sequence(p);
        p->stats.seq_resets++;
    }
    result = observe_seq(p, out->seq);
    if (result == CLP_FRAME) {
        p->stats.accepted++;
    }
    return result;
}

clp_result_t clp_parser_feed(clp_parser_t *p, uint8_t byte, clp_frame_t *out)
{
    clp_result_t result;
    p->stats.bytes_in++;
    if (byte == 0x00u) {
        if (p->enc_len == 0) {
            return CLP_NONE; /* empty segment: idle line or a leading delimiter */
        }
        result = finish_segment(p, out);
        start_segment(p);
        return result;
    }
    if (p->skipping) {
        p->enc_len++;
        return CLP_NONE;
    }
    if (++p->enc_len > CLP_MAX_ENCODED_LEN) {
        p->skipping = 1;
        p->stats.oversize++;
        return CLP_NONE;
    }
    if (p->remaining == 0) { /* a code byte */
        if (p->prev_code != 0 && p->prev_code != 0xFFu) {
            append_raw(p, 0x00u);
        }
        p->prev_code = byte;
        p->remaining = (uint8_t)(byte - 1u);
    } else {
        append_raw(p, byte);
        p->remaining--;
    }
    return CLP_NONE;
}
