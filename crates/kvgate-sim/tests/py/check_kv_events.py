#!/usr/bin/env python3
"""Independent decoder for kvgate sim's KV events (msgpack + pyzmq, no kvgate code).

Subscribes to a running sim, drives traffic over HTTP, and checks the bytes against vLLM's wire
format: 3 frames [topic, seq u64 BE, payload]; payload [ts, [events], dp_rank]; events as maps
(--encoding map: vLLM 0.32's fields; --encoding map-0.24: 0.24's) or tagged arrays (--encoding array); uint64 hashes; gap-free sequence numbers;
replay over a DEALER socket ([b"", start] -> [b"", topic, seq, payload]... then [b"", b"", END, b""]);
and that the stored-minus-removed hash set equals the engine's own cache (GET /sim/cache).
Exit status 0 = all checks passed; prints a JSON summary on the last line.
"""
import argparse
import json
import sys
import time
import urllib.request

import msgpack
import zmq

END_SEQ = b"\xff" * 8
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"]
REMOVED_KEYS = ["type", "block_hashes", "medium"]
# vLLM 0.32's maps (the sim's default `map`) append these; `map-0.24` and `array` do not.
STORED_KEYS_032 = STORED_KEYS + ["extra_keys", "group_idx", "kv_cache_spec_kind"]
REMOVED_KEYS_032 = REMOVED_KEYS + ["group_idx"]


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def post(base, path, body):
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())


def normalize(ev, encoding, block_size):
    """Returns (type, fields dict) after checking the exact shape."""
    if encoding in ("map", "map-0.24"):
        check(isinstance(ev, dict), f"map encoding: event is {type(ev).__name__}")
        t = ev.get("type")
        keys = list(ev.keys())
        v032 = encoding == "map"
        if t == "BlockStored":
            check(keys == (STORED_KEYS_032 if v032 else STORED_KEYS), f"BlockStored keys/order {keys}")
            if v032:
                check(ev["extra_keys"] == [None] * len(ev["block_hashes"]), f"extra_keys {ev['extra_keys']!r}")
                check(ev["group_idx"] == 0 and ev["kv_cache_spec_kind"] == "full_attention", "group/spec kind")
        elif t == "BlockRemoved":
            check(keys == (REMOVED_KEYS_032 if v032 else REMOVED_KEYS), f"BlockRemoved keys/order {keys}")
        elif t == "AllBlocksCleared":
            check(keys == ["type"], f"AllBlocksCleared keys {keys}")
        else:
            fail(f"unknown event type {t!r}")
        return t, ev
    check(isinstance(ev, list) and ev and isinstance(ev[0], str), f"array encoding: event {ev!r}")
    t = ev[0]
    if t == "BlockStored":
        check(len(ev) == 8, f"BlockStored array length {len(ev)}")
        return t, dict(zip(STORED_KEYS, ev))
    if t == "BlockRemoved":
        check(len(ev) == 3, f"BlockRemoved array length {len(ev)}")
        return t, dict(zip(REMOVED_KEYS, ev))
    if t == "AllBlocksCleared":
        check(len(ev) == 1, f"AllBlocksCleared array length {len(ev)}")
        return t, {"type": t}
    fail(f"unknown event tag {t!r}")


def is_u64(x):
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--http", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay", required=True)
    ap.add_argument("--encoding", choices=["map", "map-0.24", "array"], required=True)
    ap.add_argument("--topic", default="")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dp-rank", type=int, default=0)
    a = ap.parse_args()

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, a.topic.encode())
    sub.connect(a.endpoint)
    time.sleep(0.5)  # slow-joiner: let the subscription reach the publisher

    # Traffic: a long prompt twice (stores, then hits), many distinct prompts (evictions),
    # a cache reset (AllBlocksCleared), then one more prompt (stores after the reset).
    # Token-id prompts: exact lengths (320 tokens = 20 blocks of 16) whatever the tokenizer.
    words = list(range(1000, 1320))
    for _ in range(2):
        st, _ = post(a.http, "/v1/completions", {"prompt": words, "max_tokens": 2, "ignore_eos": True})
        check(st == 200, f"completion status {st}")
    for k in range(6):
        p = list(range(10_000 * (k + 1), 10_000 * (k + 1) + 320))
        post(a.http, "/v1/completions", {"prompt": p, "max_tokens": 2, "ignore_eos": True})
    post(a.http, "/reset_prefix_cache", {})
    post(a.http, "/v1/completions", {"prompt": words, "max_tokens": 2, "ignore_eos": True})
    time.sleep(0.3)

    live = []  # (seq, payload bytes)
    while sub.poll(300):
        frames = sub.recv_multipart()
        check(len(frames) == 3, f"expected 3 frames, got {len(frames)}")
        topic, seq_b, payload = frames
        check(topic == a.topic.encode(), f"topic {topic!r}")
        check(len(seq_b) == 8, f"seq frame is {len(seq_b)} bytes")
        live.append((int.from_bytes(seq_b, "big"), payload))
    check(live, "no KV events received")
    seqs = [s for s, _ in live]
    check(seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"sequence numbers not consecutive: {seqs[:20]}")

    counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
    resident = {}  # hash -> tokens
    high_bit = 0
    for seq, payload in live:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        check(isinstance(batch, list) and len(batch) == 3, f"batch shape {type(batch).__name__} len {len(batch)}")
        ts, events, rank = batch
        check(isinstance(ts, float) and abs(ts - time.time()) < 600, f"ts {ts!r}")
        check(rank == a.dp_rank, f"dp_rank {rank!r}")
        check(isinstance(events, list) and events, "empty event list in a published batch")
        for ev in events:
            t, f = normalize(ev, a.encoding, a.block_size)
            counts[t] += 1
            if t == "BlockStored":
                hs = f["block_hashes"]
                check(hs and all(is_u64(h) for h in hs), f"block_hashes not uint64: {hs!r}")
                check(f["parent_block_hash"] is None or is_u64(f["parent_block_hash"]), "parent hash")
                check(f["block_size"] == a.block_size, f"block_size {f['block_size']}")
                check(len(f["token_ids"]) == len(hs) * a.block_size, "token_ids length != n*block_size")
                check(f["lora_id"] is None and f["medium"] == "GPU" and f["lora_name"] is None, "lora/medium")
                if f["parent_block_hash"] is not None:
                    check(f["parent_block_hash"] in resident, "parent of a stored run is not resident")
                for i, h in enumerate(hs):
                    high_bit += h >= 2**63
                    resident[h] = f["token_ids"][i * a.block_size:(i + 1) * a.block_size]
            elif t == "BlockRemoved":
                check(f["medium"] == "GPU", "medium")
                for h in f["block_hashes"]:
                    check(is_u64(h), f"removed hash {h!r}")
                    check(h in resident, f"removed a hash never stored: {h}")
                    del resident[h]
            else:
                resident.clear()
    for t, n in counts.items():
        check(n > 0, f"no {t} event seen")
    check(high_bit > 0, "no hash >= 2**63 seen: uint64 range not exercised")

    cache = get(a.http, "/sim/cache")
    engine = {b["hash"]: b["token_ids"] for b in cache["blocks"]}
    check(engine == resident, f"event-derived cache ({len(resident)} blocks) != engine cache ({len(engine)} blocks)")

    # Replay from the start and from the middle.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(a.replay)
    for start in (seqs[0], seqs[len(seqs) // 2]):
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            check(dealer.poll(5000), f"replay from {start}: timed out")
            fr = dealer.recv_multipart()
            check(fr[0] == b"", f"replay reply lacks the empty delimiter: {fr[:1]!r}")
            if fr[1:] == [b"", END_SEQ, b""]:
                break
            check(len(fr) == 4, f"replay batch has {len(fr)} frames")
            _, topic, seq_b, payload = fr
            check(topic == a.topic.encode(), "replay topic")
            got.append((int.from_bytes(seq_b, "big"), payload))
        want = [(s, p) for s, p in live if s >= start]
        check(got == want, f"replay from {start}: {len(got)} batches, expected {len(want)} identical ones")

    print(json.dumps({"ok": True, "encoding": a.encoding, "batches": len(live), "first_seq": seqs[0],
                      "events": counts, "resident_blocks": len(resident), "hashes_ge_2_63": high_bit}))


if __name__ == "__main__":
    main()
