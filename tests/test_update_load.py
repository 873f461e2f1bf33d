"""Never mixed under load: weight updates while clients keep generating.

Three client threads send requests (a random choice among three variants, 5-6 grid points, unary
Generate or GenerateStream, a timeout on every call) while the main thread cycles updates
A -> B -> A -> ... Every response's sha256 must equal the resident sha256 of the checkpoint
its reported generation names (odd generations A, even B): a response computed with one
generation's weights and another's plans, or reported under the wrong generation, fails.
"""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from servicekit import REQ_FOX, REQ_RAIN, REQ_SHORT, SERVING, StartPair, Weights, ref_sha

from ditcore import GenerationRequest
from ditserve.client import GeneratorClient

VARIANTS: list[dict[str, Any]] = [REQ_FOX, REQ_SHORT, REQ_RAIN]  # 6, 5, 5 grid points
CLIENTS = 3
CALL_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Response:
    client: int
    seq: int
    variant: int
    generation: int
    sha256: str


def run_load(pairs: StartPair, weights: Weights, updates: int, dwell_s: float, min_per_generation: int) -> None:
    assert all(5 <= v["num_inference_steps"] <= 6 for v in VARIANTS)
    refs = {(str(c), i): ref_sha(c, v) for c in (weights.a, weights.b) for i, v in enumerate(VARIANTS)}
    assert len(set(refs.values())) == len(refs), "every (checkpoint, variant) must have its own output"
    pair = pairs(weights.a)

    stop = threading.Event()
    lock = threading.Lock()
    responses: list[Response] = []
    errors: list[str] = []
    per_generation: collections.Counter[int] = collections.Counter()

    def client_loop(k: int) -> None:
        rng = random.Random(1000 + k)
        with GeneratorClient(pair.target) as client:
            seq = 0
            while not stop.is_set():
                v = rng.randrange(len(VARIANTS))
                req = GenerationRequest.from_dict({**VARIANTS[v], "request_id": f"load-{k}-{seq}"})
                try:
                    if rng.random() < 0.5:
                        r = client.generate_unary(req, timeout=CALL_TIMEOUT_S)
                    else:
                        r = client.generate(req, timeout=CALL_TIMEOUT_S)  # also checks the chunks' sha256
                except Exception as e:  # any error (a timeout is a hang) fails the test
                    with lock:
                        errors.append(f"client {k} request {seq} (variant {v}): {type(e).__name__}: {e}")
                    return
                with lock:
                    responses.append(Response(k, seq, v, r.generation, r.sha256))
                    per_generation[r.generation] += 1
                seq += 1

    def wait_responses(generation: int) -> None:
        end = time.monotonic() + max(dwell_s, 0) + CALL_TIMEOUT_S
        t0 = time.monotonic()
        while time.monotonic() < end:
            with lock:
                if errors or (per_generation[generation] >= min_per_generation and time.monotonic() - t0 >= dwell_s):
                    return
            time.sleep(0.02)
        raise AssertionError(f"fewer than {min_per_generation} responses on generation {generation}")

    threads = [threading.Thread(target=client_loop, args=(k,), name=f"client-{k}", daemon=True) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    current = 1
    try:
        for _ in range(updates):
            wait_responses(current)
            if errors:
                break
            target = weights.ckpt_of(current + 1)
            up = pair.update(target, expected_generation=current, timeout=CALL_TIMEOUT_S)
            assert (up.generation, up.previous_generation) == (current + 1, current)
            current += 1
        if not errors:
            wait_responses(current)
    finally:
        stop.set()
        for t in threads:
            t.join(CALL_TIMEOUT_S + 10)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"client threads never returned: {hung}"
    assert not errors, "\n".join(errors)

    mismatches = [
        r
        for r in responses
        if not 1 <= r.generation <= current or r.sha256 != refs[(str(weights.ckpt_of(r.generation)), r.variant)]
    ]
    assert not mismatches, f"{len(mismatches)} of {len(responses)} responses mixed weights: {mismatches[:5]}"
    # a client's requests are sequential: the generation it sees never goes backwards
    by_client: dict[int, list[Response]] = collections.defaultdict(list)
    for r in responses:
        by_client[r.client].append(r)
    for k, rs in by_client.items():
        gens = [r.generation for r in sorted(rs, key=lambda r: r.seq)]
        assert gens == sorted(gens), f"client {k} saw generations go backwards: {gens}"
    assert current == updates + 1
    assert len(per_generation) >= 3, dict(per_generation)
    assert set(per_generation) == set(range(1, current + 1)), dict(per_generation)
    assert pair.health() == SERVING
    st, ss = pair.status(), pair.state()
    assert st.generation == ss.generation == current
    assert ss.leases_held == 0 and ss.pending_weights_path == ""
    print(f"responses per generation: {dict(sorted(per_generation.items()))}")


def test_never_mixed_under_load(pairs: StartPair, weights: Weights) -> None:
    run_load(pairs, weights, updates=4, dwell_s=4.0, min_per_generation=3)


@pytest.mark.slow
def test_never_mixed_under_load_long(pairs: StartPair, weights: Weights) -> None:
    run_load(pairs, weights, updates=30, dwell_s=4.0, min_per_generation=10)
