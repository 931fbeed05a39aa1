"""A row's output record, built from its reply fold (`chatapp.engine.reply.Reply`)."""

from __future__ import annotations

from typing import Any

from chatapp.batch.requests import RequestId
from chatapp.engine.reply import Reply


def timings_record(reply: Reply) -> dict[str, float]:
    """Seconds one row spent: the prefill of the call it was in, then the decode steps until it finished."""
    return {
        "prefill_s": round(reply.prefill_seconds, 6),
        "decode_s": round(reply.decode_seconds, 6),
        "tokens_per_s": round(reply.tokens_per_second, 3),
    }


def row_record(reply: Reply, request_id: RequestId, sample: int, routing_level: str | None = None) -> dict[str, Any]:
    """The JSON record of one finished row. `tokens`, `forced` and `tags` list every emitted token, a final stop
    token included; `text` is the reply's text, which ends before that token. `routing_level`: the STT routing level
    the row ran at (`GenerationSettings.routing_level`)."""
    record: dict[str, Any] = {
        "id": request_id,
        "sample": sample,
        "text": reply.text,
        "finish_reason": reply.finish_reason,
        "tokens": [event.token for event in reply.events],
        "forced": [event.forced for event in reply.events],
        "tags": [list(event.tags) for event in reply.events],
        "tool_calls": reply.tool_calls,
        "routing": {str(layer): round(fraction, 6) for layer, fraction in reply.layer_computed().items()},
        "routing_level": routing_level,
        "compute_saved": round(reply.compute_saved, 6),  # share of all decoder-layer work skipped, net
        "stt_skipped": round(reply.stt_skipped_fraction, 6),  # the same over the STT layers' blocks
        "timings": timings_record(reply),
    }
    if reply.error is not None:
        record["error"] = reply.error
    if (content := reply.logprobs_content()) is not None:  # the line asked for `logprobs`: OpenAI's shape
        record["logprobs"] = {"content": content}
    return record
