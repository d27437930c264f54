"""Batch generation: JSONL in, JSONL out, in input order, resumable.

Each input line is {"prompt": "..."} or {"messages": [...]} (chat template
applied) plus optional sampling fields (max_tokens, temperature, top_p, ...,
any SamplingParams field), an optional "id" and an optional "model": the
name of a LoRA adapter known to the engine (`--lora-modules`) runs the line
with it, the base model's name (or none) without. Each output line has the
input's index and id, text, token ids, finish reason, token counts and
timing (with n > 1, also "outputs": every answer by index); a line that cannot be run (bad JSON, unknown field, bad value) gets
an error record and the rest are still generated. Re-running with the same
output file skips the lines already written and appends the rest.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from jaxkv.core.sampling_params import SamplingParams

_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def _done_count(out_path: Path) -> int:
    """Complete records already in the output file; a torn last line (an
    interrupted write) is cut off so it is written again."""
    if not out_path.exists():
        return 0
    data = out_path.read_bytes()
    keep = data[: data.rfind(b"\n") + 1]
    if len(keep) != len(data):
        out_path.write_bytes(keep)
    return keep.count(b"\n")


def read_lines(path: Path) -> list[str | bytes]:
    """The input's non-blank lines, split on "\\n" only (a JSON string may
    hold U+2028 and other line separators). Blank is JSON's whitespace only
    (space, tab, CR): a line of other control characters is a line, and
    gets its error record. A line that is not UTF-8 stays bytes, so it gets
    its own error record and the others still run."""
    out: list[str | bytes] = []
    for raw in path.read_bytes().split(b"\n"):
        if not raw.strip(b" \t\r"):
            continue
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(raw)
    return out


def _record_line(rec: dict) -> str:
    """One output line. Text that cannot be written as UTF-8 (a lone
    surrogate, say in an id) is written with JSON escapes instead."""
    line = json.dumps(rec, ensure_ascii=False) + "\n"
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(rec, ensure_ascii=True) + "\n"
    return line


def _loads(line: str | bytes) -> Any:
    """The line's JSON value; ValueError for a line that is not JSON or is
    nested too deeply to parse (or to write back)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"line is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError("line is nested too deeply to parse as JSON") from None


def _checked_id(value: Any) -> Any:
    """A line's "id", if it can be written back."""
    try:
        json.dumps(value)
    except (RecursionError, ValueError, TypeError):
        raise ValueError("id: nested too deeply to write back") from None
    return value


def _parse_line(rec: Any, defaults: dict[str, Any], tokenizer) -> tuple[Any, SamplingParams]:
    """A parsed line -> (prompt for the engine, SamplingParams); ValueError
    names the field."""
    if not isinstance(rec, dict):
        raise ValueError("line must be a JSON object")
    extra = set(rec) - _FIELDS - {"prompt", "messages", "prompt_token_ids", "id", "model"}
    if extra:
        raise ValueError(f"unknown field(s): {sorted(extra)}")
    kinds = [k for k in ("prompt", "messages", "prompt_token_ids") if k in rec]
    if len(kinds) != 1:
        raise ValueError("line needs exactly one of 'prompt', 'messages', 'prompt_token_ids'")
    fields = {**defaults, **{k: v for k, v in rec.items() if k in _FIELDS}}
    params = SamplingParams(**fields)
    if "messages" in rec:
        msgs = rec["messages"]
        if (
            not isinstance(msgs, list)
            or not msgs
            or not all(
                isinstance(m, dict)
                and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)
                for m in msgs
            )
        ):
            raise ValueError(
                "messages: must be a non-empty list of {'role': str, 'content': str} objects"
            )
        if tokenizer is None:
            raise ValueError("messages: this model has no chat template")
        text = tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
        prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
    elif "prompt" in rec:
        if not isinstance(rec["prompt"], str):
            raise ValueError("prompt: must be a string")
        prompt = rec["prompt"]
    else:
        prompt = {"prompt_token_ids": rec["prompt_token_ids"]}
    return prompt, params


def _adapter(rec: dict, engine, model_names) -> str | None:
    """The LoRA adapter a line's "model" names (None: the base model)."""
    model = rec.get("model")
    if model is None or model in model_names:
        return None
    known = engine.loras.names() if engine.loras is not None else []
    if model not in known:
        raise ValueError(
            f"model: {model!r} is neither the base model ({', '.join(model_names)}) "
            f"nor a LoRA adapter (adapters: {', '.join(known) or 'none'})"
        )
    return model


def run_batch(
    engine,
    in_path,
    out_path,
    *,
    defaults: dict[str, Any] | None = None,
    progress: bool = True,
    model_names=(),
) -> dict[str, int]:
    """Generate for every line of `in_path` into `out_path`; returns counts.
    `model_names`: what a line's "model" may say for the base model."""
    in_path, out_path = Path(in_path), Path(out_path)
    lines = read_lines(in_path)
    done = _done_count(out_path)
    if done > len(lines):
        raise ValueError(
            f"{out_path}: has {done} records but {in_path} has only {len(lines)} lines"
        )
    defaults = dict(defaults or {})
    pending: dict[int, dict] = {}  # index -> record skeleton
    rid_of: dict[str, int] = {}
    for i in range(done, len(lines)):
        rec = {"index": i}
        try:
            if isinstance(lines[i], bytes):
                lines[i].decode("utf-8")  # raises: the line is not UTF-8
            raw = _loads(lines[i])
            if isinstance(raw, dict) and "id" in raw:
                rec["id"] = _checked_id(raw["id"])
            prompt, params = _parse_line(raw, defaults, engine.tokenizer)
            rid = engine.add_request(
                prompt,
                params,
                request_id=f"batch-{i}",
                lora_request=_adapter(raw, engine, model_names),
            )
            rid_of[rid] = i
        except UnicodeDecodeError as e:
            rec.update(error=f"line is not valid UTF-8 (byte {e.start})", finish_reason="error")
        except (ValueError, TypeError) as e:
            rec.update(error=str(e), finish_reason="error")
        except Exception as e:  # noqa: BLE001 - one line never ends the job
            rec.update(error=f"line: {type(e).__name__}: {e}"[:500], finish_reason="error")
        pending[i] = rec
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(lines), initial=done, desc="batch", unit="req", dynamic_ncols=True)
    t0 = time.perf_counter()
    gen_tokens = 0
    counts = {"written": 0, "errors": 0, "skipped": done}
    nxt = done
    with out_path.open("a", encoding="utf-8") as f:

        def flush():
            nonlocal nxt
            while nxt in pending and ("finish_reason" in pending[nxt]):
                rec = pending.pop(nxt)
                counts["written"] += 1
                counts["errors"] += rec.get("finish_reason") == "error"
                f.write(_record_line(rec))
                nxt += 1
                if bar is not None:
                    bar.update(1)
            f.flush()

        flush()
        while engine.has_unfinished_requests():
            for o in engine.step():
                gen_tokens += sum(len(c.delta_token_ids) for c in o.outputs)
                if not o.finished or o.request_id not in rid_of:
                    continue
                i = rid_of.pop(o.request_id)
                c = o.outputs[0]
                m = o.metrics
                rec = pending[i]
                if o.error:
                    rec.update(error=o.error, finish_reason="error")
                else:
                    rec.update(
                        text=c.text,
                        token_ids=c.token_ids,
                        finish_reason=c.finish_reason,
                        prompt_tokens=len(o.prompt_token_ids),
                        completion_tokens=len(c.token_ids),
                        cached_prompt_tokens=o.num_cached_tokens,
                        ttft_s=round(m["first_token"] - m["arrival"], 4)
                        if m.get("first_token")
                        else None,
                        latency_s=round(m["finish"] - m["arrival"], 4),
                    )
                    if len(o.outputs) > 1:  # n > 1: every answer, by index
                        rec.update(
                            completion_tokens=sum(len(x.token_ids) for x in o.outputs),
                            outputs=[
                                dict(
                                    index=x.index,
                                    text=x.text,
                                    token_ids=x.token_ids,
                                    finish_reason=x.finish_reason,
                                )
                                for x in o.outputs
                            ],
                        )
            if bar is not None:
                el = time.perf_counter() - t0
                bar.set_postfix_str(f"{gen_tokens / el:.1f} tok/s")
            flush()
        flush()
    if bar is not None:
        bar.close()
    return counts
