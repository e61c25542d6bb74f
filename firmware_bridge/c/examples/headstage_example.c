/*
 * headstage_example.c: a closedloop headstage built on closedloop_proto.h, as a board would
 * run it, but on a POSIX tty.  Read it as a template for firmware: everything below
 * main() maps to a UART driver, a timer and a main loop.
 *
 *   usage: headstage_example TTY|pty [CHANNELS=192] [SECONDS=3]
 *
 *   TTY    a serial port to serve (/dev/ttyACM0, the device end of a pty made elsewhere)
 *   pty    make a pty, print "pty /dev/pts/N" as the first line of stdout and serve its
 *          master end; the host opens /dev/pts/N as it would a USB serial port
 *
 * What it does (docs/devices.md, "Session semantics"; wire format: docs/protocol.md):
 *   1. HELLO first, at seq 0; then HELLO + HEARTBEAT(IDLE) once a second, nothing else,
 *      until a HELLO of kind "host" arrives.
 *   2. Answer with its HELLO, send STATUS(10 STREAMING), and stream one NEURAL_FRAME per
 *      20 ms bin (bin 0 ends at the host HELLO), plus HEARTBEAT(RUNNING) once a second.
 *      A later host HELLO gets a fresh HELLO and STATUS(11 HOST_RECONNECTED).
 *   3. Count DECODER_OUTPUT frames from the host, and everything the parser (or the
 *      payload check, which the C library leaves to the application) rejects.
 *   4. Stop after SECONDS of streaming, or on SIGTERM/SIGINT; print one summary line.
 *
 * Build (from firmware_bridge/c):
 *   cc -std=c99 -Wall -Wextra -I. examples/headstage_example.c closedloop_proto.c -o headstage_example
 *
 * The protocol path (encode, parse) uses only static buffers: no heap.
 */
#ifndef _XOPEN_SOURCE
#define _XOPEN_SOURCE 600 /* posix_openpt, grantpt, unlockpt, ptsname; clock_gettime; sigaction */
#endif

#include "closedloop_proto.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define RATE_HZ 50u
#define BIN_US (1000000u / RATE_HZ) /* 20 ms bins */
#define MAX_CHANNELS 2045u          /* 4 + 2 + 2 * 2045 = 4096 payload bytes */

/* STATUS codes of the reference devices (docs/devices.md; the protocol leaves codes to the device). */
enum { ST_STREAMING = 10, ST_HOST_RECONNECTED = 11, ST_BAD_COMMAND = 31 };

/* ---------------------------------------------------------------- state */

static int fd = -1;                         /* the serial line */
static clp_parser_t rx;                     /* one parser, ~4.1 KiB */
static uint8_t tx[CLP_MAX_WIRE_LEN];        /* one encoded frame */
static uint8_t payload[CLP_MAX_PAYLOAD_LEN];
static uint32_t tx_seq;                     /* +1 per frame sent, from 0 at boot (HELLO first) */
static uint16_t n_channels = 192;

static int streaming;
static uint32_t bin;                        /* next bin to send */
static uint64_t t_handshake_us, next_beat_us, next_bad_command_us;
static unsigned long frames_sent, decoder_outputs, host_hellos, bad_payloads;
static volatile sig_atomic_t stop_requested;

static void on_signal(int sig) { (void)sig; stop_requested = 1; }

/* Device clock: microseconds since boot, monotonic (every frame's timestamp_us). */
static uint64_t now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* ------------------------------------------- payload fields: little-endian, unaligned */

static uint8_t *put_u8(uint8_t *p, uint8_t v) { *p = v; return p + 1; }
static uint8_t *put_u16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); return p + 2; }
static uint8_t *put_u32(uint8_t *p, uint32_t v)
{
    p = put_u16(p, (uint16_t)v);
    return put_u16(p, (uint16_t)(v >> 16));
}
static uint8_t *put_f32(uint8_t *p, float v)
{
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits); /* IEEE-754 binary32 on every target this runs on */
    return put_u32(p, bits);
}
static uint8_t *put_str8(uint8_t *p, const char *s) /* u8 length + UTF-8 bytes */
{
    size_t n = strlen(s);
    p = put_u8(p, (uint8_t)n);
    memcpy(p, s, n);
    return p + n;
}
static uint16_t get_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* ---------------------------------------------------------------- sending */

static void write_all(const uint8_t *buf, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, buf, n);
        if (w < 0) {
            if (errno == EINTR && !stop_requested) {
                continue;
            }
            return; /* line gone or stopping: the host sees a sequence gap, as for a lost frame */
        }
        buf += w;
        n -= (size_t)w;
    }
}

/* Every frame goes through here: the next sequence number, the device clock, unsigned. */
static void send_frame(uint8_t type, uint64_t t_us, const uint8_t *end_of_payload)
{
    size_t n = clp_frame_encode(type, tx_seq++, t_us, payload, (uint16_t)(end_of_payload - payload),
                                NULL, tx, sizeof tx);
    write_all(tx, n); /* n == 0 only for a payload over 4096 bytes, which main() rules out */
}

static void send_hello(void)
{
    uint8_t *p = put_str8(payload, "headstage");   /* kind: what the host checks */
    p = put_u8(p, CLP_PROTOCOL_VERSION);
    p = put_u16(p, n_channels);
    p = put_f32(p, (float)RATE_HZ);
    p = put_u16(p, 0);                              /* n_dims: no command limits follow */
    p = put_str8(p, "c-example");                   /* free-form name */
    send_frame(CLP_MSG_HELLO, now_us(), p);
}

static void send_heartbeat(uint8_t state)
{
    send_frame(CLP_MSG_HEARTBEAT, now_us(), put_u8(payload, state));
}

static void send_status(uint16_t code, uint8_t severity, const char *text)
{
    size_t n = strlen(text);
    uint8_t *p = put_u16(payload, code);
    p = put_u8(p, severity);
    p = put_u16(p, (uint16_t)n);
    memcpy(p, text, n);
    send_frame(CLP_MSG_STATUS, now_us(), p + n);
}

/* BAD_COMMAND is rate-limited to one per second (docs/devices.md, STATUS codes). */
static void bad_command(const char *text)
{
    uint64_t now = now_us();
    if (now >= next_bad_command_us) {
        send_status(ST_BAD_COMMAND, CLP_SEV_WARNING, text);
        next_bad_command_us = now + 1000000u;
    }
}

/* One bin of spike counts.  A real board fills counts from its threshold crossings;
 * the timestamp is the end of the bin (docs/protocol.md section 6). */
static void send_neural_frame(uint32_t index, uint64_t end_of_bin_us)
{
    uint8_t *p = put_u32(payload, index);
    uint16_t ch;
    p = put_u16(p, n_channels);
    for (ch = 0; ch < n_channels; ch++) {
        p = put_u16(p, (uint16_t)((index * 7u + ch * 3u) % 5u)); /* deterministic test pattern */
    }
    send_frame(CLP_MSG_NEURAL_FRAME, end_of_bin_us, p);
    frames_sent++;
}

/* ---------------------------------------------------------------- receiving */

/* The C parser checks framing, CRC, header, signature and sequence (steps 1-12); the payload
 * layout (step 13) is the application's job: a payload that does not fit is malformed. */

/* HELLO: kind_len u8, kind, version u8, n_channels u16, rate f32, n_dims u16,
 * low f32[n_dims], high f32[n_dims], name_len u8, name.  Returns 1 if the layout fits. */
static int hello_fits(const clp_frame_t *f)
{
    size_t len = f->payload_len, at;
    if (len < 1) {
        return 0;
    }
    at = 1u + f->payload[0] + 1u + 2u + 4u;         /* up to n_dims */
    if (len < at + 2u) {
        return 0;
    }
    at += 2u + 8u * get_u16(f->payload + at);       /* command_low and command_high */
    return len > at && len == at + 1u + f->payload[at];
}

static int hello_kind_is(const clp_frame_t *f, const char *kind)
{
    size_t n = strlen(kind);
    return f->payload[0] == n && memcmp(f->payload + 1, kind, n) == 0;
}

/* DECODER_OUTPUT: bin_index u32, text_len u16, text, n_probs u16, probs f32[n_probs]. */
static int decoder_output_fits(const clp_frame_t *f)
{
    size_t len = f->payload_len, at = 4u + 2u;
    if (len < at) {
        return 0;
    }
    at += get_u16(f->payload + 4);
    return len >= at + 2u && len == at + 2u + 4u * get_u16(f->payload + at);
}

static void on_host_hello(void)
{
    uint64_t now = now_us();
    host_hellos++;
    send_hello(); /* every host HELLO gets a fresh device HELLO */
    if (streaming) {
        send_status(ST_HOST_RECONNECTED, CLP_SEV_INFO, "host reconnected"); /* bins go on, not reset */
        return;
    }
    streaming = 1;
    send_status(ST_STREAMING, CLP_SEV_INFO, "streaming; faults: none");
    t_handshake_us = now; /* bin 0 ends here; bin k ends k * 20 ms later */
    bin = 0;
    next_beat_us = now;   /* first HEARTBEAT(RUNNING) right away */
}

static void on_frame(const clp_frame_t *f)
{
    switch (f->msg_type) {
    case CLP_MSG_HELLO: /* the parser already restarted its tracking of the host's seq */
        if (!hello_fits(f)) {
            bad_payloads++;
        } else if (hello_kind_is(f, "host")) {
            on_host_hello();
        } else {
            bad_command("HELLO of a kind other than host ignored");
        }
        break;
    case CLP_MSG_DECODER_OUTPUT: /* the headstage's one command: a board would display the text */
        if (decoder_output_fits(f)) {
            decoder_outputs++;
        } else {
            bad_payloads++;
        }
        break;
    case CLP_MSG_HEARTBEAT:
    case CLP_MSG_STATUS:
        break; /* host liveness and events: nothing to do here */
    case CLP_MSG_ACTUATOR_COMMAND:
    case CLP_MSG_JOINT_COMMAND:
        bad_command("a headstage accepts only DECODER_OUTPUT");
        break;
    default:
        break; /* unknown or device-to-host types: ignore, so newer hosts do not break us */
    }
}

/* Wait for input until deadline_us (or a signal), feeding every byte to the parser. */
static void receive_until(uint64_t deadline_us)
{
    uint8_t buf[256];
    uint64_t now = now_us();
    struct pollfd pfd;
    int timeout_ms = now >= deadline_us ? 0 : (int)((deadline_us - now + 999u) / 1000u);
    ssize_t n, i;
    pfd.fd = fd;
    pfd.events = POLLIN;
    if (poll(&pfd, 1, timeout_ms) <= 0 || !(pfd.revents & POLLIN)) {
        return; /* timeout, signal, or a hung-up line (nothing to read) */
    }
    n = read(fd, buf, sizeof buf);
    if (n == 0 || (n < 0 && errno != EINTR && errno != EAGAIN)) {
        stop_requested = 1; /* the port went away (a pty whose host end closed, a USB unplug) */
        return;
    }
    for (i = 0; i < n; i++) {
        clp_frame_t f;
        if (clp_parser_feed(&rx, buf[i], &f) == CLP_FRAME) {
            on_frame(&f);
        }
        /* other results: a rejected segment, or a duplicate/late frame; all counted in rx.stats */
    }
}

/* ---------------------------------------------------------------- the line */

/* Raw 8N1: no echo, no line editing, no CR/LF translation, no flow control, bytes as they come. */
static int make_raw(int tty)
{
    struct termios t;
    if (tcgetattr(tty, &t) != 0) {
        return -1;
    }
    t.c_iflag &= (tcflag_t)~(IGNBRK | BRKINT | PARMRK | ISTRIP | INLCR | IGNCR | ICRNL | IXON | IXOFF);
    t.c_oflag &= (tcflag_t)~OPOST;
    t.c_lflag &= (tcflag_t)~(ECHO | ECHONL | ICANON | ISIG | IEXTEN);
    t.c_cflag &= (tcflag_t)~(CSIZE | PARENB | CSTOPB);
    t.c_cflag |= CS8 | CLOCAL | CREAD;
    t.c_cc[VMIN] = 1;
    t.c_cc[VTIME] = 0;
    /* A real UART also sets its baud rate here (cfsetispeed/cfsetospeed); USB CDC and ptys ignore it. */
    return tcsetattr(tty, TCSANOW, &t);
}

/* "pty": make a pty, keep its device end open (so the master never reads EIO while no host
 * has it open, and it stays raw), print its path, and serve the master end. */
static int open_pty(void)
{
    int master = posix_openpt(O_RDWR | O_NOCTTY), slave;
    const char *name;
    if (master < 0 || grantpt(master) != 0 || unlockpt(master) != 0 || (name = ptsname(master)) == NULL) {
        return -1;
    }
    slave = open(name, O_RDWR | O_NOCTTY);
    if (slave < 0 || make_raw(slave) != 0) {
        return -1;
    }
    printf("pty %s\n", name);
    fflush(stdout);
    return master;
}

static int open_tty(const char *path)
{
    int tty = open(path, O_RDWR | O_NOCTTY);
    if (tty >= 0 && make_raw(tty) != 0) {
        close(tty);
        return -1;
    }
    return tty;
}

/* ---------------------------------------------------------------- main loop */

int main(int argc, char **argv)
{
    long channels = argc > 2 ? strtol(argv[2], NULL, 10) : 192;
    double seconds = argc > 3 ? strtod(argv[3], NULL) : 3.0;
    uint32_t n_bins = (uint32_t)(seconds * RATE_HZ + 0.5);
    uint64_t linger_until = 0;
    struct sigaction sa;
    const clp_stats_t *st = &rx.stats;

    if (argc < 2 || channels < 1 || channels > (long)MAX_CHANNELS || !(seconds > 0)) {
        fprintf(stderr, "usage: %s TTY|pty [CHANNELS 1..%u] [SECONDS > 0]\n", argv[0], MAX_CHANNELS);
        return 2;
    }
    n_channels = (uint16_t)channels;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal; /* no SA_RESTART: a signal wakes poll() */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);

    fd = strcmp(argv[1], "pty") == 0 ? open_pty() : open_tty(argv[1]);
    if (fd < 0) {
        perror(argv[1]);
        return 3;
    }
    clp_parser_init(&rx, NULL, 0, 0); /* unsigned link; a signed one passes the host-to-device key */

    write_all((const uint8_t *)"", 1); /* one 0x00 first: the host drops any partial bytes it holds */
    next_beat_us = now_us();
    while (!stop_requested) {
        uint64_t now = now_us(), wake;
        if (!streaming) {
            /* 1. Identify: HELLO (seq 0 the first time) and HEARTBEAT(IDLE) once a second. */
            if (now >= next_beat_us) {
                send_hello();
                send_heartbeat(CLP_STATE_IDLE);
                next_beat_us += 1000000u;
            }
            wake = next_beat_us;
        } else {
            /* 2. Stream: every bin that has ended (more than one if this loop was late). */
            while (bin < n_bins && now >= t_handshake_us + (uint64_t)bin * BIN_US) {
                send_neural_frame(bin, t_handshake_us + (uint64_t)bin * BIN_US);
                bin++;
            }
            if (now >= next_beat_us) {
                send_heartbeat(CLP_STATE_RUNNING);
                next_beat_us += 1000000u;
            }
            if (bin >= n_bins) {
                break;
            }
            wake = t_handshake_us + (uint64_t)bin * BIN_US;
            if (next_beat_us < wake) {
                wake = next_beat_us;
            }
        }
        receive_until(wake);
    }

    /* Done: listen 100 ms more, so the host's answers to the last bins are counted. */
    linger_until = now_us() + 100000u;
    while (now_us() < linger_until) {
        receive_until(linger_until);
    }
    printf("frames_sent=%lu decoder_outputs=%lu host_hellos=%lu rejected=%lu lost=%lld\n",
           frames_sent, decoder_outputs, host_hellos,
           (unsigned long)(st->crc_errors + st->malformed + st->oversize + st->bad_tag + st->replayed +
                           st->unsigned_frames) + bad_payloads,
           (long long)st->lost);
    return 0;
}
