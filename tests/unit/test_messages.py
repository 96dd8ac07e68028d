"""Side-channel messages and frames: round trips, strict decoding, signing, and a fuzz of the whole decode path."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import hmac

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsm_pd.kernels.layout import KVLayout
from fsm_pd.transport.messages import (
    CODEC,
    Abort,
    Heartbeat,
    MalformedMessage,
    MessageType,
    Prepare,
    Pulled,
    Ready,
    decode_body,
    encode_body,
    new_instance_id,
    stamped,
)
from fsm_pd.transport.signing import (
    HEADER_BYTES,
    MAC_BYTES,
    SECRET_ENV,
    WIRE_VERSION,
    RejectedFrame,
    SecretError,
    generate_secret,
    open_frame,
    parse_secret,
    seal,
    secret_env,
    secret_from_env,
)

SECRET = bytes(range(32))
LAYOUT = KVLayout(num_layers=2, num_pages=64, page_size=16, kv_heads=2, head_dim=8, dtype="bfloat16").to_dict()
COMMON = dict(room=12345, sender="decode-0", instance="0123456789abcdef", origin="tcp://127.0.0.1:5555",
              nonce=987654321, sent_at=1_700_000_000.25)

EXAMPLES = [
    Prepare(
        **COMMON,
        transfer_id=1,
        reply_to="tcp://127.0.0.1:5555",
        layout=LAYOUT,
        page_count=3,
        prompt_len=40,
    ),
    Ready(
        **COMMON,
        transfer_id=1,
        uuid=2**63 + 5,
        transfer_addr="127.0.0.1:7000",
        backend="jax",
        layout=LAYOUT,
        page_count=3,
        first_token=42,
        first_logprob=-0.5,
        input_logprobs=[-1.0, -2.5, float("-inf")],
    ),
    Ready(
        **COMMON,
        transfer_id=1,
        uuid=0,
        transfer_addr="",
        backend="fake",
        layout={},
        page_count=0,
        first_token=0,
        first_logprob=None,
        input_logprobs=None,
    ),
    Pulled(**COMMON, transfer_id=1),
    Abort(**COMMON, reason="decode: pull timed out after 30 s"),
    Heartbeat(**{**COMMON, "room": 0}, pong=False),
    Heartbeat(**{**COMMON, "room": 0}, pong=True),
]


def test_the_codec_table_covers_every_type_once():
    assert set(CODEC) == set(MessageType)
    assert {cls.TYPE for cls in CODEC.values()} == set(MessageType)
    assert {type(msg) for msg in EXAMPLES} == set(CODEC.values())


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_each_type_round_trips_through_body_and_frame(msg):
    assert decode_body(msg.TYPE, encode_body(msg)) == msg
    frame = seal(msg, SECRET)
    assert frame[0] == WIRE_VERSION == 2 and frame[1] == msg.TYPE
    assert open_frame(frame, SECRET) == msg


def test_body_is_a_compact_positional_array():
    body = encode_body(EXAMPLES[3])  # Pulled
    assert msgpack.unpackb(body) == [12345, "decode-0", "0123456789abcdef", "tcp://127.0.0.1:5555", 987654321,
                                     1_700_000_000.25, 1]
    assert len(body) < 80


def test_every_message_names_its_sender_instance_and_origin():
    for msg in EXAMPLES:
        assert (msg.sender, msg.instance, msg.origin) == ("decode-0", "0123456789abcdef", "tcp://127.0.0.1:5555")
    for field, bad in (("instance", ""), ("instance", "x" * 65), ("instance", None), ("origin", ""),
                       ("origin", 5)):
        with pytest.raises(MalformedMessage, match=field):
            Pulled(**{**COMMON, field: bad}, transfer_id=1)


def test_abort_ack_is_retired_and_its_number_stays_unused():
    assert 5 not in set(MessageType) and not hasattr(MessageType, "ABORT_ACK")
    with pytest.raises(MalformedMessage, match="unknown message type 5"):
        decode_body(5, encode_body(EXAMPLES[4]))


def test_a_version_1_frame_is_refused_as_bad_version():
    frame = seal(EXAMPLES[3], SECRET)
    with pytest.raises(RejectedFrame) as err:
        open_frame(b"\x01" + frame[1:], SECRET)
    assert err.value.reason == "bad_version"


def test_instance_ids_are_16_hex_characters_and_a_seeded_rng_repeats_them():
    import random

    ids = {new_instance_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 16 and set(i) <= set("0123456789abcdef") for i in ids)
    assert new_instance_id(random.Random(3)) == new_instance_id(random.Random(3))


def test_messages_are_frozen_and_slotted():
    msg = EXAMPLES[3]
    with pytest.raises(dataclasses.FrozenInstanceError):
        msg.room = 1
    assert not hasattr(msg, "__dict__")
    with pytest.raises(TypeError):
        Pulled(1, "a", "i", "tcp://h:1", 2, 3.0, 4)  # keyword-only


def test_ints_are_widened_to_floats_and_checked_once_at_construction():
    msg = Ready(**{**vars_of(EXAMPLES[1]), "first_logprob": 0, "input_logprobs": [0, 1]})
    assert msg.first_logprob == 0.0 and type(msg.first_logprob) is float
    assert all(type(x) is float for x in msg.input_logprobs)


def test_stamped_fills_a_fresh_nonce_and_time():
    a = stamped(Pulled, sender="p", instance="i", origin="tcp://h:1", room=1, transfer_id=2)
    b = stamped(Pulled, sender="p", instance="i", origin="tcp://h:1", room=1, transfer_id=2)
    assert a.nonce != b.nonce and 0 <= a.nonce < 2**63 and a.sent_at > 1e9


def vars_of(msg) -> dict:
    return {f.name: getattr(msg, f.name) for f in dataclasses.fields(msg)}


# -- malformed bodies ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field,bad",
    [
        ("room", -1),
        ("room", True),
        ("room", 1.0),
        ("room", "1"),
        ("sender", b"bytes"),
        ("sender", None),
        ("nonce", None),
        ("sent_at", "now"),
        ("sent_at", float("nan")),
        ("sent_at", float("inf")),
        ("transfer_id", 2**64),
        ("layout", [1, 2]),
        ("layout", {"a": [1]}),
        ("layout", {1: 2}),
        ("first_logprob", "x"),
        ("input_logprobs", [1.0, None]),
        ("input_logprobs", (1.0,)),
        ("uuid", None),
    ],
)
def test_a_wrong_field_type_is_malformed(field, bad):
    with pytest.raises(MalformedMessage, match=field):
        Ready(**{**vars_of(EXAMPLES[1]), field: bad})


def test_heartbeat_room_must_be_zero_and_pong_a_bool():
    with pytest.raises(MalformedMessage, match="room"):
        Heartbeat(**COMMON, pong=False)
    for bad in (0, 1, None, "yes"):
        with pytest.raises(MalformedMessage, match="pong"):
            Heartbeat(**{**COMMON, "room": 0}, pong=bad)


@pytest.mark.parametrize(
    "type_byte,body",
    [
        (0, encode_body(EXAMPLES[3])),
        (99, encode_body(EXAMPLES[3])),
        (MessageType.PULLED, b""),
        (MessageType.PULLED, b"\xc1"),  # never-used msgpack byte
        (MessageType.PULLED, encode_body(EXAMPLES[3]) + b"\x00"),  # trailing data
        (MessageType.PULLED, msgpack.packb({"room": 1})),
        (MessageType.PULLED, msgpack.packb([1, "a", "i", "tcp://h:1", 2, 3.0])),  # one field short
        (MessageType.PULLED, msgpack.packb([1, "a", "i", "tcp://h:1", 2, 3.0, 4, 5])),  # one too many
        (MessageType.PULLED, msgpack.packb([1, "a", 2, 3.0, 4])),  # a version-1 body: no instance, no origin
        (MessageType.ABORT, encode_body(EXAMPLES[3])),  # a PULLED body under another type
        (MessageType.PULLED, msgpack.packb([1, "a", "i", "tcp://h:1", 2, 3.0, msgpack.ExtType(1, b"x")])),
        (MessageType.PULLED, msgpack.packb([-(2**63), "a", "i", "tcp://h:1", 2, 3.0, 4])),
        (MessageType.PULLED, b"\xdd\xff\xff\xff\xff"),  # array claiming 4G elements
        (MessageType.PREPARE, b"\x91" * 5000 + b"\x00"),  # deeply nested
    ],
)
def test_malformed_bodies_raise_malformed_message_only(type_byte, body):
    with pytest.raises(MalformedMessage):
        decode_body(type_byte, body)


# -- hypothesis: random field values round-trip ---------------------------------------------------------------------

u64 = st.integers(min_value=0, max_value=2**64 - 1)
finite = st.floats(allow_nan=False, allow_infinity=False)
logprob = st.floats(allow_nan=False)
text = st.text(max_size=40)
scalar = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | text
layouts = st.dictionaries(text, scalar, max_size=8)
nonempty = st.text(min_size=1, max_size=40)
common = dict(room=u64, sender=text, instance=st.text(min_size=1, max_size=64), origin=nonempty,
              nonce=st.integers(0, 2**63 - 1), sent_at=finite)

STRATEGIES = {
    Prepare: st.builds(
        Prepare, **common, transfer_id=u64, reply_to=text, layout=layouts, page_count=u64, prompt_len=u64
    ),
    Ready: st.builds(
        Ready,
        **common,
        transfer_id=u64,
        uuid=u64,
        transfer_addr=text,
        backend=text,
        layout=layouts,
        page_count=u64,
        first_token=u64,
        first_logprob=st.none() | logprob,
        input_logprobs=st.none() | st.lists(logprob, max_size=50),
    ),
    Pulled: st.builds(Pulled, **common, transfer_id=u64),
    Abort: st.builds(Abort, **common, reason=text),
    Heartbeat: st.builds(Heartbeat, **{**common, "room": st.just(0)}, pong=st.booleans()),
}
any_message = st.one_of(*STRATEGIES.values())


@settings(max_examples=300, deadline=None)
@given(any_message)
def test_random_messages_round_trip(msg):
    assert decode_body(msg.TYPE, encode_body(msg)) == msg
    assert open_frame(seal(msg, SECRET), SECRET) == msg


# -- frames and signing ---------------------------------------------------------------------------------------------


def test_a_frame_signed_with_another_secret_is_bad_mac():
    frame = seal(EXAMPLES[0], generate_secret())
    with pytest.raises(RejectedFrame) as err:
        open_frame(frame, SECRET)
    assert err.value.reason == "bad_mac"


@pytest.mark.parametrize("position", [1, HEADER_BYTES, HEADER_BYTES + 5, -MAC_BYTES - 1, -1])
def test_any_altered_byte_is_bad_mac(position):
    frame = bytearray(seal(EXAMPLES[0], SECRET))
    frame[position] ^= 0x01
    with pytest.raises(RejectedFrame) as err:
        open_frame(bytes(frame), SECRET)
    assert err.value.reason == "bad_mac"


def test_a_body_without_mac_is_unsigned():
    msg = EXAMPLES[0]
    bare = bytes((WIRE_VERSION, msg.TYPE)) + encode_body(msg)
    for frame in (bare, b"\x02\x03"):
        with pytest.raises(RejectedFrame) as err:
            open_frame(frame, SECRET)
        assert err.value.reason == "unsigned"


def test_oversized_and_wrong_version_frames_are_rejected_before_the_mac():
    frame = seal(EXAMPLES[1], SECRET)
    with pytest.raises(RejectedFrame) as err:
        open_frame(frame, SECRET, max_frame_bytes=len(frame) - 1)
    assert err.value.reason == "oversized"
    assert open_frame(frame, SECRET, max_frame_bytes=len(frame)) == EXAMPLES[1]
    with pytest.raises(RejectedFrame) as err:
        open_frame(b"\x03" + frame[1:], SECRET)
    assert err.value.reason == "bad_version"


def test_the_mac_covers_the_type_byte():
    frame = seal(Abort(**COMMON, reason=""), SECRET)
    swapped = frame[:1] + bytes((MessageType.PULLED,)) + frame[2:]
    with pytest.raises(RejectedFrame, match="bad_mac"):
        open_frame(swapped, SECRET)


def test_secret_comes_from_env_as_hex_and_is_required():
    secret = generate_secret()
    assert len(secret) == 32 and generate_secret() != secret
    assert secret_from_env(secret_env(secret)) == secret
    with pytest.raises(SecretError, match=SECRET_ENV):
        secret_from_env({})
    with pytest.raises(SecretError, match="hex"):
        secret_from_env({SECRET_ENV: "correct horse battery staple"})
    with pytest.raises(SecretError, match="16 bytes"):
        parse_secret("abcd")
    with pytest.raises(SecretError):
        secret_env(b"short")


# -- fuzz: nothing but the documented errors ------------------------------------------------------------------------

DOCUMENTED = (RejectedFrame, MalformedMessage)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_documented_errors(data):
    with pytest.raises(DOCUMENTED):
        open_frame(data, SECRET)
    for type_byte in (0, 1, 2, 3, 4, 5, 6, 255):
        with contextlib.suppress(MalformedMessage):
            decode_body(type_byte, data)


def _resign(signed_part: bytes) -> bytes:
    # The fuzz must reach the body decoder, so mutated frames are re-signed with the right secret.
    return signed_part + hmac.new(SECRET, signed_part, hashlib.sha256).digest()


mutation = st.tuples(
    st.sampled_from(["flip", "insert", "delete", "truncate"]), st.integers(0, 10_000), st.binary(min_size=1, max_size=4)
)


@settings(max_examples=500, deadline=None)
@given(any_message, st.lists(mutation, min_size=1, max_size=4), st.booleans())
def test_mutated_valid_frames_raise_only_documented_errors(msg, mutations, resign):
    frame = bytearray(seal(msg, SECRET)[:-MAC_BYTES])
    for kind, at, data in mutations:
        at %= len(frame) + 1
        if kind == "flip" and at < len(frame):
            frame[at] ^= data[0] or 1
        elif kind == "insert":
            frame[at:at] = data
        elif kind == "delete":
            del frame[at : at + len(data)]
        elif kind == "truncate":
            del frame[at:]
    candidate = _resign(bytes(frame)) if resign else bytes(frame) + seal(msg, SECRET)[-MAC_BYTES:]
    try:
        out = open_frame(candidate, SECRET)
    except DOCUMENTED:
        return
    assert type(out) in CODEC.values()  # a mutation can still be a valid message; it must then be a real one


random_body = st.recursive(
    scalar | st.binary(max_size=8),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(text | st.integers(-(2**63), 2**63 - 1), children, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(MessageType)), random_body, st.lists(random_body, max_size=12))
def test_signed_random_msgpack_bodies_raise_only_malformed(msg_type, obj, arr):
    for body in (msgpack.packb(obj), msgpack.packb(arr)):
        try:
            out = open_frame(_resign(bytes((WIRE_VERSION, msg_type)) + body), SECRET)
        except MalformedMessage:
            continue
        assert type(out) is CODEC[msg_type]
