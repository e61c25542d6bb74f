"""Optional frame signing: HMAC-SHA256 tags with a monotonic counter against replay.

A link may share a secret key at set-up.  A signed frame (header flag bit 0) carries,
after its payload, a u64 signing counter and a 16-byte tag: the first 16 bytes of
HMAC-SHA256(key, header + payload + counter).  The receiver refuses a frame whose tag
does not verify, whose counter is not strictly greater than the last counter it
accepted under that key (a replayed or reordered frame), and, when the link requires
signing, any unsigned frame.  Each direction should use its own key, so that a frame
cannot be reflected back to its sender: :func:`derive_link_keys` derives both from
one shared secret.  The sender must never reuse a counter value under a key; one that
cannot persist its counter across restarts should start it from a real-time clock
in microseconds (the default here) or get a fresh key per session.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

from .errors import MessageError

__all__ = ["FrameSigner", "FrameVerifier", "derive_link_keys", "TAG_LEN", "SIGNATURE_LEN", "MIN_KEY_LEN"]

#: Bytes of the truncated HMAC-SHA256 tag.
TAG_LEN = 16
#: Bytes appended to a signed frame's payload: u64 counter + tag.
SIGNATURE_LEN = 8 + TAG_LEN
#: Shortest key accepted (128 bits).
MIN_KEY_LEN = 16

_U64 = struct.Struct("<Q")
_HOST_TO_DEVICE = b"closedloop/v1 host-to-device"
_DEVICE_TO_HOST = b"closedloop/v1 device-to-host"


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)):
        raise MessageError(f"signing key must be bytes; got {type(key).__name__}")
    if len(key) < MIN_KEY_LEN:
        raise MessageError(f"signing key is {len(key)} bytes; use at least {MIN_KEY_LEN} random bytes "
                           "(e.g. secrets.token_bytes(32))")
    return bytes(key)


def compute_tag(key: bytes, signed_region: bytes | bytearray | memoryview) -> bytes:
    """The 16-byte tag over ``signed_region`` (header + payload + u64 counter)."""
    return hmac.digest(key, signed_region, hashlib.sha256)[:TAG_LEN]


def derive_link_keys(shared_secret: bytes) -> tuple[bytes, bytes]:
    """Per-direction keys ``(host_to_device, device_to_host)`` from one shared secret.

    Each key is ``HMAC-SHA256(shared_secret, label)`` with the ASCII labels
    ``"closedloop/v1 host-to-device"`` and ``"closedloop/v1 device-to-host"``.
    """
    secret = _check_key(shared_secret)
    return (hmac.digest(secret, _HOST_TO_DEVICE, hashlib.sha256),
            hmac.digest(secret, _DEVICE_TO_HOST, hashlib.sha256))


class FrameSigner:
    """Signs outgoing frames with one key and a strictly increasing u64 counter.

    Parameters
    ----------
    key : bytes
        The sending direction's key (at least 16 bytes).
    counter_start : int, optional
        First counter value.  Defaults to the real-time clock in microseconds, so a
        restarted sender never reuses a counter under the same key.
    """

    def __init__(self, key: bytes, counter_start: int | None = None) -> None:
        self.key = _check_key(key)
        start = time.time_ns() // 1000 if counter_start is None else int(counter_start)
        if not 0 <= start < 2**64:
            raise MessageError(f"counter_start {start} does not fit in a u64")
        self.next_counter = start

    def signature(self, header_and_payload: bytes | bytearray) -> bytes:
        """The 24 bytes to append after the payload: u64 counter then the tag."""
        counter = self.next_counter
        if counter >= 2**64:
            raise MessageError("signing counter exhausted 2**64 values; set up a new key")
        self.next_counter = counter + 1
        packed = _U64.pack(counter)
        return packed + compute_tag(self.key, bytes(header_and_payload) + packed)


class FrameVerifier:
    """Checks incoming signed frames and refuses replays; optionally requires signing.

    Parameters
    ----------
    key : bytes or None
        The receiving direction's key.  ``None`` means this link has no key: signed
        frames cannot be verified and are refused (``bad_tag``).
    required : bool, optional
        Refuse unsigned frames (``unsigned``).  Defaults to ``True`` when a key is given.
    last_counter : int, optional
        Highest counter already accepted (persist it to keep replay protection across
        receiver restarts); frames must carry a larger one.  ``-1`` accepts any first counter.
    """

    def __init__(self, key: bytes | None, required: bool | None = None, last_counter: int = -1) -> None:
        self.key = None if key is None else _check_key(key)
        self.required = (key is not None) if required is None else bool(required)
        self.last_counter = int(last_counter)

    def check(self, signed_region: bytes | bytearray | memoryview, counter: int, tag: bytes | bytearray
              ) -> tuple[str, str] | None:
        """``None`` when the tag verifies and the counter is fresh (then remember it),
        else ``(reason, detail)`` with reason ``"bad_tag"`` or ``"replayed"``."""
        if self.key is None:
            return ("bad_tag", "signed frame on a link without a key; configure the shared key")
        if not hmac.compare_digest(compute_tag(self.key, signed_region), bytes(tag)):
            return ("bad_tag", "HMAC tag does not verify: wrong key, or the frame was altered")
        if counter <= self.last_counter:
            return ("replayed", f"signing counter {counter} is not above the last accepted "
                                f"{self.last_counter}: a replayed or reordered frame")
        self.last_counter = counter
        return None


class UnverifiedTags(FrameVerifier):
    """Accepts a signed frame's tag unchecked and counts it (``signed``): reading a recording of a signed session
    without its key (replay, the recording's view, NWB export). The frames were verified when they were recorded;
    without the key nobody can check that again, and whoever reads them this way says so."""

    def __init__(self) -> None:
        super().__init__(None, required=False)
        self.signed = 0

    def check(self, signed_region: bytes | bytearray | memoryview, counter: int, tag: bytes | bytearray
              ) -> tuple[str, str] | None:
        self.signed += 1
        return None
