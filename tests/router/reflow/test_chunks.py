"""Chunking, the chunk's wire form, and session derivation (pure)."""

from __future__ import annotations

from router.reflow.chunks import Chunk, Direction, FinishState, session_id_for, split_utf8


def test_split_respects_the_bound_and_character_boundaries():
    body = ("héllo wörld ✓ " * 100).encode()
    pieces = split_utf8(body, 16)
    assert all(len(p.encode()) <= 16 for p in pieces)
    assert "".join(pieces).encode() == body
    assert split_utf8(b"", 16) == [""]


def test_chunk_round_trips_through_bytes():
    chunk = Chunk("r1", Direction.RESPONSE, 3, "c", "m", "s", 12.5, text="hi", token_ids=(1, 2),
                  finish=FinishState.DEADLINE, usage={"completion_tokens": 2}, num_request_chunks=2, num_dropped=1,
                  extra={"error": "late"})
    assert Chunk.from_bytes(chunk.to_bytes()) == chunk
    first = Chunk("r1", Direction.REQUEST, 0, "c", "m", "s", 12.5)
    assert Chunk.from_bytes(first.to_bytes()) == first


def test_chunk_bytes_are_the_compact_json_of_its_non_empty_fields_in_field_order():
    delta = Chunk("r1", Direction.RESPONSE, 3, "c", "m", "s", 12.5, text="h\u00e9 \"x\"", token_ids=(7,))
    assert delta.to_bytes() == ('{"request_id":"r1","direction":"response","seq":3,"client_id":"c","service_id":"m",'
                                '"session_id":"s","timestamp":12.5,"text":"h\u00e9 \\"x\\"","token_ids":[7]}').encode()
    final = Chunk("r1", Direction.RESPONSE, 0, "c", "m", "s", 1.0, finish=FinishState.ERROR,
                  usage={"prompt_tokens": 0, "completion_tokens": 2}, extra={"error": "boom"})
    assert final.to_bytes() == ('{"request_id":"r1","direction":"response","seq":0,"client_id":"c","service_id":"m",'
                                '"session_id":"s","timestamp":1.0,"finish":"error","usage":{"prompt_tokens":0,'
                                '"completion_tokens":2},"extra":{"error":"boom"}}').encode()


def test_explicit_session_ids_win_in_order():
    body = {"messages": [{"role": "user", "content": "hi"}], "user": "u-1", "metadata": {"session_id": "meta-1"}}
    assert session_id_for("c", "m", body, {"x-session-id": "hdr"}) == "hdr"
    assert session_id_for("c", "m", body) == "meta-1"
    assert session_id_for("c", "m", {**body, "metadata": {}}) == "u-1"


def test_follow_up_turns_share_the_derived_session():
    system = {"role": "system", "content": "be brief"}
    first = {"messages": [system, {"role": "user", "content": "hi"}]}
    follow_up = {"messages": [system, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                              {"role": "user", "content": "and then?"}]}
    assert session_id_for("c", "m", first) == session_id_for("c", "m", follow_up)


def test_different_conversations_clients_and_models_get_different_sessions():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    other = {"messages": [{"role": "user", "content": "bye"}]}
    session = session_id_for("c", "m", chat)
    assert session != session_id_for("c", "m", other)
    assert session != session_id_for("c2", "m", chat)
    assert session != session_id_for("c", "m2", chat)
    assert session_id_for("c", "m", {"prompt": "a"}) != session_id_for("c", "m", {"prompt": "b"})
