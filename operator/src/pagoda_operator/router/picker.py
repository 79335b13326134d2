"""Choosing an endpoint for a request: prefix affinity weighed against load.

Prefix affinity. The picker remembers, per endpoint, the chained chunk hashes (``prefix.chunk_hashes``) of the
requests it sent there, in an LRU set. A candidate's *match* is how many leading chunks of the request it holds. The
set is bounded by ``max_chunks_per_endpoint`` and, once a scrape told the endpoint's KV capacity
(``num_blocks * block_size`` tokens), by that capacity in characters at ~4 characters per token (English text and
code run about 3.5-4.5 characters per token): chunks beyond what the cache can hold are surely evicted there.
With a ``KVIndex`` (the engines' KV events), a request given as ``token_ids`` is matched against what the endpoint
really holds (``match_tokens``; blocks are compared as tokens, a text chunk counts ``chunk_chars / 4`` tokens), and
the text index follows the engine's: cleared when it cleared its cache, trimmed when it holds fewer blocks than the
text index assumes (sparing chunks routed in the last ``kv_grace`` seconds: the engine reports blocks as it
prefills them).

Load. ``load = in_flight + others + queued + kv_weight * kv_usage`` where ``in_flight`` is what this router sent
there and has not seen finish (current, but blind to other clients), and ``running`` / ``waiting`` / ``kv_usage``
come from the last scrape (seen by everyone, but up to an interval late). ``others = running + waiting - s`` and
``queued = waiting - s`` (at least 0), with ``s`` this router's in-flight count when that scrape arrived: the
scrape's requests that were this router's are followed by ``in_flight`` as they finish, so a stale scrape never
makes an endpoint look busy with requests that are long done (which would herd new sessions onto the other one).
Waiting requests count twice, since they mean the engine is saturated. A failed scrape (``update_load(key, None)``) counts as
``unknown_load`` on top of the in-flight count (default: just over ``load_threshold``, "loaded, not idle"); an
endpoint never scraped counts its in-flight count only. An endpoint that runs or queues the requested LoRA adapter
counts ``lora_weight`` less (a weight, not a rule: a busy endpoint with the adapter still loses to an idle one).

The rule, among the candidates left after ``exclude``:
1. only those whose load is within ``load_threshold`` of the least loaded candidate's stay eligible (so the longest
   prefix match wins unless its endpoint is more than ``load_threshold`` busier than the least loaded one; then the
   best match among the eligible ones wins);
2. the eligible ones with the longest match;
3. of those, the least loaded (loads within ``tie_tolerance`` tie: kv_usage noise alone never decides);
4. of those, the highest rendezvous hash of (anchor, endpoint key), where the anchor is the request's first chunk
   past the longest match (for a new session behind a shared system prompt: its first chunk of its own), among
   those whose text index is at most ``1 + spread_slack`` times the tied endpoints' mean size (consistent hashing
   with bounded loads): a stable choice per session that still spreads different
   sessions evenly, also one request at a time, before any index exists.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import asdict
from hashlib import blake2b
from time import monotonic
from typing import TYPE_CHECKING, Any, Optional

from pagoda_operator.router.endpoints import Endpoint, EndpointLoad
from pagoda_operator.router.prefix import chunk_hashes

if TYPE_CHECKING:
    from pagoda_operator.router.kv_index import KVIndex

# Characters per token, to compare a text index with token counts (KV capacity, KV-event matches).
CHARS_PER_TOKEN = 4
# Block size assumed for token matches when neither a scrape nor a KV event told the endpoint's.
DEFAULT_BLOCK_SIZE = 16


def _text_anchor(text: str) -> int:
    """The anchor of a prompt shorter than one chunk: its whole text."""
    return int.from_bytes(blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "big")


def _rendezvous(anchor: int, key: str) -> int:
    digest = blake2b(anchor.to_bytes(8, "big") + key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Picker:
    """Chooses an endpoint for a request: prefix affinity weighed against load. Owns the per-endpoint prefix index
    (what the router sent where, an LRU bounded per endpoint), the local in-flight counts and the last loads."""

    def __init__(
        self,
        *,
        chunk_chars: int = 128,
        max_chunks_per_endpoint: int = 100_000,
        load_threshold: float = 4.0,
        kv_index: Optional[KVIndex] = None,
        kv_weight: float = 4.0,
        lora_weight: float = 1.0,
        unknown_load: Optional[float] = None,
        tie_tolerance: float = 0.5,
        kv_grace: float = 10.0,
        spread_slack: float = 0.25,
    ) -> None:
        if chunk_chars <= 0 or max_chunks_per_endpoint <= 0:
            raise ValueError("chunk_chars and max_chunks_per_endpoint must be positive")
        if min(load_threshold, tie_tolerance, kv_grace, spread_slack) < 0:
            raise ValueError("load_threshold, tie_tolerance, kv_grace and spread_slack must not be negative")
        self.chunk_chars = chunk_chars
        self.max_chunks_per_endpoint = max_chunks_per_endpoint
        self.load_threshold = load_threshold
        self.kv_index = kv_index
        self.kv_weight = kv_weight
        self.lora_weight = lora_weight
        self.unknown_load = load_threshold + 1.0 if unknown_load is None else unknown_load
        self.tie_tolerance = tie_tolerance
        self.kv_grace = kv_grace
        self.spread_slack = spread_slack
        # endpoint -> chunk hash -> when it was last routed there (monotonic), least recent first
        self._chunks: dict[str, OrderedDict[int, float]] = {}
        self._in_flight: dict[str, int] = {}
        self._in_flight_at_scrape: dict[str, int] = {}  # this router's in-flight count when the last scrape came
        self._loads: dict[str, Optional[EndpointLoad]] = {}
        self._generations: dict[str, int] = {}
        self._memo: tuple[str, list[int]] = ("", [])

    # ---- what the server reports ---------------------------------------------------------------------------------

    def started(self, endpoint: Endpoint, text: str) -> None:
        """The request was sent to ``endpoint``: count it in flight and record its chunks there."""
        key = endpoint.key
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        hashes = self._hashes(text)
        if not hashes:
            return
        chunks = self._chunks.setdefault(key, OrderedDict())
        now = monotonic()
        for chunk in hashes:
            chunks[chunk] = now
            chunks.move_to_end(chunk)
        self._trim(key)

    def finished(self, endpoint: Endpoint) -> None:
        """The request's reply ended (success or not)."""
        key = endpoint.key
        if self._in_flight.get(key, 0) > 0:
            self._in_flight[key] -= 1

    def update_load(self, key: str, load: Optional[EndpointLoad]) -> None:
        """The endpoint's last scrape; None when it failed (the load is unknown)."""
        self._loads[key] = load
        self._in_flight_at_scrape[key] = self._in_flight.get(key, 0)
        self._trim(key)

    def forget(self, key: str) -> None:
        """The endpoint is gone: drop its index, in-flight count and load."""
        for table in (self._chunks, self._in_flight, self._loads, self._generations, self._in_flight_at_scrape):
            table.pop(key, None)

    # ---- choosing ------------------------------------------------------------------------------------------------

    def pick(
        self,
        endpoints: Sequence[Endpoint],
        text: str,
        *,
        lora: Optional[str] = None,
        exclude: Collection[str] = (),
        token_ids: Optional[Sequence[int]] = None,
    ) -> Optional[Endpoint]:
        """The endpoint for a request whose canonical prompt is ``text`` (token prompts may give ``token_ids`` too);
        None when no candidate is left after ``exclude``."""
        candidates = [endpoint for endpoint in endpoints if endpoint.key not in exclude]
        if not candidates:
            return None
        hashes = self._hashes(text)
        loads = {endpoint.key: self.load_of(endpoint.key, lora=lora) for endpoint in candidates}
        least = min(loads.values())
        eligible = [endpoint for endpoint in candidates if loads[endpoint.key] <= least + self.load_threshold]
        matches = {endpoint.key: self.match(endpoint, hashes, token_ids=token_ids, lora=lora) for endpoint in eligible}
        best = max(matches.values())
        longest = [endpoint for endpoint in eligible if matches[endpoint.key] == best]
        lightest = min(loads[endpoint.key] for endpoint in longest)
        tied = [endpoint for endpoint in longest if loads[endpoint.key] <= lightest + self.tie_tolerance]
        if not hashes:
            return self._spread(tied, _text_anchor(text))
        depth = best if token_ids is None or self.kv_index is None else best * CHARS_PER_TOKEN / self.chunk_chars
        return self._spread(tied, hashes[min(int(depth), len(hashes) - 1)])

    def _spread(self, tied: list[Endpoint], anchor: int) -> Endpoint:
        """Rendezvous hashing with bounded loads: the highest (anchor, key) hash among the tied endpoints whose text
        index is at most (1 + spread_slack) times the tied endpoints' mean (the smallest always is)."""
        ranked = sorted(tied, key=lambda endpoint: _rendezvous(anchor, endpoint.key), reverse=True)
        sizes = {endpoint.key: len(self._chunks.get(endpoint.key, ())) for endpoint in tied}
        bound = (1.0 + self.spread_slack) * sum(sizes.values()) / len(tied)
        return next(endpoint for endpoint in ranked if sizes[endpoint.key] <= bound)

    def load_of(self, key: str, *, lora: Optional[str] = None) -> float:
        """The endpoint's load by the module's formula (lower is less loaded)."""
        in_flight = self._in_flight.get(key, 0)
        if key not in self._loads:
            return float(in_flight)
        load = self._loads[key]
        if load is None:
            return in_flight + self.unknown_load
        # The scrape is up to an interval old: of what it saw, the requests this router had in flight then are
        # counted by in_flight now (which follows them as they finish); the rest are other clients'.
        at_scrape = self._in_flight_at_scrape.get(key, 0)
        others = max(0.0, load.running + load.waiting - at_scrape)
        queued = max(0.0, load.waiting - at_scrape)
        value = in_flight + others + queued + self.kv_weight * load.kv_usage
        if lora is not None and lora in load.loras:
            value -= self.lora_weight
        return value

    def match(
        self,
        endpoint: Endpoint,
        hashes: Sequence[int],
        *,
        token_ids: Optional[Sequence[int]] = None,
        lora: Optional[str] = None,
    ) -> float:
        """How much of the request's prefix the endpoint holds: in chunks, or in tokens for ``token_ids`` prompts
        when a KV index is given (then a text chunk counts ``chunk_chars / CHARS_PER_TOKEN`` tokens)."""
        key = endpoint.key
        self._follow_engine(key)
        chunks = self._chunks.get(key)
        matched = 0
        if chunks:
            for chunk in hashes:
                if chunk not in chunks:
                    break
                matched += 1
        if token_ids is None or self.kv_index is None:
            return float(matched)
        text_tokens = matched * self.chunk_chars / CHARS_PER_TOKEN
        if not self.kv_index.known(key):
            return text_tokens
        block_size = self._block_size(key)
        return float(self.kv_index.match_tokens(key, token_ids, block_size, lora=lora) * block_size)

    def explain(self) -> dict[str, Any]:
        """Per endpoint: in-flight count, last load (None: unknown), indexed chunks and the load the rule uses."""
        keys = sorted(set(self._chunks) | set(self._in_flight) | set(self._loads))
        report: dict[str, Any] = {}
        for key in keys:
            load = self._loads.get(key)
            report[key] = {
                "in_flight": self._in_flight.get(key, 0),
                "load": None if load is None else {**asdict(load), "loras": sorted(load.loras)},
                "load_known": key in self._loads and load is not None,
                "indexed_chunks": len(self._chunks.get(key, ())),
                "chunk_capacity": self.chunk_capacity(key),
                "held_chunks": self._held_chunks(key),
                "score": self.load_of(key),
            }
            if self.kv_index is not None:
                report[key]["kv_blocks"] = self.kv_index.num_blocks(key)
        return report

    # ---- the index's bounds --------------------------------------------------------------------------------------

    def chunk_capacity(self, key: str) -> int:
        """The most chunks the endpoint's text index keeps: ``max_chunks_per_endpoint`` and its KV capacity in
        characters (``num_blocks * block_size`` tokens of the last scrape, at CHARS_PER_TOKEN)."""
        capacity = self.max_chunks_per_endpoint
        load = self._loads.get(key)
        if load is not None and load.num_blocks is not None and load.block_size is not None:
            capacity = min(capacity, load.num_blocks * load.block_size * CHARS_PER_TOKEN // self.chunk_chars)
        return max(capacity, 0)

    def _held_chunks(self, key: str) -> Optional[int]:
        """What the endpoint's KV events say it holds, in text chunks; None without KV events from it."""
        if self.kv_index is None or not self.kv_index.known(key):
            return None
        return self.kv_index.num_blocks(key) * self._block_size(key) * CHARS_PER_TOKEN // self.chunk_chars

    def _block_size(self, key: str) -> int:
        load = self._loads.get(key)
        if load is not None and load.block_size:
            return load.block_size
        if self.kv_index is not None:
            return self.kv_index.block_size(key) or DEFAULT_BLOCK_SIZE
        return DEFAULT_BLOCK_SIZE

    def _follow_engine(self, key: str) -> None:
        """Clear the text index when the engine cleared its cache since we last looked; trim it to what it holds."""
        if self.kv_index is None or not self.kv_index.known(key):
            return
        generation = self.kv_index.generation(key)
        if self._generations.get(key, 0) != generation:
            self._generations[key] = generation
            self._chunks.pop(key, None)
        self._trim(key)

    def _trim(self, key: str) -> None:
        chunks = self._chunks.get(key)
        if not chunks:
            return
        capacity = self.chunk_capacity(key)
        while len(chunks) > capacity:
            chunks.popitem(last=False)  # the least recently routed chunk first
        held = self._held_chunks(key)
        if held is None:
            return
        # The engine stores a request's blocks only as it prefills them: chunks routed in the last kv_grace seconds
        # may be missing from its count yet, so only older ones are trimmed to what it says it holds.
        recent = monotonic() - self.kv_grace
        while len(chunks) > held and next(iter(chunks.values())) < recent:
            chunks.popitem(last=False)

    def _hashes(self, text: str) -> list[int]:
        # pick() and started() hash the same text back to back: hash it once
        if self._memo[0] != text:
            self._memo = (text, chunk_hashes(text, self.chunk_chars))
        return self._memo[1]
