/*
 * Host test: checks closedloop_proto.c byte-for-byte against the shared test vectors.
 *
 * Usage: test_vectors VECTORS.txt   (the text form of testvectors/frames.json, written
 * by firmware_bridge.vectors.write_c_vectors; the Python test suite builds and runs
 * this program).  Prints one line per failure and a summary; exits 0 when all pass.
 */
#include "closedloop_proto.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static char line[1 << 17];
static uint8_t buf_a[1 << 16], buf_b[1 << 16], buf_c[1 << 16];
static clp_parser_t parser;
static int checks, failures;

static void fail(const char *what, const char *name)
{
    failures++;
    printf("FAIL %s: %s\n", what, name);
}

static size_t unhex(const char *hex, uint8_t *out, size_t cap)
{
    size_t n = 0;
    if (strcmp(hex, "-") == 0) {
        return 0;
    }
    while (hex[0] && hex[1] && n < cap) {
        unsigned v;
        if (sscanf(hex, "%2x", &v) != 1) {
            break;
        }
        out[n++] = (uint8_t)v;
        hex += 2;
    }
    return n;
}

static const char *result_name(clp_result_t r)
{
    switch (r) {
    case CLP_NONE: return "none";
    case CLP_FRAME: return "accept";
    case CLP_ERR_CRC: return "crc_errors";
    case CLP_ERR_MALFORMED: return "malformed";
    case CLP_ERR_OVERSIZE: return "oversize";
    case CLP_ERR_BAD_TAG: return "bad_tag";
    case CLP_ERR_REPLAYED: return "replayed";
    case CLP_ERR_UNSIGNED: return "unsigned";
    case CLP_DROP_DUPLICATE: return "duplicate";
    case CLP_DROP_OUT_OF_ORDER: return "out_of_order";
    }
    return "?";
}

static void init_parser(const char *key_hex, const char *require)
{
    static uint8_t key[256];
    size_t key_len = unhex(key_hex, key, sizeof key);
    clp_parser_init(&parser, key_len ? key : NULL, key_len, atoi(require));
}

static void check_frame(char **tok, int ntok)
{
    const char *name = tok[1], *expect = tok[2];
    size_t wire_len = unhex(tok[5], buf_a, sizeof buf_a), i;
    clp_result_t last = CLP_NONE;
    clp_frame_t frame;
    init_parser(tok[3], tok[4]);
    for (i = 0; i < wire_len; i++) {
        clp_result_t r = clp_parser_feed(&parser, buf_a[i], &frame);
        if (r != CLP_NONE) {
            last = r;
        }
    }
    checks++;
    if (strcmp(result_name(last), expect) != 0) {
        printf("  parser said %s, expected %s\n", result_name(last), expect);
        fail("parse result", name);
        return;
    }
    if (strcmp(expect, "accept") != 0 || ntok < 13) {
        return;
    }
    {
        unsigned msg_type = (unsigned)strtoul(tok[6], NULL, 10), flags = (unsigned)strtoul(tok[7], NULL, 10);
        uint32_t seq = (uint32_t)strtoul(tok[8], NULL, 10);
        uint64_t ts = strtoull(tok[9], NULL, 10);
        uint16_t plen = (uint16_t)strtoul(tok[10], NULL, 10);
        size_t payload_len = unhex(tok[12], buf_b, sizeof buf_b), n;
        clp_signer_t signer;
        clp_signer_t *use_signer = NULL;
        checks++;
        if (frame.msg_type != msg_type || frame.flags != flags || frame.seq != seq || frame.timestamp_us != ts ||
            frame.payload_len != plen || payload_len != plen || memcmp(frame.payload, buf_b, plen) != 0) {
            fail("decoded fields", name);
        }
        if (strcmp(tok[11], "-") != 0) {
            uint8_t key[256];
            size_t key_len = unhex(tok[3], key, sizeof key);
            uint64_t counter = strtoull(tok[11], NULL, 10);
            checks++;
            if (frame.sign_counter != counter) {
                fail("sign counter", name);
            }
            clp_signer_init(&signer, key, key_len, counter);
            use_signer = &signer;
        }
        n = clp_frame_encode((uint8_t)msg_type, seq, ts, buf_b, plen, use_signer, buf_c, sizeof buf_c);
        checks++;
        if (n != wire_len || memcmp(buf_c, buf_a, n) != 0) {
            fail("encode byte-for-byte", name);
        }
    }
}

static uint64_t stat_value(const char *key, int *known)
{
    const clp_stats_t *s = &parser.stats;
    *known = 1;
    if (!strcmp(key, "accepted")) return s->accepted;
    if (!strcmp(key, "crc_errors")) return s->crc_errors;
    if (!strcmp(key, "malformed")) return s->malformed;
    if (!strcmp(key, "oversize")) return s->oversize;
    if (!strcmp(key, "bad_tag")) return s->bad_tag;
    if (!strcmp(key, "replayed")) return s->replayed;
    if (!strcmp(key, "unsigned")) return s->unsigned_frames;
    if (!strcmp(key, "lost")) return (uint64_t)s->lost;
    if (!strcmp(key, "duplicate")) return s->duplicate;
    if (!strcmp(key, "out_of_order")) return s->out_of_order;
    if (!strcmp(key, "seq_resets")) return s->seq_resets;
    if (!strcmp(key, "bytes_discarded")) return s->bytes_discarded;
    *known = 0; /* unknown_type: the C layer does not decode payloads */
    return 0;
}

static void check_stream(char **tok, int ntok)
{
    size_t n = unhex(tok[4], buf_a, sizeof buf_a), i;
    clp_frame_t frame;
    int t;
    init_parser(tok[2], tok[3]);
    for (i = 0; i < n; i++) {
        (void)clp_parser_feed(&parser, buf_a[i], &frame);
    }
    for (t = 5; t < ntok; t++) {
        char *eq = strchr(tok[t], '=');
        int known;
        uint64_t got;
        if (eq == NULL) {
            continue;
        }
        *eq = '\0';
        got = stat_value(tok[t], &known);
        if (!known) {
            continue;
        }
        checks++;
        if (got != strtoull(eq + 1, NULL, 10)) {
            printf("  %s: got %llu, expected %s\n", tok[t], (unsigned long long)got, eq + 1);
            fail("stream counter", tok[1]);
        }
    }
}

int main(int argc, char **argv)
{
    FILE *fh;
    if (argc != 2) {
        fprintf(stderr, "usage: %s VECTORS.txt\n", argv[0]);
        return 2;
    }
    fh = fopen(argv[1], "r");
    if (fh == NULL) {
        perror(argv[1]);
        return 2;
    }
    while (fgets(line, sizeof line, fh) != NULL) {
        char *tok[64];
        int ntok = 0;
        char *p = strtok(line, " \r\n");
        while (p != NULL && ntok < 64) {
            tok[ntok++] = p;
            p = strtok(NULL, " \r\n");
        }
        if (ntok == 0 || tok[0][0] == '#') {
            continue;
        }
        if (!strcmp(tok[0], "CRC") && ntok == 3) {
            size_t n = unhex(tok[1], buf_a, sizeof buf_a);
            checks++;
            if (clp_crc32c(0, buf_a, n) != (uint32_t)strtoul(tok[2], NULL, 16)) {
                fail("crc32c", tok[1]);
            }
        } else if (!strcmp(tok[0], "COBS") && ntok == 3) {
            size_t raw_len = unhex(tok[1], buf_a, sizeof buf_a);
            size_t enc_len = unhex(tok[2], buf_b, sizeof buf_b), n;
            int ok;
            checks += 2;
            n = clp_cobs_encode(buf_a, raw_len, buf_c, sizeof buf_c);
            if (n != enc_len || memcmp(buf_c, buf_b, n) != 0) {
                fail("cobs encode", tok[2]);
            }
            n = clp_cobs_decode(buf_b, enc_len, buf_c, sizeof buf_c, &ok);
            if (!ok || n != raw_len || memcmp(buf_c, buf_a, n) != 0) {
                fail("cobs decode", tok[2]);
            }
        } else if (!strcmp(tok[0], "KDF") && ntok == 4) {
#ifndef CLP_NO_SIGNING
            uint8_t h2d[32], d2h[32];
            size_t n = unhex(tok[1], buf_a, sizeof buf_a);
            clp_derive_link_keys(buf_a, n, h2d, d2h);
            unhex(tok[2], buf_b, 32);
            unhex(tok[3], buf_c, 32);
            checks++;
            if (memcmp(h2d, buf_b, 32) != 0 || memcmp(d2h, buf_c, 32) != 0) {
                fail("key derivation", tok[1]);
            }
#endif
        } else if (!strcmp(tok[0], "FRAME") && ntok >= 6) {
            check_frame(tok, ntok);
        } else if (!strcmp(tok[0], "STREAM") && ntok >= 5) {
            check_stream(tok, ntok);
        } else {
            fail("unreadable record", tok[0]);
        }
    }
    fclose(fh);
    printf("%d checks, %d failures\n", checks, failures);
    return failures == 0 && checks > 0 ? 0 : 1;
}
