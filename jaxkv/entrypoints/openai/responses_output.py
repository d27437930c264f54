"""The Responses API's output items as an answer grows (reasoning, a
message of output_text, function calls) and the stream events that say
so, each numbered (`sequence_number`), as OpenAI's clients rebuild them."""

from __future__ import annotations

import json
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Output:
    """The answer's output items as they grow, and the events that say so."""

    def __init__(self, response: dict):
        self.items: list[dict] = []
        self.response = response
        self.seq = 0
        self.open: dict[str, int] = {}  # "reasoning" / "message": its output index while open

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _close(self, key: str) -> list[dict]:
        if key not in self.open:
            return []
        i = self.open.pop(key)
        item = self.items[i]
        item["status"] = "completed"
        if key == "call":
            return [
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    arguments=item["arguments"],
                    name=item["name"],
                ),
                self.event("response.output_item.done", output_index=i, item=item),
            ]
        part = item["content"][0]
        kind = "output_text" if key == "message" else "reasoning_text"
        return [
            self.event(
                f"response.{kind}.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=part["text"],
            ),
            self.event(
                "response.content_part.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=i, item=item),
        ]

    def text(self, delta: str, key: str = "message") -> list[dict]:
        if not delta:
            return []
        ev = self._close("call") + self._close("message" if key == "reasoning" else "reasoning")
        if key not in self.open:
            self.open[key] = len(self.items)
            item = (
                {
                    "type": "message",
                    "id": new_id("msg"),
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                if key == "message"
                else {
                    "type": "reasoning",
                    "id": new_id("rs"),
                    "status": "in_progress",
                    "summary": [],
                    "content": [],
                }
            )
            self.items.append(item)
            part = (
                {"type": "output_text", "text": "", "annotations": []}
                if key == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            ev.append(
                self.event(
                    "response.output_item.added",
                    output_index=self.open[key],
                    item=json.loads(json.dumps(item)),
                )
            )
            item["content"].append(part)
            ev.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self.open[key],
                    content_index=0,
                    part=dict(part),
                )
            )
        i = self.open[key]
        self.items[i]["content"][0]["text"] += delta
        kind = "output_text" if key == "message" else "reasoning_text"
        extra = {"logprobs": []} if key == "message" else {}
        return ev + [
            self.event(
                f"response.{kind}.delta",
                item_id=self.items[i]["id"],
                output_index=i,
                content_index=0,
                delta=delta,
                **extra,
            )
        ]

    def call(self, delta: dict) -> list[dict]:
        """One of `tool_stream`'s tool-call deltas: a call's id and name open
        its function_call item, its arguments grow it as they come."""
        if "id" in delta:
            ev = self._close("reasoning") + self._close("message") + self._close("call")
            self.open["call"] = i = len(self.items)
            item = {
                "type": "function_call",
                "id": new_id("fc"),
                "call_id": delta["id"],
                "name": delta["function"]["name"],
                "arguments": "",
                "status": "in_progress",
            }
            self.items.append(item)
            return ev + [self.event("response.output_item.added", output_index=i, item=dict(item))]
        i, args = self.open["call"], delta["function"]["arguments"]
        self.items[i]["arguments"] += args
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=self.items[i]["id"],
                output_index=i,
                delta=args,
            )
        ]

    def finish(self) -> list[dict]:
        return self._close("reasoning") + self._close("message") + self._close("call")
